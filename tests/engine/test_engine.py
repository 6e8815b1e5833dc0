"""The engine end to end: inputs of every kind, dedup, backpressure, bad input, loop lag, CLI."""

from __future__ import annotations

import base64
import http.server
import io
import itertools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import PIL.Image
import pytest
import torch
from counting_decoder import ConcurrencyDecoder, CountingDecoder

from aiomm.cache.item_cache import CacheOutcome
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import (
    ConfigError,
    DecodeError,
    EngineClosedError,
    ImageTooLargeError,
    ItemCountMismatchError,
    UnknownArchitectureError,
)
from aiomm.media.fetch import FetchConfig
from aiomm.media.image import DecodeConfig
from aiomm.media.samples import encode, photo_like
from aiomm.types import Request

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def prompt(n: int) -> str:
    return " ".join(["<|im_start|>user describe", *[PH] * n, "<|im_end|>"])


def image(seed: int, h: int = 96, w: int = 128) -> PIL.Image.Image:
    return photo_like(np.random.default_rng(seed), h, w)


def expected(processor, prompt_text: str, images: list, dtype=torch.bfloat16):
    ids = processor.hf_processor.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    out = processor.apply(ids, {"image": images})
    merged = out.merged_kwargs()
    norm = out.normalization
    pv = norm.module().forward_native(merged["pixel_values"], dtype, layout=norm.layout)
    return out, merged, pv


async def test_process_every_input_kind(make_processor, tmp_path: Path) -> None:
    processor = make_processor()
    imgs = [image(i) for i in range(5)]
    jpeg = encode(imgs[0], "JPEG")
    decoded_jpeg = PIL.Image.open(io.BytesIO(jpeg)).convert("RGB")
    path = tmp_path / "b.png"
    path.write_bytes(encode(imgs[1], "PNG"))
    data_url = "data:image/png;base64," + base64.b64encode(encode(imgs[2], "PNG")).decode()
    sources = [jpeg, str(path), data_url, imgs[3], np.asarray(imgs[4])]
    reference = [decoded_jpeg, imgs[1], imgs[2], imgs[3], imgs[4]]
    config = EngineConfig(fetch=FetchConfig(allowed_local_root=tmp_path), device="cpu")
    async with Engine(processor, config) as engine:
        result = await engine.process(Request(prompt=prompt(5), images=sources, request_id="r1"))
    out, merged, pv = expected(processor, prompt(5), reference)
    assert result.ok and result.request_id == "r1"
    assert result.prompt_token_ids == out.prompt_token_ids
    assert result.mm_placeholders["image"] == out.mm_placeholders["image"]
    assert torch.equal(result.mm_kwargs["image_grid_thw"], merged["image_grid_thw"])
    assert result.pixel_values.dtype == torch.bfloat16
    assert torch.equal(result.pixel_values, pv)
    assert result.cache == [CacheOutcome.MISS] * 5
    assert len(set(result.item_hashes)) == 5
    assert {"fetch", "decode_transform", "assemble", "device", "total"} <= set(result.timings)


async def test_device_false_returns_the_transforms_uint8_rows(make_processor) -> None:
    processor = make_processor()
    imgs = [image(7), image(8, 64, 80)]
    async with Engine(processor, EngineConfig(device="cpu")) as engine:
        rows = await engine.process(Request(prompt=prompt(2), images=imgs), device=False)
        # the second call hits the cache: cached items serve both modes
        normalised = await engine.process(Request(prompt=prompt(2), images=imgs))
    out, merged, pv = expected(processor, prompt(2), imgs)
    assert rows.pixel_values.dtype == torch.uint8 and rows.pixel_values.device.type == "cpu"
    # the model's layout (Qwen's frames repeated), not the items' compact rows
    assert rows.pixel_values.shape == pv.shape
    assert torch.equal(rows.pixel_values, merged["pixel_values"])
    assert torch.equal(rows.mm_kwargs["image_grid_thw"], merged["image_grid_thw"])
    assert rows.prompt_token_ids == normalised.prompt_token_ids == out.prompt_token_ids
    assert rows.mm_placeholders == normalised.mm_placeholders
    assert rows.item_hashes == normalised.item_hashes
    assert normalised.cache == [CacheOutcome.HIT] * 2
    # normalising the rows gives exactly what the device stage gives
    norm = out.normalization
    again = norm.module().forward_native(rows.pixel_values, torch.bfloat16, layout=norm.layout)
    assert torch.equal(again, normalised.pixel_values)


