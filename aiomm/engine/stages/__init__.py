"""The engine's stages: one object per job, each with its own bound and its own statistics.

A request flows through them in this order (composed by :class:`aiomm.engine._pipeline.Pipeline`; no
stage imports another):

=============  =========================================  ==================================
stage          work                                       runs on / bounded by
=============  =========================================  ==================================
admission      one slot per request (network requests     loop; ``max_in_flight``,
               in a lane of their own); sheds overload    ``max_waiting``
load           URL / data URL / path -> encoded bytes     loop (async I/O); network fetches
                                                          by ``fetch_concurrency``
hash           an item's id (the engine's Hasher)         loop, or a thread for large inputs
                                                          and in-memory images
cache          per-item lookup, single-flight join        loop
transform      probe, admit bytes, decode, resize,        threads; ``transform_threads`` and
               patchify (uint8), per item; audio:         ``max_decoded_bytes_in_flight``
               decode, resample, features
assemble       prompt updates, placeholder ranges         loop
output         merge items, normalise on the device       threads; ``device_staging_buffers``
=============  =========================================  ==================================
"""

from ._stage import Stage as Stage
from ._stage import StageStatistics as StageStatistics
from .admission import AdmissionStage as AdmissionStage
from .admission import AdmissionStatistics as AdmissionStatistics
from .assemble import AssembleStage as AssembleStage
from .cache import CacheStage as CacheStage
from .hashing import ContentHasher as ContentHasher
from .hashing import Hasher as Hasher
from .hashing import HashStage as HashStage
from .load import Fetcher as Fetcher
from .load import LoadStage as LoadStage
from .load import is_network as is_network
from .output import OutputStage as OutputStage
from .transform import Decoder as Decoder
from .transform import PillowDecoder as PillowDecoder
from .transform import TransformStage as TransformStage
from .transform import VideoLimits as VideoLimits

__all__ = (
    "AdmissionStage",
    "AdmissionStatistics",
    "AssembleStage",
    "CacheStage",
    "ContentHasher",
    "Decoder",
    "Fetcher",
    "HashStage",
    "Hasher",
    "LoadStage",
    "OutputStage",
    "PillowDecoder",
    "Stage",
    "StageStatistics",
    "TransformStage",
    "VideoLimits",
    "is_network",
)
