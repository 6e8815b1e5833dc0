"""The fetch stage: an image source (URL, ``data:`` URL, local path or bytes) -> encoded bytes.

Runs on the event loop (async I/O); local files are read in a worker thread. Every source kind is
capped at :attr:`FetchConfig.max_bytes`.

SSRF guard. Each HTTP connection is opened by :class:`_GuardedNetworkBackend`, which resolves the
host once, refuses the connection when *any* resolved address is not allowed, and then connects to
one of the addresses it checked. Checking and connecting on the same resolution leaves no window
for DNS rebinding, while TLS (SNI, certificate check) and connection pooling still use the host
name. Redirects are followed here, not by httpx, so every hop's scheme is checked, and every new
connection a hop needs goes through the same backend.
"""

from __future__ import annotations

import base64
import binascii
import enum
import errno
import http.cookiejar
import ipaddress
import os
import re
import socket
import stat
import types
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

import anyio
import httpcore
import httpx

from aiomm.config import FetchConfig as FetchConfig
from aiomm.errors import (
    AiommError,
    BlockedAddressError,
    DownloadTooLargeError,
    FetchError,
    FetchTimeoutError,
    HTTPStatusError,
    InvalidSourceError,
    PathNotAllowedError,
    TooManyRedirectsError,
)
from aiomm.logging import get_logger
from aiomm.media._inflate import EncodingRefused, InflateLimitExceeded, body_decoder
from aiomm.redaction import redact

__all__ = (
    "METADATA_ADDRESSES",
    "FetchConfig",
    "FetchStatistics",
    "MediaFetcher",
    "address_refusal",
)

log = get_logger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Cloud instance-metadata endpoints (AWS/GCP/Azure/Oracle, AWS IPv6, AWS ECS, Alibaba, Azure's
#: wire server): refused even when private or link-local addresses are allowed, unless
#: ``allowed_networks`` names them.
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",
        "fd00:ec2::254",
        "169.254.170.2",
        "100.100.100.200",
        "168.63.129.16",
    )
)

_PRIVATE_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",  # carrier-grade NAT
        "fc00::/7",  # unique-local
        "fec0::/10",  # deprecated site-local
        # NAT64 local-use (RFC 8215): translators the operator runs, reaching its own networks
        "64:ff9b:1::/48",
    )
)
# IPv6 forms that carry an IPv4 address in their low 32 bits: well-known NAT64, SIIT
# (::ffff:0:a.b.c.d) and the deprecated IPv4-compatible ::a.b.c.d.
_EMBEDDING_NETWORKS: tuple[ipaddress.IPv6Network, ...] = tuple(
    ipaddress.IPv6Network(n) for n in ("64:ff9b::/96", "::ffff:0:0:0/96", "::/96")
)

# A scheme needs two or more characters, so a Windows drive letter ("C:\\x") stays a path.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_DATA_URL_SHOWN = 40
_URL_SHOWN = 200
# base64 payloads above this size are decoded in a worker thread, not on the loop.
_DATA_URL_THREAD_BYTES = 1 << 20


@dataclass(frozen=True)
class FetchStatistics:
    """A snapshot of a :class:`MediaFetcher`'s counters."""

    #: ``fetch()`` calls started
    requests: int
    #: bytes returned by successful fetches (all source kinds)
    bytes_downloaded: int
    #: failed fetches by exception class name
    errors: types.MappingProxyType[str, int]
    #: ``fetch()`` calls running now
    in_flight: int
    #: HTTP redirects followed
    redirects: int
    #: GETs sent again after the server closed the connection before any response (a pooled
    #: keep-alive connection it had just timed out); once per hop
    retries: int = 0


