"""Device kernels of aiomm, installed as ``aiomm.kernels`` (never as a top-level ``kernels``)."""

if __name__ != "aiomm.kernels":  # pragma: no cover - guards a broken install or sys.path
    raise ImportError(
        "aiomm's kernels/ directory must be imported as 'aiomm.kernels'; a top-level 'kernels' "
        "would shadow the Hugging Face 'kernels' package. Install aiomm (pip install -e .)."
    )

from typing import TYPE_CHECKING, Any

from .norm import ChannelLayout, FusedMMInputNorm

if TYPE_CHECKING:
    from ._triton_norm import fused_mm_input_norm_triton

__all__ = ("ChannelLayout", "FusedMMInputNorm", "fused_mm_input_norm_triton")


def __getattr__(name: str) -> Any:
    # The launcher imports Triton; load it on first use so `import aiomm.kernels` stays light.
    if name == "fused_mm_input_norm_triton":
        from ._triton_norm import fused_mm_input_norm_triton

        return fused_mm_input_norm_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