async def test_repeat_is_a_cache_hit_and_equal(make_processor) -> None:
    processor = make_processor()
    img = encode(image(7), "PNG")
    async with Engine(processor, EngineConfig(device="cpu")) as engine:
        first = await engine.process(Request(prompt=prompt(1), images=[img]))
        second = await engine.process(Request(prompt=prompt(1), images=[img]))
        stats = engine.stats()
    assert first.cache == [CacheOutcome.MISS] and second.cache == [CacheOutcome.HIT]
    assert torch.equal(first.pixel_values, second.pixel_values)
    assert stats.cache.hits == 1 and stats.cache.misses == 1
    # requests that came without an id get distinct ones
    assert re.fullmatch("[0-9a-f]{12}", first.request_id) and first.request_id != second.request_id


def counting_decoder() -> CountingDecoder:
    return CountingDecoder(delay=0.05)  # keep the computation in flight while others arrive


async def test_an_image_header_is_parsed_once(make_processor, monkeypatch) -> None:
    # PillowDecoder's probe and decode share one open; a subclass's own decode is still called
    import aiomm.media.image

    opens = []
    real_open = aiomm.media.image._open
    monkeypatch.setattr(aiomm.media.image, "_open", lambda *a: opens.append(1) or real_open(*a))
    data = [encode(image(k, 100 + k, 120), fmt) for k, fmt in enumerate(["JPEG", "PNG", "WEBP"])]
    async with Engine(make_processor(), EngineConfig(device="cpu", cache_capacity_bytes=0)) as e:
        plain = [await e.process(Request(prompt=prompt(1), images=[d])) for d in data]
    assert len(opens) == len(data)
    opens.clear()
    decoder = counting_decoder()
    monkeypatch.setattr(time, "sleep", lambda _: None)
    config = EngineConfig(device="cpu", cache_capacity_bytes=0)
    async with Engine(make_processor(), config, decoder=decoder) as e:
        counted = [await e.process(Request(prompt=prompt(1), images=[d])) for d in data]
    assert decoder.decodes == len(data) and len(opens) == 2 * len(data)  # its probe, its decode
    for a, b in zip(plain, counted, strict=True):
        assert torch.equal(a.pixel_values, b.pixel_values)


@pytest.mark.parametrize("busy", [None, 1])
async def test_busy_transform_threads_under_load_all_threads_for_one_request(
    make_processor, busy: int | None
) -> None:
    """With ``busy_transform_threads=1`` one request alone decodes its two images at once, two
    requests in flight one image at a time; unset, every thread runs either way."""
    config = EngineConfig(device="cpu", transform_threads=2, busy_transform_threads=busy)
    alone, together = ConcurrencyDecoder(0.2), ConcurrencyDecoder(0.0, gate=threading.Event())
    pngs = [encode(image(40 + i), "PNG") for i in range(4)]
    async with Engine(make_processor(), config, decoder=alone) as engine:
        await engine.process(Request(prompt=prompt(2), images=pngs[:2]))
    async with Engine(make_processor(), config, decoder=together) as engine:
        async with anyio.create_task_group() as tg:
            for png in pngs[2:]:
                tg.start_soon(engine.process, Request(prompt=prompt(1), images=[png]))
            # decodes wait at the gate until the statistics are read: one (busy) or both run
            assert await anyio.to_thread.run_sync(together.wait_running, 1 if busy else 2)
            with anyio.fail_after(10):
                # nothing signals a job held at the pool's gate: look until the second is there
                while busy and engine.stats().stage_statistics["transform"].waiting < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            during = engine.stats()
            assert together.gate is not None
            together.gate.set()
        after = engine.stats()  # all done: every thread
    assert alone.most == 2
    assert together.most == (2 if busy is None else 1)
    # the statistics show the threads held back while busy
    assert during.stage_statistics["transform"].limit == (2 if busy is None else 1)
    assert during.queues["transform"].limit == during.stage_statistics["transform"].limit
    assert during.stage_statistics["transform"].capacity == 2
    assert after.stage_statistics["transform"].limit == after.queues["transform"].limit == 2
    assert during.queues["requests"].limit == during.queues["requests"].capacity


