"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``), audio.

Reference: transformers' ``Qwen2AudioProcessor`` with the ``WhisperFeatureExtractor`` that
``Qwen/Qwen2-Audio-7B-Instruct`` configures (128 mel bins, 16 kHz, hop 160, 400-point FFT,
30 s chunks), called as vLLM 0.33's ``Qwen2AudioMultiModalProcessor`` calls it:
``sampling_rate`` the extractor's, ``truncation=True``, and the processor's own
``padding="max_length"``. Every clip so becomes 30 s of features: ``input_features``
``[128, 3000]`` float32 (a clip longer than 30 s is cut) and ``feature_attention_mask``
``[3000]`` int32, 1 for each frame whose hop starts inside the clip. Both are batched fields, as
vLLM lays them out. The native transform is :func:`aiomm.processing.audio_features.log_mel_features`
(bit-identical to the extractor). Audio reaches the processor decoded, averaged to mono and
resampled to 16 kHz as vLLM's loader does (the engine's :class:`~aiomm.engine._audio.AudioLoader`).

Prompt: each ``<|AUDIO|>`` becomes ``N`` of itself, every one an embedding, with ``N`` from the
clip's mask length ``L`` as vLLM's ``_get_feat_extract_output_lengths``:
``((L - 1) // 2 + 1 - 2) // 2 + 1``. A clip of one frame (at most 160 samples) gives ``N = 0``,
which vLLM refuses ("too short to be represented inside the model"); so does this processor
(:class:`~aiomm.errors.ItemRejectedError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from aiomm.adapters.offline import build_tokenizer
from aiomm.adapters.registry import Architecture, register
from aiomm.errors import ItemRejectedError
from aiomm.processing.audio_features import WhisperFeatureConfig, feature_batch
from aiomm.processing.dummy_inputs import BaseDummyInputsBuilder
from aiomm.processing.fields import FieldConfig, MultiModalFieldConfig, MultiModalKwargsItem
from aiomm.processing.processor import BaseMultiModalProcessor, NormalizationParams
from aiomm.processing.prompt_updates import PromptReplacement, PromptUpdate

__all__ = ("Qwen2AudioMultiModalProcessor", "audio_output_length", "build_hf_processor")

AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
#: Qwen2-Audio's chat tokens (Qwen2's) and its audio tokens
QWEN2_AUDIO_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", AUDIO_TOKEN, AUDIO_BOS, AUDIO_EOS,
)  # fmt: skip

#: ``Qwen/Qwen2-Audio-7B-Instruct``'s preprocessor_config.json
QWEN2_AUDIO_FEATURE_PARAMS: dict[str, Any] = {
    "chunk_length": 30,
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 480000,
    "nb_max_frames": 3000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 16000,
}


def build_hf_processor(backend: str = "torchvision", **overrides: Any) -> Any:
    """``Qwen2AudioProcessor`` of Qwen2-Audio-7B-Instruct, with a tokenizer built in code
    (``backend`` names an image backend; audio has none, so it changes nothing)."""
    import transformers

    tokenizer = build_tokenizer(QWEN2_AUDIO_SPECIAL_TOKENS, eos_token="<|im_end|>")
    tokenizer.pad_token = "<|endoftext|>"
    return transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor(
            **{**QWEN2_AUDIO_FEATURE_PARAMS, **overrides}
        ),
        tokenizer=tokenizer,
        audio_token=AUDIO_TOKEN,
        audio_bos_token=AUDIO_BOS,
        audio_eos_token=AUDIO_EOS,
    )


def audio_output_length(mask_length: int) -> int:
    """The audio tokens of a clip of ``mask_length`` feature frames (vLLM's
    ``_get_feat_extract_output_lengths``: the encoder's stride-2 convolution, then its pooling)."""
    feat = (mask_length - 1) // 2 + 1
    return (feat - 2) // 2 + 1


@register(
    Architecture(
        "qwen2-audio",
        "Qwen2AudioForConditionalGeneration",
        build_hf_processor,
        "Qwen/Qwen2-Audio-7B-Instruct",
    )
)
class Qwen2AudioMultiModalProcessor(BaseMultiModalProcessor):
    """Processor of Qwen2-Audio (``Qwen2AudioProcessor``): Whisper log-mel features."""

    supported_modalities: ClassVar[tuple[str, ...]] = ("audio",)
    dummy_inputs: ClassVar[BaseDummyInputsBuilder] = BaseDummyInputsBuilder(
        {"audio": AUDIO_BOS + AUDIO_TOKEN + AUDIO_EOS}
    )
    # features are float32 model input: nothing to normalise on the device
    default_device_normalize: ClassVar[bool] = False
    has_native: ClassVar[bool] = True

    def __init__(self, hf_processor: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, **kwargs)
        if self.device_normalize:
            raise ValueError("Qwen2-Audio's features are not normalised on the device")
        self.feature_config = WhisperFeatureConfig.of(hf_processor.feature_extractor)
        self.audio_sampling_rate = self.feature_config.sampling_rate
        self.audio_token_id = int(hf_processor.tokenizer.convert_tokens_to_ids(AUDIO_TOKEN))

    # the transform --------------------------------------------------------------------------

    def _get_hf_mm_inputs(
        self, mm_items: Mapping[str, list[Any]], hf_kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(mm_items, hf_kwargs)
        # what vLLM's processor adds to every call
        kwargs.update(sampling_rate=self.feature_config.sampling_rate, truncation=True)
        return hf_data, kwargs, passthrough

    def _call_native_transform(self, hf_data: dict[str, Any], hf_kwargs: dict[str, Any]) -> Any:
        clips = hf_data.get("audio") or []
        if not clips:
            return {}
        config = self.feature_config
        features, mask = feature_batch(clips, pad_to=config.n_samples, truncate=True, config=config)
        return {"input_features": features, "feature_attention_mask": mask}

    def _postprocess_hf_mm_data(
        self, data: dict[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        data.pop("num_audio_tokens", None)  # the HF processor's count for its own expansion
        data = super()._postprocess_hf_mm_data(data, hf_kwargs)
        mask = data.get("feature_attention_mask")
        if mask is not None:
            for length in mask.sum(-1).tolist():
                if audio_output_length(int(length)) <= 0:
                    raise ItemRejectedError(
                        "audio",
                        f"{length} feature frame(s) are too short to be represented inside "
                        "the model",
                    )
        return data

    # fields, updates ------------------------------------------------------------------------

    def _get_mm_fields_config(
        self, outputs: Mapping[str, Any], hf_kwargs: Mapping[str, Any]
    ) -> dict[str, FieldConfig]:
        return {
            "input_features": MultiModalFieldConfig.batched("audio"),
            "feature_attention_mask": MultiModalFieldConfig.batched("audio"),
        }

    def _get_prompt_updates(
        self,
        mm_counts: Mapping[str, int],
        hf_kwargs: Mapping[str, Any],
        mm_kwargs: Mapping[str, list[MultiModalKwargsItem]],
    ) -> list[PromptUpdate]:
        items = mm_kwargs.get("audio", [])
        token = self.audio_token_id

        def replacement(i: int) -> list[int]:
            length = int(items[i].data["feature_attention_mask"].sum())
            count = audio_output_length(length)
            if count <= 0:
                raise ItemRejectedError(
                    "audio",
                    f"{length} feature frame(s) are too short to be represented inside the model",
                )
            return [token] * count

        return [PromptReplacement("audio", [token], replacement)]

    def _get_normalization_params(self, hf_kwargs: Mapping[str, Any]) -> NormalizationParams:
        raise NotImplementedError("Qwen2-Audio has no pixels to normalise")
