"""The exceptions aiomm raises.

Every error is an :class:`AiommError`; most also subclass the builtin a caller would expect, so
``except ValueError`` keeps working. Messages name what was wrong (shapes, dtypes, counts, names)
and never embed payloads. Any error may carry the ``request_id`` and ``item_index`` it concerns;
``str()`` shows them when set::

    AiommError
    ├── ConfigError (ValueError)                   a configuration field out of range or mistyped
    ├── InvalidRequestError (ValueError)           a Request whose fields contradict each other
    ├── KernelInputError (ValueError)              bad tensors handed to a device kernel
    │   ├── UnsupportedDtypeError (TypeError)      input/output dtype the kernel does not take
    │   ├── LayoutError                            channel layout does not fit the tensor's shape
    │   └── OutputBufferError                      ``out`` of the wrong dtype, shape, device, size
    ├── ProcessingError (ValueError)               multimodal processing of one request failed
    │   ├── UnknownModalityError                   a modality the adapter does not handle
    │   ├── ItemCountMismatchError                 images vs placeholders in the prompt
    │   ├── PromptUpdateError                      a prompt update cannot be applied or found
    │   ├── ProcessorKwargsError                   processor kwargs the processor rejects
    │   ├── PixelValueRoundingError                uint8 output would not be exact
    │   ├── CacheValueError                        an item the shared cache cannot (de)serialise
    │   └── ItemRejectedError                      the model's processor refuses this item
    │       ├── AspectRatioError                   an image or video too elongated for it
    │       ├── EmptyResizeError                   its resize would leave a side of no pixels
    │       └── TooFewFramesError                  a video shorter than one temporal patch
    ├── UnknownArchitectureError (KeyError)        no adapter for that architecture name
    ├── MediaError (ValueError)                    an item could not be loaded
    │   ├── FetchError                             could not obtain the encoded bytes
    │   │   ├── InvalidSourceError                 malformed URL / data URL / unsupported source
    │   │   ├── BlockedAddressError                SSRF guard: private, loopback, metadata address
    │   │   ├── PathNotAllowedError                local path outside the allowed root
    │   │   ├── DownloadTooLargeError              body exceeded the size cap
    │   │   ├── TooManyRedirectsError              redirect limit exceeded
    │   │   ├── FetchTimeoutError (TimeoutError)   connect, read or total timeout
    │   │   └── HTTPStatusError                    non-2xx response (``status_code``, ``url``)
    │   └── DecodeError                            corrupt, truncated, empty or unsupported image
    │       ├── ImageTooLargeError                 pixel count above the limit (decompression bomb)
    │       ├── EmptyVideoError                    a video without a decodable frame
    │       ├── AudioDecodeError                   bytes that are not decodable audio
    │       ├── EmptyAudioError                    audio without a sample
    │       ├── AudioTooLongError                  audio longer than the duration limit
    │       ├── AudioTooLargeError                 audio above the encoded or decoded byte limit
    │       └── VideoTooLargeError                 sampled frames or bytes above the video budget
    ├── OverloadedError (RuntimeError)             too many requests waiting: shed (HTTP 429/503)
    └── EngineClosedError (RuntimeError)           the engine is not open
"""

from __future__ import annotations

import http
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from aiomm.redaction import redact

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = (
    "AiommError",
    "AspectRatioError",
    "AudioDecodeError",
    "AudioTooLargeError",
    "AudioTooLongError",
    "BlockedAddressError",
    "CacheValueError",
    "ConfigError",
    "DecodeError",
    "DownloadTooLargeError",
    "EmptyAudioError",
    "EmptyResizeError",
    "EmptyVideoError",
    "EngineClosedError",
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
    "OutputBufferError",
    "OverloadedError",
    "PathNotAllowedError",
    "PixelValueRoundingError",
    "ProcessingError",
    "ProcessorKwargsError",
    "PromptUpdateError",
    "TooFewFramesError",
    "TooManyRedirectsError",
    "UnknownArchitectureError",
    "UnknownModalityError",
    "UnsupportedDtypeError",
    "VideoTooLargeError",
    "first_error",
)

_E = TypeVar("_E", bound="AiommError")


