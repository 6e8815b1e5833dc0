"""The packaged stand-in for ``vllm serve --tokens-only`` (:mod:`aiomm.server.standin`) behind
``aiomm serve --upstream``, as separate processes on loopback, for one architecture per distinct
preprocessing (rows sharing their processor class and reference render alike; every row's
gateway is driven in-process by tests/server/test_architectures.py).

For each short name, ``python -m aiomm.server.standin NAME`` and ``aiomm serve NAME --upstream``
are started (the next architectures' pairs start while one is tested, so their start-ups
overlap) and driven with the official openai client: a chat with a JPEG data URL (twice: the
same text), the same chat streamed (the same text, the same usage), and a completion cut by
``max_tokens``. The rendered ``GenerateRequest`` posted to the stand-in directly is accepted, and
refused (vLLM's 400 error body) with an image token outside every placeholder, a placeholder
without its mm_hash, or a token id outside the vocabulary.
"""

from __future__ import annotations

import base64
import copy
import io
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import PIL.Image
import pytest
from architectures import one_per_preprocessing

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

from aiomm.server.standin import ModelSpec  # noqa: E402
from aiomm.server.state import model_folder  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import free_port, wait_healthy  # noqa: E402

ADAPTERS = one_per_preprocessing()
#: pairs started ahead of the one under test
LOOKAHEAD = 3
START_TIMEOUT_S = 180.0


def _jpeg() -> bytes:
    pixels = np.random.default_rng(7).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


IMAGE_URL = "data:image/jpeg;base64," + base64.b64encode(_jpeg()).decode()
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": IMAGE_URL}},
            {"type": "text", "text": "Describe the image."},
        ],
    }
]


