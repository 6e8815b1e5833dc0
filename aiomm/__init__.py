"""aiomm: an async streaming preprocessing engine for multimodal model serving.

``import aiomm`` stays light: configuration records and errors load with the package; the engine,
and with it torch and transformers, load on first use of a name that needs them.
"""

import importlib as _importlib
import typing as _typing

from .errors import AiommError as AiommError
from .errors import AspectRatioError as AspectRatioError
from .errors import AudioDecodeError as AudioDecodeError
from .errors import AudioTooLargeError as AudioTooLargeError
from .errors import AudioTooLongError as AudioTooLongError
from .errors import BlockedAddressError as BlockedAddressError
from .errors import CacheValueError as CacheValueError
from .errors import ConfigError as ConfigError
from .errors import DecodeError as DecodeError
from .errors import DownloadTooLargeError as DownloadTooLargeError
from .errors import EmptyAudioError as EmptyAudioError
from .errors import EmptyResizeError as EmptyResizeError
from .errors import EmptyVideoError as EmptyVideoError
from .errors import EngineClosedError as EngineClosedError
from .errors import FetchError as FetchError
from .errors import FetchTimeoutError as FetchTimeoutError
from .errors import HTTPStatusError as HTTPStatusError
from .errors import ImageTooLargeError as ImageTooLargeError
from .errors import InvalidRequestError as InvalidRequestError
from .errors import InvalidSourceError as InvalidSourceError
from .errors import ItemCountMismatchError as ItemCountMismatchError
from .errors import ItemRejectedError as ItemRejectedError
from .errors import KernelInputError as KernelInputError
from .errors import LayoutError as LayoutError
from .errors import MediaError as MediaError
from .errors import OutputBufferError as OutputBufferError
from .errors import OverloadedError as OverloadedError
from .errors import PathNotAllowedError as PathNotAllowedError
from .errors import PixelValueRoundingError as PixelValueRoundingError
from .errors import ProcessingError as ProcessingError
from .errors import ProcessorKwargsError as ProcessorKwargsError
from .errors import PromptUpdateError as PromptUpdateError
from .errors import TooFewFramesError as TooFewFramesError
from .errors import TooManyRedirectsError as TooManyRedirectsError
from .errors import UnknownArchitectureError as UnknownArchitectureError
from .errors import UnknownModalityError as UnknownModalityError
from .errors import UnsupportedDtypeError as UnsupportedDtypeError
from .errors import VideoTooLargeError as VideoTooLargeError
from .logging import configure_logging as configure_logging

if _typing.TYPE_CHECKING:
    from .cache.item_cache import CacheOutcome as CacheOutcome
    from .config import DecodeConfig as DecodeConfig
    from .config import EngineConfig as EngineConfig
    from .config import FetchConfig as FetchConfig
    from .config import MultiModalConfig as MultiModalConfig
    from .config import SharedCacheConfig as SharedCacheConfig
    from .engine import Engine as Engine
    from .engine import EngineStats as EngineStats
    from .engine import ResultStream as ResultStream
    from .processing.placeholders import PlaceholderRange as PlaceholderRange
    from .types import Request as Request
    from .types import Result as Result

__version__ = "0.1.0"

# name -> module it lives in, imported on first access
_LAZY = {
    "CacheOutcome": "aiomm.cache.item_cache",
    "DecodeConfig": "aiomm.config",
    "Engine": "aiomm.engine._engine",
    "EngineConfig": "aiomm.config",
    "EngineStats": "aiomm.engine._engine",
    "FetchConfig": "aiomm.config",
    "MultiModalConfig": "aiomm.config",
    "PlaceholderRange": "aiomm.processing.placeholders",
    "Request": "aiomm.types",
    "Result": "aiomm.types",
    "ResultStream": "aiomm.engine._stream",
    "SharedCacheConfig": "aiomm.config",
}

__all__ = (
    "AiommError",
    "AspectRatioError",
    "AudioDecodeError",
    "AudioTooLargeError",
    "AudioTooLongError",
    "BlockedAddressError",
    "CacheOutcome",
    "CacheValueError",
    "ConfigError",
    "DecodeConfig",
    "DecodeError",
    "DownloadTooLargeError",
    "EmptyAudioError",
    "EmptyResizeError",
    "EmptyVideoError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "FetchConfig",
    "FetchError",
    "FetchTimeoutError",
    "HTTPStatusError",
    "ImageTooLargeError",
    "InvalidRequestError",
    "InvalidSourceError",
    "ItemCountMismatchError",
    "ItemRejectedError",
    "KernelInputError",
    "LayoutError",
    "MediaError",
    "MultiModalConfig",
    "OutputBufferError",
    "OverloadedError",
    "PathNotAllowedError",
    "PixelValueRoundingError",
    "PlaceholderRange",
    "ProcessingError",
    "ProcessorKwargsError",
    "PromptUpdateError",
    "Request",
    "Result",
    "ResultStream",
    "SharedCacheConfig",
    "TooFewFramesError",
    "TooManyRedirectsError",
    "UnknownArchitectureError",
    "UnknownModalityError",
    "UnsupportedDtypeError",
    "VideoTooLargeError",
    "__version__",
    "configure_logging",
)


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiomm' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
