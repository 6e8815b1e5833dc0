"""The fetcher against a hostile server on loopback: compressed bombs, slow loris, endless bodies,
wrong lengths, redirect games and address spellings. Every one ends in a typed FetchError within
the limits; none costs more memory than the download cap."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from hostile_server import HostileServer, drip, endless, fixed, gzip_bomb, head, nested_gzip

from aiomm.errors import (
    BlockedAddressError,
    DownloadTooLargeError,
    FetchError,
    FetchTimeoutError,
    InvalidSourceError,
    TooManyRedirectsError,
)
from aiomm.media.fetch import FetchConfig, MediaFetcher

CAP = 1 << 20
CONFIG = FetchConfig(
    allow_loopback=True, max_bytes=CAP, connect_timeout=1.0, read_timeout=0.5, total_timeout=2.0
)
PAYLOAD = bytes(range(256)) * 64  # 16 KiB that compress a little

BOMB = gzip_bomb(256 << 20)  # 256 MiB of zeros in ~250 KB
GZIP_GZIP = nested_gzip(256 << 20, 2)  # ~600 bytes
TRIPLE = nested_gzip(256 << 20, 3)


def _short(conn: socket.socket, release: threading.Event) -> None:  # declares more than it sends
    conn.sendall(head(200, Content_Length=1000) + b"x" * 10)


def _garbage(conn: socket.socket, release: threading.Event) -> None:
    conn.sendall(b"\x00\xffnot http at all\r\n\r\n")


ROUTES = {
    "/bomb": fixed(200, BOMB, Content_Encoding="gzip"),
    "/gzip-gzip": fixed(200, GZIP_GZIP, Content_Encoding="gzip, gzip"),
    "/triple": fixed(200, TRIPLE, Content_Encoding="gzip,gzip,gzip"),
    "/bomb-chunked": lambda c, r: c.sendall(
        head(200, Content_Encoding="gzip", Transfer_Encoding="chunked")
        + b"".join(
            b"%x\r\n%s\r\n" % (len(BOMB[i : i + 4096]), BOMB[i : i + 4096])
            for i in range(0, len(BOMB), 4096)
        )
        + b"0\r\n\r\n"
    ),
    "/br": fixed(200, PAYLOAD, Content_Encoding="br"),
    "/gzip-ok": fixed(200, gzip.compress(PAYLOAD), Content_Encoding="gzip"),
    "/gzip-members": fixed(
        200, gzip.compress(PAYLOAD[:100]) + gzip.compress(PAYLOAD[100:]), Content_Encoding="gzip"
    ),
    "/deflate-zlib": fixed(200, zlib.compress(PAYLOAD), Content_Encoding="deflate"),
    "/deflate-raw": fixed(
        200, zlib.compress(PAYLOAD, wbits=-zlib.MAX_WBITS), Content_Encoding="deflate"
    ),
    "/gzip-corrupt": fixed(
        200, gzip.compress(PAYLOAD)[:20] + b"\x00" * 50, Content_Encoding="gzip"
    ),
    "/identity": fixed(200, PAYLOAD, Content_Encoding="identity"),
    "/drip": drip,
    "/endless": endless,
    "/short": _short,
    "/long": fixed(200, b"y" * 100, Content_Length=10),
    "/garbage": _garbage,
    "/loop-a": fixed(302, b"", Location="/loop-b"),
    "/loop-b": fixed(302, b"", Location="/loop-a"),
    "/to-metadata": fixed(302, b"", Location="http://169.254.169.254/latest/meta-data/"),
    "/to-mapped": fixed(302, b"", Location="http://[::ffff:169.254.169.254]/"),
    "/to-file": fixed(302, b"", Location="file:///etc/passwd"),
    "/to-bomb": fixed(302, b"", Location="/bomb"),
}


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    with HostileServer(ROUTES).running() as server:
        yield server


async def fetch(url: str, config: FetchConfig = CONFIG) -> bytes:
    async with MediaFetcher(config) as fetcher:
        return await fetcher.fetch(url)


async def peak_bytes_of(url: str) -> tuple[Any, int]:
    """(result or exception, peak bytes Python allocated while fetching ``url``)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            outcome: Any = await fetch(url)
        except FetchError as exc:
            outcome = exc
        return outcome, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("path", ["/bomb", "/bomb-chunked", "/to-bomb"])
async def test_gzip_bomb_stops_at_the_cap(hostile: HostileServer, path: str) -> None:
    outcome, peak = await peak_bytes_of(hostile.url(path))
    assert isinstance(outcome, DownloadTooLargeError), outcome
    assert "inflates past the limit of 1048576 bytes" in str(outcome)
    # 256 MiB inflated if unbounded; bounded, the decoded bytes kept never pass the cap
    assert peak < 4 * CAP, peak


@pytest.mark.parametrize("path", ["/gzip-gzip", "/triple"])
async def test_stacked_encodings_are_refused_unread(hostile: HostileServer, path: str) -> None:
    outcome, peak = await peak_bytes_of(hostile.url(path))
    assert isinstance(outcome, FetchError) and not isinstance(outcome, DownloadTooLargeError)
    assert "stacks" in str(outcome) and "at most one" in str(outcome)
    assert peak < 4 * CAP, peak


