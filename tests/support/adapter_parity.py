"""The parity harness: every registered adapter against its reference, on both HF backends.

Driven by the registry: :func:`cases` lists every ``(short name, backend)`` of
:func:`~aiomm.adapters.supported_adapters`, and :func:`check_case` runs one seeded case. The only
per-architecture data is a :class:`Family` per processor class (how to draw images for it and
how to call its reference), so a new row of an existing family is tested with no new code, and a
new processor class without a :class:`Family` fails ``tests/adapters/test_parity.py``.

A case draws fresh random images (the seed is in every failure message; ``AIOMM_TEST_SEED``
replays it) and checks, for each of our transforms (``hf`` where the adapter has an HF transform,
and ``native``):

- token ids equal the reference's ``input_ids``; placeholder ranges (one per image) cover exactly
  the reference's image tokens, and their embedding positions exactly its embedding tokens;
- per-image metadata (grids, image sizes, tile counts) equals the reference's;
- uint8 ``pixel_values`` equal the reference's output with rescale/normalise off, bit for bit;
- normalised by ``FusedMMInputNorm`` they equal the reference's float output to a norm-wise
  relative error under 1e-6 (under bfloat16's epsilon where the reference normalises in
  bfloat16: ``Family.float_dtype``, Llama 4);
- with ``classic=True``, also the classic CPU path (``mm_device_do_normalize=False``): float
  ``pixel_values`` equal to the reference's float output exactly.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import deepseek_ocr_reference as deepseek_ocr
import kimi_reference as kimi
import nemotron_vl_reference as nemotron
import numpy as np
import parity
import torch
from parity import SEED, hf_processor, rel_err

from aiomm.adapters import AdapterInfo, build_processor, get_adapter_info, supported_adapters
from aiomm.adapters.chameleon import ChameleonMultiModalProcessor
from aiomm.adapters.deepseek_ocr import DeepseekOCRProcessor
from aiomm.adapters.gemma import Gemma3MultiModalProcessor
from aiomm.adapters.gemma4 import Gemma4MultiModalProcessor
from aiomm.adapters.glm import GlmVMultiModalProcessor
from aiomm.adapters.idefics3 import Idefics3MultiModalProcessor
from aiomm.adapters.internvl import InternVLMultiModalProcessor
from aiomm.adapters.kimi_k25 import KimiK25MultiModalProcessor
from aiomm.adapters.llama4 import Llama4MultiModalProcessor
from aiomm.adapters.llava import (
    LLAVA_NEXT_PINPOINTS,
    ONEVISION_PINPOINTS,
    LlavaNextMultiModalProcessor,
    LlavaOnevisionMultiModalProcessor,
)
from aiomm.adapters.mistral3 import Mistral3MultiModalProcessor
from aiomm.adapters.nemotron_vl import LlamaNemotronVLProcessor
from aiomm.adapters.paddleocr_vl import PaddleOCRVLMultiModalProcessor
from aiomm.adapters.qwen2_audio import Qwen2AudioMultiModalProcessor
from aiomm.adapters.qwen_omni import QwenOmniProcessor
from aiomm.adapters.qwen_vl import QwenVLProcessor
from aiomm.adapters.smolvlm import SmolVLMMultiModalProcessor
from aiomm.media.samples import photo_like
from aiomm.processing.processor import MultiModalConfig

__all__ = (
    "AUDIO_FAMILIES",
    "FAMILIES",
    "AudioFamily",
    "Family",
    "Reference",
    "cases",
    "check_audio_case",
    "check_case",
    "family_of",
    "prompt_text",
)

BACKENDS = ("torchvision", "pil")
#: the relative error allowed between device-normalised uint8 pixels and the reference's floats
NORMALISED_REL_ERR = 1e-6


@dataclass(frozen=True)
class Reference:
    """What the reference produced for one prompt, in the terms the harness compares."""

    input_ids: list[int]
    #: uint8 pixels (rescale/normalise off), in the reference's dtype
    pixel_values_u8: torch.Tensor
    #: the float model input
    pixel_values: torch.Tensor
    #: per-image metadata our merged output must equal (grids, sizes, tile counts)
    fields: dict[str, torch.Tensor]
    #: the tokens the placeholder ranges cover, and those of them that take embeddings
    range_tokens: frozenset[int]
    embed_token: int


#: ``reference(reference_processor, text, images, kwargs) -> Reference``
ReferenceFn = Callable[[Any, str, list[Any], dict[str, Any]], Reference]


@dataclass(frozen=True)
class Family:
    """How the harness draws images for one processor class and calls its reference."""

    reference: ReferenceFn
    #: the channel layout of its uint8 ``pixel_values`` on the device
    layout: str
    sizes: tuple[tuple[int, int], ...]
    large_sizes: tuple[tuple[int, int], ...]
    #: drawn sizes above this aspect ratio become square (processors that reject them)
    max_aspect: float | None = None
    random_side: int = 900
    backends: tuple[str, ...] = BACKENDS
    #: the float values compared after normalising (default: all of them)
    inside: Callable[[torch.Tensor, Reference], torch.Tensor] | None = None
    #: the words around the prompt's placeholders (the offline tokenizers know them)
    placeholder_words: tuple[str, str] = ("user", "assistant")
    #: the dtype of the reference's float output; device-normalised fp32 pixels are compared
    #: with a bfloat16 one (Llama 4 normalises in bfloat16) within its rounding
    float_dtype: torch.dtype = torch.float32


def _hf_reference(
    fields: Sequence[str],
    range_tokens: Callable[[Any], Sequence[int]],
    embed_token: Callable[[Any], int] = lambda proc: int(proc.image_token_id),
    **call_kwargs: Any,
) -> ReferenceFn:
    """The reference of an adapter that reproduces an HF processor: that processor, called."""

    def reference(proc: Any, text: str, images: list[Any], kwargs: dict[str, Any]) -> Reference:
        def call(**extra: Any) -> Any:
            return proc(
                text=[text], images=images, return_tensors="pt", **call_kwargs, **kwargs, **extra
            )

        u8 = call(do_rescale=False, do_normalize=False)
        return Reference(
            input_ids=u8["input_ids"][0].tolist(),
            pixel_values_u8=u8["pixel_values"],
            pixel_values=call()["pixel_values"],
            fields={key: u8[key] for key in fields},
            range_tokens=frozenset(int(t) for t in range_tokens(proc)),
            embed_token=embed_token(proc),
        )

    return reference


def _nemotron_reference(
    params: Any, text: str, images: list[Any], kwargs: dict[str, Any]
) -> Reference:
    assert not kwargs, "the restated reference takes tile kwargs directly"
    ref = nemotron.reference_outputs(images)
    tok = params.tokenizer
    start, end, context = tok.convert_tokens_to_ids(["<img>", "</img>", "<IMG_CONTEXT>"])
    return Reference(
        input_ids=tok(nemotron.reference_prompt(text, ref["num_patches"]))["input_ids"],
        pixel_values_u8=ref["uint8"],
        pixel_values=ref["float"],
        fields={"image_num_patches": torch.tensor(ref["num_patches"])},
        range_tokens=frozenset((start, end, context)),
        embed_token=context,
    )


def _deepseek_ocr_reference(
    params: Any, text: str, images: list[Any], kwargs: dict[str, Any]
) -> Reference:
    """vLLM's DeepSeek-OCR (v1) or OCR 2 processing restated (``deepseek_ocr_reference``, the
    strategy of ``params``): the global views as ``pixel_values``, the local views (normalised
    on the host) and grids as fields, each ``<image>`` repeated to the image's token count."""
    ref = deepseek_ocr.reference_outputs(images, strategy=params.strategy, **kwargs)
    tok = params.tokenizer
    image_id = tok.convert_tokens_to_ids("<image>")
    ids, counts = [], iter(ref["tokens"])
    for t in tok(text)["input_ids"]:
        ids.extend([t] * next(counts) if t == image_id else [t])
    return Reference(
        input_ids=ids,
        pixel_values_u8=ref["uint8"],
        pixel_values=ref["float"],
        fields={
            "images_crop": ref["images_crop"],
            "images_spatial_crop": ref["images_spatial_crop"],
        },
        range_tokens=frozenset({image_id}),
        embed_token=image_id,
    )


