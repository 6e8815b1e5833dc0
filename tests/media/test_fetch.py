"""MediaFetcher against a real loopback HTTP server: limits, redirects, the SSRF guard, data URLs
and local paths."""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import os
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import pytest

import aiomm.media.fetch
from aiomm.errors import (
    BlockedAddressError,
    DownloadTooLargeError,
    FetchError,
    FetchTimeoutError,
    HTTPStatusError,
    InvalidSourceError,
    PathNotAllowedError,
    TooManyRedirectsError,
)
from aiomm.media.fetch import FetchConfig, FetchStatistics, MediaFetcher, address_refusal

# LoopbackServer and the fixtures (server, ok_png, connections, elapsed) live in conftest.py.
LoopbackServer = Any

LOOPBACK = FetchConfig(allow_loopback=True, connect_timeout=1.0, read_timeout=0.3)


async def fetch(source: Any, config: FetchConfig = LOOPBACK) -> bytes:
    async with MediaFetcher(config) as fetcher:
        return await fetcher.fetch(source)


# -- http ----------------------------------------------------------------------------------------


async def test_fetch_ok(ok_png: bytes, server: LoopbackServer, connections: list[str]) -> None:
    async with MediaFetcher(LOOPBACK) as fetcher:
        assert await fetcher.fetch(server.url("/ok.png")) == ok_png
        stats = fetcher.statistics()
    assert stats == FetchStatistics(
        requests=1, bytes_downloaded=len(ok_png), errors=stats.errors, in_flight=0, redirects=0
    )
    assert dict(stats.errors) == {}
    assert connections == ["127.0.0.1"]
    assert server.headers_seen[0]["user-agent"] == LOOPBACK.user_agent


async def test_read_timeout(server: LoopbackServer, elapsed: Any) -> None:
    with elapsed() as t, pytest.raises(FetchTimeoutError, match=r"no data received for 0\.3 s"):
        await fetch(server.url("/slow"))
    assert t.seconds < 2


async def test_total_timeout_bounds_a_slow_drip(server: LoopbackServer, elapsed: Any) -> None:
    config = dataclasses.replace(LOOPBACK, total_timeout=0.5)
    with elapsed() as t, pytest.raises(FetchTimeoutError, match=r"longer than 0\.5 s"):
        await fetch(server.url("/drip"), config)
    assert t.seconds < 2


async def test_declared_content_length_over_the_cap_is_refused_before_reading(
    server: LoopbackServer, elapsed: Any
) -> None:
    # The server sends 100 bytes of the 1 GB it declares and stalls: reading the body would end
    # in a read timeout, so DownloadTooLargeError proves the header alone decided.
    config = dataclasses.replace(LOOPBACK, max_bytes=1000)
    with elapsed() as t, pytest.raises(DownloadTooLargeError, match="Content-Length"):
        await fetch(server.url("/big-declared"), config)
    assert t.seconds < 0.3


async def test_chunked_body_over_the_cap_is_aborted_mid_stream(server: LoopbackServer) -> None:
    config = dataclasses.replace(LOOPBACK, max_bytes=10_000)
    async with MediaFetcher(config) as fetcher:
        with pytest.raises(DownloadTooLargeError, match="limit of 10000 bytes"):
            await fetcher.fetch(server.url("/big-chunked"))
        stats = fetcher.statistics()
    assert stats.errors == {"DownloadTooLargeError": 1} and stats.bytes_downloaded == 0


@pytest.mark.parametrize("route", ["bytes", "chunked"])
async def test_size_cap_boundary(server: LoopbackServer, route: str) -> None:
    config = dataclasses.replace(LOOPBACK, max_bytes=1000)
    assert await fetch(server.url(f"/{route}/1000"), config) == b"z" * 1000
    with pytest.raises(DownloadTooLargeError):
        await fetch(server.url(f"/{route}/1001"), config)


async def test_redirect_is_followed(ok_png: bytes, server: LoopbackServer) -> None:
    async with MediaFetcher(LOOPBACK) as fetcher:
        assert await fetcher.fetch(server.url("/redirect")) == ok_png
        assert fetcher.statistics().redirects == 1
    assert server.hits["/redirect"] == 1 and server.hits["/ok.png"] == 1


