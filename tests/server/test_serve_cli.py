"""``aiomm serve`` as a process: it serves, and SIGTERM drains in-flight requests and stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from aiomm.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, free_port

FIXTURE = Path(__file__).parent / "fixtures" / "chat_two_images.json"


def test_serve_refuses_a_missing_folder(tmp_path: Path, capsys: Any) -> None:
    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "not a model folder" in capsys.readouterr().out


def test_serve_process_drains_on_sigterm(model_folder: Path) -> None:
    port = free_port()
    exe = Path(sys.executable).with_name("aiomm")
    proc = subprocess.Popen(
        [str(exe), "serve", str(model_folder), "--port", str(port), "--model-id",
         RECORDED_MODEL, "--served-model-name", RECORDED_MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        case = json.loads(FIXTURE.read_text())
        result: dict[str, Any] = {}
        raw = json.dumps(case["body"]).encode()
        first_sent, signalled = threading.Event(), threading.Event()

        def body() -> Any:
            # half the body, then the rest only after SIGTERM: the request is surely in flight
            yield raw[: len(raw) // 2]
            first_sent.set()
            signalled.wait(30)
            time.sleep(0.2)
            yield raw[len(raw) // 2 :]

        def post() -> None:
            try:
                result["r"] = httpx.post(
                    url + case["path"],
                    content=body(),
                    timeout=60,
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError as exc:
                result["r"] = exc

        thread = threading.Thread(target=post)
        thread.start()
        assert first_sent.wait(30)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        signalled.set()
        thread.join(60)
        # uvicorn re-raises the captured signal once it has drained and shut down
        assert proc.wait(60) in (0, -signal.SIGTERM)
        r = result["r"]
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 200
        expected = case["response"]["features"]["mm_hashes"]
        assert r.json()["features"]["mm_hashes"] == expected
        log = proc.stdout.read().decode() if proc.stdout else ""
        lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
        assert any(x.get("event") == "request" and x.get("status") == 200 for x in lines), log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
