"""The worker tier (``EngineConfig.peer_cache_dir``): engines sharing a folder copy items from
each other over real Unix sockets, and every fault of a peer costs only a recomputation.

Engines in one process stand for the workers of ``aiomm serve --workers N``: they share nothing
but the folder.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
from counting_decoder import CountingDecoder

import aiomm.cache.peer
from aiomm.cache.item_cache import CacheOutcome
from aiomm.cache.peer import PeerItemCache
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import ConfigError
from aiomm.media.samples import encode, photo_like
from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.types import Request

PH = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user describe {PH}<|im_end|>"
_seeds = iter(range(20_000, 1_000_000))


async def _until(done: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait for ``done()``: a serving thread counts an item once its last byte is sent, which
    may be just after the peer has read that byte."""
    for _ in range(int(seconds * 100)):
        if done():
            return
        await anyio.sleep(0.01)


def new_image() -> bytes:
    return encode(photo_like(np.random.default_rng(next(_seeds)), 64, 80), "PNG")


def req(data: bytes) -> Request:
    return Request(prompt=PROMPT, images=[data])


def config(folder: Path) -> EngineConfig:
    return EngineConfig(device="cpu", transform_threads=2, peer_cache_dir=str(folder))


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def links(folder: Path) -> dict[str, str]:
    return {p.name: os.readlink(p) for p in folder.iterdir() if p.name.startswith("i")}


def tier(engine: Engine) -> PeerItemCache:
    second = engine._pipeline.cache.cache.second_tier  # type: ignore[union-attr]
    assert isinstance(second, PeerItemCache)
    return second


async def test_an_item_computed_by_one_worker_is_copied_by_the_other(
    make_processor, tmp_path: Path
) -> None:
    data = new_image()
    decoders = CountingDecoder(), CountingDecoder()
    processor = make_processor()
    async with (
        Engine(processor, config(tmp_path), decoder=decoders[0]) as a,
        Engine(processor, config(tmp_path), decoder=decoders[1]) as b,
    ):
        first = await a.process(req(data))
        announced = links(tmp_path)
        second = await b.process(req(data))
        held = b.stats().cache.entries
        again = await b.process(req(data))
        third = await b.process(req(data))
        key = second.item_hashes[0]
        copied = await anyio.to_thread.run_sync(tier(b)._fetch, tier(a).socket_name, key)
        await _until(lambda: a.stats().cache.shared.served >= 3)
        stats_a, stats_b = a.stats().cache, b.stats().cache
        sockets = {tier(a).socket_name, tier(b).socket_name}
        assert sockets <= names(tmp_path)
    async with Engine(processor, EngineConfig(device="cpu")) as alone:
        reference = await alone.process(req(data))
    assert first.cache == [CacheOutcome.MISS]
    assert second.cache == [CacheOutcome.SHARED_HIT]
    # b uses its first copy and drops it (a holds the item for both); the second it keeps
    assert held == 0 and again.cache == [CacheOutcome.SHARED_HIT]
    assert third.cache == [CacheOutcome.HIT]
    assert stats_b.entries == stats_a.entries == 1
    assert (decoders[0].decodes, decoders[1].decodes) == (1, 0)
    assert list(announced.values()) == [tier(a).socket_name]
    for key, value in reference.mm_kwargs.items():
        assert torch.equal(second.mm_kwargs[key], value), key
    assert second.prompt_token_ids == reference.prompt_token_ids
    # the payload was received onto the format's alignment
    assert all(v.data_ptr() % 64 == 0 for v in copied.data.values() if v.numel())
    assert stats_a.shared.misses == 1 and stats_a.shared.served == 3
    assert stats_b.shared.hits == 2 and stats_b.shared_hits == 2 and stats_b.shared.errors == 0
    assert stats_b.shared.bytes_read == stats_a.shared.bytes_written > 0
    assert names(tmp_path) == set()  # closing removed both sockets and a's link