async def test_redirect_limit(ok_png: bytes, server: LoopbackServer) -> None:
    # /redirect-chain/3 takes exactly max_redirects=3 redirects; /redirect-chain/4 one too many
    assert await fetch(server.url("/redirect-chain/3")) == ok_png
    with pytest.raises(TooManyRedirectsError, match="more than 3 redirects"):
        await fetch(server.url("/redirect-chain/4"))
    with pytest.raises(TooManyRedirectsError):
        await fetch(server.url("/redirect"), dataclasses.replace(LOOPBACK, max_redirects=0))


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/x",
        "http://[fd00:ec2::254]/latest",
        "http://[::ffff:169.254.169.254]/latest",
    ],
)
async def test_redirect_to_a_refused_address(
    server: LoopbackServer, connections: list[str], target: str
) -> None:
    url = server.url("/redirect-to?url=" + quote(target, safe=""))
    with pytest.raises(BlockedAddressError, match="redirect 1 of") as info:
        await fetch(url)
    assert "does not connect" in str(info.value)
    # only the loopback server was contacted (the connections fixture fails any other target)
    assert connections == ["127.0.0.1"]
    assert server.hits["/redirect-to"] == 1


async def test_allowed_media_domains(ok_png: bytes, server: LoopbackServer) -> None:
    # vLLM's --allowed-media-domains: only URLs whose host is listed are fetched
    config = dataclasses.replace(LOOPBACK, allowed_media_domains=("localhost",))
    url = server.url("/ok.png")  # http://127.0.0.1:PORT/ok.png: not a listed host
    with pytest.raises(BlockedAddressError, match="not one of the allowed media domains") as info:
        await fetch(url, config)
    assert info.value.source == url and url in str(info.value)
    assert server.hits["/ok.png"] == 0  # refused before any connection
    listed = dataclasses.replace(LOOPBACK, allowed_media_domains=("LOCALHOST.", "127.0.0.1"))
    assert listed.allowed_media_domains == ("localhost", "127.0.0.1")
    assert await fetch(url, listed) == ok_png
    # every redirect's target is checked too
    to_localhost = server.url("/ok.png", host="localhost")
    redirect = server.url("/redirect-to?url=" + quote(to_localhost, safe=""))
    only_ip = dataclasses.replace(LOOPBACK, allowed_media_domains=("127.0.0.1",))
    with pytest.raises(BlockedAddressError, match="redirect 1 of") as info:
        await fetch(redirect, only_ip)
    assert info.value.source == to_localhost
    assert server.hits["/ok.png"] == 1


def test_allowed_media_domains_validation() -> None:
    assert FetchConfig(allowed_media_domains=("[::1]",)).allowed_media_domains == ("::1",)
    assert FetchConfig(allowed_media_domains=("bücher.example",)).allowed_media_domains == (
        "xn--bcher-kva.example",
    )
    for bad in ("https://example.com/", "example.com:443", "", "a b"):
        with pytest.raises(ValueError, match="is not a host name"):
            FetchConfig(allowed_media_domains=(bad,))
    with pytest.raises(ValueError, match="wrap it in a tuple"):
        FetchConfig(allowed_media_domains="example.com")  # type: ignore[arg-type]


async def test_metadata_is_refused_even_with_private_addresses_allowed(
    server: LoopbackServer,
) -> None:
    config = dataclasses.replace(LOOPBACK, allow_private_addresses=True)
    url = server.url("/redirect-to?url=" + quote("http://169.254.169.254/", safe=""))
    with pytest.raises(BlockedAddressError, match="metadata"):
        await fetch(url, config)


@pytest.mark.parametrize("target", ["file:///etc/passwd", "data:,hello", "ftp://127.0.0.1/x"])
async def test_redirect_may_not_leave_http(server: LoopbackServer, target: str) -> None:
    url = server.url("/redirect-to?url=" + quote(target, safe=""))
    with pytest.raises(InvalidSourceError, match=r"redirect target has scheme|redirect Location"):
        await fetch(url)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://10.0.0.1/x", "private"),
        ("http://192.168.1.1/", "private"),
        ("http://100.64.0.1/", "private"),
        ("http://[::1]/", "loopback"),
        ("http://127.0.0.1/", "loopback"),
        ("http://2130706433/", "loopback"),  # 127.0.0.1 as one decimal number
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "metadata"),
        ("https://[fd00:ec2::254]/", "metadata"),
        ("http://169.254.1.1/", "link-local"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://224.0.0.1/", "multicast"),
        ("http://192.0.2.10/", "reserved"),  # documentation range
    ],
)
async def test_refused_address_without_any_connection(
    url: str, kind: str, connections: list[str], elapsed: Any
) -> None:
    config = FetchConfig(connect_timeout=1.0, read_timeout=0.3)
    with elapsed() as t, pytest.raises(BlockedAddressError, match=f"a {kind} address"):
        await fetch(url, config)
    assert connections == []
    assert t.seconds < 0.5