async def test_fifty_concurrent_requests_one_decode(make_processor) -> None:
    decoder = counting_decoder()
    data = encode(image(3, 300, 400), "JPEG")
    results: dict[int, object] = {}
    async with Engine(make_processor(), EngineConfig(device="cpu"), decoder=decoder) as engine:

        async def one(i: int, scope: anyio.CancelScope) -> None:
            with scope:
                results[i] = await engine.process(Request(prompt=prompt(1), images=[data]))

        scopes = [anyio.CancelScope() for _ in range(50)]
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(one, i, scopes[i])
            await anyio.sleep(0.01)
            scopes[0].cancel()  # the first requester goes away mid-flight
        stats = engine.stats()
    assert decoder.decodes == 1
    assert 0 not in results
    assert len(results) == 49
    outcomes = [r.cache[0].value for r in results.values()]
    # the cancelled first requester led the computation; the others joined it
    assert outcomes.count("joined") >= 48 and outcomes.count("miss") <= 1
    first = next(iter(results.values()))
    assert all(torch.equal(r.pixel_values, first.pixel_values) for r in results.values())
    assert stats.cache.joins >= 48 and stats.cache.misses <= 1


async def test_stream_backpressure_with_lazy_source(make_processor) -> None:
    pulled = 0
    small = np.asarray(image(1, 28, 28))

    def source() -> Iterator[Request]:
        nonlocal pulled
        for i in range(100_000):
            pulled += 1
            yield Request(prompt_token_ids=[1, 2], images=[], request_id=str(i)) if i % 2 else \
                Request(prompt=prompt(1), images=[small], request_id=str(i))  # fmt: skip

    bound = 8
    async with Engine(make_processor(), EngineConfig(device="cpu", max_in_flight=64)) as engine:
        async with engine.stream(source(), max_in_flight=bound) as stream:
            seen = 0
            async for result in stream:
                assert result.ok, result.error
                assert result.request_id == str(seen)  # ordered
                seen += 1
                assert pulled - seen <= bound, (pulled, seen)
                await anyio.sleep(0.001)  # a slow consumer
                if seen == 300:
                    break
            await anyio.sleep(0.05)
            assert pulled <= seen + bound
    assert pulled < 400


async def test_stream_unordered_yields_in_completion_order(make_processor) -> None:
    big = encode(image(5, 1500, 2000), "PNG")
    small = np.asarray(image(6, 28, 28))
    requests = [Request(prompt=prompt(1), images=[big], request_id="slow")] + [
        Request(prompt=prompt(1), images=[small], request_id=f"fast{i}") for i in range(3)
    ]
    async with Engine(make_processor(), EngineConfig(device="cpu")) as engine:
        async with engine.stream(requests, ordered=False) as stream:
            ids = [r.request_id async for r in stream]
    assert sorted(ids) == sorted(r.request_id for r in requests)
    assert ids[-1] == "slow"


def _cmyk_jpeg() -> bytes:
    buf = io.BytesIO()
    image(11).convert("CMYK").save(buf, format="JPEG")
    return buf.getvalue()


def _palette_png() -> bytes:
    buf = io.BytesIO()
    image(12).convert("P").save(buf, format="PNG")
    return buf.getvalue()


def _png16() -> bytes:
    arr = (np.arange(64 * 80, dtype=np.uint16).reshape(64, 80) * 13) % 65535
    buf = io.BytesIO()
    PIL.Image.fromarray(arr.astype(np.uint16)).save(buf, format="PNG")
    return buf.getvalue()


def _rgba_png() -> bytes:
    rgba = image(13).convert("RGBA")
    alpha = np.full((rgba.height, rgba.width), 128, dtype=np.uint8)
    rgba.putalpha(PIL.Image.fromarray(alpha))
    return encode(rgba, "PNG")


