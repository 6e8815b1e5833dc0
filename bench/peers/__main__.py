"""``python bench/peers`` (or ``python -m peers`` from bench/, ``python -m bench.peers`` from the
checkout): aiomm against smg and vLLM."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
# bench/ on the path (render_bench, and this package as ``peers``); the checkout's root off it,
# where its kernels/ folder would shadow Hugging Face's ``kernels``
_OFF = (BENCH.parent, BENCH / "peers")
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in _OFF]
sys.path.insert(0, str(BENCH))

from peers.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