async def test_a_read_by_a_peer_keeps_the_item_at_its_owner(make_processor, tmp_path: Path) -> None:
    processor = make_processor()
    x, y, z = new_image(), new_image(), new_image()  # the same size: items of equal bytes
    async with Engine(processor, EngineConfig(device="cpu")) as probe:
        await probe.process(req(x))
        item_bytes = probe.stats().cache.bytes
    room_for_two = replace(config(tmp_path), cache_capacity_bytes=item_bytes * 5 // 2)
    async with (
        Engine(processor, room_for_two) as a,
        Engine(processor, config(tmp_path)) as b,
    ):
        await a.process(req(x))
        await a.process(req(y))
        first = await b.process(req(x))  # x is now a's most recent item, y its oldest
        await a.process(req(z))  # evicts y, not x
        again = await b.process(req(x))
        missed = await b.process(req(y))
    assert first.cache == again.cache == [CacheOutcome.SHARED_HIT]
    assert missed.cache == [CacheOutcome.MISS]


async def test_no_worker_tier_without_an_in_process_cache(make_processor, tmp_path: Path) -> None:
    async with Engine(make_processor(), replace(config(tmp_path), cache_capacity_bytes=0)) as e:
        second = e._pipeline.cache.cache.second_tier  # type: ignore[union-attr]
        listed = names(tmp_path)
    assert second is None and listed == set()


async def test_an_item_the_owner_no_longer_holds_is_computed_and_announced_again(
    make_processor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aiomm.cache.peer, "_LINK_GRACE_S", 0.0)
    data = new_image()
    decoder = CountingDecoder()
    processor = make_processor()
    async with (
        Engine(processor, config(tmp_path)) as a,
        Engine(processor, config(tmp_path), decoder=decoder) as b,
    ):
        first = await a.process(req(data))
        await a._pipeline.cache.cache.clear()  # type: ignore[union-attr]  # evicted at a
        second = await b.process(req(data))
        stats_a, stats_b = a.stats().cache.shared, b.stats().cache.shared
        now = links(tmp_path)
        owner = tier(b).socket_name
    assert second.cache == [CacheOutcome.MISS] and decoder.decodes == 1
    assert torch.equal(second.pixel_values, first.pixel_values)
    assert stats_a.served_misses == 1 and stats_a.links == 0
    assert stats_b.hits == 0 and stats_b.misses == 1 and stats_b.errors == 0
    assert list(now.values()) == [owner]


def _fake_owner(path: Path, reply: bytes) -> threading.Thread:
    """A peer that answers one request with ``reply``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(1 << 16)
                conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "owner", ["gone", "damaged", "oversize"], ids=["gone", "damaged", "oversize"]
)
async def test_a_gone_or_damaged_owner_costs_only_a_recomputation(
    make_processor, tmp_path: Path, owner: str
) -> None:
    data = new_image()
    decoder = CountingDecoder()
    processor = make_processor()
    name = "w1-0badc0de.sock"
    thread = None
    if owner == "damaged":
        thread = _fake_owner(tmp_path / name, b"\x01" + (64).to_bytes(8, "little") + b"x" * 64)
    elif owner == "oversize":
        thread = _fake_owner(tmp_path / name, b"\x01" + (1 << 40).to_bytes(8, "little"))
    async with Engine(processor, EngineConfig(device="cpu")) as alone:
        reference = await alone.process(req(data))
    os.symlink(name, tmp_path / PeerItemCache.link_name(reference.item_hashes[0]))
    async with Engine(processor, config(tmp_path), decoder=decoder) as b:
        result = await b.process(req(data))
        stats = b.stats().cache.shared
        now = links(tmp_path)
        mine = tier(b).socket_name
    if thread is not None:
        thread.join(5)
    assert result.ok and result.cache == [CacheOutcome.MISS] and decoder.decodes == 1
    assert torch.equal(result.pixel_values, reference.pixel_values)
    assert stats.errors == 1 and stats.hits == 0
    assert list(now.values()) == [mine]  # the item is announced as this worker's now


async def test_links_beyond_max_links_are_removed_oldest_first(tmp_path: Path) -> None:
    peer = PeerItemCache(tmp_path, max_links=2)
    await peer.start(lambda key: None)
    item = MultiModalKwargsItem(
        "image", {"x": torch.arange(4)}, {"x": MultiModalFieldConfig.batched("image")}
    )

    async def compute() -> MultiModalKwargsItem:
        return item

    # an announcement that stopped half-way left its temporary link: the next one replaces it
    stale = tmp_path / f".{peer.link_name('k3')}.{peer.socket_name}"
    os.symlink("elsewhere", stale)
    try:
        for key in ("k1", "k2", "k3"):
            got, how = await peer.get_or_compute(key, compute)
            assert got is item and how == "computed"
        assert set(links(tmp_path)) == {peer.link_name("k2"), peer.link_name("k3")}
        assert os.readlink(tmp_path / peer.link_name("k3")) == peer.socket_name
        assert stale.name not in names(tmp_path)
        assert peer.statistics().links == 2
    finally:
        await peer.aclose()
    assert names(tmp_path) == set()


async def test_a_missing_or_shared_peer_folder_is_a_config_error(
    make_processor, tmp_path: Path
) -> None:
    engine = Engine(make_processor(), config(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="peer_cache_dir"):
        await engine.__aenter__()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)  # a group could plant links to a socket of its own
    engine = Engine(make_processor(), config(shared))
    with pytest.raises(ConfigError, match="mode 700"):
        await engine.__aenter__()
    with pytest.raises(ConfigError, match="peer_cache_dir"):
        EngineConfig(peer_cache_dir=tmp_path)  # type: ignore[arg-type]


async def test_a_cancelled_close_still_removes_the_socket_and_links(tmp_path: Path) -> None:
    peer = PeerItemCache(tmp_path)
    await peer.start(lambda key: None)
    item = MultiModalKwargsItem(
        "image", {"x": torch.arange(4)}, {"x": MultiModalFieldConfig.batched("image")}
    )

    async def compute() -> MultiModalKwargsItem:
        return item

    await peer.get_or_compute("k", compute)
    assert len(names(tmp_path)) == 2
    with anyio.CancelScope() as scope:
        scope.cancel()
        await peer.aclose()
    assert names(tmp_path) == set()


async def test_many_peers_at_once_are_all_served(tmp_path: Path) -> None:
    """Six workers' fetches at once, more than socketserver's default backlog of 5: none is
    refused."""
    owner = PeerItemCache(tmp_path)
    askers = [PeerItemCache(tmp_path) for _ in range(6)]
    item = MultiModalKwargsItem(
        "image", {"x": torch.arange(1 << 16)}, {"x": MultiModalFieldConfig.batched("image")}
    )
    await owner.start({f"k{i}": item for i in range(4)}.get)
    for asker in askers:
        await asker.start(lambda key: None)

    async def compute() -> MultiModalKwargsItem:
        return item

    async def never() -> MultiModalKwargsItem:
        raise AssertionError("computed instead of copied")

    try:
        for i in range(4):
            await owner.get_or_compute(f"k{i}", compute)
        got: list[str] = []

        async def ask(asker: PeerItemCache, i: int) -> None:
            value, how = await asker.get_or_compute(f"k{i}", never)
            assert torch.equal(value.data["x"], item.data["x"])
            got.append(how)

        async with anyio.create_task_group() as tg:
            for asker in askers:
                for i in range(4):
                    tg.start_soon(ask, asker, i)
        assert got == ["hit"] * 24
        assert sum(a.statistics().errors for a in askers) == 0
        await _until(lambda: owner.statistics().served >= 24)
        assert owner.statistics().served == 24
    finally:
        for asker in askers:
            await asker.aclose()
        await owner.aclose()


def test_a_key_read_from_a_peer_is_kept_from_its_second_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    peers = PeerItemCache(tmp_path)
    monkeypatch.setattr(peers, "_READ_ONCE_KEPT", 2)
    assert [peers.store_hit(k) for k in "abc"] == [False, False, False]
    assert peers.store_hit("a") is False  # the oldest was forgotten: a first read again
    assert peers.store_hit("c") is True and peers.store_hit("a") is True
    assert peers.store_hit("c") is False  # kept once; a later copy counts afresh