def address_refusal(address: IPAddress, config: FetchConfig) -> str | None:
    """Why ``config`` refuses a connection to ``address`` ("loopback", "metadata", ...); None if
    it is allowed."""
    embedded = _embedded_ipv4(address)
    candidates = (address,) if embedded is None else (address, embedded)
    for net in config.allowed_networks:
        if any(a in net for a in candidates):
            return None
    kind = _address_kind(embedded if embedded is not None else address)
    if kind is None:
        return None
    if kind == "loopback" and config.allow_loopback:
        return None
    if kind in ("private", "link-local") and config.allow_private_addresses:
        return None
    return kind


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    # An IPv4 address carried in IPv6 (mapped, 6to4, NAT64) reaches that IPv4 host, so it is
    # judged as that host: ::ffff:169.254.169.254 is the metadata service.
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if int(address) <= 1:  # :: and ::1 are themselves, not 0.0.0.0 and 0.0.0.1
        return None
    if any(address in net for net in _EMBEDDING_NETWORKS):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _address_kind(address: IPAddress) -> str | None:
    if address in METADATA_ADDRESSES:
        return "metadata"
    if address.is_unspecified:
        # Linux connects 0.0.0.0 to the local host, so it is never a loopback opt-in.
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_multicast:
        return "multicast"
    if address.is_link_local:
        return "link-local"
    if any(address in net for net in _PRIVATE_NETWORKS):
        return "private"
    if not address.is_global:
        return "reserved"
    return None


class _RefusedAddress(Exception):
    """Raised inside the transport; :meth:`MediaFetcher.fetch` turns it into a
    BlockedAddressError that names the URL."""

    def __init__(self, host: str, address: IPAddress, kind: str) -> None:
        self.host = host
        self.address = address
        self.kind = kind
        super().__init__(f"{host} resolves to {address} ({kind})")


class _GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """Resolves once, checks every address, connects only to a checked address."""

    def __init__(self, config: FetchConfig) -> None:
        self._config = config
        self._inner = httpcore.AnyIOBackend()
        # Resolution blocks a thread; the fetcher's own limiter keeps a slow resolver from
        # taking anyio's default pool, which local reads and hashing share.
        self._dns_limiter = anyio.CapacityLimiter(config.dns_threads)

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        deadline = None if timeout is None else anyio.current_time() + timeout
        host = host.strip("[]")
        with anyio.move_on_after(timeout) as scope:
            addresses = await self._resolve(host, port)
        if scope.cancelled_caught:
            raise httpcore.ConnectTimeout(f"resolving {host!r} took longer than {timeout} s")
        for address in addresses:
            kind = address_refusal(address, self._config)
            if kind is not None:
                raise _RefusedAddress(host, address, kind)
        last: Exception | None = None
        for address in addresses:
            remaining = None if deadline is None else max(deadline - anyio.current_time(), 0.0)
            try:
                return await self._inner.connect_tcp(
                    str(address),
                    port,
                    timeout=remaining,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except httpcore.ConnectError as exc:  # try the next address, as getaddrinfo users do
                last = exc
        assert last is not None
        raise last

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            pass
        try:
            infos = await anyio.to_thread.run_sync(
                _lookup, host, port, limiter=self._dns_limiter, abandon_on_cancel=True
            )
        except (OSError, UnicodeError) as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
        addresses: list[IPAddress] = []
        for family, _type, _proto, _name, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if address not in addresses:
                addresses.append(address)
        if not addresses:
            raise httpcore.ConnectError(f"{host!r} has no IPv4 or IPv6 address")
        return addresses

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not fetched")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, config: FetchConfig, limits: httpx.Limits) -> None:
        ssl_context = httpx.create_ssl_context(trust_env=False)
        super().__init__(verify=ssl_context, trust_env=False, limits=limits)
        # httpx has no public hook for the connect step, so the pool it just built (nothing is
        # opened yet) is replaced by the same pool on the guarded network backend.
        # tests/media/test_fetch.py::test_hostname_resolving_to_loopback_is_refused fails if
        # httpx ever stops sending requests through ``_pool``.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_GuardedNetworkBackend(config),
        )