async def test_encoding_not_asked_for_is_refused(hostile: HostileServer) -> None:
    with pytest.raises(FetchError, match="'br' was not asked for"):
        await fetch(hostile.url("/br"))


@pytest.mark.parametrize(
    "path", ["/gzip-ok", "/gzip-members", "/deflate-zlib", "/deflate-raw", "/identity"]
)
async def test_honest_encodings_decode(hostile: HostileServer, path: str) -> None:
    assert await fetch(hostile.url(path)) == PAYLOAD


async def test_corrupt_gzip_is_a_fetch_error(hostile: HostileServer) -> None:
    with pytest.raises(FetchError, match="corrupt gzip-encoded body"):
        await fetch(hostile.url("/gzip-corrupt"))


async def test_exactly_the_cap_inflated_passes(hostile: HostileServer) -> None:
    body = gzip_bomb(CAP)
    ROUTES["/cap"] = fixed(200, body, Content_Encoding="gzip")
    ROUTES["/cap+1"] = fixed(200, gzip_bomb(CAP + 1), Content_Encoding="gzip")
    assert await fetch(hostile.url("/cap")) == bytes(CAP)
    with pytest.raises(DownloadTooLargeError):
        await fetch(hostile.url("/cap+1"))


async def test_slow_loris_headers_hit_the_total_timeout(hostile: HostileServer) -> None:
    t = time.perf_counter()
    with pytest.raises(FetchTimeoutError, match=r"longer than 2\.0 s"):
        await fetch(hostile.url("/drip"))
    assert time.perf_counter() - t < 3


async def test_endless_body_is_cut_at_the_cap(hostile: HostileServer) -> None:
    outcome, peak = await peak_bytes_of(hostile.url("/endless"))
    assert isinstance(outcome, DownloadTooLargeError), outcome
    assert peak < 4 * CAP, peak


@pytest.mark.parametrize("path", ["/short", "/garbage"])
async def test_wrong_lengths_and_garbage_are_fetch_errors(
    hostile: HostileServer, path: str
) -> None:
    with pytest.raises(FetchError):
        await fetch(hostile.url(path))


async def test_body_longer_than_declared_is_cut_to_the_declared_length(
    hostile: HostileServer,
) -> None:
    assert await fetch(hostile.url("/long")) == b"y" * 10


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/loop-a", TooManyRedirectsError),
        ("/to-metadata", BlockedAddressError),
        ("/to-mapped", BlockedAddressError),
        ("/to-file", FetchError),
    ],
)
async def test_redirect_games(hostile: HostileServer, path: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        await fetch(hostile.url(path))


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[0:0:0:0:0:ffff:127.0.0.1]",
        "[::127.0.0.1]",
        "[::ffff:0:127.0.0.1]",
        "[64:ff9b::127.0.0.1]",
        "[64:ff9b:1::7f00:1]",
        "localhost",
        "0.0.0.0",
        "[::]",
    ],
)
async def test_every_loopback_spelling_is_refused(hostile: HostileServer, host: str) -> None:
    strict = FetchConfig(connect_timeout=1.0, read_timeout=0.5, total_timeout=2.0)
    # a spelling httpx cannot parse (octal) is refused as an invalid URL instead
    with pytest.raises((BlockedAddressError, InvalidSourceError)):
        await fetch(f"http://{host}:{hostile.port}/spelling", strict)
    assert hostile.hits.get("/spelling", 0) == 0  # refused before connecting


@pytest.mark.parametrize(
    "source",
    [
        "http://a\x1b[2J.test/x.png",  # httpx echoes the bad character in its message
        "ftp://x/\x1b]0;title\x07",
        "http://[::1\r\nX-Forged: 1",
        "data:image/png;base64,\x00\x1b[31m",
        "relative/\x1b[2Jpath.png",  # local paths disabled: the error names the path
        "gopher://\u202eevil",  # a bidi override: not printable either
    ],
)
async def test_error_messages_never_echo_control_characters(source: str) -> None:
    with pytest.raises(FetchError) as info:
        await fetch(source)
    text = str(info.value)
    assert text.isprintable(), repr(text)
    assert info.value.source is not None and info.value.source.isprintable()
    assert "\\x1b" in text or "\\r" in text or "\\x00" in text or "\\u202e" in text


@pytest.mark.parametrize(
    "source",
    [
        "http://[::1",
        "https://[",
        "http://a b/",
        "http://%zz/",
        "http://x:abc/",
        "http://[::1]:99999/",
        "https://example.com:-1/",
        "http://" + "a" * 64 + ".example/",
        "http://-bad-.example/",
        "http:///path",
        "HTTP://[zz::1]/",
    ],
)
async def test_every_malformed_url_is_an_invalid_source_naming_it(source: str) -> None:
    # refused before any resolution or connection: nothing here may reach a resolver
    with pytest.raises(InvalidSourceError) as info:
        await fetch(source)
    assert info.value.source is not None and info.value.source[:10] == source[:10]
