"""Logging: silent unless the host asks; stdlib levels and handlers decide; configure_logging()."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from fresh_python import run_python

from aiomm.errors import ConfigError
from aiomm.logging import configure_logging, get_logger

_ENGINE_RUN = """
import io, sys
import anyio, numpy as np, PIL.Image
import aiomm

PROMPT = "<|im_start|>user <|vision_start|><|image_pad|><|vision_end|> describe<|im_end|>"
buf = io.BytesIO()
PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(
    buf, "PNG"
)

async def run():
    config = aiomm.EngineConfig(device="cpu", transform_threads=2)
    async with aiomm.Engine.from_pretrained("qwen2-vl", config) as engine:
        good = await engine.process(aiomm.Request(prompt=PROMPT, images=[buf.getvalue()]))
        # a failing request makes the engine log a warning, which stdlib's lastResort handler
        # would print to stderr if aiomm's logger had no handler at all
        try:
            error = (await engine.process(aiomm.Request(prompt=PROMPT, images=[b"no image"]))).error
        except aiomm.AiommError as exc:
            error = exc
    assert good.ok and good.pixel_values is not None, good.error
    assert isinstance(error, aiomm.DecodeError), error

anyio.run(run)
"""


def _run_engine_script(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Not from the repository root: there the top-level kernels/ directory would shadow the
    # Hugging Face package transformers probes for.
    env = {k: v for k, v in os.environ.items() if k != "AIOMM_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # configure_logging() and these tests change process-wide state; put it back
    root = logging.getLogger("aiomm")
    handlers, level = list(root.handlers), root.level
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_engine_prints_nothing_unless_logging_is_configured(tmp_path: Path) -> None:
    out = _run_engine_script(_ENGINE_RUN, tmp_path)
    assert out.returncode == 0, out.stderr
    assert (out.stdout, out.stderr) == ("", "")


def test_configure_logging_shows_the_engine_events_on_stderr(tmp_path: Path) -> None:
    code = "import aiomm\naiomm.configure_logging(level='DEBUG')\n" + _ENGINE_RUN
    out = _run_engine_script(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    events = [json.loads(line) for line in out.stderr.splitlines()]
    by_name = {e["event"]: e for e in events}
    assert {"engine_open", "request_done", "request_failed", "engine_closed"} <= set(by_name)
    assert by_name["engine_open"]["logger"] == "aiomm.engine._engine"
    assert by_name["request_failed"]["level"] == "warning"
    assert by_name["request_failed"]["error"] == "DecodeError"
    assert all("timestamp" in e for e in events)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("aiomm.test_logging")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


def test_events_are_stdlib_records_filtered_by_stdlib_levels(records: _Records) -> None:
    log = get_logger("aiomm.test_logging")
    logging.getLogger("aiomm.test_logging").setLevel(logging.INFO)
    log.debug("dropped", x=1)
    log.info("kept", request_id="r1", images=2)
    log.warning("warned")
    assert [(r.name, r.levelname) for r in records.records] == [
        ("aiomm.test_logging", "INFO"),
        ("aiomm.test_logging", "WARNING"),
    ]
    kept = records.records[0]
    assert kept.msg == {"event": "kept", "request_id": "r1", "images": 2}
    # a plain stdlib formatter shows the event and its fields
    assert logging.Formatter("%(levelname)s %(name)s %(message)s").format(kept) == (
        "INFO aiomm.test_logging kept request_id='r1' images=2"
    )
    assert records.records[1].getMessage() == "warned"


def test_a_host_structlog_configuration_shapes_aiomm_events(records: _Records) -> None:
    structlog.configure(processors=[structlog.processors.KeyValueRenderer(key_order=["event"])])
    before = structlog.get_config()
    processors = list(before["processors"])
    get_logger("aiomm.test_logging").warning("hello", n=3)
    configure_logging(stream=io.StringIO(), level="DEBUG")
    assert [r.getMessage() for r in records.records] == ["event='hello' n=3"]
    # configure_logging left the host's structlog configuration alone
    assert structlog.get_config() == before and before["processors"] == processors


def test_capture_logs_sees_aiomm_events() -> None:
    with structlog.testing.capture_logs() as logs:
        get_logger("aiomm.test_logging").warning("captured", k="v")
    assert logs == [{"event": "captured", "k": "v", "log_level": "warning"}]


def test_importing_aiomm_configures_no_structlog() -> None:
    code = "import structlog, aiomm.engine._engine; print(structlog.is_configured())"
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _configured_log(buf: io.StringIO, **kwargs: Any) -> structlog.stdlib.BoundLogger:
    configure_logging(stream=buf, **kwargs)
    return get_logger("aiomm.test_logging")


def test_configure_logging_emits_json_lines_when_not_a_tty() -> None:
    buf = io.StringIO()  # StringIO.isatty() is False
    log = _configured_log(buf, level="DEBUG")
    log.info("first_event", request_id="r1", images=2)
    log.debug("second_event", stage="decode")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["event"] == "first_event" and first["request_id"] == "r1" and first["images"] == 2
    assert first["level"] == "info" and "timestamp" in first
    assert first["logger"] == "aiomm.test_logging"
    assert second["event"] == "second_event" and second["level"] == "debug"


def test_configure_logging_again_replaces_its_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    _configured_log(first, level="INFO")
    _configured_log(second, level="INFO").info("once")
    assert first.getvalue() == ""
    assert [json.loads(line)["event"] for line in second.getvalue().splitlines()] == ["once"]


def test_configure_logging_level_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOMM_LOG_LEVEL", "warning")
    buf = io.StringIO()
    log = _configured_log(buf)
    log.info("hidden")
    log.warning("shown")
    events = [json.loads(line)["event"] for line in buf.getvalue().splitlines()]
    assert events == ["shown"]


def test_configure_logging_console_renderer_on_tty() -> None:
    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    buf = FakeTTY()
    _configured_log(buf, level="INFO").info("pretty_event", k=1)
    text = buf.getvalue()
    assert "pretty_event" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_configure_logging_rejects_unknown_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOMM_LOG_LEVEL", "chatty")
    with pytest.raises(ConfigError, match=r"(?i)chatty"):
        configure_logging(stream=io.StringIO())
