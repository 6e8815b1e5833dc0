"""The Redis item cache shared by replicas, against a real redis-server on a loopback port.

Two engines in one process stand for two replicas: they share nothing but Redis.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import numpy as np
import pytest
import redis.asyncio
import torch
from counting_decoder import CountingDecoder
from redis_server import RedisServer, free_port

from aiomm.cache.item_cache import CacheOutcome
from aiomm.cache.redis import SharedItemCache
from aiomm.config import EngineConfig, SharedCacheConfig
from aiomm.engine import Engine
from aiomm.media.hashing import hash_bytes
from aiomm.media.samples import encode, photo_like
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.types import Request

PH = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user describe {PH}<|im_end|>"
_seeds = iter(range(10_000, 1_000_000))


def new_image() -> bytes:
    """A PNG no other test has used (keys must be new in the shared Redis)."""
    return encode(photo_like(np.random.default_rng(next(_seeds)), 64, 80), "PNG")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def config(redis_server: RedisServer) -> EngineConfig:
    if redis_server.proc is None:  # a test that killed it failed before restarting it
        redis_server.start()
    return EngineConfig(
        device="cpu",
        transform_threads=2,
        shared_cache_url=redis_server.url,
        shared_cache=SharedCacheConfig(
            op_timeout_s=0.5, lease_ttl_s=2.0, lease_wait_s=5.0, retry_after_s=0.2
        ),
    )


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    conn = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        yield conn
    finally:
        await conn.aclose()


def req(data: bytes | str, **kw: object) -> Request:
    return Request(prompt=PROMPT, images=[data], **kw)  # type: ignore[arg-type]


async def test_an_item_computed_by_one_replica_is_a_hit_for_the_other(
    make_processor, config: EngineConfig
) -> None:
    data = new_image()
    decoders = CountingDecoder(), CountingDecoder()
    processor = make_processor()
    async with (
        Engine(processor, config, decoder=decoders[0]) as a,
        Engine(processor, config, decoder=decoders[1]) as b,
    ):
        first = await a.process(req(data))
        second = await b.process(req(data))
        again = await b.process(req(data))
        stats_a, stats_b = a.stats().cache, b.stats().cache
    async with Engine(processor, EngineConfig(device="cpu")) as alone:
        reference = await alone.process(req(data))
    assert first.cache == [CacheOutcome.MISS]
    assert second.cache == [CacheOutcome.SHARED_HIT]
    assert again.cache == [CacheOutcome.HIT]  # now in b's own first tier
    assert (decoders[0].decodes, decoders[1].decodes) == (1, 0)
    for key, value in reference.mm_kwargs.items():
        assert torch.equal(second.mm_kwargs[key], value), key
        assert torch.equal(first.mm_kwargs[key], value), key
    assert second.prompt_token_ids == reference.prompt_token_ids
    assert stats_a.shared.misses == 1 and stats_a.shared.stored == 1
    assert stats_b.shared.hits == 1 and stats_b.shared_hits == 1
    assert stats_b.shared.bytes_read == stats_a.shared.bytes_written > 0


async def test_twenty_concurrent_requests_over_two_replicas_compute_once(
    make_processor, config: EngineConfig
) -> None:
    data = new_image()
    decoders = CountingDecoder(delay=0.2), CountingDecoder(delay=0.2)
    processor = make_processor()
    results = []
    async with (
        Engine(processor, config, decoder=decoders[0]) as a,
        Engine(processor, config, decoder=decoders[1]) as b,
    ):

        async def one(engine: Engine) -> None:
            results.append(await engine.process(req(data)))

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, (a, b)[i % 2])
        shared = a.stats().cache.shared, b.stats().cache.shared
    assert len(results) == 20 and all(r.ok for r in results)
    assert decoders[0].decodes + decoders[1].decodes == 1, (shared, [r.cache for r in results])
    outcomes = sorted(r.cache[0].value for r in results)
    # one computation; the rest joined it in-process or across Redis
    assert outcomes.count("miss") == 1
    assert set(outcomes) <= {"miss", "joined", "shared_joined", "shared_hit"}
    assert shared[0].misses + shared[1].misses == 1
    assert shared[0].joins + shared[1].joins + shared[0].hits + shared[1].hits == 1
    assert all(torch.equal(r.pixel_values, results[0].pixel_values) for r in results)


async def test_a_cancelled_holder_hands_its_lease_on(config: EngineConfig) -> None:
    # Two replicas' shared tiers; the holder's computation is cancelled mid-way (an engine
    # closing, a task group torn down), which no decode thread can show: threads finish.
    item = MultiModalKwargsItem(
        "image", {"x": torch.arange(6)}, {"x": MultiModalFieldConfig.batched("image")}
    )
    holder = SharedItemCache(config.shared_cache_url, config.shared_cache)
    waiter = SharedItemCache(config.shared_cache_url, config.shared_cache)
    key = f"cancelled-holder-{next(_seeds)}"
    started = anyio.Event()
    computed: list[str] = []

    async def never_finishes() -> MultiModalKwargsItem:
        computed.append("holder")
        started.set()
        await anyio.sleep_forever()
        raise AssertionError

    async def compute_here() -> MultiModalKwargsItem:
        computed.append("waiter")
        return item

    holder_scope = anyio.CancelScope()
    result: list = []

    async def hold() -> None:
        with holder_scope:
            await holder.get_or_compute(key, never_finishes)

    async def wait_for_it() -> None:
        result.append(await waiter.get_or_compute(key, compute_here))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await started.wait()
            tg.start_soon(wait_for_it)
            with anyio.fail_after(5):
                while waiter.statistics().lease_waits == 0:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            t0 = time.monotonic()
            holder_scope.cancel()
        elapsed = time.monotonic() - t0
    finally:
        await holder.aclose()
        await waiter.aclose()
    assert computed == ["holder", "waiter"]
    assert result[0][1] == "computed" and torch.equal(result[0][0].data["x"], item.data["x"])
    stats = waiter.statistics()
    assert stats.lease_takeovers == 1 and stats.misses == 1 and stats.stored == 1
    assert elapsed < config.shared_cache.lease_ttl_s / 2  # released at once, not left to expire


async def test_a_holder_computing_longer_than_its_lease_keeps_it(
    make_processor, config: EngineConfig
) -> None:
    short = EngineConfig(
        device="cpu",
        shared_cache_url=config.shared_cache_url,
        shared_cache=SharedCacheConfig(lease_ttl_s=0.3, lease_wait_s=5.0),
    )
    data = new_image()
    decoders = CountingDecoder(delay=1.0), CountingDecoder()
    processor = make_processor()
    results: list = []
    async with (
        Engine(processor, short, decoder=decoders[0]) as a,
        Engine(processor, short, decoder=decoders[1]) as b,
    ):

        async def one(engine: Engine) -> None:
            results.append(await engine.process(req(data)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, a)
            await anyio.to_thread.run_sync(decoders[0].entered.wait, 10)
            tg.start_soon(one, b)
        stats = b.stats().cache.shared
    # renewed every lease_ttl_s / 3: b waited through three lease periods and joined
    assert [r.cache for r in results] == [[CacheOutcome.MISS], [CacheOutcome.SHARED_JOINED]]
    assert (decoders[0].decodes, decoders[1].decodes) == (1, 0)
    assert stats.joins == 1 and stats.lease_takeovers == 0


async def test_a_dead_holders_lease_expires(
    make_processor, config: EngineConfig, client: redis.asyncio.Redis
) -> None:
    data = new_image()
    decoder = CountingDecoder()
    async with Engine(make_processor(), config, decoder=decoder) as engine:
        shared = engine._pipeline.cache.cache.second_tier  # type: ignore[union-attr]
        key = engine._pipeline.cache.key(hash_bytes(data), {})  # type: ignore[union-attr]
        # a replica that took the lease and died: nobody will release it
        assert await client.set(shared.lease_key(key), "dead-replica", nx=True, px=400)
        t0 = time.monotonic()
        result = await engine.process(req(data))
        elapsed = time.monotonic() - t0
        stats = engine.stats().cache.shared
    assert result.ok and result.cache == [CacheOutcome.MISS] and decoder.decodes == 1
    assert 0.3 < elapsed < 2.0
    assert stats.lease_waits == 1 and stats.lease_takeovers == 1


async def test_killing_redis_mid_stream_loses_no_request_and_engines_recover(
    make_processor, config: EngineConfig, redis_server: RedisServer
) -> None:
    images = [new_image() for _ in range(18)]
    processor = make_processor()
    async with Engine(processor, config) as a, Engine(processor, config) as b:
        # both replicas get every image, and most images come after the kill
        requests = [req(images[i // 2], request_id=f"r{i}") for i in range(36)]
        done: list = []

        async def consume(engine: Engine, reqs: list[Request]) -> None:
            async with engine.stream(reqs, max_in_flight=4) as results:
                async for r in results:
                    done.append(r)
                    if len(done) == 8:
                        redis_server.kill()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, a, requests[::2])
            tg.start_soon(consume, b, requests[1::2])
        assert len(done) == 36 and all(r.ok for r in done), [r.error for r in done if not r.ok]
        down = a.stats().cache.shared, b.stats().cache.shared
        assert not (down[0].available and down[1].available)
        assert down[0].errors + down[1].errors > 0

        redis_server.start()
        await anyio.sleep(config.shared_cache.retry_after_s)
        fresh = new_image()
        first = await a.process(req(fresh))
        second = await b.process(req(fresh))
        up = a.stats().cache.shared, b.stats().cache.shared
    assert first.cache == [CacheOutcome.MISS] and second.cache == [CacheOutcome.SHARED_HIT]
    assert up[0].available and up[1].available
    assert up[0].recoveries >= 1 and up[1].recoveries >= 1


async def test_redis_down_at_start_and_slow_redis_cost_at_most_the_timeout(
    make_processor, config: EngineConfig, redis_server: RedisServer
) -> None:
    processor = make_processor()
    nowhere = EngineConfig(
        device="cpu",
        shared_cache_url=f"redis://127.0.0.1:{free_port()}/0",
        shared_cache=config.shared_cache,
    )
    async with Engine(processor, nowhere) as engine:
        result = await engine.process(req(new_image()))
        stats = engine.stats().cache.shared
    assert result.ok and result.cache == [CacheOutcome.MISS]
    assert not stats.available and stats.errors >= 1 and stats.local_computes == 1

    slow = EngineConfig(
        device="cpu",
        shared_cache_url=config.shared_cache_url,
        shared_cache=SharedCacheConfig(op_timeout_s=0.1, retry_after_s=5.0),
    )
    async with Engine(processor, slow) as engine:
        await engine.process(req(new_image()))  # warm: connected, threads started
        sent = threading.Event()

        def block_redis() -> None:
            with socket.create_connection(("127.0.0.1", redis_server.port), timeout=5) as conn:
                conn.sendall(b"DEBUG SLEEP 1.5\r\n")
                sent.set()
                conn.recv(64)

        blocker = threading.Thread(target=block_redis)
        blocker.start()
        await anyio.to_thread.run_sync(sent.wait, 5)
        await anyio.sleep(0.05)  # the server reads the command and stops answering
        t0 = time.monotonic()
        result = await engine.process(req(new_image()))
        elapsed = time.monotonic() - t0
        stats = engine.stats().cache.shared
        await anyio.to_thread.run_sync(blocker.join)
    assert result.ok and result.cache == [CacheOutcome.MISS]
    assert elapsed < 1.0, elapsed  # one timed-out command, then computed locally
    assert stats.errors == 1 and not stats.available


async def test_redis_answering_errors_costs_no_request(
    make_processor, config: EngineConfig, redis_server: RedisServer
) -> None:
    processor = make_processor()
    async with Engine(processor, config) as engine:
        await engine.process(req(new_image()))
        # out of memory and not allowed to evict: every write answers "-OOM ..."
        redis_server.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        redis_server.command("CONFIG", "SET", "maxmemory", "1")
        try:
            results = [await engine.process(req(new_image())) for _ in range(3)]
            stats = engine.stats().cache.shared
        finally:
            redis_server.command("CONFIG", "SET", "maxmemory", "256mb")
            redis_server.command("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    assert all(r.ok and r.cache == [CacheOutcome.MISS] for r in results)
    assert stats.errors >= 1 and "OutOfMemoryError" in (stats.last_error or "")
    assert not stats.available
    assert stats.stored == 1 and stats.local_computes == 3


async def test_a_corrupt_stored_value_is_a_counted_miss(
    make_processor, config: EngineConfig, client: redis.asyncio.Redis
) -> None:
    data = new_image()
    processor = make_processor()
    async with Engine(processor, config) as a:
        first = await a.process(req(data))
        shared = a._pipeline.cache.cache.second_tier  # type: ignore[union-attr]
        item_key = shared.item_key(first.item_hashes[0])
    value = await client.get(item_key)
    assert value is not None
    await client.set(item_key, value[:-10] + bytes(b ^ 0xFF for b in value[-10:]))
    decoder = CountingDecoder()
    async with Engine(processor, config, decoder=decoder) as b:
        second = await b.process(req(data))
        stats = b.stats().cache.shared
    assert second.ok and second.cache == [CacheOutcome.MISS] and decoder.decodes == 1
    assert torch.equal(second.pixel_values, first.pixel_values)
    assert stats.corrupt == 1 and stats.hits == 0 and stats.misses == 1
    assert await client.get(item_key) == value  # rewritten whole


async def test_supplied_hashes_cannot_reach_content_or_other_tenants_entries(
    make_processor, config: EngineConfig
) -> None:
    x, y = new_image(), new_image()
    processor = make_processor()
    async with Engine(processor, config) as a, Engine(processor, config) as b:
        reference_x = await a.process(req(x))
        reference_y = await a.process(req(y))
        # a client claims y is x (by x's content hash): it gets y, not x's cached item
        forged = await b.process(req(y, image_hashes=[hash_bytes(x)]))
        assert torch.equal(forged.pixel_values, reference_y.pixel_values)
        assert forged.item_hashes[0] not in (reference_x.item_hashes[0], reference_y.item_hashes[0])
        # tenant "alice" stores x under "h"; tenant "mallory" supplying "h" cannot read it
        alice = await a.process(req(x, image_hashes=["h"], tenant="alice"))
        mallory = await b.process(req(y, image_hashes=["h"], tenant="mallory"))
        assert torch.equal(alice.pixel_values, reference_x.pixel_values)
        assert torch.equal(mallory.pixel_values, reference_y.pixel_values)
        assert mallory.cache == [CacheOutcome.MISS]
        # the same tenant shares across replicas, and a hit in Redis skips even the download
        again = await b.process(
            req("http://127.0.0.1:9/never.png", image_hashes=["h"], tenant="alice")
        )
        assert again.cache == [CacheOutcome.SHARED_HIT]
        assert torch.equal(again.pixel_values, reference_x.pixel_values)
    untrusting = EngineConfig(
        device="cpu",
        shared_cache_url=config.shared_cache_url,
        shared_cache=config.shared_cache,
        trust_supplied_hashes=False,
    )
    async with Engine(processor, untrusting) as c:
        ignored = await c.process(req(y, image_hashes=["h"], tenant="alice"))
        assert c.stats().cache.shared.hits == 1
    assert ignored.item_hashes == reference_y.item_hashes
    assert ignored.cache == [CacheOutcome.SHARED_HIT]
    assert torch.equal(ignored.pixel_values, reference_y.pixel_values)


async def test_an_item_over_the_size_cap_stays_local_and_nobody_waits_for_it(
    make_processor, config: EngineConfig
) -> None:
    capped = EngineConfig(
        device="cpu",
        shared_cache_url=config.shared_cache_url,
        shared_cache=SharedCacheConfig(max_item_bytes=1024, lease_wait_s=5.0),
    )
    data = new_image()
    decoders = CountingDecoder(delay=0.3), CountingDecoder()
    processor = make_processor()
    async with (
        Engine(processor, capped, decoder=decoders[0]) as a,
        Engine(processor, capped, decoder=decoders[1]) as b,
    ):
        results: list = []

        async def one(engine: Engine) -> None:
            results.append(await engine.process(req(data)))

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, a)
            await anyio.to_thread.run_sync(decoders[0].entered.wait, 10)
            tg.start_soon(one, b)
        elapsed = time.monotonic() - t0
        stats = a.stats().cache.shared, b.stats().cache.shared
    assert all(r.ok and r.cache == [CacheOutcome.MISS] for r in results)
    assert decoders[0].decodes == decoders[1].decodes == 1
    assert stats[0].oversize_skips == 1 and stats[0].stored == 0
    assert stats[1].local_computes == 1 and elapsed < 2.0


def test_shared_cache_config_is_checked() -> None:
    from aiomm.errors import ConfigError

    for url in ("http://x:1/0", "redis://:1/0", "redis://h:99999/0", "redis://h:1/x", 5):
        with pytest.raises(ConfigError, match="shared_cache_url"):
            EngineConfig(shared_cache_url=url)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="poll_max_s"):
        SharedCacheConfig(poll_min_s=1.0, poll_max_s=0.5)
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        SharedCacheConfig(lease_ttl_s=0)
    with pytest.raises(ConfigError, match="trust_supplied_hashes"):
        EngineConfig(trust_supplied_hashes="no")  # type: ignore[arg-type]
    assert EngineConfig(shared_cache_url="redis://cache.internal:6380/2").shared_cache_url
