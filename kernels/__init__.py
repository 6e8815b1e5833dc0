"""Device kernels of aiomm, installed as ``aiomm.kernels`` (never as a top-level ``kernels``)."""

if __name__ != "aiomm.kernels":  # pragma: no cover - guards a broken install or sys.path
    raise ImportError(
        "aiomm's kernels/ directory must be imported as 'aiomm.kernels'; a top-level 'kernels' "
        "would shadow the Hugging Face 'kernels' package. Install aiomm (pip install -e .)."
    )

from typing import TYPE_CHECKING, Any

from ._norm_checks import expand_repeat
from .norm import INPUT_DTYPES, OUTPUT_DTYPES, ChannelLayout, FusedMMInputNorm

if TYPE_CHECKING:
    from ._triton_norm import fused_mm_input_norm_triton
    from ._triton_resample import resample_uint8_triton
    from .resample import (
        ImageLayout,
        ResampleVariant,
        ResizeCoefficients,
        resize_coefficients,
        resize_uint8,
        resize_uint8_reference,
    )

__all__ = (
    "INPUT_DTYPES",
    "OUTPUT_DTYPES",
    "ChannelLayout",
    "FusedMMInputNorm",
    "ImageLayout",
    "ResampleVariant",
    "ResizeCoefficients",
    "expand_repeat",
    "fused_mm_input_norm_triton",
    "resample_uint8_triton",
    "resize_coefficients",
    "resize_uint8",
    "resize_uint8_reference",
)

# Resize: the public names of .resample (pure torch) and the launcher (imports Triton).
_LAZY = {
    "ImageLayout": "resample",
    "ResampleVariant": "resample",
    "ResizeCoefficients": "resample",
    "resize_coefficients": "resample",
    "resize_uint8": "resample",
    "resize_uint8_reference": "resample",
    "resample_uint8_triton": "_triton_resample",
}


def __getattr__(name: str) -> Any:
    # The launcher imports Triton; load it on first use so `import aiomm.kernels` stays light.
    if name == "fused_mm_input_norm_triton":
        from ._triton_norm import fused_mm_input_norm_triton

        return fused_mm_input_norm_triton
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
