"""What ``aiomm serve`` configures: :class:`ServerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiomm.config import EngineConfig
from aiomm.server.render import RenderLimits

__all__ = ("ENCODE_ON_SEND_CORES", "ServerConfig", "encode_on_send")


@dataclass(frozen=True)
class ServerConfig:
    """What ``aiomm serve`` configures."""

    #: a model folder, or a registered short name (its offline folder:
    #: :func:`aiomm.server.state.model_folder`)
    model: str
    #: the model id vLLM hashes items with: the model path as given to vLLM (default: ``model``)
    model_id: str | None = None
    served_model_names: tuple[str, ...] = ()
    upstream: str | None = None
    max_body_bytes: int = 64 << 20
    limits: RenderLimits = field(default_factory=RenderLimits)
    #: ``file:`` URLs are read under this folder (vLLM's ``--allowed-local-media-path``); None:
    #: refused, the refusal naming that flag
    allowed_local_media_path: str | None = None
    #: hosts ``http(s)`` media URLs may name (vLLM's ``--allowed-media-domains``;
    #: ``FetchConfig.allowed_media_domains``); empty: any host
    allowed_media_domains: tuple[str, ...] = ()
    #: fetch media from loopback and private networks too (``--allow-private-networks``:
    #: ``FetchConfig.allow_loopback`` and ``allow_private_addresses``); cloud metadata
    #: addresses stay refused
    allow_private_networks: bool = False
    #: a Redis item cache shared by every replica (``redis://HOST:PORT/DB``; see
    #: ``EngineConfig.shared_cache_url``), set on the engine's configuration
    shared_cache_url: str | None = None
    #: the directory the workers of ``--workers N`` share items through (``serve`` makes it;
    #: see ``EngineConfig.peer_cache_dir``), set on the engine's configuration
    peer_cache_dir: str | None = None
    #: the engine's transform threads per process (``EngineConfig.transform_threads``); None:
    #: the engine's default, one per core
    transform_threads: int | None = None
    #: of those, the threads that run at once while two or more requests are in flight
    #: (``EngineConfig.busy_transform_threads``); None: the engine's (all of them).
    #: :func:`~aiomm.server.serve.serve` gives each of ``--workers N`` its share of the cores
    busy_transform_threads: int | None = None
    #: bytes of items the server caches in memory (``EngineConfig.cache_capacity_bytes``), all of
    #: its processes together: :func:`~aiomm.server.serve.serve` gives each of ``--workers N`` an
    #: N-th, since the workers read each other's items; 0: nothing in memory (a Redis tier still
    #: caches); None: the engine's default (4 GiB, vLLM's ``--mm-processor-cache-gb`` default,
    #: which vLLM gives each process) in all
    cache_bytes: int | None = None
    #: fault in this process's cache budget before serving
    #: (:func:`aiomm.tuning.malloc.pretouch_heap`; ``aiomm serve --cache-pretouch``): the
    #: cache's growth then costs no page faults while it serves; the process holds the budget's
    #: memory from its start
    cache_pretouch: bool = False
    #: make each item's base64 on the event loop while the response sends it, each piece
    #: written while still in the core's cache (``True``), or whole in the encode threads
    #: before the response starts (``False``); None: on when this process's share of the cores
    #: is at most 2 (:data:`ENCODE_ON_SEND_CORES`), where the loop has time to spare; with more
    #: cores per process the encode threads spread the base64 over them.
    #: :func:`~aiomm.server.serve.serve` gives each of ``--workers N`` its share
    encode_on_send: bool | None = None
    #: the engine's configuration (its ``fetch`` is the URL policy; ``return_items`` is forced);
    #: None: ``EngineConfig(device="cpu")``
    engine: EngineConfig | None = None
    #: the server owns its process (``aiomm serve``): the engine takes every process-wide
    #: setting measured worth it (:func:`aiomm.tuning.tuned`); off for an app mounted in
    #: another application, which leaves its host's process alone
    tuned: bool = False
    #: keys a client must send as ``Authorization: Bearer KEY`` on the paths vLLM guards
    #: (``/v1``, ``/v2``, ``/inference``, ``/cohere``; :mod:`.auth`), any one of them; empty: no
    #: key. ``aiomm serve`` takes them from ``--api-key`` or ``VLLM_API_KEY``, as vLLM does;
    #: this field reads no environment. Left out of the repr
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    #: the upstream engine's own key (its ``--api-key``), sent as ``Authorization: Bearer`` on
    #: every gateway request to it; never one of ``api_keys`` a client sent. Left out of the repr
    upstream_api_key: str | None = field(default=None, repr=False)
    #: ``/ready``: how long each dependency check (the upstream's ``/health``, a Redis ``PING``)
    #: may take, and how long its report is reused by the probes that follow (:mod:`.readiness`)
    ready_timeout_s: float = 0.5
    ready_cache_s: float = 1.0


#: :attr:`ServerConfig.encode_on_send` is on by default up to this many cores per process
ENCODE_ON_SEND_CORES = 2


def encode_on_send(config: ServerConfig, cores: int) -> bool:
    """``config``'s :attr:`ServerConfig.encode_on_send`, or when unset its default for a process
    with ``cores`` of its own."""
    if config.encode_on_send is not None:
        return config.encode_on_send
    return cores <= ENCODE_ON_SEND_CORES