async def test_hostname_resolving_to_loopback_is_refused(
    ok_png: bytes, server: LoopbackServer, connections: list[str]
) -> None:
    url = server.url("/ok.png", host="localhost")
    with pytest.raises(BlockedAddressError, match=r"localhost resolves to .* loopback"):
        await fetch(url, dataclasses.replace(LOOPBACK, allow_loopback=False))
    assert connections == [] and server.hits["/ok.png"] == 0
    assert await fetch(url) == ok_png


def _fake_getaddrinfo(monkeypatch: pytest.MonkeyPatch, answers: list[list[str]]) -> list[str]:
    """Answer successive resolver calls with ``answers``; returns the hosts asked."""
    asked: list[str] = []

    def getaddrinfo(host: str, port: int) -> list[Any]:
        asked.append(host)
        addresses = answers[min(len(asked), len(answers)) - 1]
        return [
            (
                socket.AF_INET6 if ":" in a else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (a, port),
            )
            for a in addresses
        ]

    monkeypatch.setattr(aiomm.media.fetch, "_lookup", getaddrinfo)
    return asked


async def test_connection_is_pinned_to_the_checked_address(
    ok_png: bytes, server: LoopbackServer, connections: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rebinding resolver: loopback first, a private address afterwards. The fetcher resolves
    # once and connects to what it checked, sending the original Host header.
    asked = _fake_getaddrinfo(monkeypatch, [["127.0.0.1"], ["10.0.0.1"]])
    url = server.url("/ok.png", host="images.example")
    assert await fetch(url) == ok_png
    assert asked == ["images.example"]
    assert connections == ["127.0.0.1"]
    assert server.headers_seen[0]["host"] == f"images.example:{server.port}"


async def test_any_refused_resolved_address_refuses_the_host(
    server: LoopbackServer, connections: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_getaddrinfo(monkeypatch, [["127.0.0.1", "10.0.0.1"]])
    with pytest.raises(BlockedAddressError, match=r"10\.0\.0\.1, a private address"):
        await fetch(server.url("/ok.png", host="mixed.example"))
    assert connections == []


async def test_next_resolved_address_is_tried(
    ok_png: bytes, server: LoopbackServer, connections: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # ::1 refuses the connection (the server listens on 127.0.0.1 only), 127.0.0.1 answers
    _fake_getaddrinfo(monkeypatch, [["::1", "127.0.0.1"]])
    assert await fetch(server.url("/ok.png", host="dual.example")) == ok_png
    assert connections[-1] == "127.0.0.1"


@pytest.mark.parametrize("status", [404, 500])
async def test_http_status_error(server: LoopbackServer, status: int) -> None:
    with pytest.raises(HTTPStatusError, match=f"HTTP status {status}") as info:
        await fetch(server.url(f"/status/{status}"))
    assert info.value.status_code == status  # type: ignore[attr-defined]
    assert server.url(f"/status/{status}") in str(info.value)


async def test_404_route(server: LoopbackServer) -> None:
    with pytest.raises(HTTPStatusError) as info:
        await fetch(server.url("/404"))
    assert info.value.status_code == 404  # type: ignore[attr-defined]


async def test_connection_refused_is_a_fetch_error(elapsed: Any) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with elapsed() as t, pytest.raises(FetchError, match="ConnectError") as info:
        await fetch(f"http://127.0.0.1:{port}/x")
    assert type(info.value) is FetchError and t.seconds < 0.9


async def test_cookies_never_travel_between_fetches(server: LoopbackServer) -> None:
    async with MediaFetcher(LOOPBACK) as fetcher:
        await fetcher.fetch(server.url("/set-cookie"))
        await fetcher.fetch(server.url("/ok.png"))
    assert "cookie" not in server.headers_seen[1]


async def test_credentials_in_the_url_are_not_in_the_message(server: LoopbackServer) -> None:
    url = server.url("/status/403").replace("http://", "http://user:hunter2@")
    with pytest.raises(HTTPStatusError) as info:
        await fetch(url)
    assert "hunter2" not in str(info.value) and "/status/403" in str(info.value)


# -- source kinds --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    ["ftp://127.0.0.1/x.png", "gopher://h/", "javascript:alert(1)", "s3://bucket/key.png"],
)
async def test_unsupported_scheme(source: str) -> None:
    with pytest.raises(InvalidSourceError, match="unsupported URL scheme"):
        await fetch(source)


@pytest.mark.parametrize("source", [42, None, ["http://x"]])
async def test_unsupported_source_type(source: Any) -> None:
    with pytest.raises(InvalidSourceError, match="unsupported source type"):
        await fetch(source)


async def test_bytes_pass_through_capped() -> None:
    assert await fetch(b"abc") == b"abc"
    assert await fetch(memoryview(b"abcd")) == b"abcd"
    with pytest.raises(DownloadTooLargeError):
        await fetch(b"x" * 11, FetchConfig(max_bytes=10))


async def test_data_url_base64_and_percent_encoded(ok_png: bytes) -> None:
    url = "data:image/png;base64," + base64.b64encode(ok_png).decode()
    assert await fetch(url) == ok_png
    assert await fetch("DATA:;BASE64," + base64.b64encode(b"hi").decode()) == b"hi"
    assert await fetch("data:text/plain,a%20b%00") == b"a b\x00"
    assert await fetch("data:,") == b""


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64",  # no comma
        "data:image/png;base64,iVBOR!!!",  # not base64
        "data:image/png;base64,iVBORw0",  # bad padding
        "data:image/png;base64,iVBO Rw==",  # whitespace: strict validation
    ],
)
async def test_malformed_data_url(url: str) -> None:
    with pytest.raises(InvalidSourceError, match="data URL") as info:
        await fetch(url)
    assert url[:40] in str(info.value)


