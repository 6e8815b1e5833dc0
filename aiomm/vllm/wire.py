"""vLLM's wire format of one multimodal item (``MsgpackEncoder`` with every tensor inline).

One item is one msgpack map ``{key: {"data": Tensor, "field": [kind, kwargs]}}``, base64-encoded
(standard alphabet, padded). A tensor is ``[dtype name, shape, ext(3, C-order bytes)]``; a field
is vLLM's ``MultiModalFieldConfig`` factory name with every dataclass field in declaration order:
``["batched", {keep_on_cpu}]``, ``["flat", {keep_on_cpu, slices, dim}]`` or ``["shared",
{keep_on_cpu, batch_size}]``; a slice is ``[start, stop, step]``. msgspec writes the smallest
msgpack forms, as vLLM's encoder (also msgspec) does, so the bytes are identical.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np
import pybase64
import torch

from aiomm.processing.image_ops import as_runs, numpy_copyable

__all__ = (
    "Field",
    "ItemB64",
    "LazyPieces",
    "PiecesString",
    "TensorValue",
    "WireRows",
    "decode_item",
    "encode_item",
    "encode_item_b64",
    "encode_item_lazy",
    "encode_item_pieces",
    "tensor_wire",
)

_EXT_TENSOR = 3
#: largest row buffer a thread keeps for the next item
_KEEP_BYTES = 64 << 20
#: tensors from this size on are base64-encoded in place, never copied into the msgpack buffer
_SPLICE_BYTES = 1 << 12
#: rows of a strided tensor are gathered into a buffer of about this size, then encoded: the
#: gathered rows and their base64 stay in a core's L2 cache (a 1288x728 image's item: 0.57 ms
#: against 0.63 with 1 MiB blocks, 0.59 with 256 KiB)
_BLOCK_BYTES = 1 << 19
#: bytes kept free before a block in a thread's row buffer (aligned for any dtype), where the
#: writer's pending bytes are put to be encoded with the block
_LEAD = 64
_LOCAL = threading.local()
_ENCODER = msgspec.msgpack.Encoder()
#: a random fixext16 payload standing for a spliced tensor's bytes in the small document
_MARK = os.urandom(16)
_MARK_ENCODED = b"\xd8\x03" + _MARK
_MARK_EXT = msgspec.msgpack.Ext(_EXT_TENSOR, _MARK)
#: msgpack's fixext codes by payload size
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
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


class LazyPieces(Protocol):
    """Pieces made as they are read (each iteration makes them again), of known total size."""

    nbytes: int

    def __iter__(self) -> Any: ...


class PiecesString:
    """A JSON string value given as ASCII pieces that need no escaping (base64): a sequence of
    them, or :class:`LazyPieces` made while the value is sent."""

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: Sequence[bytes] | LazyPieces) -> None:
        self.pieces: Iterable[bytes]
        if isinstance(pieces, Sequence):
            self.pieces = list(pieces)
            self.nbytes = sum(len(p) for p in self.pieces)
        else:
            self.pieces, self.nbytes = pieces, pieces.nbytes

    @property
    def made_when_read(self) -> bool:
        """Whether the pieces are made as they are read (:class:`LazyPieces`)."""
        return not isinstance(self.pieces, list)

    def __str__(self) -> str:
        return b"".join(self.pieces).decode("ascii")


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
    dtype = str(tensor.dtype).removeprefix("torch.")
    raw = _c_order_bytes(tensor)
    # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
    return [dtype, list(tensor.shape), msgspec.msgpack.Ext(_EXT_TENSOR, memoryview(raw))]  # type: ignore[arg-type]


def _c_order_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values in C order as a flat uint8 array (its own memory when contiguous).

    numpy does the views where it can: every torch call releases the GIL, and a worker thread
    then waits to get it back (:mod:`aiomm.processing.image_ops`).
    """
    if not tensor.numel():
        return np.empty(0, np.uint8)
    if numpy_copyable(tensor):
        return np.ascontiguousarray(tensor.numpy()).reshape(-1).view(np.uint8)
    t = tensor.detach().contiguous()  # bfloat16: numpy has no such dtype
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class WireRows:
    """A tensor given as a numpy view (any strides): on the wire it is
    ``[dtype, [n, prod(rest)], bytes]`` of ``array``'s C-order values, written without first
    materialising it (Qwen-VL's repeated frames are a broadcast view of compact rows)."""

    array: np.ndarray
    dtype: str

    @property
    def shape(self) -> list[int]:
        shape = self.array.shape
        return [int(shape[0]), math.prod(shape[1:])] if shape else [1, 1]


