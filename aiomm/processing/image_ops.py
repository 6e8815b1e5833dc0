"""uint8 image operations of the ``native`` transforms: RGB conversion, resize, patchify.

Every function here keeps pixels in uint8 and spends its time in Pillow or torch kernels, which
release the GIL, so worker threads scale with cores. Views and bookkeeping are numpy's: every
torch call releases the GIL, even one that only makes a view, and a worker thread that gives the
GIL up waits to get it back (under the render server's load, about 0.4 ms on average, often
behind the event loop). Each function mirrors the exact operation one HF image-processor backend
performs, so the results are equal bit for bit:

- PIL backend (``*Pil`` classes): ``PIL.Image.resize`` on the RGB image;
- torchvision backend: ``torch.nn.functional.interpolate`` on a contiguous uint8 CHW tensor with
  ``antialias=True`` (the op ``torchvision.transforms.v2.functional.resize`` dispatches to for
  uint8 on the CPU).
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from aiomm.errors import ProcessingError

__all__ = (
    "NUMPY_VIEWABLE_DTYPES",
    "Backend",
    "ReducedImage",
    "Resample",
    "as_runs",
    "as_tensor_view",
    "backend_of",
    "copy_permuted",
    "hf_backend_normalize",
    "numpy_copyable",
    "padded_pixels",
    "patchify",
    "permuted_copy",
    "resize",
    "resize_chw",
    "scratch_bytes",
    "to_rgb_array",
)


@dataclass(frozen=True)
class ReducedImage:
    """An image decoded at a reduced scale (``DecodeConfig(fidelity="fast")``).

    ``pixels`` is the reduced ``H x W x 3`` uint8 array; ``source_height`` and ``source_width``
    the encoded image's size, from which the adapter computes its resize target, so the item has
    the same size (and token count) as the exact decode's.
    """

    pixels: np.ndarray
    source_height: int
    source_width: int


class Backend(enum.Enum):
    """Which HF image-processor backend a transform reproduces."""

    PIL = "pil"
    TORCHVISION = "torchvision"


def backend_of(image_processor: Any) -> Backend:
    """The backend an HF image processor runs on (``*Pil`` classes: PIL; else torchvision)."""
    named = getattr(image_processor, "backend", None)  # HF's property, or a stored snapshot's
    if isinstance(named, str) and named in Backend._value2member_map_:
        return Backend(named)
    from transformers.image_processing_backends import PilBackend

    return Backend.PIL if isinstance(image_processor, PilBackend) else Backend.TORCHVISION


class Resample(enum.IntEnum):
    """Resampling filters (values are Pillow's, as HF stores them)."""

    NEAREST = 0
    LANCZOS = 1
    BILINEAR = 2
    BICUBIC = 3


_TORCH_MODES = {
    Resample.NEAREST: "nearest",
    Resample.BILINEAR: "bilinear",
    Resample.BICUBIC: "bicubic",
}


def _composite_on_white(image: PIL.Image.Image) -> PIL.Image.Image:
    rgba = image.convert("RGBA")
    white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return PIL.Image.alpha_composite(white, rgba).convert("RGB")


def to_rgb_array(image: PIL.Image.Image | np.ndarray) -> np.ndarray:
    """Convert an image to an ``H x W x 3`` uint8 array the way HF's ``convert_to_rgb`` does.

    Transparency (an alpha band or a palette/`transparency` key) is composited onto white;
    greyscale and palette images are expanded. Arrays must be ``H x W``, ``H x W x 1``,
    ``H x W x 3`` or ``H x W x 4`` uint8.

    :raises ProcessingError: for arrays of another dtype or shape.
    """
    if isinstance(image, PIL.Image.Image):
        has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
        if has_alpha:
            return np.asarray(_composite_on_white(image))
        # convert() copies even when the mode already is RGB
        return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    array = np.asarray(image)
    if array.dtype != np.uint8:
        raise ProcessingError(f"image arrays must be uint8, got {array.dtype}")
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ProcessingError(
            f"image arrays must be H x W x C with C in (1, 3, 4), got shape {array.shape}"
        )
    if array.shape[-1] == 1:
        return np.repeat(array, 3, axis=-1)
    if array.shape[-1] == 4:
        alpha = array[..., 3:4] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return array


def _chw_view(image: np.ndarray) -> torch.Tensor:
    """A ``C x H x W`` view (channels-last strides) of an ``H x W x C`` array, never a copy."""
    # numpy's transpose, not torch's permute: every torch op releases the GIL and a worker
    # thread may then wait for the event loop to hand it back (see module docstring)
    return as_tensor_view(image.transpose(2, 0, 1))


def as_tensor_view(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory, also when the array is read-only.

    Decoded images are read-only views of Pillow's pixel bytes; ``torch.from_numpy`` warns on
    those, so they cross through DLPack, which shares them silently. The pipeline only reads
    these tensors: every operation that changes pixels writes a new tensor.
    """
    if array.flags.writeable:
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def resize(
    image: np.ndarray,
    height: int,
    width: int,
    resample: Resample,
    backend: Backend,
    *,
    scratch: bool = False,
) -> torch.Tensor:
    """Resize an ``H x W x 3`` uint8 image to a uint8 ``C x H x W`` tensor.

    The result may have channels-last strides: the resample kernels and ``patchify`` read any
    strides, and skipping the channels-first copy keeps the values identical. ``scratch``: see
    :func:`resize_chw` (the torchvision backend only; the result is only valid until the next
    scratch resize in this thread).
    """
    h, w = image.shape[:2]
    if backend is Backend.PIL:
        if (h, w) != (height, width):
            pil = PIL.Image.fromarray(image).resize((width, height), resample=int(resample))
            image = np.array(pil)
        return _chw_view(image)
    if (h, w) == (height, width):
        return _chw_view(image)
    padded = padded_pixels(image)
    mode = _TORCH_MODES.get(resample)
    if scratch and mode in _AA_OPS:
        # torch resizes 4-byte pixels without first unpacking them (the scratch resize of a
        # 1080p image: 3.0 ms against 3.6 for 3 channels); every channel is resized on its own,
        # so the first three are the same
        resized = _resize_into_scratch(image if padded is None else padded, height, width, mode)
        if resized is not None:
            return as_tensor_view(resized[..., :3].transpose(2, 0, 1))
    if padded is not None:
        return resize_chw(_chw_view(padded), height, width, resample)[:3]
    return resize_chw(_chw_view(image), height, width, resample)


def padded_pixels(image: np.ndarray) -> np.ndarray | None:
    """The C-contiguous ``H x W x 4`` uint8 array whose first three channels ``image`` is a
    view of (as :func:`aiomm.media.image.decode_image` returns RGB JPEGs and PNGs), else None."""
    base = image.base
    if (
        isinstance(base, np.ndarray)
        and base.dtype == np.uint8
        and base.shape == (*image.shape[:2], 4)
        and image.shape[2:] == (3,)
        and base.flags.c_contiguous
        and image.strides == base.strides
        and image.__array_interface__["data"][0] == base.__array_interface__["data"][0]
    ):
        return base
    return None


def resize_chw(
    chw: torch.Tensor, height: int, width: int, resample: Resample, *, scratch: bool = False
) -> torch.Tensor:
    """A uint8 ``C x H x W`` tensor (or a ``N x C x H x W`` batch of them, e.g. a video's
    frames) resized as the torchvision backend resizes (antialiased).

    ``scratch=True`` (one RGB or RGBA image, bilinear or bicubic): the result is written into
    this thread's reusable buffers, channels-last, and stays valid only until the next scratch
    resize in the same thread, so the caller copies out of it first (``patchify`` does). Same
    values; it spares the kernel's own buffers and its channels-first repacking, whose fresh
    pages the kernel zero-fills on every image once the worker arenas fragment.

    :raises ProcessingError: for a resample filter that backend has no mode for.
    """
    mode = _TORCH_MODES.get(resample)
    if mode is None:
        raise ProcessingError(f"the torchvision-backend native resize has no {resample.name} mode")
    if scratch and chw.dim() == 3 and mode in _AA_OPS and numpy_copyable(chw):
        resized = _resize_into_scratch(chw.numpy().transpose(1, 2, 0), height, width, mode)
        if resized is not None:
            return as_tensor_view(resized.transpose(2, 0, 1))
    antialias = mode != "nearest"
    out = F.interpolate(
        chw if chw.dim() == 4 else chw.unsqueeze(0),
        size=(height, width),
        mode=mode,
        align_corners=False if antialias else None,
        antialias=antialias,
    )
    return out if chw.dim() == 4 else out[0]


#: the antialiased kernels ``F.interpolate`` dispatches to (by mode), callable with ``out=``
#: (an overload torch's stubs leave out)
_AA_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "bicubic": torch._C._nn._upsample_bicubic2d_aa,
    "bilinear": torch._C._nn._upsample_bilinear2d_aa,
}
#: a scratch buffer larger than this is not kept (a fresh tensor is used instead)
_SCRATCH_MAX_BYTES = 64 << 20
_scratch = threading.local()
#: bytes of scratch buffers per thread that has any (an entry goes when its thread's locals do).
#: No lock: single dict stores, pops and copies are atomic, and a lock taken by the finaliser
#: could be held forever in a child forked while another thread held it
_held: dict[int, int] = {}


class _Holder:
    """One thread's scratch buffers by slot; counted in :func:`scratch_bytes` while it lives."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}
        self.key = id(self)  # not reused before the finaliser has run
        weakref.finalize(self, _held.pop, self.key, None)

    def set(self, slot: str, buffer: np.ndarray) -> None:
        self.buffers[slot] = buffer
        _held[self.key] = sum(int(b.nbytes) for b in self.buffers.values())


def scratch_bytes() -> int:
    """Bytes the scratch buffers of the resize and patch layout hold now, all threads together
    (each thread that ran them keeps up to three, at most 64 MiB each, until it exits). A
    buffer replaced by a larger one, or left by an exited thread, is no longer counted even
    while a result still views it."""
    return sum(_held.copy().values())


def _scratch_view(slot: str, channels: int, height: int, width: int) -> np.ndarray | None:
    """An ``H x W x C`` view of this thread's buffer ``slot`` (grown on demand), or None when it
    would be above the size kept."""
    size = channels * height * width
    if size > _SCRATCH_MAX_BYTES:
        return None
    holder = getattr(_scratch, "holder", None)
    if holder is None:
        holder = _scratch.holder = _Holder()
    buffer = holder.buffers.get(slot)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, dtype=np.uint8)
        holder.set(slot, buffer)
    return buffer[:size].reshape(height, width, channels)


def _resize_into_scratch(
    image: np.ndarray, height: int, width: int, mode: str
) -> np.ndarray | None:
    """A uint8 ``H x W x C`` array (C-contiguous, 3 or 4 channels) resized into this thread's
    buffers (an ``H x W x C`` view of them): the horizontal and vertical passes run as two calls
    of the antialiased kernel of ``mode``, as the fused kernel runs them (uint8 in between, the
    same weights), so the values are the same. None when the input does not qualify or a buffer
    would be too large.

    The kernel reads and writes channels-last ``1 x C x H x W`` tensors, which are numpy views
    here: the only torch calls are the two passes (each releases the GIL while it computes).
    """
    if (
        image.dtype != np.uint8
        or image.ndim != 3
        or image.shape[2] not in (3, 4)
        or not image.flags.c_contiguous
    ):
        return None  # the kernel would repack it anyway
    op = _AA_OPS[mode]
    h, _, c = image.shape
    src = image
    # horizontal first, then vertical: the order (and uint8 rounding between) of the fused kernel
    for slot, size in (("horizontal", (h, width)), ("vertical", (height, width))):
        if src.shape[:2] == size:
            continue
        out = _scratch_view(slot, c, *size)
        if out is None:
            return None
        op(_nchw(src), size, False, None, None, out=_nchw(out))
        src = out
    return src


def _nchw(hwc: np.ndarray) -> torch.Tensor:
    """The ``1 x C x H x W`` channels-last tensor view of an ``H x W x C`` array."""
    return as_tensor_view(hwc[None].transpose(0, 3, 1, 2))


def hf_backend_normalize(
    image_processor: Any,
    backend: Backend,
    chw: torch.Tensor,
    rescale_factor: float,
    image_mean: tuple[float, ...],
    image_std: tuple[float, ...],
) -> torch.Tensor:
    """The classic CPU path: rescale + normalise a uint8 ``C x H x W`` image into float32 with
    the HF backend's own operations, so the result equals the HF processor's bit for bit."""
    if backend is Backend.TORCHVISION:
        # tuples: the backend caches its fused mean/std on these arguments
        return image_processor.rescale_and_normalize(
            chw.unsqueeze(0), True, rescale_factor, True, tuple(image_mean), tuple(image_std)
        )[0]
    array = image_processor.normalize(
        image_processor.rescale(chw.numpy(), rescale_factor), list(image_mean), list(image_std)
    )
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


def patchify(
    chw: torch.Tensor, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> torch.Tensor:
    """Cut a ``C x H x W`` image into Qwen-VL rows ``[grid_h * grid_w, C * T * P * P]``.

    Rows are ordered by merge window (``merge_size x merge_size`` neighbouring patches stay
    adjacent); within a row the layout is channel-major, each channel holding the same frame
    ``temporal_patch_size`` times. One copy, no dtype change.
    """
    c, h, w = chw.shape
    p, m = patch_size, merge_size
    gh, gw = h // p, w // p
    order = (1, 4, 2, 5, 0, 3, 6)  # gh/m, gw/m, m, m, C, P, P
    rows = (gh * gw, c * temporal_patch_size * p * p)
    if temporal_patch_size == 1:
        rgbx = _rgbx_view(chw, p * m)
        if rgbx is not None:
            return torch.from_numpy(_rows_of_rgbx(rgbx, p, m))
    if temporal_patch_size == 1 and numpy_copyable(chw):
        # reshaped in numpy: a torch reshape would release the GIL for a view
        windows = chw.numpy().reshape(c, gh // m, m, p, gw // m, m, p)
        return torch.from_numpy(permuted_copy(windows, order, rows))
    x = chw.reshape(c, gh // m, m, p, gw // m, m, p).permute(order)
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, temporal_patch_size, -1, -1)
    return x.reshape(rows)


def _rgbx_view(chw: torch.Tensor, multiple: int) -> np.ndarray | None:
    """``chw`` as numpy, when it is a uint8 channels-last RGB view of 4-byte pixels (as the
    scratch resize returns) whose sides are multiples of ``multiple``; else None."""
    if chw.dtype != torch.uint8 or not numpy_copyable(chw):
        return None
    view = chw.numpy()  # numpy's strides: torch's stride() would release the GIL
    if view.ndim != 3 or view.shape[0] != 3:
        return None
    _, h, w = view.shape
    if not h or not w or h % multiple or w % multiple or view.strides != (1, 4 * w, 4):
        return None
    return view


#: four bytes as a number whose low byte is the first, on any host
_PIXEL = np.dtype("<u4")
#: gathered pixels per band of :func:`_rows_of_rgbx` (fits a core's L2 cache with room; best of
#: 64 KiB to 2 MiB on a 2 MiB-L2 Xeon)
_BAND_BYTES = 512 << 10


def _rows_of_rgbx(view: np.ndarray, p: int, m: int) -> np.ndarray:
    """Qwen-VL rows ``[gh * gw, 3 * p * p]`` (one frame) of an RGB view of 4-byte pixels.

    Copying the view's patches byte by byte moves 14-byte runs through numpy's iterator
    (1.1 ms for a 1288x728 image); here each patch row's pixels move as one run into patch
    order, then channel ``c`` is the low byte of the 4-byte numbers starting at byte ``c`` of
    each pixel, which numpy casts to uint8 over long rows. A run stops before its last pixel's
    fourth byte, which the view may not own (that byte of the gathered pixels is never read).

    The gathered pixels are read four times (the run copy's write, then each channel's cast), so
    they go through this thread's scratch buffer a band of merge windows at a time, about
    :data:`_BAND_BYTES`, which stays in the core's L2 cache between the four passes: 0.51 ms for
    a 1288x728 image against 0.91 with the whole image gathered first.
    """
    _, h, w = view.shape
    gh, gw = h // p, w // p
    run = np.dtype((np.void, 4 * p - 1))
    row, patch_row = 4 * w, 4 * p
    runs = (
        np.lib.stride_tricks.as_strided(
            view,
            (gh // m, m, p, gw // m, m, 4 * p - 1),
            (m * p * row, p * row, row, m * patch_row, patch_row, 1),
        )
        .view(run)[..., 0]
        .transpose(0, 3, 1, 4, 2)
    )
    patch = p * patch_row
    per_band_row = gw * m  # the patches of one row of merge windows
    band_rows = max(1, min(gh // m, _BAND_BYTES // (per_band_row * patch)))
    # 4 bytes more than the pixels: the numbers starting at byte 1 or 2 of the last pixel
    size = band_rows * per_band_row * patch + 4
    scratch = _scratch_view("patch_pixels", 1, 1, size)
    gathered = (np.empty(size, np.uint8) if scratch is None else scratch).reshape(-1)
    into = np.lib.stride_tricks.as_strided(
        gathered,
        (band_rows, gw // m, m, m, p, 4 * p - 1),
        (per_band_row * patch, m * m * patch, m * patch, patch, patch_row, 1),
    ).view(run)[..., 0]
    out = np.empty((gh * gw, 3, p * p), np.uint8)
    for first in range(0, gh // m, band_rows):
        last = min(gh // m, first + band_rows)
        np.copyto(into[: last - first], runs[first:last])
        band = out[first * per_band_row : last * per_band_row]
        for channel in range(3):
            numbers = np.ndarray((len(band), p * p), _PIXEL, gathered, offset=channel)
            np.copyto(band[:, channel], numbers, casting="unsafe")  # keeps the low byte
    return out.reshape(gh * gw, 3 * p * p)


#: dtypes whose CPU tensors numpy can view
NUMPY_VIEWABLE_DTYPES = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bool,
    }
)


def numpy_copyable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.numpy()`` shares its memory (a CPU tensor of a dtype numpy has, no grad):
    the numpy paths of :func:`copy_permuted`, the scratch resize and the wire encoding."""
    return (
        tensor.device.type == "cpu"
        and tensor.dtype in NUMPY_VIEWABLE_DTYPES
        and not (tensor.requires_grad)
    )


def copy_permuted(x: torch.Tensor, order: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """``x.permute(order).reshape(shape)`` as a contiguous CPU tensor, copied by numpy
    (:func:`permuted_copy`)."""
    return torch.from_numpy(permuted_copy(x.numpy(), order, shape))


def permuted_copy(a: np.ndarray, order: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """``a.transpose(order).reshape(shape)`` as a C-contiguous array (a view of ``a`` when that
    is contiguous already): patch layouts move runs of a patch's width (14 bytes), where
    numpy's strided copy is about twice torch's."""
    runs = as_runs(a) if a.ndim and order[-1] == a.ndim - 1 else None
    if runs is not None:  # the last axis stays last: half the time of 14-byte runs
        return np.ascontiguousarray(runs.transpose(order[:-1])).view(a.dtype).reshape(shape)
    return np.ascontiguousarray(a.transpose(order)).reshape(shape)


def as_runs(a: np.ndarray) -> np.ndarray | None:
    """``a`` with each run along its last axis as one opaque element (a view without that axis),
    or None when that axis is not contiguous (or ``a`` is empty). numpy's copy of such a view
    strides over whole runs instead of restarting its inner loop for each one."""
    if not a.ndim or not a.size or a.strides[-1] != a.itemsize:
        return None
    return a.view(np.dtype((np.void, a.shape[-1] * a.itemsize)))[..., 0]