async def test_data_url_size_cap_and_message_without_payload() -> None:
    payload = base64.b64encode(b"p" * 3000).decode()
    with pytest.raises(DownloadTooLargeError, match="limit of 1000 bytes") as info:
        await fetch("data:image/png;base64," + payload, FetchConfig(max_bytes=1000))
    assert payload[:100] not in str(info.value)
    assert len(str(info.value)) < 200
    with pytest.raises(DownloadTooLargeError):
        await fetch("data:," + "q" * 1001, FetchConfig(max_bytes=1000))


async def test_big_data_url_decodes_in_a_thread() -> None:
    data = os.urandom(3 << 20)
    url = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
    assert await fetch(url) == data


# -- local files ---------------------------------------------------------------------------------


@pytest.fixture
def root(ok_png: bytes, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(ok_png)
    (tmp_path / "secret.txt").write_bytes(b"secret")
    (root / "escape").symlink_to(tmp_path / "secret.txt")
    (root / "inside-link").symlink_to(root / "sub" / "a.png")
    return root


async def test_local_file_inside_the_root(
    ok_png: bytes, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(root)  # relative paths are taken relative to the working directory
    config = FetchConfig(allowed_local_root=root)
    path = root / "sub" / "a.png"
    for source in (str(path), path, path.as_uri(), "sub/a.png", "sub/../sub/a.png"):
        assert await fetch(source, config) == ok_png, source
    assert await fetch(root / "inside-link", config) == ok_png


async def test_local_file_outside_the_root(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(root)
    config = FetchConfig(allowed_local_root=root)
    secret = root.parent / "secret.txt"
    for source in (
        str(root / ".." / "secret.txt"),
        "../secret.txt",
        str(root / "escape"),  # a symlink pointing out of the root
        str(secret),
        secret.as_uri(),
        "/etc/passwd",
    ):
        with pytest.raises(PathNotAllowedError, match="outside the allowed local root") as info:
            await fetch(source, config)
        assert str(root) not in str(info.value).replace(str(source), "")


async def test_local_paths_refused_without_a_root(root: Path) -> None:
    with pytest.raises(PathNotAllowedError, match="file: URLs are disabled") as info:
        await fetch(str(root / "sub" / "a.png"), FetchConfig())
    assert "FetchConfig.allowed_local_root is not set" in str(info.value)
    # a server names its own flag, not the library's field
    config = FetchConfig(local_root_setting="--allowed-local-media-path")
    with pytest.raises(PathNotAllowedError, match="--allowed-local-media-path is not set") as info:
        await fetch((root / "sub" / "a.png").as_uri(), config)
    assert "FetchConfig" not in str(info.value)
    assert info.value.source == (root / "sub" / "a.png").as_uri()


async def test_relative_paths_resolve_against_the_working_directory(
    ok_png: bytes, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the root (tmp_path/root) is not the working directory: "sub/a.png" is read from where the
    # process runs, at fetch time, and must still lie under the root
    monkeypatch.chdir(root / "sub")
    config = FetchConfig(allowed_local_root=root)
    assert await fetch("a.png", config) == ok_png
    assert await fetch("./a.png", config) == ok_png
    assert await fetch(Path("a.png"), config) == ok_png
    monkeypatch.chdir(root)
    assert await fetch("sub/a.png", config) == ok_png
    with pytest.raises(FetchError, match="no such file") as info:
        await fetch("a.png", config)  # root/a.png: inside the root, but not there
    assert info.value.source == "a.png"
    monkeypatch.chdir(tmp_path)  # the working directory outside the root: refused
    (tmp_path / "here.png").write_bytes(ok_png)
    with pytest.raises(PathNotAllowedError, match="outside the allowed local root") as info:
        await fetch("here.png", config)
    assert info.value.source == "here.png"
    assert await fetch("root/sub/a.png", config) == ok_png


async def test_a_relative_root_is_taken_relative_to_the_working_directory(
    ok_png: bytes, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(root / "sub")
    config = FetchConfig(allowed_local_root=Path(".."))
    assert config.allowed_local_root == root / "sub" / ".."
    assert await fetch("../sub/a.png", config) == ok_png
    with pytest.raises(PathNotAllowedError):
        await fetch("../../secret.txt", config)
    monkeypatch.chdir(root.parent)  # the root was fixed when the configuration was made
    assert await fetch("root/sub/a.png", config) == ok_png
    with pytest.raises(PathNotAllowedError):
        await fetch("secret.txt", config)


async def test_allowed_local_paths_are_folders_or_single_files(
    ok_png: bytes, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "b.png").write_bytes(ok_png)
    (other / "c.png").write_bytes(b"not named")
    (root / "link-to-b").symlink_to(other / "b.png")
    monkeypatch.chdir(root)
    # a single file allowed by name: that file, not its neighbours
    config = FetchConfig(allowed_local_root=root, allowed_local_paths=(other / "b.png",))
    assert await fetch(str(other / "b.png"), config) == ok_png
    assert await fetch("../other/b.png", config) == ok_png
    assert await fetch("link-to-b", config) == ok_png  # the link resolves to the allowed file
    for source in (str(other / "c.png"), "../other/c.png", "../secret.txt", str(other)):
        with pytest.raises(PathNotAllowedError, match="outside the allowed local root"):
            await fetch(source, config)
    # a folder, without any root
    config = FetchConfig(allowed_local_paths=(other,))
    assert await fetch(str(other / "c.png"), config) == b"not named"
    with pytest.raises(PathNotAllowedError):
        await fetch("sub/a.png", config)
    # a file named but missing: no such file, not a refusal
    config = FetchConfig(allowed_local_paths=(other / "missing.png",))
    with pytest.raises(FetchError, match="no such file"):
        await fetch(str(other / "missing.png"), config)


async def test_local_file_errors(ok_png: bytes, root: Path) -> None:
    config = FetchConfig(allowed_local_root=root, max_bytes=len(ok_png) - 1)
    with pytest.raises(FetchError, match="no such file") as info:
        await fetch(str(root / "missing.png"), config)
    assert type(info.value) is FetchError
    with pytest.raises(FetchError, match="not a regular file"):
        await fetch(str(root / "sub"), config)
    with pytest.raises(DownloadTooLargeError):
        await fetch(str(root / "sub" / "a.png"), config)
    with pytest.raises(InvalidSourceError, match="names host"):
        await fetch("file://otherhost/sub/a.png", config)
    with pytest.raises(InvalidSourceError, match="invalid file URL"):
        await fetch("file://[x/sub/a.png", config)  # an unclosed IPv6 bracket


@pytest.mark.parametrize("swapped", ["sub/a.png", "sub"])
async def test_a_link_swapped_in_after_the_check_is_not_followed(
    root: Path, swapped: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race, made deterministic: the path is checked while it has no link (resolve() sees
    # the plain path), then a link out of the root takes the place of a file or a directory.
    outside = root.parent / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "a.png").write_bytes(b"secret")
    (outside / "a.png").write_bytes(b"secret")
    target = root / swapped
    if target.is_dir():
        (target / "a.png").unlink()
        target.rmdir()
    else:
        target.unlink()
    target.symlink_to(outside / swapped)
    monkeypatch.setattr(Path, "resolve", lambda self, strict=False: Path(os.path.abspath(self)))
    with pytest.raises(PathNotAllowedError, match="a link appeared in the path"):
        await fetch(str(root / "sub" / "a.png"), FetchConfig(allowed_local_root=root))


async def test_a_file_in_a_directorys_place_is_not_a_link(root: Path) -> None:
    with pytest.raises(FetchError, match=r"cannot (open the file|resolve)") as info:
        await fetch(str(root / "sub" / "a.png" / "x.png"), FetchConfig(allowed_local_root=root))
    assert not isinstance(info.value, PathNotAllowedError)


async def test_resolution_threads_are_the_fetchers_own(
    ok_png: bytes, server: LoopbackServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # anyio's default thread pool is exhausted by other work; resolving still proceeds
    _fake_getaddrinfo(monkeypatch, [["127.0.0.1"]])
    default = anyio.to_thread.current_default_thread_limiter()
    monkeypatch.setattr(default, "total_tokens", 1)
    blocker = threading.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, blocker.wait)  # holds the only default token
        await anyio.wait_all_tasks_blocked()
        try:
            with anyio.fail_after(5):
                assert await fetch(server.url("/ok.png", host="images.example")) == ok_png
        finally:
            blocker.set()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
async def test_fifo_is_refused_without_blocking(root: Path, elapsed: Any) -> None:
    os.mkfifo(root / "pipe")
    with elapsed() as t, pytest.raises(FetchError, match="not a regular file"):
        await fetch(str(root / "pipe"), FetchConfig(allowed_local_root=root))
    assert t.seconds < 1


# -- lifecycle, statistics, policy ---------------------------------------------------------------


async def test_lifecycle() -> None:
    fetcher = MediaFetcher()
    with pytest.raises(RuntimeError, match="unopened"):
        await fetcher.fetch(b"x")
    async with fetcher:
        assert await fetcher.fetch(b"x") == b"x"
    with pytest.raises(RuntimeError, match="closed"):
        await fetcher.fetch(b"x")
    with pytest.raises(RuntimeError, match="opened once"):
        await fetcher.__aenter__()
    await fetcher.aclose()  # idempotent


async def test_statistics_count_errors_and_in_flight(server: LoopbackServer) -> None:
    async with MediaFetcher(LOOPBACK) as fetcher:

        async def slow() -> None:
            with pytest.raises(FetchTimeoutError):
                await fetcher.fetch(server.url("/slow"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await anyio.sleep(0.1)
            in_flight = fetcher.statistics().in_flight
        for source, error in (
            ("ftp://x/", InvalidSourceError),
            ("http://10.0.0.1/", BlockedAddressError),
            (server.url("/status/404"), HTTPStatusError),
        ):
            with pytest.raises(error):
                await fetcher.fetch(source)
        assert await fetcher.fetch(b"ok") == b"ok"
        stats = fetcher.statistics()
    assert in_flight == 1
    assert stats.requests == 5 and stats.in_flight == 0 and stats.bytes_downloaded == 2
    assert dict(stats.errors) == {
        "FetchTimeoutError": 1,
        "InvalidSourceError": 1,
        "BlockedAddressError": 1,
        "HTTPStatusError": 1,
    }


@pytest.mark.parametrize(
    ("address", "flags", "refused"),
    [
        ("8.8.8.8", {}, None),
        ("2606:4700::1111", {}, None),
        ("127.0.0.1", {}, "loopback"),
        ("127.0.0.1", {"allow_loopback": True}, None),
        ("127.0.0.1", {"allow_private_addresses": True}, "loopback"),
        ("10.1.2.3", {"allow_private_addresses": True}, None),
        ("10.1.2.3", {"allow_loopback": True}, "private"),
        ("fd12::1", {"allow_private_addresses": True}, None),
        ("169.254.169.254", {"allow_private_addresses": True}, "metadata"),
        ("169.254.169.254", {"allowed_networks": ("169.254.169.254/32",)}, None),
        ("::ffff:10.0.0.1", {}, "private"),
        ("64:ff9b::a9fe:a9fe", {}, "metadata"),  # NAT64 form of 169.254.169.254
        ("2002:a9fe:a9fe::1", {}, "metadata"),  # 6to4 form of 169.254.169.254
        ("168.63.129.16", {"allow_private_addresses": True}, "metadata"),  # Azure wire server
        ("::10.0.0.1", {}, "private"),  # IPv4-compatible
        ("::ffff:0:a9fe:a9fe", {"allow_private_addresses": True}, "metadata"),  # SIIT
        ("64:ff9b:1::a00:1", {}, "private"),  # NAT64 local-use
        ("64:ff9b:1::a00:1", {"allow_private_addresses": True}, None),
        ("::1", {"allow_loopback": True}, None),
        ("0.0.0.0", {"allow_loopback": True}, "unspecified"),
        ("10.9.0.1", {"allowed_networks": ("10.9.0.0/16",)}, None),
        ("10.8.0.1", {"allowed_networks": ("10.9.0.0/16",)}, "private"),
    ],
)
def test_address_policy(address: str, flags: dict[str, Any], refused: str | None) -> None:
    assert address_refusal(ipaddress.ip_address(address), FetchConfig(**flags)) == refused


def test_config_validation(tmp_path: Path) -> None:
    assert FetchConfig(allowed_local_root=str(tmp_path)).allowed_local_root == tmp_path  # type: ignore[arg-type]
    for bad in (
        {"connect_timeout": 0},
        {"read_timeout": -1},
        {"max_bytes": 0},
        {"max_redirects": -1},
        {"allowed_networks": ("not-a-network",)},
    ):
        with pytest.raises(ValueError):
            FetchConfig(**bad)


def test_defaults() -> None:
    config = FetchConfig()
    assert (config.connect_timeout, config.read_timeout) == (5.0, 10.0)
    assert config.max_bytes == 64 * 2**20 and config.max_redirects == 3
    assert not config.allow_loopback and not config.allow_private_addresses
    assert config.allowed_local_root is None


class _ClosingKeepAliveServer:
    """Answers the first GET on each connection with keep-alive, then closes the connection as
    the next GET on it arrives, without a response: a server that timed out an idle
    keep-alive connection just as the client reused it. ``always`` closes every request."""

    def __init__(self, body: bytes, *, always: bool = False) -> None:
        self.body, self.always = body, always
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            for answer in (not self.always, False):
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                self.requests += 1
                if not answer:
                    return  # closed without a response
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(self.body)}\r\n\r\n"
                conn.sendall(head.encode() + self.body)

    def close(self) -> None:
        self.sock.close()


async def test_a_get_on_a_connection_the_server_just_closed_is_sent_again(
    ok_png: bytes,
) -> None:
    server = _ClosingKeepAliveServer(ok_png)
    try:
        async with MediaFetcher(LOOPBACK) as fetcher:
            url = f"http://127.0.0.1:{server.port}/a.png"
            assert await fetcher.fetch(url) == ok_png
            assert await fetcher.fetch(url) == ok_png  # the pooled connection is closed on it
            stats = fetcher.statistics()
    finally:
        server.close()
    assert stats.retries == 1 and dict(stats.errors) == {}
    assert server.requests == 3


async def test_a_server_that_never_answers_is_sent_the_get_twice_at_most() -> None:
    server = _ClosingKeepAliveServer(b"", always=True)
    try:
        async with MediaFetcher(LOOPBACK) as fetcher:
            with pytest.raises(FetchError, match="RemoteProtocolError"):
                await fetcher.fetch(f"http://127.0.0.1:{server.port}/a.png")
            stats = fetcher.statistics()
    finally:
        server.close()
    assert stats.retries == 1 and server.requests == 2
