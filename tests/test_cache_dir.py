"""aiomm's cache folder: ``$AIOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiomm``, else
``~/.cache/aiomm``; the model folders and processor snapshots both go there."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiomm.adapters import _stored, folders


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No cache variable set and a home folder of the test's own."""
    monkeypatch.delenv("AIOMM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_default_is_under_the_home_folder(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert folders.default_cache_dir() == tmp_path / "home" / ".cache" / "aiomm"


def test_xdg_cache_home_moves_it(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert folders.default_cache_dir() == tmp_path / "xdg" / "aiomm"
    # the XDG rule: an empty or relative value is ignored
    for ignored in ("", "relative/cache"):
        env.setenv("XDG_CACHE_HOME", ignored)
        assert folders.default_cache_dir() == tmp_path / "home" / ".cache" / "aiomm"


def test_aiomm_cache_dir_wins(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env.setenv("AIOMM_CACHE_DIR", str(tmp_path / "mine"))
    assert folders.default_cache_dir() == tmp_path / "mine"
    env.setenv("AIOMM_CACHE_DIR", "~/elsewhere")
    assert folders.default_cache_dir() == tmp_path / "home" / "elsewhere"
    # empty: the default place (and no processor snapshots kept)
    env.setenv("AIOMM_CACHE_DIR", "")
    assert folders.default_cache_dir() == tmp_path / "xdg" / "aiomm"
    assert _stored._cache_file("qwen2-vl/pil", {"transformers": "0", "tokenizers": "0"}) is None


def test_model_folders_and_snapshots_share_the_folder(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env.setenv("AIOMM_CACHE_DIR", str(tmp_path / "mine"))
    folder = folders.model_folder("qwen2-vl")
    assert folder.parent == tmp_path / "mine" / "models"
    assert (folder / "config.json").is_file()
    snapshot = _stored._cache_file("qwen2-vl/pil", {"transformers": "1", "tokenizers": "2"})
    assert snapshot == tmp_path / "mine" / "processors" / "transformers1-tokenizers2" / (
        "qwen2-vl--pil.json"
    )
    assert not (tmp_path / "home").exists()  # nothing written under the home folder
