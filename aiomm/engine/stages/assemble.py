"""The assemble stage: prompt token ids + a request's items -> model inputs with placeholders.

Input: the request (its token ids, or text tokenized here) and its items in order. Output:
:class:`~aiomm.processing.processor.ProcessedInputs` (prompt updates applied, placeholder ranges
found). Runs on the event loop: it is a few list operations per item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from aiomm.errors import ProcessingError
from aiomm.processing.fields import MultiModalKwargsItem
from aiomm.processing.processor import BaseMultiModalProcessor, ProcessedInputs
from aiomm.processing.tokenize import encode_plain
from aiomm.types import Request

from ._stage import Stage

__all__ = ("AssembleStage",)


class AssembleStage(Stage):
    """Tokenizes text prompts and applies the adapter's prompt updates."""

    name = "assemble"

    def __init__(self, processor: BaseMultiModalProcessor) -> None:
        super().__init__(None)
        self.processor = processor

    def prompt_ids(self, request: Request) -> list[int]:
        """The request's token ids (its text tokenized with the adapter's tokenizer).

        :raises ProcessingError: a text prompt for an adapter without a tokenizer.
        """
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        tokenizer = getattr(self.processor.hf_processor, "tokenizer", None)
        if tokenizer is None:
            raise ProcessingError(
                f"{type(self.processor).__name__} has no tokenizer: pass prompt_token_ids"
            )
        # a Request holds exactly one of prompt_token_ids and prompt
        return encode_plain(tokenizer, cast(str, request.prompt))

    def assemble(
        self,
        prompt_ids: Sequence[int],
        items: Sequence[MultiModalKwargsItem],
        kwargs: Mapping[str, Any],
        *,
        videos: Sequence[MultiModalKwargsItem] = (),
        audios: Sequence[MultiModalKwargsItem] = (),
        normalization: bool = True,
    ) -> ProcessedInputs:
        """Prompt updates for ``items`` (images), ``videos`` and ``audios`` (each in prompt
        order) applied to ``prompt_ids`` (``normalization=False``: without the device
        normalisation's parameters, for a routing plan).

        :raises ItemCountMismatchError: items and placeholders differ in number.
        :raises PromptUpdateError: an update cannot be applied.
        """
        with self.counted():
            mm_kwargs = {"image": list(items)} if items else {}
            if videos:
                mm_kwargs["video"] = list(videos)
            if audios:
                mm_kwargs["audio"] = list(audios)
            return self.processor.assemble(
                prompt_ids, mm_kwargs, kwargs, normalization=normalization
            )
