"""Dummy text for HF processors whose ``__call__`` needs text with placeholders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ("BaseDummyInputsBuilder",)


@dataclass(frozen=True)
class BaseDummyInputsBuilder:
    """Builds the text an HF processor is called with when the real text is not available.

    ``placeholders`` maps each modality to the placeholder text of one item as the model's chat
    template writes it (e.g. ``"<|vision_start|><|image_pad|><|vision_end|>"``).
    """

    placeholders: Mapping[str, str]

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """One placeholder per item, modality by modality."""
        return "".join(self.placeholders[m] * n for m, n in mm_counts.items() if n)