class _B64Writer:
    """Base64 of a byte stream written in pieces; small writes are gathered, large ones are
    encoded from their own memory (cut at multiples of 3 bytes, so the pieces concatenate to
    the base64 of the whole stream). :meth:`take` hands over the pieces made so far."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self._pending = bytearray()

    def write(self, data: bytes | memoryview) -> None:
        if len(self._pending) + len(data) < _SPLICE_BYTES:
            self._pending += data
            return
        view = memoryview(data).cast("B")
        need = (-len(self._pending)) % 3
        self._pending += view[:need]
        view = view[need:]
        if self._pending:
            self.pieces.append(pybase64.b64encode(self._pending))
            self._pending = bytearray()
        cut = len(view) - len(view) % 3
        if cut:
            self.pieces.append(pybase64.b64encode(view[:cut]))
        self._pending += view[cut:]

    @property
    def pending(self) -> int:
        """Bytes written and not yet encoded (fewer than a quantum after a large write)."""
        return len(self._pending)

    def write_block(self, buf: np.ndarray, start: int, end: int) -> None:
        """Write ``buf[start:end]``; ``buf``'s bytes before ``start`` are free: the pending
        bytes (fewer than :data:`_LEAD`) go there, encoded with the block, not as a piece of
        their own."""
        lead = len(self._pending)
        if lead > start:  # the document's gathered head: encoded as a piece of its own
            # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
            self.write(memoryview(buf[start:end]))  # type: ignore[arg-type]
            return
        if lead:
            buf[start - lead : start] = np.frombuffer(self._pending, np.uint8)
            self._pending = bytearray()
        # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
        self.write(memoryview(buf[start - lead : end]))  # type: ignore[arg-type]

    def take(self) -> list[bytes]:
        pieces, self.pieces = self.pieces, []
        return pieces

    def close(self) -> list[bytes]:
        if self._pending:
            self.pieces.append(pybase64.b64encode(self._pending))
            self._pending = bytearray()
        return self.take()


def _ext_header(size: int) -> bytes:
    # the smallest form, as msgspec writes it
    if size in _FIXEXT:
        return bytes((_FIXEXT[size], _EXT_TENSOR))
    if size < 1 << 8:
        return bytes((0xC7, size, _EXT_TENSOR))
    if size < 1 << 16:
        return b"\xc8" + size.to_bytes(2, "big") + bytes((_EXT_TENSOR,))
    return b"\xc9" + size.to_bytes(4, "big") + bytes((_EXT_TENSOR,))


def _write_rows(out: _B64Writer, rows: np.ndarray) -> Iterator[None]:
    """Write ``rows``' C-order bytes to ``out`` about :data:`_BLOCK_BYTES` at a time, yielding
    after each block (its base64 is then in ``out``, and the block's buffer free for the next).
    Blocks end on whole base64 quanta of the stream, so no block leaves bytes for a small
    piece of their own before the next."""
    if rows.flags.c_contiguous:
        # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
        flat = memoryview(rows.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        start = 0
        while start < len(flat):
            size = _BLOCK_BYTES - (out.pending + _BLOCK_BYTES) % 3
            out.write(flat[start : start + size])
            start += size
            yield
        return
    row_bytes = max(1, rows.itemsize * (rows.size // max(1, rows.shape[0])))
    step = max(1, _BLOCK_BYTES // row_bytes)
    buf = getattr(_LOCAL, "rows", None)
    need = _LEAD + min(rows.shape[0], step) * row_bytes
    if buf is None or buf.size < need:
        buf = _LOCAL.rows = np.empty(max(need, 1), np.uint8)
    for start in range(0, rows.shape[0], step):
        block = rows[start : start + step]
        end = _LEAD + block.size * block.itemsize
        dst = buf[_LEAD:end].view(block.dtype).reshape(block.shape)
        # Qwen-VL's repeated 196-byte frames as whole runs: a quarter faster than byte rows
        runs = as_runs(block)
        if runs is None:
            np.copyto(dst, block)
        else:
            dst_runs = as_runs(dst)
            assert dst_runs is not None  # dst: C-contiguous, of block's (non-empty) shape
            np.copyto(dst_runs, runs)
        # no yield between the copy and this write: a generator that runs meanwhile on this
        # thread may fill the same buffer
        out.write_block(buf, _LEAD, end)
        yield
    if buf.size > _KEEP_BYTES:
        _LOCAL.rows = None


class ItemB64:
    """The base64 (ASCII) of one item, made while it is read: iterating gives pieces whose
    concatenation is the item's string, :attr:`nbytes` long, each made just before it is
    handed over (a sender writes it while it is still in the core's cache). Iterating again
    makes the pieces again; the item's tensors must not change meanwhile."""

    __slots__ = ("_heads", "_tail", "_tensors", "nbytes")

    def __init__(self, heads: list[bytes], tensors: list[np.ndarray], tail: bytes) -> None:
        self._heads, self._tensors, self._tail = heads, tensors, tail
        size = len(tail) + sum(
            len(h) + r.size * r.itemsize for h, r in zip(heads, tensors, strict=True)
        )
        self.nbytes = 4 * ((size + 2) // 3)

    def __iter__(self) -> Iterator[bytes]:
        out = _B64Writer()
        for head, rows in zip(self._heads, self._tensors, strict=True):
            out.write(head)
            for _ in _write_rows(out, rows):
                yield from out.take()
        out.write(self._tail)
        yield from out.close()


def encode_item_lazy(entries: Mapping[str, tuple[Any, Field]]) -> ItemB64:
    """One item as an :class:`ItemB64`: its small msgpack document is written now, its large
    tensors are encoded from their memory while the pieces are read (the item is never one
    contiguous msgpack buffer, nor one base64 string).

    ``entries`` maps each key (in wire order) to ``(value, field)``; a value is a CPU tensor,
    a :class:`WireRows`, an already built wire tensor, None or a number.
    """
    spliced: list[np.ndarray] = []

    def wire(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.numel() * value.element_size() < _SPLICE_BYTES:
                return tensor_wire(value)
            spliced.append(_c_order_bytes(value))
            return [str(value.dtype).removeprefix("torch."), list(value.shape), _MARK_EXT]
        if isinstance(value, WireRows):
            spliced.append(value.array)
            return [value.dtype, value.shape, _MARK_EXT]
        return value

    doc = {key: {"data": wire(v), "field": fld.wire()} for key, (v, fld) in entries.items()}
    parts = _ENCODER.encode(doc).split(_MARK_ENCODED)
    if len(parts) != len(spliced) + 1:  # the random mark cannot occur in a small document
        raise RuntimeError("the tensor mark occurs in the item's own bytes")
    heads = [
        head + _ext_header(rows.size * rows.itemsize)
        for head, rows in zip(parts[:-1], spliced, strict=True)
    ]
    return ItemB64(heads, spliced, parts[-1])


def encode_item_pieces(entries: Mapping[str, tuple[Any, Field]]) -> list[bytes]:
    """Base64 (ASCII) of one item, as pieces whose concatenation is the item's string
    (:func:`encode_item_lazy`, all made now)."""
    return list(encode_item_lazy(entries))


def encode_item_b64(entries: Mapping[str, tuple[Any, Field]]) -> bytes:
    """Base64 (ASCII bytes) of one item (:func:`encode_item_pieces` joined)."""
    return b"".join(encode_item_pieces(entries))


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
