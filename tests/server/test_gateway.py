"""Gateway mode with the official openai client against a loopback stand-in upstream."""

from __future__ import annotations

import base64
import io
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import PIL.Image
import pytest

openai = pytest.importorskip("openai")

from aiomm.server import ServerConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RECORDED_MODEL, LiveServer  # noqa: E402
from upstream_standin import StandIn, UpstreamServer, validate  # noqa: E402

REPLY = "The picture shows a red car on the road."


def _png(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    rng = np.random.default_rng(seed)
    img = PIL.Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(*urls: str, text: str = "Describe this image.") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def gateway(model_folder: Path) -> Iterator[tuple[LiveServer, StandIn, list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    script = [*tokenizer.encode(REPLY, add_special_tokens=False), 151645]
    standin = StandIn(script, delay_s=0.05)
    with UpstreamServer(standin) as upstream:
        config = ServerConfig(
            model=str(model_folder), model_id=RECORDED_MODEL, upstream=upstream.url
        )
        with LiveServer(config) as server:
            yield server, standin, script


def _client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_chat_sync(gateway: Any, model_folder: Path) -> None:
    server, standin, script = gateway
    out = _client(server).chat.completions.create(
        model=str(model_folder), messages=_messages(_png(1), _png(2))
    )
    assert out.choices[0].message.content == REPLY
    assert out.choices[0].finish_reason == "stop"
    body = standin.seen[-1]
    assert validate(body) == []
    assert len(body["features"]["mm_placeholders"]["image"]) == 2
    assert out.usage.prompt_tokens == len(body["token_ids"])
    assert out.usage.completion_tokens == len(script)


def test_chat_with_a_video(gateway: Any, model_folder: Path) -> None:
    from record_fixtures import data_url, videos

    server, standin, _ = gateway
    clips = videos()
    messages = _messages(_png(9), text="What changes between these?")
    messages[0]["content"].append(
        {"type": "video_url", "video_url": {"url": data_url(clips["vp9"])}}
    )
    out = _client(server).chat.completions.create(model=str(model_folder), messages=messages)
    assert out.choices[0].message.content == REPLY
    body = standin.seen[-1]
    assert validate(body) == []
    assert [len(body["features"]["mm_placeholders"][m]) for m in ("image", "video")] == [1, 1]
    # a video of 16 frames at 8 fps sampled at 2 fps: 4 frames, 2 temporal patches
    assert body["features"]["mm_placeholders"]["video"][0]["length"] == 2 * 2 * 3
    with pytest.raises(openai.BadRequestError, match="DecodeError"):
        _client(server).chat.completions.create(
            model=str(model_folder),
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": data_url(("video/mp4", b"x"))}}
                    ],
                }
            ],
        )


def test_chat_sync_stream(gateway: Any, model_folder: Path) -> None:
    server, standin, _ = gateway
    stream = _client(server).chat.completions.create(
        model=str(model_folder), messages=_messages(_png(3)), stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert standin.seen[-1]["stream"] is True


async def test_async_completions_and_stream(gateway: Any, model_folder: Path) -> None:
    from transformers import AutoTokenizer

    server, standin, script = gateway
    decode = AutoTokenizer.from_pretrained(model_folder).decode
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = await client.completions.create(model=str(model_folder), prompt="Tell me", max_tokens=4)
    assert out.choices[0].text == decode(script[:4], skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length"
    assert standin.seen[-1]["sampling_params"]["max_tokens"] == 4
    assert standin.seen[-1]["features"] is None
    stream = await client.chat.completions.create(
        model=str(model_folder), messages=_messages(_png(4)), stream=True, max_tokens=5
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream]
    assert "".join(pieces) == decode(script[:5], skip_special_tokens=True)
    assert len([p for p in pieces if p]) >= 3  # streamed, not sent at once
    await client.close()


def test_disconnect_mid_stream_cancels_upstream(gateway: Any, model_folder: Path) -> None:
    server, standin, _ = gateway
    body = {"model": str(model_folder), "messages": _messages(_png(5)), "stream": True}
    before = len(standin.seen)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data:") for line in got)
    rid = standin.seen[before]["request_id"]
    deadline = time.monotonic() + 10
    while rid not in standin.abandoned and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in standin.abandoned
    assert rid not in standin.completed


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "Decode"),
        ("http://127.0.0.1:9/cat.png", "Blocked"),
        ("http://169.254.169.254/latest/meta-data", "Blocked"),
        ("file:///etc/passwd", "PathNotAllowed"),
    ],
)
def test_bad_images_are_4xx_and_the_next_request_is_fine(
    gateway: Any, model_folder: Path, url: str, needle: str
) -> None:
    server, _, _ = gateway
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=str(model_folder), messages=_messages(url))
    assert needle.lower() in str(info.value).lower()
    ok = client.chat.completions.create(model=str(model_folder), messages=_messages(_png(6)))
    assert ok.choices[0].message.content == REPLY


