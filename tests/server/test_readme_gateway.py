"""README.md's openai-client snippet, run as written against ``aiomm standin`` and ``aiomm serve
--upstream`` on loopback (8001 and 8000 when free; otherwise free ports, and only the snippet's
``127.0.0.1:8000`` is rewritten to the gateway's)."""

from __future__ import annotations

import io
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("starlette")
pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port, wait_healthy

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)
    found = [b for b in blocks if "from openai import OpenAI" in b]
    assert found, "README.md has no Python block with `from openai import OpenAI`"
    return found[0]


def _port(preferred: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            return free_port()
    return preferred


def test_the_readme_gateway_snippet_runs(tmp_path: Path) -> None:
    code = _snippet()
    assert "127.0.0.1:8000" in code
    upstream, gateway = _port(8001), _port(8000)
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{gateway}")
    pixels = np.random.default_rng(3).integers(0, 256, (60, 80, 3), dtype=np.uint8)
    jpeg = io.BytesIO()
    PIL.Image.fromarray(pixels).save(jpeg, "JPEG")
    (tmp_path / "photo.jpg").write_bytes(jpeg.getvalue())
    (tmp_path / "snippet.py").write_text(code)
    aiomm = str(Path(sys.executable).with_name("aiomm"))
    commands = [
        [sys.executable, "-P", "-m", "aiomm.server.standin", "qwen2-vl", "--port", str(upstream)],
        [aiomm, "serve", "qwen2-vl", "--upstream", f"http://127.0.0.1:{upstream}",
         "--port", str(gateway)],
    ]  # fmt: skip
    procs = [
        subprocess.Popen(c, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for c in commands
    ]
    try:
        deadline = time.monotonic() + 180
        wait_healthy(f"http://127.0.0.1:{upstream}", procs[0], deadline)
        wait_healthy(f"http://127.0.0.1:{gateway}", procs[1], deadline)
        run = subprocess.run(
            [sys.executable, "snippet.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), "the snippet printed no text"
