"""A compact, safe byte format for one processed item (what the shared cache stores).

Layout (little endian)::

    magic "AIMMITEM" | format u16 | reserved u16 | header length u32 | blake3(header + payload)
    | header (JSON) | payload (each tensor's raw bytes at a 64-byte aligned offset)

The header names the modality, the prompt data (JSON, optional), each value (a tensor as dtype,
shape, offset and length; a plain value as JSON) and each field config (its type and parameters).
Nothing in a value is executed: no pickle, dtypes come from an allow list, field configs from a
fixed set of types, and every offset and length is checked against the payload. The digest makes
a truncated or altered value a :class:`~aiomm.errors.CacheValueError`, never a wrong item.

Decoded tensors share one writable copy of the value (one allocation per item), or the writable
buffer the caller hands over (``decode_item(..., take=True)``).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from blake3 import blake3

from aiomm.errors import CacheValueError
from aiomm.processing.fields import (
    FeatureFramesField,
    FieldConfig,
    FieldKind,
    MultiModalFieldConfig,
    MultiModalKwargsItem,
    PaddedImageField,
    PaddedPatchesField,
    Repeat,
)

__all__ = (
    "FORMAT_VERSION",
    "ITEM_ALIGN",
    "ITEM_PREFIX_BYTES",
    "decode_item",
    "encode_item",
    "encode_item_parts",
    "item_header_bytes",
)

#: bumped whenever the layout or the meaning of a header field changes (2: the "prompt" key,
#: video timestamps an item needs; a reader of 1 would drop it)
FORMAT_VERSION = 2

_MAGIC = b"AIMMITEM"
_PREFIX = struct.Struct("<8sHHI32s")
_ALIGN = 64
#: the alignment of each tensor's bytes within the payload
ITEM_ALIGN = _ALIGN
#: bytes before the header: magic, format, header length, digest
ITEM_PREFIX_BYTES = _PREFIX.size
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    )
}


def encode_item(item: MultiModalKwargsItem) -> bytes:
    """Serialise ``item``.

    :raises CacheValueError: a value that is neither a tensor of an allowed dtype nor plain JSON
        data, or a field config of a type this format does not know.
    """
    return b"".join(encode_item_parts(item))


def encode_item_parts(item: MultiModalKwargsItem) -> list[bytes | memoryview]:
    """:func:`encode_item` as the parts its bytes concatenate: the tensors' parts view their
    memory (valid while ``item`` is), for a writer that sends them without joining them.

    :raises CacheValueError: see :func:`encode_item`.
    """
    values: dict[str, Any] = {}
    chunks: list[memoryview | bytes] = []
    offset = 0
    for key, value in item.data.items():
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise CacheValueError(f"value {key!r} has dtype {name}, not storable")
            flat = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            pad = -offset % _ALIGN
            if pad:
                chunks.append(bytes(pad))
                offset += pad
            # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
            chunks.append(memoryview(flat.numpy()))  # type: ignore[arg-type]
            values[key] = {
                "tensor": name,
                "shape": list(value.shape),
                "offset": offset,
                "nbytes": flat.numel(),
            }
            offset += flat.numel()
        else:
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise CacheValueError(
                    f"value {key!r} of type {type(value).__name__} is neither a tensor nor JSON"
                ) from None
            values[key] = {"json": value}
    head: dict[str, Any] = {
        "modality": item.modality,
        "data": values,
        "fields": {key: _field_to_json(key, cfg) for key, cfg in item.fields.items()},
    }
    if item.prompt_data:
        try:
            json.dumps(item.prompt_data, allow_nan=False)
        except (TypeError, ValueError):
            raise CacheValueError("the item's prompt data is not JSON") from None
        head["prompt"] = item.prompt_data
    header = json.dumps(head, separators=(",", ":")).encode()
    digest = blake3(header)
    for chunk in chunks:
        digest.update(chunk)
    prefix = _PREFIX.pack(_MAGIC, FORMAT_VERSION, 0, len(header), digest.digest())
    return [prefix, header, *chunks]


def item_header_bytes(prefix: bytes | bytearray | memoryview) -> int:
    """The header's length, read from an item's first :data:`ITEM_PREFIX_BYTES` (a reader that
    receives an item in parts places the payload with it).

    :raises CacheValueError: the bytes are not an item's prefix.
    """
    if len(prefix) < _PREFIX.size:
        raise CacheValueError(f"value of {len(prefix)} bytes is shorter than the item prefix")
    magic, _, _, header_len, _ = _PREFIX.unpack_from(prefix)
    if magic != _MAGIC:
        raise CacheValueError("value does not start with the item magic")
    return int(header_len)


def decode_item(
    blob: bytes | bytearray | memoryview, *, take: bool = False
) -> MultiModalKwargsItem:
    """Read an item written by :func:`encode_item`.

    ``take``: ``blob`` is writable memory the caller gives up (a bytearray or a view of one);
    the tensors view it instead of a copy of its payload, so they are aligned as the caller
    placed the payload.

    :raises CacheValueError: a value that is truncated, altered, of another format version, or
        that names a dtype, field type or range the format does not allow.
    """
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise CacheValueError(f"value of {len(view)} bytes is shorter than the item prefix")
    magic, version, _, header_len, digest = _PREFIX.unpack_from(view)
    if magic != _MAGIC:
        raise CacheValueError("value does not start with the item magic")
    if version != FORMAT_VERSION:
        raise CacheValueError(f"item format {version}, expected {FORMAT_VERSION}")
    body = view[_PREFIX.size :]
    if header_len > len(body):
        raise CacheValueError(f"header of {header_len} bytes but {len(body)} bytes follow")
    if blake3(body).digest() != digest:
        raise CacheValueError("item digest mismatch: the value is truncated or altered")
    try:
        header = json.loads(bytes(body[:header_len]))
        # One writable buffer shared by the tensors (torch refuses read-only buffers silently).
        payload: bytearray | memoryview
        if take and not view.readonly:
            payload = body[header_len:]
        else:
            payload = bytearray(body[header_len:])
        data = {k: _value_from_json(k, v, payload) for k, v in header["data"].items()}
        fields = {k: _field_from_json(v) for k, v in header["fields"].items()}
        modality = header["modality"]
        prompt_data = header.get("prompt", {})
    except CacheValueError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise CacheValueError(f"malformed item header: {type(exc).__name__}: {exc}") from None
    if not isinstance(modality, str):
        raise CacheValueError("item modality is not a string")
    if not isinstance(prompt_data, dict):
        raise CacheValueError("item prompt data is not an object")
    return MultiModalKwargsItem(modality, data, fields, prompt_data)


def _value_from_json(key: str, spec: dict[str, Any], payload: bytearray | memoryview) -> Any:
    if "json" in spec:
        return spec["json"]
    dtype = _DTYPES.get(spec["tensor"])
    if dtype is None:
        raise CacheValueError(f"value {key!r} has dtype {spec['tensor']!r}, not allowed")
    shape = [int(d) for d in spec["shape"]]
    offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
    numel = 1
    for d in shape:
        if d < 0:
            raise CacheValueError(f"value {key!r} has a negative dimension in {shape}")
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes != numel * itemsize or offset < 0 or offset + nbytes > len(payload):
        raise CacheValueError(
            f"value {key!r}: {nbytes} bytes at {offset} for shape {shape} do not fit a payload "
            f"of {len(payload)} bytes"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype, count=numel, offset=offset).reshape(shape)


def _field_to_json(key: str, config: FieldConfig) -> dict[str, Any]:
    if type(config) is MultiModalFieldConfig:
        return {
            "type": "mm",
            "kind": config.kind.value,
            "modality": config.modality,
            "sizes": None if config.sizes is None else list(config.sizes),
            "batch_size": config.batch_size,
            "repeat": None if config.repeat is None else list(config.repeat),
        }
    if type(config) is PaddedPatchesField:
        return {
            "type": "padded_patches",
            "modality": config.modality,
            "counts": list(config.counts),
        }
    if type(config) is FeatureFramesField:
        return {
            "type": "feature_frames",
            "modality": config.modality,
            "sizes": list(config.sizes),
            "dim": config.dim,
        }
    if type(config) is PaddedImageField:
        return {
            "type": "padded",
            "modality": config.modality,
            "sizes": [list(s) for s in config.sizes],
        }
    raise CacheValueError(f"field {key!r} has config type {type(config).__name__}, not storable")


def _field_from_json(spec: dict[str, Any]) -> FieldConfig:
    kind = spec["type"]
    if kind == "mm":
        sizes, repeat = spec["sizes"], spec["repeat"]
        batch_size = spec["batch_size"]
        return MultiModalFieldConfig(
            FieldKind(spec["kind"]),
            str(spec["modality"]),
            sizes=None if sizes is None else tuple(int(s) for s in sizes),
            batch_size=None if batch_size is None else int(batch_size),
            repeat=None if repeat is None else Repeat(int(repeat[0]), int(repeat[1])),
        )
    if kind == "padded_patches":
        return PaddedPatchesField(
            modality=str(spec["modality"]), counts=tuple(int(n) for n in spec["counts"])
        )
    if kind == "padded":
        return PaddedImageField(
            str(spec["modality"]), tuple((int(h), int(w)) for h, w in spec["sizes"])
        )
    if kind == "feature_frames":
        return FeatureFramesField(
            str(spec["modality"]), tuple(int(n) for n in spec["sizes"]), int(spec["dim"])
        )
    raise CacheValueError(f"unknown field config type {kind!r}")