class Pair:
    """A stand-in and a gateway for one architecture, as child processes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.standin_url = f"http://127.0.0.1:{free_port()}"
        self.gateway_url = f"http://127.0.0.1:{free_port()}"
        aiomm = str(Path(sys.executable).with_name("aiomm"))
        standin_port = self.standin_url.rsplit(":", 1)[1]
        gateway_port = self.gateway_url.rsplit(":", 1)[1]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-P", "-m", "aiomm.server.standin", name, "--port", standin_port],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
            ),
            subprocess.Popen(
                [aiomm, "serve", name, "--upstream", self.standin_url, "--port", gateway_port],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
            ),
        ]  # fmt: skip

    def wait(self) -> Pair:
        deadline = time.monotonic() + START_TIMEOUT_S
        for url, proc in zip((self.standin_url, self.gateway_url), self.procs, strict=True):
            wait_healthy(url, proc, deadline)
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


class Launcher:
    """Starts the pairs in ``ADAPTERS`` order, ``LOOKAHEAD`` ahead of the one asked for."""

    def __init__(self) -> None:
        self.pairs: dict[str, Pair] = {}

    def get(self, name: str) -> Pair:
        at = ADAPTERS.index(name)
        for ahead in ADAPTERS[at : at + 1 + LOOKAHEAD]:
            if ahead not in self.pairs:
                self.pairs[ahead] = Pair(ahead)
        return self.pairs[name].wait()

    def release(self, name: str) -> None:
        pair = self.pairs.pop(name, None)
        if pair is not None:
            pair.stop()

    def close(self) -> None:
        for name in list(self.pairs):
            self.release(name)


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    started = time.monotonic()
    launcher = Launcher()
    try:
        yield launcher
    finally:
        launcher.close()
        print(f"\n{len(ADAPTERS)} architectures in {time.monotonic() - started:.1f} s")


class Served:
    def __init__(self, pair: Pair) -> None:
        self.name = pair.name
        self.pair = pair
        self.client = openai.OpenAI(
            base_url=pair.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.spec = ModelSpec.from_folder(model_folder(pair.name), name=pair.name)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_folder(pair.name)))

    def rendered(self) -> dict[str, Any]:
        """The ``GenerateRequest`` the gateway renders for ``MESSAGES``."""
        out = httpx.post(
            self.pair.gateway_url + "/v1/chat/completions/render",
            json={"model": self.name, "messages": MESSAGES},
            timeout=60,
        )
        assert out.status_code == 200, out.text
        body: dict[str, Any] = out.json()
        return body

    def generate(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.pair.standin_url + "/inference/v1/generate", json=body, timeout=60)


@pytest.fixture(scope="module", params=ADAPTERS)
def served(request: pytest.FixtureRequest, launcher: Launcher) -> Iterator[Served]:
    name = request.param
    try:
        yield Served(launcher.get(name))
    finally:
        launcher.release(name)


def test_chat_with_an_image_is_deterministic(served: Served) -> None:
    first = served.client.chat.completions.create(model=served.name, messages=MESSAGES)
    again = served.client.chat.completions.create(model=served.name, messages=MESSAGES)
    text = first.choices[0].message.content
    assert text and text.strip(), served.name
    assert again.choices[0].message.content == text
    assert first.choices[0].finish_reason == "stop"
    # the same request straight to the stand-in: the ids behind the text and the usage
    body = served.rendered()
    direct = served.generate({**body, "stream": False})
    assert direct.status_code == 200, direct.text
    ids = direct.json()["choices"][0]["token_ids"]
    assert ids[-1] == served.spec.eos_token_id
    assert text == served.tokenizer.decode(ids, skip_special_tokens=True)
    assert first.usage is not None and first.usage == again.usage
    assert first.usage.prompt_tokens == len(body["token_ids"])
    assert first.usage.completion_tokens == len(ids)
    assert first.usage.total_tokens == len(body["token_ids"]) + len(ids)


def test_streamed_chat_gives_the_same_text(served: Served) -> None:
    plain = served.client.chat.completions.create(model=served.name, messages=MESSAGES)
    stream = served.client.chat.completions.create(
        model=served.name,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len([p for p in pieces if p]) > 1, "the text came in one piece"
    assert "".join(pieces) == plain.choices[0].message.content
    assert finish == "stop"
    assert usage is not None and plain.usage is not None
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_completion_honours_max_tokens(served: Served) -> None:
    one = served.client.completions.create(
        model=served.name, prompt="describe the picture", max_tokens=3
    )
    two = served.client.completions.create(
        model=served.name, prompt="describe the picture", max_tokens=3
    )
    assert one.choices[0].text.strip()
    assert one.choices[0].text == two.choices[0].text
    assert one.choices[0].finish_reason == "length"
    assert one.usage is not None and one.usage.completion_tokens == 3
    assert one.usage.total_tokens == one.usage.prompt_tokens + 3


def _refused(served: Served, body: dict[str, Any], words: str) -> None:
    out = served.generate(body)
    assert out.status_code == 400, (served.name, out.text)
    error = out.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert words in error["message"], (served.name, error["message"])


def test_the_standin_refuses_malformed_requests(served: Served) -> None:
    body = served.rendered()
    assert served.generate(body).status_code == 200
    image_token = served.spec.image_token_id
    assert image_token is not None, served.name
    assert body["token_ids"].count(image_token) > 0, "the model's image token, from its config"

    # the images' modality as rendered ("vision_chunk" for Kimi-K2.5)
    modality = next(iter(body["features"]["mm_placeholders"]))
    extra_image_token = copy.deepcopy(body)
    covered = {
        i
        for r in body["features"]["mm_placeholders"][modality]
        for i in range(r["offset"], r["offset"] + r["length"])
    }
    outside = min(set(range(len(body["token_ids"]))) - covered)
    extra_image_token["token_ids"][outside] = image_token
    _refused(served, extra_image_token, "outside every placeholder")

    short = copy.deepcopy(body)
    (first,) = short["features"]["mm_placeholders"][modality]
    short["features"]["mm_placeholders"][modality] = [{**first, "length": first["length"] - 1}]
    if body["token_ids"][first["offset"] + first["length"] - 1] == image_token:
        _refused(served, short, "")  # an image token left outside (or a grid giving more)

    unhashed = copy.deepcopy(body)
    unhashed["features"]["mm_hashes"][modality] = []
    _refused(served, unhashed, "placeholders but 0 mm_hashes")

    out_of_vocab = copy.deepcopy(body)
    out_of_vocab["token_ids"][0] = served.spec.vocab_size
    _refused(served, out_of_vocab, "out of vocabulary")

    unknown = {**body, "prompt": "hello"}
    _refused(served, unknown, "Extra inputs are not permitted")

    bad_sampling = copy.deepcopy(body)
    bad_sampling["sampling_params"]["temperature"] = -1.0
    _refused(served, bad_sampling, "temperature")
