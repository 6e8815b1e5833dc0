"""aiomm.config is a leaf: every record builds without torch/httpx; bad fields raise ConfigError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fresh_python import run_python

from aiomm import config
from aiomm.config import DecodeConfig, EngineConfig, FetchConfig, MultiModalConfig
from aiomm.errors import ConfigError


def test_configs_build_without_heavy_modules() -> None:
    code = (
        "import json, sys, aiomm\n"
        "aiomm.EngineConfig(); aiomm.FetchConfig()\n"
        "aiomm.DecodeConfig(); aiomm.MultiModalConfig()\n"
        "from aiomm.config import EngineConfig\n"
        "EngineConfig(fetch=aiomm.FetchConfig(allowed_networks=('10.0.0.0/8',)))\n"
        "heavy = ('torch', 'httpx', 'httpcore', 'transformers', 'numpy', 'PIL', 'triton')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_old_homes_re_export_the_same_classes() -> None:
    import aiomm
    from aiomm.media import fetch
    from aiomm.media import image as decode
    from aiomm.processing import processor

    assert fetch.FetchConfig is FetchConfig is aiomm.FetchConfig
    assert decode.DecodeConfig is DecodeConfig is aiomm.DecodeConfig
    assert (
        decode.DEFAULT_MAX_PIXELS
        == config.DEFAULT_MAX_PIXELS
        == DecodeConfig().resolved_max_pixels()
    )
    assert processor.MultiModalConfig is MultiModalConfig is aiomm.MultiModalConfig
    assert aiomm.EngineConfig is EngineConfig


def test_defaults() -> None:
    cfg = EngineConfig()
    assert cfg.transform_threads >= 1 and cfg.max_in_flight == 64
    assert cfg.fetch == FetchConfig() and cfg.decode == DecodeConfig()
    assert cfg.processing == MultiModalConfig(transform="auto")
    # an embedded engine changes no process-wide setting unless asked (aiomm.tuning.tuned)
    assert not cfg.tune_malloc and cfg.torch_threads is None
    assert cfg.decode.pillow_blocks_kept is None
    assert FetchConfig(allowed_local_root="/tmp").allowed_local_root == Path("/tmp")  # type: ignore[arg-type]
    nets = FetchConfig(allowed_networks=("10.1.0.0/16",)).allowed_networks  # type: ignore[arg-type]
    assert [str(n) for n in nets] == ["10.1.0.0/16"]


@pytest.mark.parametrize(
    ("cls", "kwargs", "fragment"),
    [
        (EngineConfig, {"max_in_flight": 0}, r"EngineConfig\.max_in_flight .* >= 1, got 0 \(int\)"),
        (EngineConfig, {"transform_threads": 2.0}, r"transform_threads .* got 2\.0 \(float\)"),
        (EngineConfig, {"fetch_concurrency": True}, r"fetch_concurrency .* got True \(bool\)"),
        (EngineConfig, {"max_decoded_bytes_in_flight": 0}, "max_decoded_bytes_in_flight"),
        (EngineConfig, {"cache_capacity_bytes": -1}, r"cache_capacity_bytes .* >= 0, got -1"),
        (EngineConfig, {"host_output_pool_bytes": -1}, "host_output_pool_bytes"),
        (EngineConfig, {"device_staging_buffers": 0}, "device_staging_buffers"),
        (EngineConfig, {"torch_threads": 0}, r"torch_threads .* or None, got 0"),
        (EngineConfig, {"visual_dtype": "int8"}, r"visual_dtype must be one of .*'int8'"),
        (
            EngineConfig,
            {"fetch": {"max_bytes": 1}},
            r"EngineConfig\.fetch must be a FetchConfig, got dict",
        ),
        (EngineConfig, {"decode": None}, "must be a DecodeConfig, got NoneType"),
        (FetchConfig, {"connect_timeout": 0}, r"FetchConfig\.connect_timeout .* positive .* got 0"),
        (FetchConfig, {"read_timeout": "5"}, r"read_timeout .* got '5' \(str\)"),
        (FetchConfig, {"max_bytes": 0}, r"FetchConfig\.max_bytes"),
        (FetchConfig, {"max_redirects": -1}, r"max_redirects .* >= 0, got -1"),
        (
            FetchConfig,
            {"allowed_networks": ("10.0.0.0/8", "nope")},
            r"allowed_networks\[1\]='nope'",
        ),
        (
            FetchConfig,
            {"allowed_local_root": 5},
            "allowed_local_root must be a path or None, got int",
        ),
        (DecodeConfig, {"max_pixels": 1.5}, r"DecodeConfig\.max_pixels .* got 1\.5 \(float\)"),
        (DecodeConfig, {"pillow_blocks_kept": -1}, r"pillow_blocks_kept .* >= 0 or None, got -1"),
        (
            MultiModalConfig,
            {"transform": "fast"},
            r"transform must be one of 'auto', 'hf', 'native'",
        ),
    ],
)
def test_bad_fields_raise_config_error(cls: type, kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        cls(**kwargs)
    assert isinstance(info.value, ValueError)  # ``except ValueError`` callers keep working
