"""aiomm's cache folder (a leaf: imported by the registry's snapshots and the model folders)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ("default_cache_dir",)


def default_cache_dir() -> Path:
    """aiomm's cache folder, the one place its persistent caches go (the offline model folders
    of :func:`model_folder` under ``models/``, the processor snapshots of
    :mod:`aiomm.adapters._stored` under ``processors/``): ``$AIOMM_CACHE_DIR`` where it is set
    and not empty, else ``$XDG_CACHE_HOME/aiomm`` where that is an absolute path (the XDG base
    directory rule: a relative one is ignored), else ``~/.cache/aiomm``. Read at each call, so a
    change of the environment applies at once. An empty ``AIOMM_CACHE_DIR`` keeps no processor
    snapshots; model folders still go to the default."""
    given = os.environ.get("AIOMM_CACHE_DIR")
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "aiomm"
    return Path.home() / ".cache" / "aiomm"