def _kimi_reference(proc: Any, text: str, images: list[Any], kwargs: dict[str, Any]) -> Reference:
    """vLLM's Kimi-K2.5 processing restated (``kimi_reference``): the patches and ``grid_thws``,
    each ``<|media_pad|>`` repeated to the image's token count."""
    assert not kwargs, "vLLM's Kimi-K2.5 processor takes no image kwargs"
    ref = kimi.reference_outputs(images)
    media = proc.tokenizer.convert_tokens_to_ids("<|media_pad|>")
    ids, counts = [], iter(ref["tokens"])
    for t in proc.tokenizer(text)["input_ids"]:
        ids.extend([t] * next(counts) if t == media else [t])
    return Reference(
        input_ids=ids,
        pixel_values_u8=ref["uint8"],
        pixel_values=ref["float"],
        fields={"grid_thws": ref["grid_thws"]},
        range_tokens=frozenset({media}),
        embed_token=media,
    )


def _inside_images(values: torch.Tensor, ref: Reference) -> torch.Tensor:
    """Each image's own ``image_sizes`` corner of a padded batch, flattened: the padding is 0.0
    in HF's float batch and ``-mean / std`` in ours, and the model crops it away."""
    sizes = ref.fields["image_sizes"].tolist()
    return torch.cat([values[i, :, :h, :w].flatten() for i, (h, w) in enumerate(sizes)])