class _State(enum.Enum):
    UNOPENED = "unopened"  # created; ``async with`` (or ``__aenter__``) not yet called
    OPENED = "opened"  # fetches are accepted (the HTTP client is made at the first network one)
    CLOSED = "closed"  # ``aclose()`` ran; the fetcher cannot be reopened


def _shown(url: str) -> str:
    """The URL as error messages show it: data URLs cut short, credentials masked
    (:func:`aiomm.redaction.redact`, malformed URLs included)."""
    if url[:5].lower() == "data:":
        return url[:_DATA_URL_SHOWN] + ("..." if len(url) > _DATA_URL_SHOWN else "")
    url = redact(url, source=url)
    return url[:_URL_SHOWN] + ("..." if len(url) > _URL_SHOWN else "")


class MediaFetcher:
    """Turns an image source into its encoded bytes; an async resource owning one HTTP client.

    Use ``async with MediaFetcher(config) as fetcher: data = await fetcher.fetch(source)``.
    Safe to share between tasks of one event loop.
    """

    def __init__(self, config: FetchConfig | None = None) -> None:
        self.config = config if config is not None else FetchConfig()
        self._state = _State.UNOPENED
        self._client: httpx.AsyncClient | None = None
        self._requests = 0
        self._bytes = 0
        self._errors: Counter[str] = Counter()
        self._in_flight = 0
        self._redirects = 0
        self._retries = 0

    async def __aenter__(self) -> MediaFetcher:
        if self._state is not _State.UNOPENED:
            raise RuntimeError(
                f"a MediaFetcher can be opened once; this one is {self._state.value}"
            )
        # the HTTP client (its TLS context loads the CA bundle: a tenth of a second) is made at
        # the first network fetch, so an engine serving files and inline images never waits on it
        self._state = _State.OPENED
        return self

    def _http_client(self) -> httpx.AsyncClient:
        if self._client is not None:
            return self._client
        cfg = self.config
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self._client = httpx.AsyncClient(
            transport=_GuardedTransport(cfg, limits),
            follow_redirects=False,
            # pool=None: waiting for a free connection is bounded by total_timeout instead.
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout,
                read=cfg.read_timeout,
                write=cfg.read_timeout,
                pool=None,
            ),
            # Never proxies or .netrc credentials from the environment: a proxy would connect
            # on our behalf and bypass the address guard.
            trust_env=False,
            # One client serves every request's URLs, so no cookie set by one source may be
            # sent with another's request.
            cookies=_no_cookies(),
            headers={"User-Agent": cfg.user_agent, "Accept-Encoding": "identity"},
        )
        return self._client

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client and its connections; idempotent."""
        self._state = _State.CLOSED
        client, self._client = self._client, None
        if client is not None:
            with anyio.move_on_after(5, shield=True):
                await client.aclose()

    def statistics(self) -> FetchStatistics:
        """Return a snapshot of the counters."""
        return FetchStatistics(
            requests=self._requests,
            bytes_downloaded=self._bytes,
            errors=types.MappingProxyType(dict(self._errors)),
            in_flight=self._in_flight,
            redirects=self._redirects,
            retries=self._retries,
        )

    async def fetch(self, source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> bytes:
        """Return the encoded bytes of ``source``.

        ``source`` is an ``http(s)://`` URL, a ``data:`` URL, a ``file:`` URL, a local path (a
        string or path-like; a relative one is taken relative to the working directory, and
        must lie, links resolved, under ``allowed_local_root`` or one of ``allowed_local_paths``),
        or bytes (returned as they are, size-capped).

        :raises InvalidSourceError: malformed URL or data URL, or an unsupported scheme or type.
        :raises BlockedAddressError: the host, or a redirect's host, resolves to a refused address
            or is not one of ``allowed_media_domains``.
        :raises PathNotAllowedError: a local path outside ``allowed_local_root`` and
            ``allowed_local_paths``.
        :raises DownloadTooLargeError: more than ``max_bytes``.
        :raises TooManyRedirectsError: more than ``max_redirects`` redirects.
        :raises FetchTimeoutError: connect, read or total timeout.
        :raises HTTPStatusError: a non-2xx final status (``status_code`` holds it).
        :raises FetchError: anything else that kept the bytes from arriving.
        """
        if self._state is not _State.OPENED:
            raise RuntimeError(
                f"this MediaFetcher is {self._state.value}; use `async with MediaFetcher(...)`"
            )
        self._requests += 1
        self._in_flight += 1
        try:
            data = await self._fetch(source)
        except AiommError as exc:
            self._errors[type(exc).__name__] += 1
            raise
        finally:
            self._in_flight -= 1
        self._bytes += len(data)
        return data

    async def _fetch(self, source: Any) -> bytes:
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            self._check_size(len(data), "in-memory bytes")
            return data
        if isinstance(source, os.PathLike):
            path = Path(os.fsdecode(os.fspath(source)))
            return await self._read_local(path, shown=str(path))
        if not isinstance(source, str):
            raise InvalidSourceError(
                f"unsupported source type {type(source).__name__}; expected a URL, a path or bytes"
            )
        match = _SCHEME.match(source)
        scheme = match.group(1).lower() if match else None
        if scheme is None:
            return await self._read_local(Path(source), shown=source)
        if scheme in ("http", "https"):
            with anyio.move_on_after(self.config.total_timeout):
                return await self._fetch_http(source)
            raise FetchTimeoutError(
                f"download took longer than {self.config.total_timeout} s", source=_shown(source)
            )
        if scheme == "data":
            return await self._decode_data_url(source)
        if scheme == "file":
            return await self._read_local(_file_url_path(source), shown=_shown(source))
        raise InvalidSourceError(
            f"unsupported URL scheme {scheme!r}; expected http, https, data or file",
            source=_shown(source),
        )

    def _check_size(self, size: int, what: str, source: str | None = None) -> None:
        if size > self.config.max_bytes:
            raise DownloadTooLargeError(
                f"{what} is {size} bytes, above the limit of {self.config.max_bytes} bytes",
                source=source,
            )

    # -- http(s) -------------------------------------------------------------------------------

    async def _fetch_http(self, url: str) -> bytes:
        client = self._http_client()
        current = url
        redirects = 0
        retried = answered = False
        while True:
            target = _parse_http_url(current, first=redirects == 0)
            self._check_domain(target, url, current, redirects)
            try:
                async with client.stream("GET", target) as response:
                    answered = True
                    if response.has_redirect_location:
                        if redirects == self.config.max_redirects:
                            raise TooManyRedirectsError(
                                f"more than {self.config.max_redirects} redirects",
                                source=_shown(url),
                            )
                        location = response.headers["Location"]
                        current = urljoin(str(response.url), location)
                        redirects += 1
                        retried = answered = False
                        self._redirects += 1
                        log.debug(
                            "fetch.redirect", url=_shown(url), hop=redirects, to=_shown(current)
                        )
                        continue
                    if not response.is_success:
                        raise HTTPStatusError(response.status_code, _shown(current))
                    return await self._read_body(response, _shown(current))
            except _RefusedAddress as exc:
                log.warning(
                    "fetch.refused_address",
                    url=_shown(current),
                    host=exc.host,
                    address=str(exc.address),
                    kind=exc.kind,
                )
                hop = f"redirect {redirects} of {_shown(url)}: " if redirects else ""
                raise BlockedAddressError(
                    f"{hop}{exc.host} resolves to {exc.address}, a {exc.kind} address the "
                    "fetcher does not connect to",
                    source=_shown(current),
                ) from None
            except httpx.TimeoutException as exc:
                raise FetchTimeoutError(self._timeout_message(exc), source=_shown(current)) from exc
            except httpx.InvalidURL as exc:
                # httpx also parses a redirect's Location while building ``next_request``
                raise InvalidSourceError(
                    f"invalid URL or redirect Location: {exc}", source=_shown(current)
                ) from exc
            except httpx.RemoteProtocolError as exc:
                if answered or retried:
                    raise self._fetch_error(exc, url, current, redirects) from exc
                # No response at all: most likely a keep-alive connection the server closed as
                # the request went out. A GET may be sent again, once, on a new connection.
                retried = True
                self._retries += 1
                log.debug("fetch.retry", url=_shown(current), error=str(exc))
            except httpx.HTTPError as exc:
                raise self._fetch_error(exc, url, current, redirects) from exc

    def _check_domain(self, target: httpx.URL, url: str, current: str, redirects: int) -> None:
        domains = self.config.allowed_media_domains
        if not domains:
            return
        host = _host_name(target.raw_host.decode("ascii", "replace"))
        if host in domains:
            return
        hop = f"redirect {redirects} of {_shown(url)}: " if redirects else ""
        raise BlockedAddressError(
            f"{hop}host {host[:80]!r} is not one of the allowed media domains "
            f"({', '.join(domains)})",
            source=_shown(current),
        )

    @staticmethod
    def _fetch_error(exc: httpx.HTTPError, url: str, current: str, redirects: int) -> FetchError:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        hop = f" (redirect {redirects} of {_shown(url)})" if redirects else ""
        return FetchError(f"HTTP GET failed{hop}: {detail}", source=_shown(current))

    async def _read_body(self, response: httpx.Response, shown: str) -> bytes:
        limit = self.config.max_bytes
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit():
            self._check_size(int(declared), "the declared Content-Length", shown)
        try:
            decoder = body_decoder(response.headers.get("Content-Encoding"), limit)
        except EncodingRefused as exc:
            raise FetchError(str(exc), source=shown) from None
        chunks: list[bytes] = []
        wire = 0
        # Raw bytes, decoded here: httpx would inflate each chunk whole, past any cap.
        async for chunk in response.aiter_raw():
            wire += len(chunk)
            # abort mid-stream: the rest of an oversized body is never read
            self._check_size(wire, "the body read so far", shown)
            try:
                piece = decoder.feed(chunk)
            except InflateLimitExceeded:
                raise DownloadTooLargeError(
                    f"the {decoder.encoding}-encoded body inflates past the limit of {limit} "
                    f"bytes ({wire} bytes received)",
                    source=shown,
                ) from None
            except zlib.error as exc:
                raise FetchError(
                    f"corrupt {decoder.encoding}-encoded body: {exc}", source=shown
                ) from None
            if piece:
                chunks.append(piece)
        return b"".join(chunks)

    def _timeout_message(self, exc: httpx.TimeoutException) -> str:
        if isinstance(exc, httpx.ConnectTimeout):
            return f"connecting took longer than {self.config.connect_timeout} s"
        if isinstance(exc, httpx.ReadTimeout):
            return f"no data received for {self.config.read_timeout} s"
        if isinstance(exc, httpx.WriteTimeout):
            return f"sending the request took longer than {self.config.read_timeout} s"
        return f"timed out ({type(exc).__name__})"

    # -- data: ---------------------------------------------------------------------------------

    async def _decode_data_url(self, url: str) -> bytes:
        shown = _shown(url)
        header, comma, payload = url[5:].partition(",")
        if not comma:
            raise InvalidSourceError("malformed data URL: no ',' before the payload", source=shown)
        params = [p.strip().lower() for p in header.split(";")]
        if params[-1] != "base64":
            data = unquote_to_bytes(payload)
            self._check_size(len(data), "the data URL payload", shown)
            return data
        # Estimate first, so an oversized payload is refused without decoding it.
        self._check_size(len(payload) // 4 * 3 - payload[-2:].count("="), "data URL", shown)
        try:
            if len(payload) > _DATA_URL_THREAD_BYTES:
                data = await anyio.to_thread.run_sync(_b64decode, payload)
            else:
                data = _b64decode(payload)
        except (binascii.Error, ValueError) as exc:
            raise InvalidSourceError(
                f"malformed base64 in the data URL's {len(payload)}-character payload: {exc}",
                source=shown,
            ) from exc
        self._check_size(len(data), "the data URL payload", shown)
        return data

    # -- local files ---------------------------------------------------------------------------

    async def _read_local(self, path: Path, *, shown: str) -> bytes:
        cfg = self.config
        roots = (cfg.allowed_local_root, *cfg.allowed_local_paths)
        allowed = tuple(r for r in roots if r is not None)
        if not allowed:
            raise PathNotAllowedError(
                f"local paths and file: URLs are disabled: {cfg.local_root_setting} is not set "
                "(it names the folder they may be read from)",
                source=shown,
            )
        return await anyio.to_thread.run_sync(
            _read_under_root, path, allowed, cfg.max_bytes, shown, cfg.local_root_setting
        )


def _lookup(host: str, port: int) -> list[Any]:
    """Worker thread: the system resolver's answers for ``host`` (IDNA-encoded, as anyio does)."""
    encoded = host.encode("idna").decode("ascii") if not host.isascii() else host
    return socket.getaddrinfo(encoded, port, type=socket.SOCK_STREAM)


