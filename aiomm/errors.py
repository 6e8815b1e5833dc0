"""The exceptions aiomm raises.

Every error is an :class:`AiommError`; leaves also subclass the builtin a caller would expect, so
``except ValueError`` keeps working. Messages name what was wrong (shapes, dtypes, counts, names)
and never embed payloads::

    AiommError
    ├── KernelInputError (ValueError)          bad tensors handed to a device kernel
    │   ├── UnsupportedDtypeError (TypeError)  input/output dtype the kernel does not take
    │   ├── LayoutError                         channel layout does not fit the tensor's shape
    │   └── OutputBufferError                   ``out`` of the wrong dtype, shape, device or size
    ├── ProcessingError (ValueError)            multimodal processing of one request failed
        ├── UnknownModalityError                a modality the adapter does not handle
        ├── ItemCountMismatchError              images vs placeholders in the prompt
        ├── PromptUpdateError                   a prompt update cannot be applied or found
        ├── ProcessorKwargsError                processor kwargs the processor rejects
        ├── PixelValueRoundingError             uint8 output would not be exact
        └── UnknownArchitectureError (KeyError) no adapter for that architecture name
    ├── MediaError (ValueError)                 an item could not be loaded
    │   ├── FetchError                          could not obtain the encoded bytes
    │   │   ├── InvalidSourceError              malformed URL / data URL / unsupported source
    │   │   ├── BlockedAddressError             SSRF guard: private, loopback, metadata address
    │   │   ├── PathNotAllowedError             local path outside the allowed root
    │   │   ├── DownloadTooLargeError           body exceeded the size cap
    │   │   ├── TooManyRedirectsError           redirect limit exceeded
    │   │   ├── FetchTimeoutError (TimeoutError) connect or read timeout
    │   │   └── HTTPStatusError                 non-2xx response
    │   └── DecodeError                         corrupt, truncated, empty or unsupported image
    │       └── ImageTooLargeError              pixel count above the limit (decompression bomb)
    └── EngineClosedError (RuntimeError)        the engine is not open
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = (
    "AiommError",
    "BlockedAddressError",
    "DecodeError",
    "DownloadTooLargeError",
    "EngineClosedError",
    "FetchError",
    "FetchTimeoutError",
    "HTTPStatusError",
    "ImageTooLargeError",
    "InvalidSourceError",
    "ItemCountMismatchError",
    "KernelInputError",
    "LayoutError",
    "MediaError",
    "OutputBufferError",
    "PathNotAllowedError",
    "PixelValueRoundingError",
    "ProcessingError",
    "ProcessorKwargsError",
    "PromptUpdateError",
    "TooManyRedirectsError",
    "UnknownArchitectureError",
    "UnknownModalityError",
    "UnsupportedDtypeError",
)


class AiommError(Exception):
    """Base class of every error aiomm raises."""


class KernelInputError(AiommError, ValueError):
    """Raised when a tensor handed to a device kernel is unusable."""


class UnsupportedDtypeError(KernelInputError, TypeError):
    """Raised when an input or output dtype is not supported by the kernel."""


class LayoutError(KernelInputError):
    """Raised when the channel layout does not fit the tensor's shape or channel count."""


class OutputBufferError(KernelInputError):
    """Raised when a caller-provided ``out`` buffer has the wrong dtype, shape, device or size."""


class ProcessingError(AiommError, ValueError):
    """Raised when multimodal processing of a request fails."""


class UnknownModalityError(ProcessingError):
    """Raised when a request carries a modality the adapter does not handle."""

    def __init__(self, modality: str, supported: Iterable[str]) -> None:
        self.modality = modality
        self.supported = tuple(sorted(supported))
        super().__init__(
            f"unknown modality {modality!r}; this adapter supports {list(self.supported)}"
        )


class ItemCountMismatchError(ProcessingError):
    """Raised when the number of items differs from the number of placeholders in the prompt."""

    def __init__(self, modality: str, num_items: int, num_placeholders: int) -> None:
        self.modality = modality
        self.num_items = num_items
        self.num_placeholders = num_placeholders
        super().__init__(
            f"the request has {num_items} {modality} item(s) but the prompt has "
            f"{num_placeholders} {modality} placeholder(s); add or remove placeholders so that "
            "each item has exactly one"
        )


class PromptUpdateError(ProcessingError):
    """Raised when a prompt update cannot be applied, or its result cannot be found."""


class ProcessorKwargsError(ProcessingError):
    """Raised when processor kwargs are rejected (unknown name or invalid value)."""


class PixelValueRoundingError(ProcessingError):
    """Raised when uint8 pixel values were requested but the transform produced non-integers."""


class UnknownArchitectureError(AiommError, KeyError):
    """Raised when no adapter is registered under an architecture or short name."""

    def __init__(self, name: str, supported: Iterable[str]) -> None:
        self.name = name
        self.supported = tuple(sorted(supported))
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown architecture {self.name!r}; supported: {', '.join(self.supported)}"


class MediaError(AiommError, ValueError):
    """Raised when an item (image) cannot be loaded; ``source`` names it without its payload."""

    def __init__(self, message: str, *, source: str | None = None) -> None:
        self.source = source
        super().__init__(f"{message} (source: {source})" if source else message)


class FetchError(MediaError):
    """Raised when the encoded bytes of an item cannot be obtained."""


class InvalidSourceError(FetchError):
    """Raised for a malformed URL or data URL, or an unsupported kind of source."""


class BlockedAddressError(FetchError):
    """Raised when a URL (or a redirect hop) resolves to an address the SSRF guard refuses."""


class PathNotAllowedError(FetchError):
    """Raised for a local path outside the allowed root (or when local paths are disabled)."""


class DownloadTooLargeError(FetchError):
    """Raised when a download exceeds the configured maximum size."""


class TooManyRedirectsError(FetchError):
    """Raised when a download follows more redirects than allowed."""


class FetchTimeoutError(FetchError, TimeoutError):
    """Raised when connecting or reading times out."""


class HTTPStatusError(FetchError):
    """Raised for a non-success HTTP status."""


class DecodeError(MediaError):
    """Raised when bytes are not a decodable image (corrupt, truncated, empty, unsupported)."""


class ImageTooLargeError(DecodeError):
    """Raised when an image's pixel count exceeds the limit, checked before the full decode."""


class EngineClosedError(AiommError, RuntimeError):
    """Raised when a request is made to an engine that is not open."""