def test_request_errors(gateway: Any, model_folder: Path) -> None:
    server, _, _ = gateway
    client = _client(server)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=_messages())
    with pytest.raises(openai.BadRequestError, match="too many images"):
        client.chat.completions.create(model=str(model_folder), messages=_messages(*[_png(7)] * 17))
    r = httpx.post(
        server.url + "/v1/chat/completions/render",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/chat/completions/render",
        json={"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
    )
    assert r.status_code == 400 and "unsupported content part" in r.json()["error"]["message"]


def test_bodies_are_parsed_as_they_came_whole_or_in_pieces(
    gateway: Any, model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orjson

    import aiomm.server.endpoint

    parsed: list[tuple[type, int]] = []

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return getattr(orjson, name)

        def loads(self, raw: Any) -> Any:
            parsed.append((type(raw), len(raw)))
            return orjson.loads(raw)

    monkeypatch.setattr(aiomm.server.endpoint, "orjson", Recorder())
    server, _, _ = gateway
    body = json.dumps({"messages": _messages(_png(9, (300, 200)))}).encode()
    url = server.url + "/v1/chat/completions/render"
    whole = httpx.post(url, content=body, headers={"content-type": "application/json"})
    pieces = [body[i : i + 4096] for i in range(0, len(body), 4096)]
    chunked = httpx.post(url, content=iter(pieces), headers={"content-type": "application/json"})
    assert whole.status_code == chunked.status_code == 200, (whole.text[:300], chunked.text[:300])
    assert whole.json()["token_ids"] == chunked.json()["token_ids"]
    # whole or gathered from its pieces, the body reaches orjson as the same short document:
    # the image's payload was decoded from the body's bytes (aiomm.server.data_urls)
    payload = len(body) - len(body.split(b";base64,")[0])
    assert payload > 4096 and parsed[0] == parsed[1] and parsed[0][1] < len(body) - payload + 64


def test_metrics_and_models(gateway: Any, model_folder: Path) -> None:
    server, _, _ = gateway
    httpx.post(
        server.url + "/v1/chat/completions/render", json={"messages": _messages(_png(8))}
    ).raise_for_status()
    text = httpx.get(server.url + "/metrics").text
    assert 'aiomm_requests_total{endpoint="chat_render",status="200"}' in text
    assert 'aiomm_stage_seconds_bucket{le="0.001",stage="decode_transform"}' in text
    assert "aiomm_request_seconds_bucket" in text
    assert 'aiomm_errors_total{type="BadRequestError"}' in text
    assert "aiomm_images_total" in text and "aiomm_queue_in_use" in text
    # the server's transform threads resized the image in their scratch buffers
    assert float(text.split("\naiomm_scratch_bytes ")[1].split()[0]) > 0
    assert 'aiomm_queue_capacity{queue="transform"}' in text
    # the threads writing the items' wire form (a render ran above: the pool has started)
    assert float(text.split('\naiomm_queue_capacity{queue="encode"} ')[1].split()[0]) >= 1
    assert float(text.split('\naiomm_queue_in_use{queue="encode"} ')[1].split()[0]) == 0
    # idle: the transform queue may use all its threads
    assert float(text.split('\naiomm_queue_limit{queue="transform"} ')[1].split()[0]) >= 1
    assert 'aiomm_cache_events_total_engine{event="evictions"} 0.0' in text
    assert 'aiomm_cache_events_total_engine{event="oversize_skips"} 0.0' in text
    held = float(text.split("\naiomm_cache_bytes ")[1].split()[0])
    assert held > 0 and "\naiomm_cache_capacity_bytes " in text
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == str(model_folder)
    assert json.loads(httpx.get(server.url + "/health").text or "null") is None


def test_stream_with_usage_ends_with_a_usage_chunk(gateway: Any, model_folder: Path) -> None:
    server, standin, script = gateway
    stream = _client(server).chat.completions.create(
        model=str(model_folder),
        messages=_messages(_png(3)),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    seen = standin.seen[-1]
    assert seen["sampling_params"]["output_kind"] == 1  # deltas, as the gateway reads them
    assert seen["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == len(seen["token_ids"])
    assert last.usage.completion_tokens == len(script)


def test_special_tokens_are_kept_when_asked(gateway: Any, model_folder: Path) -> None:
    server, standin, _ = gateway
    out = _client(server).chat.completions.create(
        model=str(model_folder),
        messages=_messages(_png(4)),
        extra_body={"skip_special_tokens": False},
    )
    assert out.choices[0].message.content == REPLY + "<|im_end|>"
    assert standin.seen[-1]["sampling_params"]["skip_special_tokens"] is False


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
    ],
)
def test_what_the_gateway_cannot_answer_is_refused(
    gateway: Any, model_folder: Path, fields: dict[str, Any], param: str
) -> None:
    server, standin, _ = gateway
    client = _client(server)
    seen = len(standin.seen)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=str(model_folder), messages=_messages(_png(5)), extra_body=fields
        )
    assert info.value.body["param"] == param  # type: ignore[index]
    assert len(standin.seen) == seen  # refused before the upstream was asked
    ok = client.chat.completions.create(model=str(model_folder), messages=_messages(_png(5)))
    assert ok.choices[0].message.content == REPLY


def test_completion_echo_is_refused_and_continuous_usage_streams(
    gateway: Any, model_folder: Path
) -> None:
    server, standin, script = gateway
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=str(model_folder), prompt="Say", echo=True)
    assert info.value.body["param"] == "echo"  # type: ignore[index]
    stream = client.chat.completions.create(
        model=str(model_folder),
        messages=_messages(_png(6)),
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = list(stream)
    prompt = len(standin.seen[-1]["token_ids"])
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]  # type: ignore[union-attr]
    assert completion == sorted(completion) and completion[-1] == len(script)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_adds_up_to_the_whole_decode(
    model_folder: Path, fast: bool, skip: bool
) -> None:
    from transformers import AutoTokenizer

    from aiomm.server.gateway import IncrementalText

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    text = "A red car — 日本語 😀 on the road. " * 20
    ids = [*tokenizer.encode(text, add_special_tokens=False), 151645]
    whole = tokenizer.decode(ids, skip_special_tokens=skip)
    for size in (1, 3):
        stream = IncrementalText(tokenizer, skip_special_tokens=skip)
        if not fast:
            stream.stream = None  # the whole-prefix path a slow tokenizer takes
        assert (stream.stream is not None) == fast
        deltas = [stream.add(ids[i : i + size]) for i in range(0, len(ids), size)]
        assert "".join(deltas) == whole
        assert all("\ufffd" not in d for d in deltas)  # no half characters sent