def _no_cookies() -> http.cookiejar.CookieJar:
    return http.cookiejar.CookieJar(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def _parse_http_url(url: str, *, first: bool) -> httpx.URL:
    what = "URL" if first else "redirect target"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise InvalidSourceError(f"invalid {what}: {exc}", source=_shown(url)) from exc
    if parsed.scheme not in ("http", "https"):
        # A redirect may not leave http(s): never to file:, data: or anything else.
        raise InvalidSourceError(
            f"{what} has scheme {parsed.scheme!r}; only http and https are fetched",
            source=_shown(url),
        )
    if not parsed.host:
        raise InvalidSourceError(f"{what} has no host", source=_shown(url))
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise InvalidSourceError(
            f"{what} has port {parsed.port}, outside 1..65535", source=_shown(url)
        )
    if not _valid_host(parsed.raw_host.decode("ascii", "replace")):  # IDNA names in ASCII
        raise InvalidSourceError(
            f"{what} has an invalid host {parsed.host[:80]!r}", source=_shown(url)
        )
    return parsed


# A DNS name as resolvers take it (underscores included, as some internal names have them).
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def _host_name(host: str) -> str:
    """A URL's host as :attr:`FetchConfig.allowed_media_domains` holds them."""
    host = host.strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_HOST_LABEL.match(label) for label in name.split("."))


