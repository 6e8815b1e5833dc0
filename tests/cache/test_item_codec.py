"""The shared cache's item format: exact round trips, and every damaged value refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiomm.adapters import build_processor, supported_adapters
from aiomm.cache.codec import decode_item, encode_item, encode_item_parts
from aiomm.errors import CacheValueError
from aiomm.media.samples import photo_like
from aiomm.processing.fields import (
    MultiModalFieldConfig,
    MultiModalKwargsItem,
    PaddedImageField,
    PaddedPatchesField,
)


def _item() -> MultiModalKwargsItem:
    g = torch.Generator().manual_seed(0)
    return MultiModalKwargsItem(
        "image",
        {
            "pixel_values": torch.randint(0, 256, (12, 7), dtype=torch.uint8, generator=g),
            "grid": torch.tensor([1, 3, 4]),
            "bf": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "f64": torch.randn(2, generator=g, dtype=torch.float64),
            "scalar": torch.tensor(5, dtype=torch.int32),
            "empty": torch.empty(0, 3),
            "mask": torch.tensor([True, False]),
            "padded": torch.randint(0, 256, (3, 4, 6), dtype=torch.uint8, generator=g),
            "patches": torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8, generator=g),
            "n": 7,
            "names": ["a", {"b": 1.5}],
        },
        {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", [12], repeat=(7, 2)),
            "grid": MultiModalFieldConfig.batched("image"),
            "bf": MultiModalFieldConfig.shared("image", 2),
            "padded": PaddedImageField("image", ((4, 6),)),
            "patches": PaddedPatchesField(counts=(2,)),
        },
    )


def _assert_same(a: MultiModalKwargsItem, b: MultiModalKwargsItem) -> None:
    assert a.modality == b.modality and a.fields == b.fields
    assert a.data.keys() == b.data.keys()
    for key, value in a.data.items():
        if isinstance(value, torch.Tensor):
            other = b.data[key]
            assert other.dtype == value.dtype and other.shape == value.shape, key
            assert torch.equal(other, value), key
        else:
            assert b.data[key] == value, key


def test_round_trip_every_dtype_and_field_kind() -> None:
    item = _item()
    blob = encode_item(item)
    _assert_same(item, decode_item(blob))
    _assert_same(item, decode_item(bytearray(blob)))
    # raw bytes plus a small header: not much over the tensors themselves
    assert len(blob) < item.nbytes() + 2048


def test_parts_are_the_bytes_and_view_the_tensors() -> None:
    item = _item()
    parts = encode_item_parts(item)
    assert b"".join(parts) == encode_item(item)
    tensors = [v for v in item.data.values() if isinstance(v, torch.Tensor) and v.numel()]
    views = [np.frombuffer(p, np.uint8) for p in parts if isinstance(p, memoryview)]
    assert tensors and views
    for tensor in tensors:  # each tensor's bytes are sent from its own memory
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        assert any(np.shares_memory(view, raw) for view in views)


def test_take_views_the_callers_buffer_and_copies_otherwise() -> None:
    item = _item()
    blob = bytearray(encode_item(item))
    taken, copied = decode_item(blob, take=True), decode_item(blob)
    _assert_same(item, taken)
    _assert_same(item, copied)
    start = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    for decoded, inside in ((taken, True), (copied, False)):
        address = decoded.data["pixel_values"].data_ptr()
        assert (start <= address < start + len(blob)) is inside
    # bytes cannot be handed over (read-only): take=True still copies
    frozen = decode_item(bytes(blob), take=True)
    _assert_same(item, frozen)
    frozen.data["pixel_values"][0, 0] ^= 1  # writable


@pytest.mark.parametrize("name", [info.short_name for info in supported_adapters()])
def test_round_trip_of_a_real_processor_item(name: str) -> None:
    """Every architecture's items are storable in the shared tiers (Redis, peers)."""
    processor = build_processor(name)
    if "image" in processor.supported_modalities:
        image = photo_like(np.random.default_rng(1), 90, 120)
        items = processor.process_items({"image": [image]}, {})["image"]
    else:  # an audio adapter: a second of noise at its rate
        clip = np.random.default_rng(1).standard_normal(processor.audio_sampling_rate)
        items = processor.process_items({"audio": [clip.astype(np.float32)]}, {})["audio"]
    decoded = decode_item(encode_item(items[0]))
    _assert_same(items[0], decoded)
    pixels = next(k for k in decoded.data if k.startswith(("pixel_values", "input_features")))
    decoded.data[pixels].view(-1)[0] += 1  # writable, and not the cached bytes
    assert not torch.equal(decoded.data[pixels], items[0].data[pixels])


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[:-1], id="truncated"),
        pytest.param(lambda b: b[:30], id="prefix-only"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b[:-5] + bytes([b[-5] ^ 0x01]) + b[-4:], id="payload-bit"),
        pytest.param(lambda b: b[:60] + bytes([b[60] ^ 0x20]) + b[61:], id="header-bit"),
        pytest.param(lambda b: b"XIMMITEM" + b[8:], id="magic"),
        pytest.param(lambda b: b[:8] + b"\x01\x00" + b[10:], id="version"),
        pytest.param(lambda b: b + b"\x00", id="extended"),
        pytest.param(lambda b: b"\x80\x04\x95" + b[3:], id="pickle-like"),
    ],
)
def test_damaged_values_are_refused(damage) -> None:
    blob = encode_item(_item())
    with pytest.raises(CacheValueError):
        decode_item(damage(blob))


def test_forged_header_with_a_valid_digest_is_refused() -> None:
    import json
    import struct

    from blake3 import blake3

    blob = encode_item(_item())
    header_len = struct.unpack_from("<I", blob, 12)[0]
    header = json.loads(blob[48 : 48 + header_len])
    payload = blob[48 + header_len :]
    for forge in (
        lambda h: h["data"]["grid"].update(dtype=None, tensor="object"),
        lambda h: h["data"]["grid"].update(offset=10**9),
        lambda h: h["data"]["grid"].update(shape=[1000]),
        lambda h: h["fields"]["grid"].update(type="pickle"),
    ):
        forged = json.loads(json.dumps(header))
        forge(forged)
        body = json.dumps(forged).encode() + payload
        new = struct.pack("<8sHHI32s", b"AIMMITEM", 1, 0, len(body) - len(payload), b"")
        new = new[:16] + blake3(body).digest() + body
        with pytest.raises(CacheValueError):
            decode_item(new)


def test_values_the_format_cannot_hold_are_refused() -> None:
    item = _item()
    item.data["obj"] = object()
    with pytest.raises(CacheValueError, match="obj"):
        encode_item(item)
    item = _item()
    item.data["c"] = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(CacheValueError, match="complex64"):
        encode_item(item)
