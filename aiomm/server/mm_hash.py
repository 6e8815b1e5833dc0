"""vLLM's multimodal item hashes (``MultiModalHasher.hash_kwargs``), computed without vLLM.

An engine whose cache is keyed by these interoperates with vLLM's. The digest is blake3 over a
uniquely decodable stream: each chunk is framed by its 8-byte little-endian length and each value
tagged by kind (leaf, sequence, mapping), keys in sorted order::

    frame("image") LEAF frame("image") LEAF frame(<encoded bytes>)
    frame("model_id") LEAF frame(<model id>)

When decoding changed the image mode, the inner value is the mapping
``{"io_config": {"image_mode": "RGB", "rgba_background_color": [255, 255, 255]},
"data": <bytes>}``. The model id is the model path as given to vLLM on its command line.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from blake3 import blake3

__all__ = ("image_mm_hash",)

_NONE, _SEQUENCE, _MAPPING, _LEAF = b"\x00", b"\x01", b"\x02", b"\x03"
_WHITE = (255, 255, 255)


def _length(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield _length(len(chunk))
    yield chunk


def _value(obj: object) -> Iterator[bytes]:
    if obj is None:
        yield _NONE
    elif isinstance(obj, (list, tuple)):
        yield _SEQUENCE
        yield _length(len(obj))
        for elem in obj:
            yield from _value(elem)
    elif isinstance(obj, dict):
        yield _MAPPING
        yield _length(len(obj))
        for key, val in obj.items():
            yield from _framed(str(key).encode())
            yield from _value(val)
    else:
        yield _LEAF
        if isinstance(obj, bytes):
            yield from _framed(obj)
        elif isinstance(obj, str):
            yield from _framed(obj.encode())
        elif isinstance(obj, (int, float)):
            yield from _framed(np.array(obj).tobytes())  # int64 / float64, native order
        else:
            raise TypeError(f"cannot hash a {type(obj).__name__}")


def image_mm_hash(data: bytes, model_id: str, *, mode_converted: bool) -> str:
    """The hex mm_hash vLLM gives an image sent as ``data`` (encoded bytes)."""
    inner: object = data
    if mode_converted:
        inner = {"io_config": {"image_mode": "RGB", "rgba_background_color": _WHITE}, "data": data}
    hasher = blake3(max_threads=1)
    for key, val in (("image", inner), ("model_id", model_id)):
        for chunk in _framed(key.encode()):
            hasher.update(chunk)
        for chunk in (_LEAF, *_framed(b"image"), *_value(val)) if key == "image" else _value(val):
            hasher.update(chunk)
    return hasher.hexdigest()