def _printable(text: str) -> str:
    """``text`` with control and other non-printable characters escaped (``\\x1b``): a source
    string echoed in a message must not move a terminal's cursor or forge log lines."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _rebuild(cls: type[AiommError], args: tuple[Any, ...], state: dict[str, Any]) -> AiommError:
    # Leaves take fields, not the composed message, so unpickling must not call __init__.
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class AiommError(Exception):
    """Base class of every error aiomm raises.

    ``request_id`` and ``item_index`` name the request and the item (its position among the
    request's items) the error concerns, when known. The layer that knows them attaches them
    with :meth:`with_context`; ``str()`` shows them after the message.

    Credentials in a URL the message quotes (user info, a signed query) are masked
    (:func:`aiomm.redaction.redact`): an error may reach a log, a metric or a client.
    """

    request_id: str | None
    item_index: int | None

    def __init__(
        self, *args: object, request_id: str | None = None, item_index: int | None = None
    ) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))
        self.request_id = request_id
        self.item_index = item_index

    def with_context(
        self: _E, *, request_id: str | None = None, item_index: int | None = None
    ) -> _E:
        """Attach the request and item this error concerns and return the error itself.

        Only the values given are set, so an outer layer adding ``request_id`` keeps the
        ``item_index`` an inner layer attached: ``raise err.with_context(request_id=rid)``.
        """
        if request_id is not None:
            self.request_id = request_id
        if item_index is not None:
            self.item_index = item_index
        return self

    @property
    def message(self) -> str:
        """The message without the request context."""
        return self._message()

    def _message(self) -> str:
        return super().__str__()

    def __str__(self) -> str:
        context = []
        if getattr(self, "request_id", None) is not None:
            context.append(f"request_id={self.request_id!r}")
        if getattr(self, "item_index", None) is not None:
            context.append(f"item_index={self.item_index}")
        message = redact(self._message())
        return f"{message} [{', '.join(context)}]" if context else message

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class ConfigError(AiommError, ValueError):
    """Raised when a configuration field is out of range or of the wrong type."""


class InvalidRequestError(AiommError, ValueError):
    """Raised when a :class:`~aiomm.Request` is malformed (its fields contradict each other)."""


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


class CacheValueError(ProcessingError):
    """Raised when an item cannot be serialised for the shared cache, or a stored value cannot
    be read back (corrupt, truncated, another format); the shared cache treats it as a miss."""


class ItemRejectedError(ProcessingError):
    """Raised when the model's processor refuses an item for what it is (its shape or length),
    as the HF processor would: the client's item, not a fault of the server. ``modality``
    (``"image"`` or ``"video"``) and the leaf's fields say what was wrong; the engine attaches
    the item's ``item_index``. Checked before any library call could fail on the item."""

    def __init__(self, modality: str, reason: str) -> None:
        self.modality = modality
        self.reason = reason
        super().__init__(f"the model's processor refuses this {modality}: {reason}")


def _sized(modality: str, height: int, width: int) -> str:
    if modality == "video":
        return f"video of {height}x{width} frames"
    return f"{height}x{width} {modality}"


class AspectRatioError(ItemRejectedError):
    """Raised when an image (or a video's frames) is more elongated than the processor takes:
    its longer side over its shorter above ``limit`` (Qwen-VL and GLM-V: 200, GLM-V measuring
    after scaling a thin image up to one patch). ``height`` and ``width`` are the item's."""

    def __init__(
        self, modality: str, height: int, width: int, *, ratio: float, limit: float = 200
    ) -> None:
        self.height = height
        self.width = width
        self.ratio = ratio
        self.limit = limit
        super().__init__(
            modality,
            f"a {_sized(modality, height, width)} (height x width) has an aspect ratio of "
            f"{ratio:.4g}, above the limit of {limit:g}",
        )


class EmptyResizeError(ItemRejectedError):
    """Raised when the processor's resize would leave an image (or a video's frames) a side of
    zero pixels, e.g. Pixtral (Mistral 3) scaling a thin image down to fit ``longest_edge``;
    ``target`` is that ``(height, width)``."""

    def __init__(self, modality: str, height: int, width: int, target: tuple[int, int]) -> None:
        self.height = height
        self.width = width
        self.target = target
        super().__init__(
            modality,
            f"a {_sized(modality, height, width)} (height x width) would be resized to "
            f"{target[0]}x{target[1]}, a side of no pixels",
        )


class TooFewFramesError(ItemRejectedError):
    """Raised when a video has fewer (sampled) frames than the processor takes: one temporal
    patch (``temporal_patch_size`` frames) at least."""

    def __init__(self, frames: int, minimum: int) -> None:
        self.frames = frames
        self.minimum = minimum
        super().__init__(
            "video",
            f"a video of {frames} sampled frame(s) is shorter than temporal_patch_size "
            f"{minimum}, the fewest frames it takes",
        )


class UnknownArchitectureError(AiommError, KeyError):
    """Raised when no adapter is registered under an architecture or short name."""

    def __init__(self, name: str, supported: Iterable[str]) -> None:
        self.name = name
        self.supported = tuple(sorted(supported))
        super().__init__(name)

    def _message(self) -> str:
        # KeyError's own __str__ would show only the quoted name
        return f"unknown architecture {self.name!r}; supported: {', '.join(self.supported)}"


class MediaError(AiommError, ValueError):
    """Raised when an item (image) cannot be loaded; ``source`` names it without its payload."""

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        request_id: str | None = None,
        item_index: int | None = None,
    ) -> None:
        message = _printable(redact(message, source=source))
        source = None if source is None else _printable(redact(source, source=source))
        self.source = source
        super().__init__(
            f"{message} (source: {source})" if source else message,
            request_id=request_id,
            item_index=item_index,
        )


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
    """Raised for a non-success HTTP status; ``status_code`` holds it, ``url`` the URL shown."""

    def __init__(
        self,
        status_code: int,
        url: str | None = None,
        *,
        request_id: str | None = None,
        item_index: int | None = None,
    ) -> None:
        self.status_code = status_code
        self.url = None if url is None else redact(url, source=url)
        try:
            reason = f" {http.HTTPStatus(status_code).phrase}"
        except ValueError:  # a status code outside the registry, e.g. 599
            reason = ""
        super().__init__(
            f"HTTP status {status_code}{reason}",
            source=url,
            request_id=request_id,
            item_index=item_index,
        )