async def test_bad_images_fail_alone_in_a_stream(make_processor) -> None:
    good = encode(image(20), "JPEG")
    truncated = good[: len(good) // 2]
    bomb = encode(PIL.Image.new("L", (4000, 4000)), "PNG")
    cases = {
        "good": (good, None),
        "corrupt": (b"\x89PNG\r\n\x1a\n" + b"garbage" * 50, DecodeError),
        "truncated": (truncated, DecodeError),
        "empty": (b"", DecodeError),
        "bomb": (bomb, ImageTooLargeError),
        "cmyk": (_cmyk_jpeg(), None),
        "palette": (_palette_png(), None),
        "png16": (_png16(), None),
        "alpha": (_rgba_png(), None),
        "mismatch": (good, ItemCountMismatchError),
        "good2": (encode(image(21), "PNG"), None),
    }
    requests = [
        Request(prompt=prompt(2 if name == "mismatch" else 1), images=[data], request_id=name)
        for name, (data, _) in cases.items()
    ]
    config = EngineConfig(device="cpu", decode=DecodeConfig(max_pixels=4_000_000))
    async with Engine(make_processor(), config) as engine:
        async with engine.stream(requests) as stream:
            results = {r.request_id: r async for r in stream}
    assert list(results) == list(cases)
    for name, (_, error) in cases.items():
        r = results[name]
        if error is None:
            assert r.ok, (name, r.error)
            assert r.pixel_values is not None and torch.isfinite(r.pixel_values.float()).all()
        else:
            assert isinstance(r.error, error), (name, r.error)


async def test_event_loop_stays_responsive_under_saturation(make_processor) -> None:
    images = [encode(image(30 + i, 900, 1200), "JPEG") for i in range(12)]
    requests = [Request(prompt=prompt(1), images=[img]) for img in images]
    lag = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal lag
        while not done.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.005)
            lag = max(lag, time.perf_counter() - t - 0.005)

    async with Engine(make_processor(), EngineConfig(device="cpu", cache_capacity_bytes=0)) as e:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with e.stream(requests) as stream:
                n = len([r async for r in stream if r.ok])
            done.set()
        stats = e.stats()
    assert n == len(requests)
    assert stats.stages["decode_transform"].count == len(requests)
    assert lag < 0.25, f"event loop stalled for {lag * 1000:.0f} ms"


class _Handler(http.server.BaseHTTPRequestHandler):
    payload = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args: object) -> None:
        pass


async def test_http_image_through_loopback_server(make_processor) -> None:
    img = image(40)
    _Handler.payload = encode(img, "PNG")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/img.png"
        config = EngineConfig(device="cpu", fetch=FetchConfig(allow_loopback=True))
        async with Engine(make_processor(), config) as engine:
            result = await engine.process(Request(prompt=prompt(1), images=[url]))
        _, _, pv = expected(make_processor(), prompt(1), [img])
        assert torch.equal(result.pixel_values, pv)
    finally:
        server.shutdown()
        server.server_close()


async def test_supplied_hash_hit_skips_the_download(make_processor) -> None:
    img = encode(image(41), "PNG")
    async with Engine(make_processor(), EngineConfig(device="cpu")) as engine:
        first = await engine.process(
            Request(prompt=prompt(1), images=[img], image_hashes=["client-hash-1"])
        )
        # an unreachable URL: a hit must not even try it
        second = await engine.process(
            Request(
                prompt=prompt(1),
                images=["http://127.0.0.1:9/never-fetched.png"],
                image_hashes=["client-hash-1"],
            )
        )
    assert first.cache == [CacheOutcome.MISS] and second.cache == [CacheOutcome.HIT]
    assert torch.equal(first.pixel_values, second.pixel_values)


async def test_closed_engine_and_unknown_model(make_processor) -> None:
    engine = Engine(make_processor(), EngineConfig(device="cpu"))
    with pytest.raises(EngineClosedError):
        await engine.process(Request(prompt=prompt(0)))
    async with engine:
        pass
    with pytest.raises(EngineClosedError):
        await engine.process(Request(prompt=prompt(0)))
    with pytest.raises(UnknownArchitectureError, match="Qwen2VLForConditionalGeneration"):
        Engine.from_pretrained("NoSuchModelForConditionalGeneration")


async def test_close_cancels_in_flight_work_and_leaks_no_task(make_processor) -> None:
    import asyncio

    others = set(threading.enumerate())  # another engine's, left open, would not count

    def transform_threads() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t.name.startswith("aiomm-transform") and t not in others
        ]

    before = set(asyncio.all_tasks())
    big = [encode(image(50 + i, 1200, 1600), "PNG") for i in range(4)]
    config = EngineConfig(device="cpu", transform_threads=2)
    async with Engine(make_processor(), config) as engine:
        stream = engine.stream(Request(prompt=prompt(1), images=[b]) for b in itertools.cycle(big))
        async with stream:
            await stream.__anext__()
            assert 1 <= len(transform_threads()) <= 2
    await anyio.lowlevel.checkpoint()
    assert set(asyncio.all_tasks()) - before <= {asyncio.current_task()}
    assert transform_threads() == []  # the worker threads end with the engine


