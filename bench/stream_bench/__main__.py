"""``python bench/stream_bench`` (or ``python -m stream_bench`` from bench/): ``aiomm bench``."""

import sys
from pathlib import Path

if not __package__:
    # Run as a folder: sys.path[0] is this folder. Put bench/ there instead, so the package
    # imports as itself and the working directory (a checkout's root, whose kernels/ would
    # shadow Hugging Face's `kernels`) stays off the path.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from stream_bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