# pybase64's and the stdlib's b64decode differ in their signatures beyond the call below
_fast_b64decode: Callable[..., bytes]
try:  # SIMD base64 (the ``serve`` extra): ~0.1 ms a megabyte where the stdlib's takes ~6 ms
    from pybase64 import b64decode as _fast_b64decode
except ImportError:  # pragma: no cover
    _fast_b64decode = base64.b64decode


def _b64decode(payload: str) -> bytes:
    return _fast_b64decode(payload, validate=True)


def _file_url_path(url: str) -> Path:
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. "file://[x/y": an unclosed IPv6 bracket
        raise InvalidSourceError(f"invalid file URL: {exc}", source=_shown(url)) from exc
    if parts.netloc not in ("", "localhost"):
        raise InvalidSourceError(
            f"file URL names host {parts.netloc.rpartition('@')[2]!r}; only local files are read",
            source=_shown(url),
        )
    if parts.query or parts.fragment:
        raise InvalidSourceError("file URL has a query or fragment", source=_shown(url))
    return Path(unquote(parts.path))


class _LinkSwapped(OSError):
    """A component of an already-resolved path is now a symbolic link."""


def _open_beneath(root: Path, relative: Path) -> int:
    """Open ``root / relative`` for reading, following no link after ``root``.

    ``relative`` was resolved (its links followed and checked) just before; walking it again one
    component at a time with ``O_NOFOLLOW``, each opened relative to its parent's descriptor,
    means a link swapped in since the check is refused instead of followed out of the root.
    """
    # O_NONBLOCK: opening a FIFO would otherwise block this thread until a writer appears.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    parts = relative.parts
    if os.open not in os.supports_dir_fd or not hasattr(os, "O_NOFOLLOW"):
        return os.open(root.joinpath(*parts), flags)  # pragma: no cover - not on Linux/macOS
    nofollow = os.O_NOFOLLOW
    directory = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow
    dir_fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        if not parts:  # the root itself: a directory, refused by the caller's fstat
            return os.dup(dir_fd)
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, directory, dir_fd=dir_fd)
            except OSError as exc:
                _raise_if_link(exc, part, dir_fd)
                raise
            os.close(dir_fd)
            dir_fd = next_fd
        try:
            return os.open(parts[-1], flags | nofollow, dir_fd=dir_fd)
        except OSError as exc:
            _raise_if_link(exc, parts[-1], dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _raise_if_link(exc: OSError, name: str, dir_fd: int) -> None:
    # O_NOFOLLOW on a link fails with ELOOP (ENOTDIR with O_DIRECTORY); a plain file in a
    # directory's place fails with ENOTDIR too, and is not a link.
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        return
    try:
        is_link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return
    if is_link:
        raise _LinkSwapped(exc.errno, exc.strerror) from exc


def _read_under_root(
    path: Path, roots: tuple[Path, ...], max_bytes: int, shown: str, setting: str
) -> bytes:
    """Worker thread: read ``path`` (a relative one taken relative to the working directory) if,
    symlinks and ``..`` resolved, it lies under one of ``roots`` (folders, or single files)."""
    try:
        resolved = (path if path.is_absolute() else Path(os.getcwd()) / path).resolve()
        real_roots = [root.resolve() for root in roots]
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop before Python 3.13
        raise FetchError(f"cannot resolve the path: {exc}", source=shown) from exc
    except ValueError as exc:  # e.g. an embedded NUL
        raise InvalidSourceError(f"invalid path: {exc}", source=shown) from exc
    beneath: tuple[Path, Path] | None = None
    for real_root in real_roots:
        if resolved == real_root and not real_root.is_dir():  # a single file allowed by name
            beneath = (real_root.parent, Path(real_root.name))
            break
        if resolved.is_relative_to(real_root):
            beneath = (real_root, resolved.relative_to(real_root))
            break
    # The roots themselves are not shown: they are the server's layout, not the caller's business.
    if beneath is None:
        raise PathNotAllowedError(
            f"path is outside the allowed local root (see {setting})", source=shown
        )
    try:
        fd = _open_beneath(*beneath)
    except FileNotFoundError as exc:
        raise FetchError("no such file", source=shown) from exc
    except _LinkSwapped as exc:
        raise PathNotAllowedError(
            "a link appeared in the path while it was opened (refused, not followed)",
            source=shown,
        ) from exc
    except OSError as exc:
        raise FetchError(f"cannot open the file: {exc.strerror}", source=shown) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FetchError("not a regular file", source=shown)
        if st.st_size > max_bytes:
            raise DownloadTooLargeError(
                f"file is {st.st_size} bytes, above the limit of {max_bytes} bytes", source=shown
            )
    except BaseException:
        os.close(fd)
        raise
    with open(fd, "rb", closefd=True) as f:
        # read one byte past the cap: the file may have grown since fstat
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise DownloadTooLargeError(f"file is more than {max_bytes} bytes, the limit", source=shown)
    return data