class DecodeError(MediaError):
    """Raised when bytes are not a decodable image (corrupt, truncated, empty, unsupported)."""


class ImageTooLargeError(DecodeError):
    """Raised when an image's pixel count exceeds the limit, checked before the full decode."""


class EmptyVideoError(DecodeError):
    """Raised when a video holds no decodable frame (no video stream, or zero frames)."""


class AudioDecodeError(DecodeError):
    """Raised when bytes are not audio that libsndfile or FFmpeg can decode (corrupt, truncated,
    unsupported), or audio a resampler cannot take."""


class EmptyAudioError(DecodeError):
    """Raised when an audio item holds no sample: empty bytes, no audio stream, zero frames."""


class AudioTooLongError(DecodeError):
    """Raised when audio lasts longer than ``limit_s`` seconds, from the header when it tells the
    duration, else while decoding."""

    def __init__(self, duration: str, limit_s: float, **context: Any) -> None:
        self.limit_s = limit_s
        super().__init__(f"audio longer than the limit of {limit_s} s ({duration})", **context)


class AudioTooLargeError(DecodeError):
    """Raised when audio's encoded bytes, or the PCM it decodes to, exceed ``limit`` bytes."""

    def __init__(self, what: str, size: int, limit: int, **context: Any) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"{what} of {size} bytes exceed the limit of {limit} bytes", **context)


class VideoTooLargeError(DecodeError):
    """Raised when a video's sampled frames exceed the frame or byte budget, or a frame the pixel
    limit, checked from the container's header before any frame is decoded."""


class OverloadedError(AiommError, RuntimeError):
    """Raised when a request arrives while every slot is taken and ``max_waiting`` requests
    already wait for one: it is shed at once, never queued (a server answers 429 or 503)."""

    def __init__(self, waiting: int, in_flight: int, **context: Any) -> None:
        self.waiting = waiting
        self.in_flight = in_flight
        super().__init__(
            f"overloaded: {in_flight} requests in flight and {waiting} waiting (the limit); "
            "retry later",
            **context,
        )


class EngineClosedError(AiommError, RuntimeError):
    """Raised when a request is made to an engine that is not open."""


def first_error(
    group: BaseExceptionGroup,
    prefer: type[BaseException] | tuple[type[BaseException], ...] = AiommError,
) -> BaseException:
    """What a failed task group stands for: the first of ``group``'s (nested) leaves that is a
    ``prefer``, else its first leaf; never a group. A request's items load concurrently in a task
    group; a caller catching ``AiommError`` (or a server mapping errors to status codes) would not
    recognise the exception group anyio raises when one fails."""
    leaves = _leaves(group)
    return next((e for e in leaves if isinstance(e, prefer)), leaves[0])


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
