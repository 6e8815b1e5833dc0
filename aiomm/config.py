"""Every configuration record of aiomm: frozen dataclasses with defaults that suit a serving host.

A leaf module: it imports only the standard library and :mod:`aiomm.errors`, so building a
configuration loads neither torch, httpx nor transformers. The stages re-export their record
(``aiomm.media.fetch.FetchConfig`` is :class:`FetchConfig`).
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from aiomm.errors import ConfigError

__all__ = (
    "DEFAULT_FORMATS",
    "DEFAULT_MAX_PIXELS",
    "DecodeConfig",
    "EngineConfig",
    "FetchConfig",
    "Fidelity",
    "MultiModalConfig",
    "SharedCacheConfig",
    "TransformMode",
    "VisualDtype",
    "available_cores",
)

VisualDtype = Literal["bfloat16", "float16", "float32"]
TransformMode = Literal["auto", "hf", "native"]
Fidelity = Literal["exact", "fast"]
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Pillow's decompression-bomb limit (``2 * PIL.Image.MAX_IMAGE_PIXELS``, 178,956,970 pixels),
#: which is also vLLM's ``VLLM_MAX_IMAGE_PIXELS`` default: any photo vLLM takes is taken. Memory
#: is bounded by ``EngineConfig.max_decoded_bytes_in_flight`` and ``max_pixels_per_byte``, not by
#: refusing large photos (the processors scale them down).
DEFAULT_MAX_PIXELS = 178_956_970
#: Pillow formats decoded by default; a name whose plugin is not installed is skipped.
DEFAULT_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "HEIF")

_VISUAL_DTYPES = ("bfloat16", "float16", "float32")
_TRANSFORM_MODES = ("auto", "hf", "native")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def _is_int(value: object) -> bool:
    # bool is an int subclass, but ``max_bytes=True`` is a mistake, not the number 1
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(owner: object, name: str, *, minimum: int, optional: bool = False) -> None:
    value = getattr(owner, name)
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        got = f"{value!r} ({type(value).__name__})"
        raise ConfigError(
            f"{type(owner).__name__}.{name} must be an integer >= {minimum}"
            f"{' or None' if optional else ''}, got {got}"
        )


def _check_positive_number(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"{type(owner).__name__}.{name} must be a positive number of seconds, got "
            f"{value!r} ({type(value).__name__})"
        )


def _check_choice(owner: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(owner, name)
    if value not in choices:
        raise ConfigError(
            f"{type(owner).__name__}.{name} must be one of {', '.join(map(repr, choices))}, "
            f"got {value!r}"
        )


@dataclass(frozen=True)
class FetchConfig:
    """Limits and the address policy of a :class:`~aiomm.media.fetch.MediaFetcher`.

    Address policy: public addresses are allowed. Loopback needs ``allow_loopback``; private
    (RFC 1918, CGNAT, unique-local) and link-local need ``allow_private_addresses``. Cloud
    metadata (:data:`aiomm.media.fetch.METADATA_ADDRESSES`), unspecified (``0.0.0.0``, ``::``),
    multicast and reserved/documentation ranges are always refused. ``allowed_networks``
    overrides all of it: an address inside one of those networks is allowed whatever its kind.

    :raises ConfigError: a non-positive timeout or size, a negative redirect limit, or a string in
        ``allowed_networks`` that is not a network.
    """

    #: seconds to resolve the host and open the TCP (and TLS) connection
    connect_timeout: float = 5.0
    #: seconds without receiving any data
    read_timeout: float = 10.0
    #: seconds for the whole fetch, redirects included (bounds slow-drip servers)
    total_timeout: float = 60.0
    #: largest body accepted, for every source kind
    max_bytes: int = 64 * 2**20
    #: redirects followed before TooManyRedirectsError
    max_redirects: int = 3
    allow_loopback: bool = False
    allow_private_addresses: bool = False
    #: networks always allowed (strings are parsed), e.g. ``("10.1.0.0/16",)`` for an internal CDN
    allowed_networks: tuple[IPNetwork, ...] = ()
    #: host names an ``http(s)`` URL (and each redirect's target) may name, compared exactly
    #: and case-insensitively, as vLLM's ``--allowed-media-domains`` does; empty: any host. The
    #: address policy above still applies to the hosts listed
    allowed_media_domains: tuple[str, ...] = ()
    #: local paths and ``file:`` URLs are read only under this directory (symlinks resolved);
    #: None refuses them all unless ``allowed_local_paths`` names some. A relative root is taken
    #: relative to the working directory when the configuration is made; a relative *source*
    #: path relative to the working directory when it is fetched
    allowed_local_root: Path | None = None
    #: further folders or single files local sources may be read from, beside
    #: ``allowed_local_root`` (``aiomm run``: the ones named on its command line)
    allowed_local_paths: tuple[Path, ...] = ()
    #: how a refused local path names the setting that allows it (``aiomm serve``:
    #: ``--allowed-local-media-path``; ``aiomm run``: ``--allowed-root``)
    local_root_setting: str = "FetchConfig.allowed_local_root"
    user_agent: str = "aiomm/0.1"
    #: threads resolving host names at once (the fetcher's own pool, not anyio's default one)
    dns_threads: int = 8

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "total_timeout"):
            _check_positive_number(self, name)
        _check_int(self, "max_bytes", minimum=1)
        _check_int(self, "dns_threads", minimum=1)
        _check_int(self, "max_redirects", minimum=0)
        networks: list[IPNetwork] = []
        for i, net in enumerate(self.allowed_networks):
            try:
                networks.append(ipaddress.ip_network(net))
            except (ValueError, TypeError) as exc:
                raise ConfigError(
                    f"FetchConfig.allowed_networks[{i}]={net!r} ({type(net).__name__}) is not an "
                    f"IPv4 or IPv6 network: {exc}"
                ) from exc
        object.__setattr__(self, "allowed_networks", tuple(networks))
        object.__setattr__(self, "allowed_media_domains", _domains(self.allowed_media_domains))
        if self.allowed_local_root is not None:
            root = _absolute_path(self.allowed_local_root, "FetchConfig.allowed_local_root")
            object.__setattr__(self, "allowed_local_root", root)
        paths = self.allowed_local_paths
        if isinstance(paths, (str, os.PathLike)):
            raise ConfigError(
                "FetchConfig.allowed_local_paths must be a tuple of paths, got one path: "
                "wrap it in a tuple"
            )
        object.__setattr__(
            self,
            "allowed_local_paths",
            tuple(
                _absolute_path(p, f"FetchConfig.allowed_local_paths[{i}]")
                for i, p in enumerate(paths)
            ),
        )
        if not isinstance(self.local_root_setting, str) or not self.local_root_setting:
            raise ConfigError("FetchConfig.local_root_setting must be a non-empty string")


def _absolute_path(value: object, what: str) -> Path:
    """``value`` as an absolute path: a relative one is taken relative to the working directory
    now (links and ``..`` are resolved when a path is checked against it)."""
    try:
        return Path(value).absolute()  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigError(f"{what} must be a path or None, got {type(value).__name__}") from exc


def _domains(domains: object) -> tuple[str, ...]:
    """Host names as URLs carry them: lower case, IDNA-encoded, without a trailing dot."""
    if isinstance(domains, str) or not isinstance(domains, Iterable):
        raise ConfigError(
            "FetchConfig.allowed_media_domains must be a tuple of host names, got "
            f"{type(domains).__name__} (one string: wrap it in a tuple)"
        )
    out: list[str] = []
    for i, domain in enumerate(domains):
        name = domain.strip().strip("[]").rstrip(".").lower() if isinstance(domain, str) else ""
        try:  # an IP address literal, as a URL may name its host
            out.append(ipaddress.ip_address(name).compressed)
            continue
        except ValueError:
            pass
        try:
            name = name.encode("idna").decode("ascii") if not name.isascii() else name
        except UnicodeError:
            name = ""
        if not name or any(c in name for c in "/:@ "):
            raise ConfigError(
                f"FetchConfig.allowed_media_domains[{i}]={domain!r} is not a host name (give "
                "the host only: example.com, not https://example.com/)"
            )
        out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class DecodeConfig:
    """Limits of the decode stage.

    :raises ConfigError: ``max_pixels`` or ``max_pixels_per_byte`` not a positive integer or
        None, ``pillow_blocks_kept`` < 0, ``max_video_frames``, ``max_video_bytes``,
        ``max_audio_bytes`` or ``max_audio_decode_bytes`` not a positive integer,
        ``max_audio_duration_s`` not positive, ``formats`` not a tuple of format names, or
        ``fidelity`` not ``exact`` or ``fast``.
    """

    #: largest ``width * height`` decoded; larger images raise ImageTooLargeError unread.
    #: None: :data:`DEFAULT_MAX_PIXELS`, Pillow's own bomb limit and vLLM's default (a lower
    #: limit suits a deployment that wants to refuse large photos rather than downsize them)
    max_pixels: int | None = None
    #: Pillow formats opened (``PIL.Image.open``'s ``formats``); every other plugin is off, so
    #: e.g. EPS (which runs Ghostscript) is never reached. Names without a plugin are skipped.
    formats: tuple[str, ...] = DEFAULT_FORMATS
    #: largest pixels per encoded byte of an image above 4 Mi pixels: a few bytes claiming
    #: millions of pixels are a bomb (deflate, the best ratio of these formats on real images,
    #: packs about 8 thousand 1-bit pixels into a byte). None: no limit.
    max_pixels_per_byte: int | None = 8192
    #: Pillow image-memory blocks (16 MiB each by default) kept for reuse between decodes,
    #: process-wide (:mod:`aiomm.tuning.pillow`): without them every decode maps fresh memory
    #: that the kernel zero-fills page by page, about a fifth of a JPEG decode. The engine raises
    #: Pillow's setting to this while it is open. None (the default): Pillow's setting is left
    #: alone; :func:`aiomm.tuning.tuned` asks for four per transform thread.
    pillow_blocks_kept: int | None = None
    #: ``exact`` (the default): outputs bit-identical to the HF processor. ``fast`` (opt-in):
    #: a JPEG whose resize target is at most half its size in both dimensions is decoded at a
    #: reduced scale in the DCT domain (libjpeg, Pillow's ``draft``; 1/2, 1/4 or 1/8, never below
    #: the target), then resized exactly to the same target; close to exact (PSNR above 40 dB
    #: on photos, measured by ``aiomm bench --sizes``), not equal. Needs the native transform.
    fidelity: Fidelity = "exact"
    #: sampled frames a video may keep (more raise VideoTooLargeError before any decode);
    #: HF Qwen-VL's ``max_frames``
    max_video_frames: int = 768
    #: decoded bytes of a video's sampled frames at most (``frames * height * width * 3``);
    #: also bounded by ``EngineConfig.max_decoded_bytes_in_flight`` while being decoded
    max_video_bytes: int = 1 << 30
    #: seconds of audio decoded at most (longer raise AudioTooLongError, from the header where
    #: it tells); vLLM's ``VLLM_MAX_AUDIO_DECODE_DURATION_S``
    max_audio_duration_s: float = 600.0
    #: encoded bytes of one audio at most (``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``, 25 MiB)
    max_audio_bytes: int = 25 * 1024 * 1024
    #: decoded PCM bytes of one audio at most, float32 at its native rate and channels
    #: (``VLLM_MAX_AUDIO_DECODE_BYTES``, 256 MiB)
    max_audio_decode_bytes: int = 268_435_456

    def resolved_max_pixels(self) -> int:
        """``max_pixels``, or :data:`DEFAULT_MAX_PIXELS` when None."""
        return DEFAULT_MAX_PIXELS if self.max_pixels is None else self.max_pixels

    def __post_init__(self) -> None:
        _check_int(self, "max_pixels", minimum=1, optional=True)
        _check_int(self, "max_pixels_per_byte", minimum=1, optional=True)
        _check_int(self, "pillow_blocks_kept", minimum=0, optional=True)
        _check_int(self, "max_video_frames", minimum=1)
        _check_int(self, "max_video_bytes", minimum=1)
        _check_int(self, "max_audio_bytes", minimum=1)
        _check_int(self, "max_audio_decode_bytes", minimum=1)
        duration = self.max_audio_duration_s
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or duration <= 0:
            raise ConfigError(
                f"DecodeConfig.max_audio_duration_s must be a positive number, got {duration!r}"
            )
        formats = self.formats
        if isinstance(formats, str) or not all(isinstance(f, str) and f for f in formats):
            raise ConfigError(
                f"DecodeConfig.formats must be a tuple of Pillow format names, got {formats!r}"
            )
        object.__setattr__(self, "formats", tuple(f.upper() for f in formats))
        if self.fidelity not in ("exact", "fast"):
            raise ConfigError(
                f"DecodeConfig.fidelity must be 'exact' or 'fast', got {self.fidelity!r}"
            )


@dataclass(frozen=True)
class MultiModalConfig:
    """Per-processor options.

    ``mm_device_do_normalize``: None takes the adapter's default (True for every supported
    architecture). When on, the transform runs with rescale and normalise disabled and
    ``pixel_values`` come out as uint8, to be normalised on the device by ``FusedMMInputNorm``.
    ``transform``: ``hf`` calls the HF processor; ``native`` runs aiomm's own uint8 transform;
    ``auto`` takes ``native`` where the adapter has one proven equal to ``hf``.

    :raises ConfigError: ``transform`` is not ``auto``, ``hf`` or ``native``.
    """

    mm_device_do_normalize: bool | None = None
    transform: TransformMode = "auto"

    def __post_init__(self) -> None:
        _check_choice(self, "transform", _TRANSFORM_MODES)


@dataclass(frozen=True)
class SharedCacheConfig:
    """Bounds and timeouts of the Redis item cache shared by replicas
    (``EngineConfig.shared_cache_url``).

    Redis's own memory is bounded by Redis (``maxmemory`` with ``allkeys-lru``); these bound what
    one engine writes and how long it waits.

    :raises ConfigError: a non-positive size, TTL or timeout.
    """

    #: seconds an item lives in Redis (renewed by nothing: a popular item is rewritten after it
    #: expires); None keeps items until Redis evicts them
    ttl_s: float | None = 24 * 3600.0
    #: items whose serialised size exceeds this stay in the local tier only
    max_item_bytes: int = 64 << 20
    #: the longest any single Redis command may take before the engine gives up on it
    op_timeout_s: float = 0.5
    #: the longest opening a connection may take
    connect_timeout_s: float = 0.5
    #: expiry of the lease a replica holds while it computes an item (renewed while it computes,
    #: so it only runs out when the replica dies or hangs)
    lease_ttl_s: float = 10.0
    #: the longest a replica waits for another replica's computation before computing itself
    lease_wait_s: float = 10.0
    #: first and last delay between polls for another replica's result (doubling in between)
    poll_min_s: float = 0.005
    poll_max_s: float = 0.1
    #: after a Redis error the tier is bypassed this long, then tried again (reconnecting)
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.ttl_s is not None:
            _check_positive_number(self, "ttl_s")
        _check_int(self, "max_item_bytes", minimum=1)
        for name in (
            "op_timeout_s",
            "connect_timeout_s",
            "lease_ttl_s",
            "lease_wait_s",
            "poll_min_s",
            "poll_max_s",
            "retry_after_s",
        ):
            _check_positive_number(self, name)
        if self.poll_max_s < self.poll_min_s:
            raise ConfigError(
                f"SharedCacheConfig.poll_max_s ({self.poll_max_s}) must be >= poll_min_s "
                f"({self.poll_min_s})"
            )


def _check_redis_url(url: object) -> None:
    if url is None:
        return
    if not isinstance(url, str):
        raise ConfigError(
            f"EngineConfig.shared_cache_url must be a redis:// URL or None, got "
            f"{type(url).__name__}"
        )
    parts = urllib.parse.urlsplit(url)
    try:
        _ = parts.port  # parsed lazily: a bad port raises here
    except ValueError as exc:
        raise ConfigError(f"EngineConfig.shared_cache_url has a bad port: {exc}") from None
    db = parts.path.lstrip("/")
    if parts.scheme != "redis" or not parts.hostname or (db and not db.isdigit()):
        raise ConfigError(
            "EngineConfig.shared_cache_url must look like redis://HOST[:PORT][/DB], got "
            f"scheme {parts.scheme!r}, host {parts.hostname!r}, path {parts.path!r}"
        )


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of an :class:`~aiomm.Engine`.

    Every queue and pool is bounded by one of these fields; none is unbounded.

    :raises ConfigError: a count or size out of range, an unknown ``visual_dtype``, or a
        ``fetch``/``decode``/``processing`` field of the wrong type.
    """

    #: worker threads for decode + resize + patchify (GIL-releasing work): one per core
    transform_threads: int = field(default_factory=available_cores)
    #: of those, the threads that run at once while two or more requests are in the pipeline
    #: (admitted and not done, downloading or cache hits included); None: all of them. A server
    #: of N processes on one host sets cores / N: under load each process then keeps its
    #: transforms to its share of the cores (two processes on 2 cores, each with two threads
    #: busy: ~15% fewer images/s than with one each at concurrency 32), while one request alone
    #: still spreads its images over every thread. Hashing and the device stage keep theirs.
    busy_transform_threads: int | None = None
    #: concurrent downloads
    fetch_concurrency: int = 32
    #: requests admitted into the pipeline at once (``process`` calls and ``stream`` slots)
    max_in_flight: int = 64
    #: requests waiting for one of those slots; one more is shed at once with OverloadedError
    #: (a server maps it to 429/503) instead of queueing without end. None: 16 per slot
    #: (``16 * max_in_flight``); 0: shed whenever every slot is taken.
    max_waiting: int | None = None
    #: bytes of decodes admitted at once, each counted at its peak (by the image's mode: about
    #: 11 bytes a pixel for RGB, 12 for 1-bit and greyscale, 24 with alpha; an in-memory array
    #: at its size); a single larger image is still admitted alone, so nothing starves
    max_decoded_bytes_in_flight: int = 1 << 30
    #: in-process cache of per-item outputs, bounded in bytes; 0 disables it (and the worker
    #: tier of ``peer_cache_dir``, which serves from it; a Redis tier still caches)
    cache_capacity_bytes: int = 4 << 30
    #: dtype of the normalised ``pixel_values`` handed to the model
    visual_dtype: VisualDtype = "bfloat16"
    #: "auto" = CUDA when available, else CPU
    device: str = "auto"
    #: pinned host staging buffers for uint8 H2D copies (also the device stage's concurrency)
    device_staging_buffers: int = 4
    #: initial size of each staging buffer; grown (powers of two) up to the maximum below
    device_staging_buffer_bytes: int = 16 << 20
    device_staging_max_buffer_bytes: int = 256 << 20
    #: on a CPU device: idle memory kept to back the next results (fresh pages for each
    #: request's tens of megabytes cost a fifth of the CPU; see
    #: ``aiomm.device.host_buffers``); 0 = off
    host_output_pool_bytes: int = 256 << 20
    #: intra-op threads of torch, set (process-wide) while the engine is open. None (the
    #: default): torch's setting is left alone. :func:`aiomm.tuning.tuned` sets 1 when several
    #: transform threads run: they already use the cores, and torch's own pool would spin on
    #: them (about half the CPU of a small image).
    torch_threads: int | None = None
    #: resize + patchify on the device (bit-exact to the CPU path): the CPU only decodes.
    #: None = on when the device is CUDA and the adapter's transform is a plain resize.
    mm_device_resize: bool | None = None
    #: let glibc's malloc reuse the large per-image buffers instead of mapping fresh pages for
    #: each (process-wide while the engine is open; see :mod:`aiomm.tuning.malloc`); skipped when
    #: ``GLIBC_TUNABLES`` sets malloc options. Off by default: a library leaves its host's malloc
    #: alone; :func:`aiomm.tuning.tuned` turns it on.
    tune_malloc: bool = False
    #: hash encoded bytes in a worker thread above this size (below it the loop is faster); a
    #: routing plan reads the header of an image below this size on the loop too
    hash_in_thread_bytes: int = 1 << 20
    #: a Redis item cache shared by every replica, behind the in-process one
    #: (``redis://HOST:PORT/DB``); None keeps the cache per process
    shared_cache_url: str | None = None
    shared_cache: SharedCacheConfig = field(default_factory=SharedCacheConfig)
    #: a directory the worker processes of one host share (``aiomm serve --workers N`` makes
    #: one): a worker that misses copies the item from the worker that computed it
    #: (:mod:`aiomm.cache.peer`). Not used with ``shared_cache_url``, which already shares items,
    #: nor with ``cache_capacity_bytes=0`` (nothing held to share).
    peer_cache_dir: str | None = None
    #: key items by ``Request.image_hashes`` when given (a hit skips the download); False hashes
    #: every image's content instead, for callers that do not trust their clients
    trust_supplied_hashes: bool = True
    #: hand back each item as processed (``Result.items``: uint8 rows where the device
    #: normalises) and skip the device stage, leaving ``Result.mm_kwargs`` empty (unless a call
    #: asks for host rows with ``process(..., device=False)``); for render tiers that ship items
    #: to a remote model engine
    return_items: bool = False
    fetch: FetchConfig = field(default_factory=FetchConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    processing: MultiModalConfig = field(default_factory=MultiModalConfig)

    def waiting_bound(self) -> int:
        """Requests that may wait for an admission slot (``max_waiting`` resolved)."""
        return 16 * self.max_in_flight if self.max_waiting is None else self.max_waiting

    def network_slots(self) -> int:
        """Admission slots requests with a network URL may hold at once: ``fetch_concurrency``,
        at most half of ``max_in_flight`` (at least one), so slow downloads never take them all."""
        return max(1, min(self.fetch_concurrency, self.max_in_flight // 2))

    def __post_init__(self) -> None:
        for name in (
            "transform_threads",
            "fetch_concurrency",
            "max_in_flight",
            "max_decoded_bytes_in_flight",
            "device_staging_buffers",
            "device_staging_buffer_bytes",
            "device_staging_max_buffer_bytes",
        ):
            _check_int(self, name, minimum=1)
        for name in ("cache_capacity_bytes", "host_output_pool_bytes", "hash_in_thread_bytes"):
            _check_int(self, name, minimum=0)
        _check_int(self, "torch_threads", minimum=1, optional=True)
        _check_int(self, "busy_transform_threads", minimum=1, optional=True)
        _check_int(self, "max_waiting", minimum=0, optional=True)
        _check_choice(self, "visual_dtype", _VISUAL_DTYPES)
        for name, expected in (
            ("fetch", FetchConfig),
            ("decode", DecodeConfig),
            ("processing", MultiModalConfig),
            ("shared_cache", SharedCacheConfig),
        ):
            value = getattr(self, name)
            if not isinstance(value, expected):
                raise ConfigError(
                    f"EngineConfig.{name} must be a {expected.__name__}, got {type(value).__name__}"
                )
        _check_redis_url(self.shared_cache_url)
        if self.peer_cache_dir is not None and not isinstance(self.peer_cache_dir, str):
            raise ConfigError(
                "EngineConfig.peer_cache_dir must be a str path or None, got "
                f"{type(self.peer_cache_dir).__name__}"
            )
        if not isinstance(self.trust_supplied_hashes, bool):
            raise ConfigError(
                "EngineConfig.trust_supplied_hashes must be a bool, got "
                f"{type(self.trust_supplied_hashes).__name__}"
            )
