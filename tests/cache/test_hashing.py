"""Content hashes and cache keys."""

from __future__ import annotations

import numpy as np
import pytest

from aiomm.media.hashing import hash_bytes, hash_pixels, item_cache_key

KEY_PARTS = {
    "adapter": "qwen2_vl",
    "processor_kwargs": {"min_pixels": 3136, "max_pixels": 12845056},
    "normalize_mode": "device",
}


def test_equal_bytes_hash_equal_across_containers() -> None:
    data = bytes(range(256)) * 17
    digest = hash_bytes(data)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert hash_bytes(bytes(data)) == digest
    assert hash_bytes(bytearray(data)) == digest
    assert hash_bytes(memoryview(data)) == digest


def test_one_flipped_bit_changes_the_hash() -> None:
    data = bytearray(b"\x00" * 4096)
    before = hash_bytes(data)
    data[2048] ^= 0x01
    assert hash_bytes(data) != before


def test_pixels_hash_equal_across_layouts() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(7, 11, 3), dtype=np.uint8)
    transposed = np.ascontiguousarray(image.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert not transposed.flags.c_contiguous
    np.testing.assert_array_equal(transposed, image)
    strided = np.zeros((14, 11, 3), dtype=np.uint8)
    strided[::2] = image
    view = strided[::2]
    assert not view.flags.c_contiguous

    digest = hash_pixels(image)
    assert hash_pixels(image.copy()) == digest
    assert hash_pixels(transposed) == digest
    assert hash_pixels(view) == digest


def test_pixels_hash_covers_shape_and_dtype() -> None:
    flat = np.arange(24, dtype=np.uint8)
    assert hash_pixels(flat.reshape(4, 6)) != hash_pixels(flat.reshape(6, 4))
    assert hash_pixels(flat.reshape(4, 6)) != hash_pixels(flat)
    as_int8 = flat.view(np.int8)
    assert as_int8.tobytes() == flat.tobytes()
    assert hash_pixels(as_int8) != hash_pixels(flat)
    as_u16 = flat.view(np.uint16)
    assert hash_pixels(as_u16) != hash_pixels(flat)
    assert hash_pixels(flat.reshape(4, 6)) != hash_pixels(flat.reshape(4, 6) + 1)


def test_pixels_of_object_arrays_are_rejected() -> None:
    with pytest.raises(TypeError, match="object"):
        hash_pixels(np.array([object()], dtype=object))


def test_cache_key_changes_with_every_part() -> None:
    base = item_cache_key("c" * 64, **KEY_PARTS)
    assert len(base) == 64
    variants = [
        item_cache_key("d" * 64, **KEY_PARTS),
        item_cache_key("c" * 64, **{**KEY_PARTS, "adapter": "llava"}),
        item_cache_key("c" * 64, **{**KEY_PARTS, "normalize_mode": "host"}),
        item_cache_key("c" * 64, **{**KEY_PARTS, "processor_kwargs": {"min_pixels": 3136}}),
        item_cache_key(
            "c" * 64,
            **{**KEY_PARTS, "processor_kwargs": {"min_pixels": 3137, "max_pixels": 12845056}},
        ),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_cache_key_parts_cannot_bleed_into_each_other() -> None:
    one = item_cache_key("x", adapter="a|b", processor_kwargs={}, normalize_mode="c")
    two = item_cache_key("x", adapter="a", processor_kwargs={}, normalize_mode="b|c")
    assert one != two


def test_cache_key_is_stable_across_dict_ordering() -> None:
    forward = {"a": 1, "b": {"x": [1, 2], "y": 2.5}, "c": None}
    backward = {"c": None, "b": {"y": 2.5, "x": [1, 2]}, "a": 1}
    assert list(forward) != list(backward)
    key = item_cache_key("h", adapter="m", processor_kwargs=forward, normalize_mode="n")
    assert key == item_cache_key("h", adapter="m", processor_kwargs=backward, normalize_mode="n")


def test_cache_key_encodes_non_json_values_deterministically() -> None:
    def key(kwargs: dict[str, object]) -> str:
        return item_cache_key("h", adapter="m", processor_kwargs=kwargs, normalize_mode="n")

    assert key({"sizes": {"b", "a", "c"}}) == key({"sizes": {"c", "a", "b"}})
    assert key({"dtype": np.dtype("float16")}) != key({"dtype": np.dtype("float32")})
