"""Regenerate ``adapters/stored_processors.json`` from the offline builders:
``python -P -m aiomm.adapters._store_update``."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

from aiomm.adapters._stored import STORE, build_store
from aiomm.adapters.registry import get_adapter_info, supported_adapters

__all__ = ("BACKENDS", "builders", "main", "stored_names")

BACKENDS = ("torchvision", "pil")


def stored_names() -> tuple[str, ...]:
    """The short names the store covers: every registered architecture (a snapshot holds its
    processor's parameters, image and video processors, feature extractor and tokenizer, and
    the references adapters take in an HF processor's place); none is left out."""
    return tuple(info.short_name for info in supported_adapters())


def builders() -> Iterable[tuple[str, Callable[[], Any]]]:
    """``(key, build)`` of every stored processor: ``"<short name>/<backend>"``."""
    for name in stored_names():
        info = get_adapter_info(name)
        for backend in BACKENDS:
            yield f"{name}/{backend}", functools.partial(info.build_hf_processor, backend=backend)


def main() -> int:
    STORE.write_text(json.dumps(build_store(builders()), indent=1, sort_keys=True) + "\n")
    print(f"wrote {STORE}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
