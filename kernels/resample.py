"""Bit-exact uint8 bicubic resize: host coefficients, pass order and the pure-torch reference.

Both variants are separable integer convolutions, one pass per resized axis with a uint8 image
between the passes:

* ``PIL_BICUBIC``: ``PIL.Image.resize(size, BICUBIC)`` (``libImaging/Resample.c``). Keys cubic,
  ``a = -0.5``; support ``2 * max(1, in / out)``; weights normalised in float64, then fixed
  point with 22 fractional bits (round half away from zero); each output is
  ``clip((2**21 + sum(pixel * weight)) >> 22, 0, 255)``.
* ``TORCH_BICUBIC_AA``: ``torch.nn.functional.interpolate(uint8, mode="bicubic",
  antialias=True, align_corners=False)`` on the CPU, which ``torchvision.transforms.v2.functional
  .resize`` calls for uint8 images. The same taps and float64 weights (also ``a = -0.5``: the
  ``-0.75`` constant is only used without antialias), but the weights become int16 with a
  per-axis precision ``p`` (the largest ``p <= 22`` with ``round(max_weight * 2**(p + 1)) <
  2**15``) and the sum starts at ``2**(p - 1)``.

Integer sums do not depend on summation order, so the Triton passes
(``_triton_resample.py``) reproduce these results exactly; what decides exactness is the
coefficient computation (the float64 operations in the same order as the C code) and the pass
order (:func:`pass_order`), both in ``_resample_plan.py`` and re-exported here. This module
imports no Triton.
"""

from __future__ import annotations

import torch

from ._resample_plan import (
    ImageLayout,
    ResampleVariant,
    ResizeCoefficients,
    check_image,
    input_span,
    pass_order,
    resize_coefficients,
)

__all__ = (
    "ImageLayout",
    "ResampleVariant",
    "ResizeCoefficients",
    "pass_order",
    "resize_coefficients",
    "resize_uint8",
    "resize_uint8_reference",
)


def _reference_pass(
    x: torch.Tensor, dim: int, out_size: int, variant: ResampleVariant
) -> torch.Tensor:
    """One integer pass along ``dim``: a uint8 tensor with ``dim`` resized to ``out_size``."""
    in_size = x.shape[dim]
    bounds, weights, precision = resize_coefficients(in_size, out_size, variant)
    first, last = input_span(in_size, out_size, variant)
    x = x.narrow(dim, first, last - first)
    start = bounds[:, 0].to(device=x.device, dtype=torch.int64) - first
    weights = weights.to(x.device)
    shape = [1] * x.dim()
    shape[dim] = out_size
    out_shape = list(x.shape)
    out_shape[dim] = out_size
    acc = torch.full(out_shape, 1 << (precision - 1), dtype=torch.int32, device=x.device)
    for k in range(int(bounds[:, 1].max())):
        # Taps past an output's count have weight 0; clamp their index to stay inside the input.
        index = (start + k).clamp_(max=last - first - 1)
        acc.add_(x.index_select(dim, index).to(torch.int32).mul_(weights[:, k].view(shape)))
    return acc.bitwise_right_shift_(precision).clamp_(0, 255).to(torch.uint8)


def resize_uint8_reference(
    image: torch.Tensor,
    out_h: int,
    out_w: int,
    variant: ResampleVariant | str,
    *,
    layout: ImageLayout | str = ImageLayout.HWC,
) -> torch.Tensor:
    """Pure-torch integer resize, the specification and CPU fallback of the Triton passes.

    ``image``: uint8 ``[..., H, W, C]`` (``layout="hwc"``) or ``[..., C, H, W]`` (``"chw"``), any
    strides and device; leading dimensions are a batch of same-size images. Returns a new
    contiguous uint8 tensor with the spatial dimensions ``(out_h, out_w)``, equal bit for bit to
    the library ``variant`` names (see :func:`pass_order` for the order of the passes). An image
    already of the requested size comes back as a contiguous copy.

    :raises UnsupportedDtypeError: ``image`` is not uint8.
    :raises LayoutError: unknown ``layout``, or ``image`` has fewer than 3 dimensions.
    :raises KernelInputError: an empty image, an output size below 1, or an unknown variant.
    """
    variant = ResampleVariant.parse(variant)
    layout, in_h, in_w = check_image(image, out_h, out_w, layout)
    dh, dw = layout.spatial_dims
    x = image
    for axis in pass_order(in_h, in_w, out_h, out_w, variant):
        if axis == "h":
            x = _reference_pass(x, x.dim() + dw, out_w, variant)
        else:
            x = _reference_pass(x, x.dim() + dh, out_h, variant)
    return x.contiguous() if x is not image else image.clone(memory_format=torch.contiguous_format)


def resize_uint8(
    image: torch.Tensor,
    out_h: int,
    out_w: int,
    variant: ResampleVariant | str,
    *,
    layout: ImageLayout | str = ImageLayout.HWC,
) -> torch.Tensor:
    """Resize a uint8 image bit-exactly: the Triton passes for CUDA tensors, torch otherwise.

    Arguments, result and errors are those of :func:`resize_uint8_reference` (the Triton
    launcher also refuses images with 2**31 rows or row elements or more).
    """
    if image.is_cuda:
        from ._triton_resample import resample_uint8_triton

        return resample_uint8_triton(image, out_h, out_w, variant, layout=layout)
    return resize_uint8_reference(image, out_h, out_w, variant, layout=layout)