def test_cli_run_on_embedded_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from aiomm.cli import main

    output = tmp_path / "out.jsonl"
    code = main(["run", "--samples", "4", "--no-progress", "--output", str(output)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "aiomm run summary" in printed and "images/s" in printed
    lines = output.read_text().splitlines()
    assert len(lines) == 8  # 4 samples, seen twice
    import json

    rows = [json.loads(line) for line in lines]
    assert all(r["ok"] for r in rows)
    assert rows[0]["tensors"]["pixel_values"]["dtype"] == "bfloat16"
    outcomes = [c for r in rows for c in r["cache"]]
    assert outcomes.count("miss") == 4  # each sample computed once, its repeat hit or joined
    assert outcomes.count("hit") + outcomes.count("joined") == 4


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})])
async def test_runs_on_uvloop(make_processor) -> None:
    import asyncio

    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    async with Engine(make_processor(), EngineConfig(device="cpu")) as engine:
        result = await engine.process(Request(prompt=prompt(1), images=[encode(image(60))]))
    assert result.ok and result.pixel_values is not None


async def test_hf_transform_with_threads_equals_native(make_processor) -> None:
    imgs = [encode(image(70 + i, 150 + 20 * i, 200), "PNG") for i in range(6)]
    outputs = {}
    for mode in ("hf", "native"):
        config = EngineConfig(device="cpu", transform_threads=3)
        async with Engine(make_processor(transform=mode), config) as engine:
            async with engine.stream(Request(prompt=prompt(1), images=[b]) for b in imgs) as s:
                outputs[mode] = [r async for r in s]
    for a, b in zip(outputs["hf"], outputs["native"], strict=True):
        assert a.ok and b.ok
        assert torch.equal(a.pixel_values, b.pixel_values)
        assert a.prompt_token_ids == b.prompt_token_ids


async def test_cancelling_a_request_frees_its_capacity(make_processor) -> None:
    slow = encode(image(80, 1500, 2000), "PNG")
    config = EngineConfig(device="cpu", max_in_flight=1)
    async with Engine(make_processor(), config) as engine:
        with anyio.move_on_after(0.05):
            await engine.process(Request(prompt=prompt(1), images=[slow]))
        assert engine.stats().queues["requests"].in_use == 0
        with anyio.fail_after(20):
            result = await engine.process(Request(prompt=prompt(1), images=[encode(image(81))]))
        assert result.ok


async def test_stats_report_stages_queues_and_cache(make_processor) -> None:
    data = encode(image(90), "JPEG")
    async with Engine(make_processor(), EngineConfig(device="cpu")) as engine:
        for _ in range(3):
            await engine.process(Request(prompt=prompt(1), images=[data]))
        with pytest.raises(DecodeError):
            await engine.process(Request(prompt=prompt(1), images=[b"not an image"]))
        stats = engine.stats()
    assert stats.requests_started == 4 and stats.requests_completed == 3
    assert stats.requests_failed == 1 and stats.images_processed == 3
    assert stats.stages["total"].count == 3 and stats.stages["total"].p99 > 0
    assert stats.stages["decode_transform"].count == 1
    assert set(stats.queues) == {
        "requests",
        "network",
        "fetch",
        "hash",
        "transform",
        "device",
        "device_staging",
    }
    assert stats.requests_cancelled == 0
    assert stats.stage_statistics["transform"].completed == 1
    assert stats.queues["transform"].capacity == engine.config.transform_threads
    assert stats.queues["transform"].in_use == stats.queues["transform"].waiting == 0
    assert stats.stage_statistics["transform"].failed == 1  # the bytes that are no image
    assert stats.stage_statistics["output"].completed == 3
    assert stats.device.runs == 3 and stats.device.device == "cpu"
    assert stats.cache.hits == 2 and stats.cache.misses == 1
    assert stats.decoded_bytes.in_use == 0 and stats.decoded_bytes.peak > 0


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("name", ["qwen2-vl", "qwen3-vl"])
async def test_device_resize_equals_cpu_resize(make_processor, name: str, backend: str) -> None:
    """mm_device_resize moves resize + patchify to the device, bit-exact to the CPU path.

    On this CPU-only machine the device is the CPU and the resize runs the integer torch
    reference of the kernels (the Triton passes themselves are tested in tests/kernels).
    """
    rng = np.random.default_rng(int(time.time()))
    shapes = [(int(rng.integers(20, 700)), int(rng.integers(20, 700))) for _ in range(4)]
    imgs = [encode(photo_like(rng, h, w), "PNG") for h, w in shapes]
    outputs = {}
    for device_resize in (False, True):
        config = EngineConfig(device="cpu", mm_device_resize=device_resize)
        async with Engine(make_processor(name, backend), config) as engine:
            assert (engine.processor.resize_device is not None) is device_resize
            result = await engine.process(Request(prompt=prompt(4), images=imgs))
        outputs[device_resize] = result
    cpu, dev = outputs[False], outputs[True]
    assert dev.prompt_token_ids == cpu.prompt_token_ids
    assert torch.equal(dev.mm_kwargs["image_grid_thw"], cpu.mm_kwargs["image_grid_thw"])
    assert torch.equal(dev.pixel_values, cpu.pixel_values), shapes


