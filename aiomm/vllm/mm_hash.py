"""vLLM's multimodal item hashes (``MultiModalHasher.hash_kwargs``), computed without vLLM.

An engine whose cache is keyed by these interoperates with vLLM's. The digest is blake3 over a
uniquely decodable stream: each chunk is framed by its 8-byte little-endian length and each value
tagged by kind (leaf, sequence, mapping), keys in sorted order::

    frame("image") LEAF frame("image") LEAF frame(<encoded bytes>)
    frame("model_id") LEAF frame(<model id>)

When decoding changed the image mode, the inner value is the mapping
``{"io_config": {"image_mode": "RGB", "rgba_background_color": [255, 255, 255]},
"data": <bytes>}``. The model id is the model path as given to vLLM on its command line.

A video's item is the pair ``(media, metadata)`` of vLLM's loader (keys sorted, so the model id
comes first)::

    frame("model_id") LEAF frame(<model id>)
    frame("video") SEQUENCE u64(2) LEAF frame("video") LEAF <media> <metadata mapping>

where ``<media>`` is ``frame(<encoded bytes>)``, or, when the sampled frames take fewer bytes
than the encoded video, the frames as vLLM hashes an array: ``frame("ndarray")`` and the
mapping ``{"dtype": "|u1", "shape": [T, H, W, 3], "data": <frame bytes>}``.

An image of a model with one ``vision_chunk`` modality for images and videos (Kimi-K2.5) is
the mapping vLLM's chat parser makes of it, its decoded RGB image hashed by mode and pixels::

    frame("model_id") LEAF frame(<model id>)
    frame("vision_chunk") MAPPING u64(3) frame("type") LEAF frame("image")
        frame("image") LEAF frame("image") <{"mode": "RGB", "data": <ndarray>}>
        frame("uuid") NONE

An audio's item is its waveform as vLLM's parser hands it on (decoded, averaged to mono and
resampled to the feature extractor's rate), hashed as an array (its key sorts before the model
id)::

    frame("audio") LEAF frame("ndarray") <{"dtype": "<f4", "shape": [N], "data": <samples>}>
    frame("model_id") LEAF frame(<model id>)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from blake3 import blake3

__all__ = ("audio_mm_hash", "image_mm_hash", "video_mm_hash", "vision_chunk_mm_hash")

_NONE, _SEQUENCE, _MAPPING, _LEAF = b"\x00", b"\x01", b"\x02", b"\x03"
_WHITE = (255, 255, 255)


def _length(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _framed(chunk: bytes | memoryview) -> Iterator[bytes | memoryview]:
    yield _length(len(chunk))
    yield chunk


def _value(obj: object) -> Iterator[bytes | memoryview]:
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
        elif isinstance(obj, memoryview):
            yield from _framed(obj.cast("B"))  # hashed in place, never copied
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


def _ndarray(array: np.ndarray) -> list[bytes | memoryview]:
    """An array as vLLM's hasher serialises one (its bytes in place when contiguous)."""
    data: bytes | memoryview = (
        array.view(np.uint8).data if array.flags.c_contiguous else array.tobytes()
    )
    return [
        *_framed(b"ndarray"),
        *_value({"dtype": array.dtype.str, "shape": array.shape, "data": data}),
    ]


def vision_chunk_mm_hash(rgb: np.ndarray, model_id: str) -> str:
    """The hex mm_hash vLLM gives an image of a model that takes images and videos as one
    ``vision_chunk`` modality (Kimi-K2.5's ``use_unified_vision_chunk``): its item is the mapping
    ``{"type": "image", "image": <PIL image>, "uuid": None}`` and the image, decoded (``rgb``:
    ``H x W x 3`` uint8), is hashed by its mode and pixels."""
    hasher = blake3(max_threads=1)
    for chunk in (
        *_framed(b"model_id"),
        *_value(model_id),
        *_framed(b"vision_chunk"),
        _MAPPING,
        _length(3),
        *_framed(b"type"),
        *_value("image"),
        *_framed(b"image"),
        _LEAF,
        *_framed(b"image"),
        _MAPPING,
        _length(2),
        *_framed(b"mode"),
        *_value("RGB"),
        *_framed(b"data"),
        _LEAF,
        *_ndarray(np.ascontiguousarray(rgb)),
        *_framed(b"uuid"),
        _NONE,
    ):
        hasher.update(chunk)
    return hasher.hexdigest()


def audio_mm_hash(samples: np.ndarray, model_id: str) -> str:
    """The hex mm_hash vLLM gives an audio whose waveform, as its parser hands it on, is
    ``samples`` (1-D; float32 for decoded audio)."""
    hasher = blake3(max_threads=1)
    for chunk in (
        *_framed(b"audio"),
        _LEAF,
        *_ndarray(samples),
        *_framed(b"model_id"),
        *_value(model_id),
    ):
        hasher.update(chunk)
    return hasher.hexdigest()


def video_mm_hash(
    data: bytes, model_id: str, metadata: dict[str, object], frames: np.ndarray | None = None
) -> str:
    """The hex mm_hash vLLM gives a video sent as ``data`` with its loader's ``metadata``
    (:func:`aiomm.vllm.video_media.hash_metadata`); ``frames`` (``T x H x W x 3`` uint8, the
    sampled frames) only when they take fewer bytes than ``data``, as vLLM then hashes them."""
    if frames is not None and frames.nbytes < len(data):
        array = np.ascontiguousarray(frames)
        media = [
            *_framed(b"ndarray"),
            # numpy's stubs give ndarray __buffer__ (so Buffer) on Python 3.12+ only
            *_value({"dtype": array.dtype.str, "shape": array.shape, "data": memoryview(array)}),  # type: ignore[arg-type]
        ]
    else:
        media = list(_framed(data))
    hasher = blake3(max_threads=1)
    for chunk in (
        *_framed(b"model_id"),
        *_value(model_id),
        *_framed(b"video"),
        _SEQUENCE,
        _length(2),
        _LEAF,
        *_framed(b"video"),
        _LEAF,
        *media,
        *_value(metadata),
    ):
        hasher.update(chunk)
    return hasher.hexdigest()
