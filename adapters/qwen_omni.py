"""Qwen2.5-Omni's thinker (``Qwen2_5OmniThinkerForConditionalGeneration``): images, videos, audio.

Reference: transformers' ``Qwen2_5OmniProcessor`` of ``Qwen/Qwen2.5-Omni-7B`` (its
``preprocessor_config.json``: ``Qwen2VLImageProcessor`` with the image processor's defaults,
``Qwen2VLVideoProcessor``, and a ``WhisperFeatureExtractor`` of 128 mel bins at 16 kHz with
**300 s** chunks), processed as vLLM 0.33's ``Qwen2_5OmniThinkerMultiModalProcessor`` processes it.

Images and videos take the Qwen2-VL transform (:class:`~aiomm.adapters.qwen_vl.QwenVLProcessor`):
each ``<|IMAGE|>`` / ``<|VIDEO|>`` becomes ``prod(grid_thw) / merge_size**2`` of itself. Videos
are resized within the Omni processor's own default pixel bounds (``128 * 28 * 28`` to
``768 * 28 * 28`` per frame, which its call passes over the video processor's ``size``), and
their ``second_per_grid_ts`` is ``temporal_patch_size / fps`` with ``fps`` the request's or 2.0
(the processor's ``video_second_per_grid``, not the sampled frame rate Qwen2.5-VL uses).

Audio: the extractor pads every clip to 300 s (``padding="max_length"``; a longer clip stays
whole, as vLLM's call passes ``truncation=False``), and vLLM keeps only each clip's own frames:
``input_audio_features`` ``[128, L]`` float32 (the frames whose hop starts inside the clip, flat
along dim 1 across a request's clips), ``audio_feature_lengths`` ``L`` (int64) and
``feature_attention_mask`` (int32, the padded mask: ``[30000]`` up to 300 s), the last two kept
on the CPU. Each ``<|AUDIO|>`` becomes ``N`` of itself with ``N`` as Qwen2-Audio's
(:func:`~aiomm.adapters.qwen2_audio.audio_output_length`); ``N = 0`` is refused as vLLM refuses
it. Video items also carry ``use_audio_in_video`` (a ``shared`` bool, False). Setting it needs
each video's audio track (vLLM's render server takes it from the ``video_url`` only when it
trusts per-request processor kwargs), which this processor does not take
(:class:`~aiomm.errors.ProcessorKwargsError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.qwen2_audio import audio_output_length
from aiomm.adapters.qwen_vl import QwenVLProcessor, _pixel_bounded_params, _TransformParams
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ItemRejectedError, ProcessorKwargsError
from aiomm.processing.audio_features import WhisperFeatureConfig, feature_batch
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import FeatureFramesField, MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate

__all__ = ("FeatureFramesField", "QwenOmniProcessor", "build_hf_processor", "omni_hf_processor")

AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
IMAGE_TOKEN, VIDEO_TOKEN = "<|IMAGE|>", "<|VIDEO|>"
VISION_BOS, VISION_EOS = "<|vision_bos|>", "<|vision_eos|>"
#: Qwen2.5-Omni's chat tokens and its multimodal tokens
QWEN_OMNI_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS,
    VISION_BOS, VISION_EOS, IMAGE_TOKEN, VIDEO_TOKEN,
)  # fmt: skip
#: the tokenizer attributes ``Qwen2_5OmniProcessor`` reads (``extra_special_tokens``)
_NAMED_TOKENS = {
    "image_token": IMAGE_TOKEN, "audio_token": AUDIO_TOKEN, "video_token": VIDEO_TOKEN,
    "vision_bos_token": VISION_BOS, "vision_eos_token": VISION_EOS,
    "audio_bos_token": AUDIO_BOS, "audio_eos_token": AUDIO_EOS,
}  # fmt: skip

#: ``Qwen/Qwen2.5-Omni-7B``'s preprocessor_config.json: the feature extractor's part
QWEN_OMNI_FEATURE_PARAMS: dict[str, Any] = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 16000,
}
#: its image part (the image processor's defaults, written out)
QWEN_OMNI_IMAGE_PARAMS: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
#: the frame pixel bounds ``Qwen2_5OmniProcessor`` passes to its video processor by default
OMNI_VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
#: the frame rate the processor assumes for ``video_second_per_grid`` when a call names none
OMNI_DEFAULT_FPS = 2.0


def omni_hf_processor(
    processor: str,
    special_tokens: Sequence[str],
    named_tokens: Mapping[str, str],
    image_params: Mapping[str, Any],
    feature_params: Mapping[str, Any],
    backend: str = "torchvision",
    **overrides: Any,
) -> Any:
    """A Qwen Omni HF processor (transformers class ``processor``) over the backend's
    ``Qwen2VLImageProcessor`` (``image_params`` and ``overrides``), the Qwen2-VL video
    processor, a ``WhisperFeatureExtractor`` and a tokenizer built in code whose
    ``named_tokens`` are the attributes the processor reads."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    image_cls = {
        "torchvision": transformers.Qwen2VLImageProcessor,
        "pil": transformers.Qwen2VLImageProcessorPil,
    }[backend]
    base = build_tokenizer(tuple(special_tokens), eos_token="<|im_end|>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=dict(named_tokens),
    )  # fmt: skip
    return getattr(transformers, processor)(
        image_processor=image_cls(**{**image_params, **overrides}),
        video_processor=transformers.Qwen2VLVideoProcessor(**image_params),
        feature_extractor=transformers.WhisperFeatureExtractor(**feature_params),
        tokenizer=tokenizer,
    )


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``Qwen2_5OmniProcessor`` of Qwen2.5-Omni-7B over the backend's ``Qwen2VLImageProcessor``,
    with a tokenizer built in code (``overrides`` go to the image processor)."""
    return omni_hf_processor(
        "Qwen2_5OmniProcessor", QWEN_OMNI_SPECIAL_TOKENS, _NAMED_TOKENS, QWEN_OMNI_IMAGE_PARAMS,
        QWEN_OMNI_FEATURE_PARAMS, backend, **overrides,
    )  # fmt: skip


@register(
    Architecture(
        "qwen2.5-omni",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        build_hf_processor,
        "Qwen/Qwen2.5-Omni-7B",
    )
)
class QwenOmniProcessor(QwenVLProcessor):
    """Processor of Qwen2.5-Omni's thinker: Qwen2-VL images and videos, Whisper audio features
    (module docstring)."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("image", "video", "audio")
    #: vLLM's field order (audio, image, video) orders its placeholders and items
    wire_modality_order: ClassVar[tuple[str, ...]] = ("audio", "image", "video")
    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {
            "image": VISION_BOS + IMAGE_TOKEN + VISION_EOS,
            "video": VISION_BOS + VIDEO_TOKEN + VISION_EOS,
            "audio": AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS,
        }
    )
    # vLLM's Qwen2.5-Omni takes normalised pixels (no mm_device_do_normalize support)
    default_device_normalize: ClassVar[bool] = False
    #: the frame pixel bounds the processor passes to its video processor by default
    omni_video_size: ClassVar[dict[str, int]] = OMNI_VIDEO_SIZE
    #: the frame rate of ``video_second_per_grid`` when a request names none
    omni_default_fps: ClassVar[float] = OMNI_DEFAULT_FPS

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        # QwenVLProcessor knows the Qwen-VL processors' videos; Omni's are Qwen2-VL's
        self.supports_video = True
        self.video_token_id = int(hf_processor.video_token_id)
        self._seconds_per_grid = False  # Omni's seconds per grid (module docstring)
        self.audio_token_id = int(hf_processor.audio_token_id)
        self.feature_config = WhisperFeatureConfig.of(hf_processor.feature_extractor)
        self.audio_sampling_rate = self.feature_config.sampling_rate

    def allowed_hf_kwargs(self) -> frozenset[str]:
        """The image and video processors' kwargs, and ``use_audio_in_video`` (refused when
        set: module docstring)."""
        return super().allowed_hf_kwargs() | {"use_audio_in_video"}

    # kwargs ---------------------------------------------------------------------------------

    def _resolve_video_params(self, hf_kwargs: Mapping[str, Any]) -> _TransformParams:
        kwargs = dict(hf_kwargs)
        kwargs.setdefault("size", self.omni_video_size)
        return _pixel_bounded_params(self.video_processor, kwargs, "Qwen-Omni video")

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        if hf_kwargs.get("use_audio_in_video"):
            raise ProcessorKwargsError(
                "use_audio_in_video needs each video's audio track, which is not taken here"
            )
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        kwargs.pop("use_audio_in_video", None)
        if hf_data.get("audio"):
            kwargs["sampling_rate"] = self.feature_config.sampling_rate
        videos = hf_data.get("videos")
        if videos:
            # from the request's fps, which the frames' sampling took out of the call's kwargs
            passthrough["video_second_per_grid"] = self._seconds_per_grid_of(len(videos), hf_kwargs)
        return hf_data, kwargs, passthrough

    # the transform --------------------------------------------------------------------------

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        out = dict(super()._call_native_transform(hf_data, hf_kwargs))
        clips = hf_data.get("audio") or []
        if clips:
            out.update(self._call_audio_transform(clips, hf_kwargs))
        return out

    def _call_audio_transform(
        self, clips: Sequence[np.ndarray], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """``input_features`` ``[clips, mels, frames]`` and ``feature_attention_mask`` as the
        extractor returns them for the processor's call."""
        config = self.feature_config
        # vLLM's call passes truncation=False (for its text): a clip over 300 s is kept whole
        truncate = bool(hf_kwargs.get("truncation", True))
        features, mask = feature_batch(
            clips, pad_to=config.n_samples, truncate=truncate, config=config
        )
        return {"input_features": features, "feature_attention_mask": mask}

    def _check_audio_frames(self, frames: int) -> None:
        """Refuse a clip of ``frames`` feature frames that gets no tokens, as vLLM does.

        :raises ItemRejectedError: the clip is too short.
        """
        if audio_output_length(frames) <= 0:
            raise ItemRejectedError(
                "audio",
                f"{frames} feature frame(s) are too short to be represented inside the model",
            )

    def _seconds_per_grid_of(self, n: int, hf_kwargs: Mapping[str, Any]) -> torch.Tensor:
        """``video_second_per_grid`` of ``n`` videos, as the Omni processor computes it."""
        fps = hf_kwargs.get("fps")
        fps = self.omni_default_fps if fps is None else fps
        tps = int(self.video_processor.temporal_patch_size)
        return torch.tensor([tps / fps] * n)

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        data.pop("num_audio_tokens", None)  # the HF processor's count for its own expansion
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        # vLLM's _postprocess_hf_mm_data: each clip's own frames, flat along dim 1
        features = data.pop("input_features", None)
        mask = data.get("feature_attention_mask")
        if features is not None and mask is not None:
            for length in mask.sum(-1).tolist():
                self._check_audio_frames(int(length))
            data["input_audio_features"] = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
            data["audio_feature_lengths"] = mask.sum(-1)
        seconds = data.pop("video_second_per_grid", None)
        if seconds is not None:
            data["second_per_grid_ts"] = torch.as_tensor(seconds)
        if "video_grid_thw" in data:
            data["use_audio_in_video"] = torch.tensor(False)
        return data

    # fields, updates ------------------------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        fields: dict[str, Any] = dict(super()._get_mm_fields_config(outputs, hf_kwargs))
        lengths = outputs.get("audio_feature_lengths")
        if lengths is not None:
            fields["input_audio_features"] = FeatureFramesField(
                "audio", tuple(int(n) for n in lengths.tolist())
            )
            fields["feature_attention_mask"] = MultiModalFieldConfig.batched("audio")
            fields["audio_feature_lengths"] = MultiModalFieldConfig.batched("audio")
        grid = outputs.get("video_grid_thw")
        if grid is not None:
            fields["second_per_grid_ts"] = MultiModalFieldConfig.batched("video")
            fields["use_audio_in_video"] = MultiModalFieldConfig.shared("video", len(grid))
        return fields

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        updates = super()._get_prompt_updates(mm_counts, hf_kwargs, mm_kwargs)
        clips = mm_kwargs.get("audio", [])
        token = self.audio_token_id

        def replacement(i: int) -> list[int]:
            length = int(clips[i].data["audio_feature_lengths"])
            count = audio_output_length(length)
            if count <= 0:
                raise ItemRejectedError(
                    "audio",
                    f"{length} feature frame(s) are too short to be represented inside the model",
                )
            return [token] * count

        return [PromptReplacement("audio", [token], replacement), *updates]
