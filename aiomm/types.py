"""Request and Result: what callers hand the engine and what they get back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiomm.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from aiomm.cache.item_cache import CacheOutcome
    from aiomm.errors import AiommError
    from aiomm.processing.fields import MultiModalKwargsItem
    from aiomm.processing.placeholders import PlaceholderRange

__all__ = ("Request", "Result")


@dataclass
class Request:
    """One prompt with its images, videos and audios.

    An image is any of: encoded bytes, a file path, a ``data:`` URL, an ``http(s)://`` URL, a
    ``PIL.Image.Image``, or an ``H x W x C`` uint8 numpy array. A video is encoded bytes, a path
    or a URL as an image, or its frames in memory: a ``T x H x W x 3`` uint8 array or a list of
    frames (adapters that take videos: Qwen2-VL, Qwen2.5-VL). Frames are sampled as the HF video
    processor samples them, with the request's ``mm_processor_kwargs`` (``do_sample_frames``,
    ``fps``, ``num_frames``). An audio is encoded bytes, a path or a URL as an image, or its
    samples in memory: a ``(samples, sampling_rate)`` tuple of a 1-D (or ``channels x time``)
    float array and its rate in Hz (adapters that take audio: Qwen2-Audio); it is decoded,
    averaged to mono and resampled to the adapter's feature-extractor rate as vLLM's loader does.
    A request's items are its images, then its videos, then its audios.
    Give ``prompt_token_ids`` (already tokenized, as serving stacks do) or ``prompt`` (text,
    tokenized with the adapter's tokenizer). ``image_hashes`` and ``video_hashes`` may carry
    caller-supplied ids, and so may ``audio_hashes`` (OpenAI-style clients send them; None for an
    item without one): the item's
    id in the result, and a cache hit then skips even the download. A supplied id is used only as
    a cache key, never for a security decision; its entries are kept apart from computed ids'
    entries and per ``tenant`` (an id the caller vouches for, e.g. the API key's owner), so one
    tenant cannot read or poison another's supplied-id entries.

    :raises InvalidRequestError: both or neither of ``prompt_token_ids`` and ``prompt``;
        ``images``, ``videos`` or ``audios`` a single string or bytes; ``image_hashes``,
        ``video_hashes`` or ``audio_hashes`` not one per item of its modality.
    """

    prompt_token_ids: Sequence[int] | None = None
    images: Sequence[Any] = ()
    prompt: str | None = None
    request_id: str | None = None
    mm_processor_kwargs: Mapping[str, Any] | None = None
    image_hashes: Sequence[str | None] | None = None
    tenant: str | None = None
    videos: Sequence[Any] = ()
    video_hashes: Sequence[str | None] | None = None
    audios: Sequence[Any] = ()
    audio_hashes: Sequence[str | None] | None = None

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            given = "both" if self.prompt is not None else "neither"
            raise InvalidRequestError(
                f"give exactly one of prompt_token_ids and prompt, got {given}",
                request_id=self.request_id,
            )
        for name, items in (
            ("images", self.images),
            ("videos", self.videos),
            ("audios", self.audios),
        ):
            if isinstance(items, (str, bytes)):
                # a lone URL or payload would otherwise be taken as a sequence of characters
                raise InvalidRequestError(
                    f"{name} must be a sequence of {name}, got a single "
                    f"{type(items).__name__}; wrap it in a list",
                    request_id=self.request_id,
                )
        for name, hashes, items in (
            ("image", self.image_hashes, self.images),
            ("video", self.video_hashes, self.videos),
            ("audio", self.audio_hashes, self.audios),
        ):
            if hashes is not None and len(hashes) != len(items):
                raise InvalidRequestError(
                    f"{name}_hashes has {len(hashes)} entries for {len(items)} {name}s",
                    request_id=self.request_id,
                )


@dataclass
class Result:
    """The outcome of one request: model-ready inputs, or the typed error that stopped it."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    mm_placeholders: dict[str, list[PlaceholderRange]] = field(default_factory=dict)
    #: ``pixel_values`` (normalised, ``visual_dtype``, on the engine's device) and grid metadata
    mm_kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    #: each item's cache key, in request order
    item_hashes: list[str] = field(default_factory=list)
    #: each item's id, in request order: the one the request supplied, else the engine's
    #: :class:`~aiomm.engine.stages.Hasher`'s (blake3 of the encoded bytes by default; vLLM's
    #: mm_hash in ``aiomm serve``), or blake3 of an in-memory image's pixels
    item_ids: list[str] = field(default_factory=list)
    #: each item as processed, in request order (only with ``EngineConfig.return_items``)
    items: list[MultiModalKwargsItem] = field(default_factory=list)
    cache: list[CacheOutcome] = field(default_factory=list)
    #: seconds spent per stage (summed over items where a stage runs per item)
    timings: dict[str, float] = field(default_factory=dict)
    error: AiommError | None = None
    #: the engine's ``DecodeConfig.fidelity`` in force: ``exact`` (bit-identical to HF) or
    #: ``fast`` (JPEGs decoded at a reduced scale where the resize allows it)
    fidelity: str = "exact"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def pixel_values(self) -> torch.Tensor | None:
        return self.mm_kwargs.get("pixel_values")

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly one-line summary (no tensors, no payloads)."""
        return {
            "request_id": self.request_id,
            "ok": self.ok,
            "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            "num_tokens": len(self.prompt_token_ids),
            "placeholders": {
                m: [[r.offset, r.length] for r in ranges]
                for m, ranges in self.mm_placeholders.items()
            },
            "tensors": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                for k, v in self.mm_kwargs.items()
            },
            "cache": [c.value for c in self.cache],
            "fidelity": self.fidelity,
            "timings_ms": {k: round(v * 1000, 3) for k, v in self.timings.items()},
        }