async def test_device_resize_refused_for_the_classic_path(make_processor) -> None:
    processor = make_processor(mm_device_do_normalize=False)
    with pytest.raises(ConfigError, match="mm_device_resize"):
        Engine(processor, EngineConfig(device="cpu", mm_device_resize=True))
    # the default (None) keeps the CPU path off CUDA
    assert Engine(make_processor(), EngineConfig(device="cpu")).processor.resize_device is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_cpu_engine_caches_uint8_items_and_normalises_them_in_the_device_stage(
    make_processor, dtype: str
) -> None:
    """Items (and the cache) hold compact uint8 rows, a quarter of fp32's bytes; the device
    stage normalises and repeats them into the model's rows, on a miss and on a hit alike."""
    imgs = [encode(image(100 + i, 200 + 30 * i, 260), "PNG") for i in range(3)]
    engine = Engine(make_processor(), EngineConfig(device="cpu", visual_dtype=dtype))
    async with engine:
        result = await engine.process(Request(prompt=prompt(3), images=imgs))
        again = await engine.process(Request(prompt=prompt(3), images=imgs))
    decoded = [PIL.Image.open(io.BytesIO(b)).convert("RGB") for b in imgs]
    _, _, expected_pv = expected(make_processor(), prompt(3), decoded, dtype=getattr(torch, dtype))
    assert result.pixel_values.dtype == getattr(torch, dtype)
    assert torch.equal(result.pixel_values, expected_pv)
    assert again.cache == [CacheOutcome.HIT] * 3 and torch.equal(again.pixel_values, expected_pv)
    items = engine.processor.apply(
        engine.processor.hf_processor.tokenizer(prompt(1), add_special_tokens=False)["input_ids"],
        {"image": [np.asarray(decoded[0])]},
    ).mm_kwargs["image"]
    rows = items[0].data["pixel_values"]
    assert rows.dtype == torch.uint8
    assert rows.shape[-1] * 2 == expected_pv.shape[-1]  # one frame of two


async def test_cpu_results_use_recycled_memory_released_on_close(make_processor) -> None:
    """A CPU engine's results come from its ``HostBufferPool``: a result the caller dropped
    backs the next one, one still held is never reused, and closing drops the idle blocks."""
    import gc

    img = encode(image(7, 560, 560), "PNG")  # ~9 MB of float32 rows: pooled
    engine = Engine(make_processor(), EngineConfig(device="cpu", visual_dtype="float32"))
    async with engine:
        pool = engine.device.host_outputs
        assert pool is not None
        first = await engine.process(Request(prompt=prompt(1), images=[img]))
        address = first.pixel_values.data_ptr()
        del first
        gc.collect()
        second = await engine.process(Request(prompt=prompt(1), images=[img]))
        reused = second.pixel_values.data_ptr()
        third = await engine.process(Request(prompt=prompt(1), images=[img]))
        fresh = third.pixel_values.data_ptr()
        del third
        gc.collect()
    assert reused == address and fresh != reused
    stats = pool.statistics()
    assert (stats.lent, stats.reused, stats.idle_bytes) == (3, 1, 0)