def _byte_fallback_tokenizer() -> Any:
    """A Llama-style tokenizer whose byte tokens can spell bytes that are not UTF-8."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ("▁a", "▁hello", "a", "b", "▁", "▁world", "世", "界", "!"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def test_incremental_text_survives_bytes_that_are_not_utf8() -> None:
    from aiomm.server.gateway import IncrementalText

    tokenizer = _byte_fallback_tokenizer()
    hello = tokenizer.convert_tokens_to_ids("▁hello")
    # "nwE", then 0xE2 (opens a three-byte character) that "+" cannot continue, a lone 0xA0:
    # the stream's text so far can no longer be extended once "▁hello" follows
    broken = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in b"nwE\xe2+&\xa0"]
    ids = [*broken, hello, tokenizer.convert_tokens_to_ids("!"), hello]
    stream = IncrementalText(tokenizer)
    assert stream.stream is not None  # the DecodeStream path
    text = "".join(stream.add([i]) for i in ids)
    assert text.startswith("nwE")
    assert text.endswith("hello! hello")  # the stream went on past the broken bytes


def test_incremental_text_keeps_going_after_the_clean_up_rewrites_sent_text() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from aiomm.server.gateway import IncrementalText

    vocab = {"[UNK]": 0, "don": 1, "'": 2, "t": 3, ".": 4, "it": 5, "s": 6, "world": 7}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    ids = tokenizer.encode("don't it's world.", add_special_tokens=False)
    stream = IncrementalText(tokenizer)
    assert stream.stream is None  # the clean-up needs the whole-prefix path
    deltas = [stream.add([i]) for i in ids]
    # streamed without the clean-up, which would turn "don '" (sent) into "don't" afterwards
    assert "".join(deltas) == tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert "".join(deltas).endswith(" world.")
