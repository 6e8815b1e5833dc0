"""vLLM's wire format of one multimodal item (``MsgpackEncoder`` with every tensor inline).

One item is one msgpack map ``{key: {"data": Tensor, "field": [kind, kwargs]}}``, base64-encoded
(standard alphabet, padded). A tensor is ``[dtype name, shape, ext(3, C-order bytes)]``; a field
is vLLM's ``MultiModalFieldConfig`` factory name with every dataclass field in declaration order:
``["batched", {keep_on_cpu}]``, ``["flat", {keep_on_cpu, slices, dim}]`` or ``["shared",
{keep_on_cpu, batch_size}]``; a slice is ``[start, stop, step]``. msgspec writes the smallest
msgpack forms, as vLLM's encoder (also msgspec) does, so the bytes are identical.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pybase64
import torch

__all__ = (
    "Field",
    "TensorValue",
    "decode_item",
    "encode_item",
    "encode_item_b64",
    "tensor_wire",
)

_EXT_TENSOR = 3
#: largest msgpack buffer a thread keeps for the next item
_KEEP_BYTES = 64 << 20
_LOCAL = threading.local()
_ENCODER = msgspec.msgpack.Encoder()
_DTYPES = {
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "bool": np.bool_,
}


@dataclass(frozen=True)
class Field:
    """One key's field config as vLLM serialises it."""

    kind: str  # "batched" | "flat" | "shared"
    kwargs: Mapping[str, Any]

    def wire(self) -> list[Any]:
        return [self.kind, dict(self.kwargs)]


@dataclass(frozen=True)
class TensorValue:
    """A decoded tensor: its dtype name, shape and raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def array(self) -> np.ndarray:
        """The values as numpy (``bfloat16`` as raw uint16 words).

        :raises ValueError: an unknown dtype name.
        """
        if self.dtype == "bfloat16":
            return np.frombuffer(self.data, np.uint16).reshape(self.shape)
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}")
        return np.frombuffer(self.data, _DTYPES[self.dtype]).reshape(self.shape)


def tensor_wire(tensor: torch.Tensor) -> list[Any]:
    """``[dtype, shape, ext]`` of a CPU tensor; the ext shares the tensor's memory when it can."""
    t = tensor.detach().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    return [dtype, list(t.shape), msgspec.msgpack.Ext(_EXT_TENSOR, memoryview(raw))]


def _doc(entries: Mapping[str, tuple[Any, Field]]) -> dict[str, Any]:
    return {
        key: {
            "data": tensor_wire(value) if isinstance(value, torch.Tensor) else value,
            "field": fld.wire(),
        }
        for key, (value, fld) in entries.items()
    }


def encode_item_b64(entries: Mapping[str, tuple[Any, Field]]) -> bytes:
    """Base64 (ASCII bytes) of one item: ``entries`` maps each key (in wire order) to
    ``(value, field)``; a value is a CPU tensor, an already built wire tensor, None or a number.

    The msgpack document is written into a per-thread buffer that is reused, so a multi-megabyte
    item costs no fresh (page-faulting) memory before it is base64-encoded.
    """
    buf = getattr(_LOCAL, "buf", None)
    if buf is None:
        buf = _LOCAL.buf = bytearray()
    _ENCODER.encode_into(_doc(entries), buf)
    try:
        return pybase64.b64encode(buf)
    finally:
        if len(buf) > _KEEP_BYTES:
            _LOCAL.buf = bytearray()


def encode_item(entries: Mapping[str, tuple[Any, Field]]) -> str:
    """:func:`encode_item_b64` as a ``str``."""
    return encode_item_b64(entries).decode("ascii")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _EXT_TENSOR:
        raise ValueError(f"unexpected msgpack ext type {code}")
    return bytes(data)


_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def decode_item(b64: str) -> dict[str, tuple[Any, Field]]:
    """The inverse of :func:`encode_item` (tensors as :class:`TensorValue`), for tests and tools.

    :raises ValueError: not base64 msgpack of the item layout.
    """
    try:
        doc = _DECODER.decode(pybase64.b64decode(b64, validate=True))
    except (msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"not a msgpack item: {exc}") from exc
    out: dict[str, tuple[Any, Field]] = {}
    for key, elem in doc.items():
        data = elem["data"]
        if isinstance(data, list) and len(data) == 3 and isinstance(data[2], bytes):
            data = TensorValue(data[0], tuple(data[1]), data[2])
        kind, kwargs = elem["field"]
        out[key] = (data, Field(kind, kwargs))
    return out
