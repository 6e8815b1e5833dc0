"""aiomm: an async streaming preprocessing engine for multimodal model serving."""

from __future__ import annotations

from .logging import configure_logging as configure_logging

__version__ = "0.1.0"

__all__ = ("__version__", "configure_logging")