def _inside_patches(
    pinpoints: list[list[int]],
) -> Callable[[torch.Tensor, Reference], torch.Tensor]:
    """Each image's own patches of a batch padded to its most patches, flattened: the padding
    patches are 0.0 in HF's float batch and ``-mean / std`` in ours (the model drops them).
    The counts come from transformers' own choice among the grid's ``pinpoints``."""

    def inside(values: torch.Tensor, ref: Reference) -> torch.Tensor:
        from transformers.image_processing_utils import select_best_resolution

        patch = int(values.shape[-1])
        own = []
        for i, (h, w) in enumerate(ref.fields["image_sizes"].tolist()):
            best_h, best_w = select_best_resolution((h, w), pinpoints)
            own.append(values[i, : 1 + (best_h // patch) * (best_w // patch)].flatten())
        return torch.cat(own)

    return inside


def _llama4_reference(proc: Any, text: str, images: list[Any], kwargs: dict[str, Any]) -> Reference:
    """Llama 4's processor call, with the per-image fields vLLM sends taken from its image
    processor (the processor drops them): each image's tile grid and tile count."""
    ref = _hf_reference(
        [],
        lambda p: [
            p.image_token_id,
            *p.tokenizer.convert_tokens_to_ids(
                [
                    p.start_of_img_token,
                    p.end_of_img_token,
                    p.img_patch_token,
                    p.tile_token,
                    p.tile_global_token,
                ]
            ),
        ],
        embed_token=lambda p: int(p.tokenizer.convert_tokens_to_ids(p.img_patch_token)),
    )(proc, text, images, kwargs)
    tiles = proc.image_processor(images, **kwargs, do_rescale=False, do_normalize=False)
    fields = {
        "aspect_ratios": torch.stack(tiles["aspect_ratios"]),
        "patches_per_image": torch.tensor([len(t) for t in tiles["pixel_values"]]),
    }
    return dataclasses.replace(ref, fields=fields)


def _gemma4_reference(proc: Any, text: str, images: list[Any], kwargs: dict[str, Any]) -> Reference:
    """Gemma 4's processor call, its ``image_position_ids`` under vLLM's name."""
    ref = _hf_reference(
        [],
        lambda p: [p.tokenizer.boi_token_id, p.image_token_id, p.tokenizer.eoi_token_id],
        return_mm_token_type_ids=False,
    )(proc, text, images, kwargs)
    positions = proc.image_processor(images, **kwargs)["image_position_ids"]
    return dataclasses.replace(ref, fields={"pixel_position_ids": torch.as_tensor(positions)})


def _idefics3_reference(
    proc: Any, text: str, images: list[Any], kwargs: dict[str, Any]
) -> Reference:
    """Idefics3's processor call, its one prompt's batch row taken as vLLM takes it (``[n, ...]``),
    with vLLM's per-image ``num_patches`` (the image processor's count; the processor drops it)."""
    ref = _hf_reference(
        ["pixel_attention_mask"],
        lambda p: [
            p.image_token_id,
            p.fake_image_token_id,
            p.global_image_token_id,
            *p.row_col_ids,
        ],
    )(proc, text, images, kwargs)
    count = proc.image_processor.get_number_of_image_patches
    patches = [max(count(im.height, im.width, kwargs)[0], 1) for im in images]
    return dataclasses.replace(
        ref,
        pixel_values_u8=ref.pixel_values_u8[0],
        pixel_values=ref.pixel_values[0],
        fields={
            "pixel_attention_mask": ref.fields["pixel_attention_mask"][0].bool(),
            "num_patches": torch.tensor(patches),
        },
    )


def _smolvlm_reference(
    proc: Any, text: str, images: list[Any], kwargs: dict[str, Any]
) -> Reference:
    """SmolVLM's processor call, taken as :func:`_idefics3_reference` takes Idefics3's (its
    processor names the tokens around the images but not their ids)."""
    ref = _hf_reference(
        ["pixel_attention_mask"],
        lambda p: [
            p.image_token_id,
            *p.tokenizer.convert_tokens_to_ids([p.fake_image_token, p.global_image_token]),
            *p.tokenizer.convert_tokens_to_ids(
                [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
            ),
        ],
    )(proc, text, images, kwargs)
    count = proc.image_processor.get_number_of_image_patches
    patches = [max(count(im.height, im.width, kwargs)[0], 1) for im in images]
    return dataclasses.replace(
        ref,
        pixel_values_u8=ref.pixel_values_u8[0],
        pixel_values=ref.pixel_values[0],
        fields={
            "pixel_attention_mask": ref.fields["pixel_attention_mask"][0].bool(),
            "num_patches": torch.tensor(patches),
        },
    )


_SMALL = ((1, 1), (3, 5), (28, 28), (57, 33), (1, 150), (150, 1), (199, 3), (240, 320),
          (333, 500), (480, 640), (700, 20))  # fmt: skip
_LARGE = ((1080, 1920), (1536, 2048))
# Every image is resized to a 512 shortest edge before the crop, so thin images become very
# large: moderate aspect ratios only.
_CHAMELEON_SIZES = ((1, 1), (3, 5), (28, 28), (57, 33), (240, 320), (333, 500), (480, 640),
                    (512, 512), (513, 700), (700, 200), (90, 300))  # fmt: skip

#: per processor class (an adapter's class or its nearest registered base)
FAMILIES: dict[type, Family] = {
    QwenVLProcessor: Family(
        reference=_hf_reference(["image_grid_thw"], lambda p: [p.image_token_id]),
        layout="PATCHES",
        sizes=(*_SMALL, (32, 32), (90, 610)),
        large_sizes=_LARGE,
        max_aspect=200,  # smart_resize rejects aspect ratios above 200
    ),
    # Qwen2.5-Omni's images (its audio: tests/adapters/test_qwen_omni.py)
    QwenOmniProcessor: Family(
        reference=_hf_reference(["image_grid_thw"], lambda p: [p.image_token_id]),
        layout="PATCHES",
        sizes=(*_SMALL, (32, 32), (90, 610)),
        large_sizes=_LARGE,
        max_aspect=200,  # smart_resize rejects aspect ratios above 200
    ),
    GlmVMultiModalProcessor: Family(  # GLM-4V, GLM-OCR and GLM-5-Next
        # mm_token_type_ids (not compared) would make numpy warn about torch's __array__
        reference=_hf_reference(
            ["image_grid_thw"], lambda p: [p.image_token_id], return_mm_token_type_ids=False
        ),
        layout="PATCHES",
        sizes=(*_SMALL, (27, 29)),
        large_sizes=_LARGE,
        max_aspect=150,  # above 200 is rejected, after scaling thin images up
    ),
    Mistral3MultiModalProcessor: Family(
        reference=_hf_reference(
            ["image_sizes"],
            lambda p: [p.image_token_id, p.image_break_token_id, p.image_end_token_id],
        ),
        layout="NCHW",
        sizes=(*_SMALL, (29, 27), (56, 1000)),
        large_sizes=(*_LARGE, (1600, 900)),
        inside=_inside_images,
    ),
    ChameleonMultiModalProcessor: Family(
        reference=_hf_reference(
            [], lambda p: [p.image_start_token_id, p.image_token_id, p.image_end_token_id]
        ),
        layout="NCHW",
        sizes=_CHAMELEON_SIZES,
        large_sizes=_LARGE,
        max_aspect=4,
    ),
    Llama4MultiModalProcessor: Family(
        reference=_llama4_reference,
        layout="NCHW",
        # 336 multiples and thin images: ties between canvases of one scale, the upscale bound
        sizes=(*_SMALL, (336, 336), (337, 336), (336, 1008), (672, 673), (20, 2000), (5000, 40)),
        large_sizes=(*_LARGE, (2000, 600)),
        float_dtype=torch.bfloat16,
    ),
    LlavaNextMultiModalProcessor: Family(
        reference=_hf_reference(["image_sizes"], lambda p: [p.image_token_id]),
        layout="NCHW",
        sizes=(*_SMALL, (336, 336), (336, 1008), (1008, 336), (672, 673), (1, 1100)),
        large_sizes=(*_LARGE, (2000, 600)),
        inside=_inside_patches(LLAVA_NEXT_PINPOINTS),
    ),
    LlavaOnevisionMultiModalProcessor: Family(  # LLaVA-NeXT's transform, OneVision's grid
        reference=_hf_reference(["image_sizes"], lambda p: [p.image_token_id]),
        layout="NCHW",
        sizes=(*_SMALL, (384, 384), (384, 2304), (2304, 384), (1152, 1153), (1, 3000)),
        large_sizes=(*_LARGE, (3000, 800)),
        inside=_inside_patches(ONEVISION_PINPOINTS),
    ),
    DeepseekOCRProcessor: Family(
        reference=_deepseek_ocr_reference,
        layout="NCHW",
        # 640 and 768 multiples and around them (DeepSeek-OCR's and OCR 2's local views): tiled
        # or not, grid ties; odd widths centre by rounding
        sizes=(*_SMALL, (640, 641), (768, 768), (769, 768), (768, 1536), (1025, 333), (20, 2000)),
        large_sizes=(*_LARGE, (2339, 1654)),
        random_side=1400,
        backends=("pil",),  # no HF processor: one (PIL) transform
    ),
    KimiK25MultiModalProcessor: Family(
        reference=_kimi_reference,
        layout="NCHW",
        # around the 16384-patch budget and the 512-patch side limit (7168 px)
        sizes=(*_SMALL, (28, 29), (7200, 10), (10, 9000)),
        large_sizes=(*_LARGE, (1792, 1792), (1793, 2000)),
        backends=("pil",),  # no HF transform: one (PIL) transform
    ),
    LlamaNemotronVLProcessor: Family(
        reference=_nemotron_reference,
        layout="NCHW",
        sizes=(*_SMALL, (512, 512), (512, 1536), (1024, 512), (90, 610)),
        large_sizes=(*_LARGE, (2339, 1654)),
        random_side=1400,
        backends=("pil",),  # no HF processor: one (PIL) transform
    ),
    Gemma3MultiModalProcessor: Family(
        # an image's range: "\n\n", <start_of_image>, its soft tokens, <end_of_image>, "\n\n"
        reference=_hf_reference(
            [],
            lambda p: [
                p.tokenizer.convert_tokens_to_ids("\n\n"),
                p.tokenizer.boi_token_id,
                p.tokenizer.image_token_id,
                p.tokenizer.eoi_token_id,
            ],
            embed_token=lambda p: int(p.tokenizer.image_token_id),
        ),
        layout="NCHW",
        sizes=(*_SMALL, (896, 896), (300, 1000)),
        large_sizes=_LARGE,
    ),
    Idefics3MultiModalProcessor: Family(
        reference=_idefics3_reference,
        layout="NCHW",
        # 364 multiples: one sub-image, or a grid's edge
        sizes=(*_SMALL, (364, 364), (365, 364), (364, 1456), (1456, 1456), (20, 2000)),
        large_sizes=(*_LARGE, (2000, 600)),
    ),
    SmolVLMMultiModalProcessor: Family(
        reference=_smolvlm_reference,
        layout="NCHW",
        # 384 multiples: one sub-image, or a grid's edge
        sizes=(*_SMALL, (384, 384), (385, 384), (384, 1536), (1536, 1536), (20, 2000)),
        large_sizes=(*_LARGE, (2000, 600)),
    ),
    Gemma4MultiModalProcessor: Family(
        reference=_gemma4_reference,
        layout="PATCHES",
        # 48-pixel multiples (kept unresized), and thin images past the 280:1 side rule
        sizes=(*_SMALL, (48, 48), (768, 816), (1, 5000), (6000, 2)),
        large_sizes=_LARGE,
    ),
    InternVLMultiModalProcessor: Family(
        reference=_hf_reference(
            [], lambda p: [p.start_image_token_id, p.image_token_id, p.end_image_token_id]
        ),
        layout="NCHW",
        # exact 448 multiples hit the grid rule's ties (equal ratios, more tiles)
        sizes=(*_SMALL, (448, 448), (448, 896), (1344, 448), (896, 896), (20, 2000)),
        large_sizes=(*_LARGE, (2160, 3840)),
        random_side=1400,
    ),
    PaddleOCRVLMultiModalProcessor: Family(
        reference=_hf_reference(
            ["image_grid_thw"], lambda p: [p.image_token_id], return_mm_token_type_ids=False
        ),
        layout="NCHW",
        sizes=(*_SMALL, (27, 29), (384, 384)),
        large_sizes=(*_LARGE, (2000, 3000)),
        max_aspect=150,  # above 200 is rejected, after scaling thin images up
    ),
}


# -------------------------------------------------------------------------- audio families


@dataclass(frozen=True)
class AudioFamily:
    """How the harness draws clips for an audio processor class (encoded in several codecs,
    decoded and resampled as vLLM's loader does) and calls its reference. Audio has no image
    backend: one ``backends`` entry."""

    #: ``reference(reference_processor, text, waveforms) -> BatchFeature`` (``input_ids`` and
    #: the feature fields)
    reference: Callable[[Any, str, list[np.ndarray]], Any]
    #: the fields compared bit for bit with the reference's
    fields: tuple[str, ...]
    #: ``(format, subtype, rate, channels)``: soundfile formats (``audio_samples.AudioCase``)
    clips: tuple[tuple[str, str, int, int], ...]
    seconds: tuple[float, ...]
    long_seconds: tuple[float, ...]
    backends: tuple[str, ...] = ("torchvision",)
    placeholder_words: tuple[str, str] = ("user", "assistant")


def _qwen2_audio_reference(proc: Any, text: str, waveforms: list[np.ndarray]) -> Any:
    """``Qwen2AudioProcessor`` called as vLLM's processor calls it."""
    rate = proc.feature_extractor.sampling_rate
    return proc(
        text=[text], audio=waveforms, sampling_rate=rate, truncation=True, return_tensors="pt"
    )


#: every codec libsndfile reads for vLLM, rates 8 to 48 kHz, mono and stereo
_AUDIO_CLIPS = (
    ("WAV", "PCM_16", 8000, 1), ("WAV", "PCM_16", 16000, 2), ("WAV", "FLOAT", 22050, 1),
    ("WAV", "PCM_24", 48000, 2), ("WAV", "PCM_U8", 11025, 1), ("FLAC", "PCM_16", 44100, 2),
    ("FLAC", "PCM_24", 16000, 1), ("MP3", "MPEG_LAYER_III", 44100, 2),
    ("MP3", "MPEG_LAYER_III", 22050, 1), ("OGG", "VORBIS", 48000, 2),
    ("OGG", "VORBIS", 16000, 1), ("OGG", "OPUS", 48000, 1),
)  # fmt: skip

AUDIO_FAMILIES: dict[type, AudioFamily] = {
    Qwen2AudioMultiModalProcessor: AudioFamily(
        reference=_qwen2_audio_reference,
        fields=("input_features", "feature_attention_mask"),
        clips=_AUDIO_CLIPS,
        # 0.1 s to a few seconds; 30 s chunks: exactly one, just under and over (cut), 60 s
        seconds=(0.1, 0.37, 1.0, 2.71, 6.0),
        long_seconds=(29.99, 30.0, 31.3, 60.0),
    ),
}


def check_audio_case(name: str, n_clips: int, case_seed: int, *, large: bool = False) -> None:
    """One seeded audio case of adapter ``name``: ``n_clips`` clips drawn from the family's
    codecs and durations, decoded to the feature extractor's rate with vLLM's loader
    (:func:`aiomm.media.audio.decode_audio`); for each of our transforms, token ids equal the
    reference's, one placeholder range per clip covers exactly the reference's audio tokens
    (every one an embedding), and each field equals the reference's bit for bit."""
    from audio_samples import AudioCase, signal
    from audio_samples import encode as encode_audio

    from aiomm.media.audio import decode_audio

    info = get_adapter_info(name)
    fam = family_of(info)
    assert isinstance(fam, AudioFamily)
    rng = random.Random(case_seed)
    durations = fam.seconds + (fam.long_seconds if large else ())
    proc = hf_processor(name)
    rate = int(proc.feature_extractor.sampling_rate)
    drawn, waveforms = [], []
    for _ in range(n_clips):
        fmt, subtype, clip_rate, channels = rng.choice(fam.clips)
        seconds = rng.choice(durations)
        case = AudioCase("clip", fmt, subtype, clip_rate, channels, seconds)
        data = encode_audio(case, signal(clip_rate, channels, seconds, rng.randrange(2**16)))
        drawn.append(f"{fmt}/{subtype} {clip_rate} Hz x{channels} {seconds} s")
        waveforms.append(decode_audio(data, target_rate=rate))
    ctx = f"[{name} seed={case_seed} (run seed {SEED}) clips={drawn}]"

    text = prompt_text(name, n_clips)
    ref = fam.reference(proc, text, waveforms)
    ref_ids = ref["input_ids"][0].tolist()
    prompt_ids = proc.tokenizer(text)["input_ids"]
    audio_token = int(proc.audio_token_id)
    expected = [i for i, t in enumerate(ref_ids) if t == audio_token]
    for mode in _modes(info):
        out = build_processor(name, proc, config=MultiModalConfig(transform=mode)).apply(
            prompt_ids, {"audio": waveforms}
        )
        where = f"{ctx} {mode}"
        assert out.prompt_token_ids == ref_ids, f"{where}: token ids differ"
        ranges = out.mm_placeholders["audio"]
        assert len(ranges) == n_clips, f"{where}: {len(ranges)} ranges"
        covered = [r.offset + j for r in ranges for j in range(r.length)]
        assert covered == expected, f"{where}: placeholder ranges"
        assert all(r.is_embed is None for r in ranges), f"{where}: is_embed"
        merged = out.merged_kwargs()
        for key in fam.fields:
            got, want = merged[key], ref[key]
            assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {key}"
            assert torch.equal(got, want), f"{where}: {key} differs"


def family_of(info: AdapterInfo) -> Family | AudioFamily:
    """The :class:`Family` (or :class:`AudioFamily`) of an adapter's processor class (looked up
    along its MRO).

    :raises LookupError: for a processor class no family covers.
    """
    for cls in info.processor_cls.__mro__:
        if cls in FAMILIES:
            return FAMILIES[cls]
        if cls in AUDIO_FAMILIES:
            return AUDIO_FAMILIES[cls]
    raise LookupError(
        f"{info.processor_cls.__qualname__} ({info.short_name}) has no Family in "
        "tests/support/adapter_parity.py: add how to draw images for it and call its reference"
    )


def cases() -> Iterator[tuple[str, str]]:
    """``(short name, backend)`` of every registered adapter, in registry order."""
    for info in supported_adapters():
        for backend in family_of(info).backends:
            yield info.short_name, backend


def prompt_text(name: str, n_images: int) -> str:
    """A one-turn prompt with ``n_images`` of the adapter's placeholders (images', or an audio
    adapter's clips') between words."""
    info = get_adapter_info(name)
    placeholders = info.processor_cls.dummy_inputs.placeholders
    placeholder = placeholders.get("image") or placeholders["audio"]
    start, end = family_of(info).placeholder_words
    return parity.prompt_text(n_images, placeholder, start=start, end=end)


def _modes(info: AdapterInfo) -> tuple[str, ...]:
    has_hf = getattr(info.processor_cls, "has_hf_transform", True)
    return ("hf", "native") if has_hf else ("native",)


def check_case(
    name: str,
    backend: str,
    n_images: int,
    case_seed: int,
    *,
    large: bool = False,
    sizes: Sequence[tuple[int, int]] | None = None,
    kwargs: dict[str, Any] | None = None,
    classic: bool = False,
) -> None:
    """One seeded case of adapter ``name`` on ``backend`` (see the module docstring; an audio
    adapter's: :func:`check_audio_case`, ``n_images`` clips)."""
    info = get_adapter_info(name)
    fam = family_of(info)
    if isinstance(fam, AudioFamily):
        check_audio_case(name, n_images, case_seed, large=large)
        return
    kwargs = kwargs or {}
    rng = random.Random(case_seed)
    nrng = np.random.default_rng(case_seed)
    if sizes is None:
        pool = fam.sizes + (fam.large_sizes if large else ())
        sizes = parity.draw_sizes(
            rng, n_images, pool, random_side=fam.random_side, max_aspect=fam.max_aspect
        )
    images = [photo_like(nrng, h, w) for h, w in sizes]
    ctx = f"[{name}/{backend} seed={case_seed} (run seed {SEED}) sizes={sizes} kwargs={kwargs}]"

    proc = hf_processor(name, backend)
    text = prompt_text(name, len(images))
    ref = fam.reference(proc, text, images, kwargs)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    expected_ranges = [i for i, t in enumerate(ref.input_ids) if t in ref.range_tokens]
    expected_embeds = [i for i, t in enumerate(ref.input_ids) if t == ref.embed_token]

    for mode in _modes(info):
        config = MultiModalConfig(transform=mode, mm_device_do_normalize=True)
        out = build_processor(name, proc, config=config).apply(
            prompt_ids, {"image": images}, kwargs
        )
        where = f"{ctx} {mode}"
        assert out.prompt_token_ids == ref.input_ids, f"{where}: token ids differ"
        merged = out.merged_kwargs()
        for key, value in ref.fields.items():
            assert torch.equal(merged[key], value), f"{where}: {key} {merged[key]} vs {value}"

        ranges = out.mm_placeholders["image"]
        assert len(ranges) == len(images), f"{where}: {len(ranges)} ranges"
        covered = [r.offset + j for r in ranges for j in range(r.length)]
        embeds = [
            r.offset + j
            for r in ranges
            for j in range(r.length)
            if r.is_embed is None or r.is_embed[j]
        ]
        assert covered == expected_ranges, f"{where}: placeholder ranges"
        assert embeds == expected_embeds, f"{where}: embedding positions"

        pv = merged["pixel_values"]
        ref_pv = ref.pixel_values_u8
        assert pv.dtype == torch.uint8, f"{where}: {pv.dtype}"
        assert pv.shape == ref_pv.shape, f"{where}: {tuple(pv.shape)} vs {tuple(ref_pv.shape)}"
        # uint8 -> the reference's dtype is exact (0..255 are exact in every float dtype)
        assert torch.equal(pv.to(ref_pv.dtype), ref_pv), f"{where}: uint8 pixel_values differ"

        norm = out.normalization
        assert norm is not None and norm.layout.name == fam.layout, f"{where}: {norm}"
        normalised = norm.module().forward_native(pv, torch.float32, layout=norm.layout)
        ours_f, ref_f = normalised, ref.pixel_values
        if fam.inside is not None:
            ours_f, ref_f = fam.inside(ours_f, ref), fam.inside(ref_f, ref)
        err = rel_err(ours_f, ref_f)
        tolerance = NORMALISED_REL_ERR
        if fam.float_dtype != torch.float32:
            tolerance = torch.finfo(fam.float_dtype).eps
        assert err < tolerance, f"{where}: normalised rel err {err:.3g}"

        if classic:
            config = MultiModalConfig(transform=mode, mm_device_do_normalize=False)
            out = build_processor(name, proc, config=config).apply(
                prompt_ids, {"image": images}, kwargs
            )
            assert out.normalization is None, where
            assert out.prompt_token_ids == ref.input_ids, f"{where} classic: token ids differ"
            pv = out.merged_kwargs()["pixel_values"]
            assert pv.dtype == fam.float_dtype, f"{where} classic: {pv.dtype}"
            assert torch.equal(pv, ref.pixel_values), f"{where} classic: float pixels differ"
