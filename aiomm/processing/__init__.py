"""Multimodal processing: HF stages, prompt updates, per-item fields."""
