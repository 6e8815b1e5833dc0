"""vLLM 0.33's ``GenerateRequest`` and its ``features``, written from an engine result: what
``vllm launch render`` answers and ``vllm serve --tokens-only`` takes at
``/inference/v1/generate``. Used by the render server and by the Ray stage.

Each item is written in vLLM's msgpack layout (:mod:`.wire`) as vLLM's multimodal processor for
the model shapes it (:class:`WireForm`: which keys, their names, their flat slices, the fields
kept on the CPU and sent again as ``mm_metadata``); :func:`vllm_mm_hash` is vLLM's mm_hash of an
image's encoded bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch

from aiomm.adapters import hf_class_name
from aiomm.engine._ids import random_hex
from aiomm.processing.fields import (
    FieldKind,
    MultiModalFieldConfig,
    MultiModalKwargsItem,
    PaddedImageField,
)
from aiomm.processing.image_ops import numpy_copyable
from aiomm.types import Result
from aiomm.vllm.errors import ApiError
from aiomm.vllm.media import vllm_mm_hash
from aiomm.vllm.request_values import flag, lax_bool, lax_int
from aiomm.vllm.video_media import video_loader
from aiomm.vllm.wire import (
    Field,
    PiecesString,
    WireRows,
    encode_item_lazy,
    encode_item_pieces,
)

__all__ = (
    "WireForm",
    "counter_ids",
    "encode_items",
    "generate_request",
    "generate_request_features",
    "model_float_dtype",
    "order_modalities",
    "place_payload",
    "rename_modalities",
    "vllm_mm_hash",
)


#: keys vLLM keeps on the CPU (sent again as ``mm_metadata``)
_KEEP_ON_CPU = frozenset(
    {
        "image_grid_thw",
        "video_grid_thw",
        "second_per_grid_ts",
        "timestamps",
        "image_num_patches",
        "image_token_id",
        "image_sizes",
        "num_patches",  # Gemma 3
        "patches_per_image",
        "aspect_ratios",
        "images_spatial_crop",  # DeepSeek-OCR 2
        "video_frame_counts",  # Gemma 4's video items
        "video_num_soft_tokens",
        "video_timestamps",
        "grid_thws",  # Kimi-K2.5
    }
)


#: wire order of an item's keys (vLLM's with PYTHONHASHSEED=0); other keys follow
_KEY_ORDER = (
    "image_token_id",
    "image_num_patches",
    "patches_per_image",
    "pixel_values_flat",
    "timestamps",
    "images_crop",  # DeepSeek-OCR 2: its local views, global view, grid
    "pixel_position_ids",  # Gemma 4: its patches' positions before its patches
    "grid_thws",  # Kimi-K2.5: its grid before its patches
    "pixel_values",
    "images_spatial_crop",
    "image_grid_thw",
    "use_audio_in_video",  # Qwen2.5-Omni's video items: first
    "second_per_grid_ts",
    "video_grid_thw",
    "video_timestamps",  # Gemma 4: its video fields before its frames' patches
    "video_num_soft_tokens",
    "pixel_position_ids_videos",
    "video_frame_counts",
    "pixel_values_videos",
    "audio_feature_lengths",  # Qwen2.5-Omni's audio items
    "input_audio_features",
    "input_features",
    "feature_attention_mask",
)


_MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_float_dtype(folder: str | Path) -> torch.dtype | None:
    """The dtype vLLM casts an item's floating-point tensors to (``model_config.dtype`` with
    ``--dtype auto``: the folder's ``torch_dtype``); None when the config names none."""
    try:
        config = orjson.loads((Path(folder) / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    if name is None and isinstance(config.get("text_config"), dict):
        name = config["text_config"].get("torch_dtype") or config["text_config"].get("dtype")
    return _MODEL_DTYPES.get(str(name)) if name else None


#: keys an HF processor returns that vLLM's processor for it drops (absent from its fields
#: config), by HF processor class: Mistral 3's items carry only ``pixel_values``; LLaVA-OneVision's
#: no ``batch_num_images``
_DROPPED_KEYS: dict[str, frozenset[str]] = {
    "PixtralProcessor": frozenset({"image_sizes"}),
    "LlavaOnevisionProcessor": frozenset({"batch_num_images"}),
}


#: keys vLLM's processor names otherwise, by HF processor class: the InternVL-style processors
#: (Llama Nemotron VL) send their tiles as ``pixel_values_flat``
_RENAMED_KEYS: dict[str, dict[str, str]] = {
    "NemotronVLReference": {"pixel_values": "pixel_values_flat"},
    # Gemma 4's patch positions (aiomm's items already hold them under vLLM's name)
    "Gemma4Processor": {"image_position_ids": "pixel_position_ids"},
}


#: the processors whose items carry the image token's id as a ``shared`` field kept on the CPU
#: (vLLM's InternVL-style processors: the model picks the embedding positions with it), by HF
#: processor class: the adapter attribute holding the id
_TOKEN_ID_FIELD: dict[str, str] = {
    "NemotronVLReference": "img_context_id",
    "InternVLProcessor": "image_token_id",
}


#: the processors whose image items vLLM sends as rows of HF's padded batch, by HF processor
#: class: LLaVA-NeXT's and LLaVA-OneVision's patch stacks, each padded with zero patches to the
#: request's most
_PATCH_PADDED = frozenset({"LlavaNextProcessor", "LlavaOnevisionProcessor"})


#: keys vLLM's processor sends in another dtype than aiomm's items hold them, by HF processor
#: class: Idefics3's all-ones ``pixel_attention_mask`` (HF's int64; bool in aiomm's items and
#: caches, an eighth of the bytes)
_WIRE_DTYPES: dict[str, dict[str, torch.dtype]] = {
    "Idefics3Processor": {"pixel_attention_mask": torch.int64},
    "SmolVLMProcessor": {"pixel_attention_mask": torch.int64},
    # vLLM sets Qwen3-Omni's float32 masks after its processor output took the model's dtype
    "Qwen3OmniMoeProcessor": {"feature_attention_mask": torch.float32},
}


#: keys vLLM keeps on the CPU for one HF processor class only (besides :data:`_KEEP_ON_CPU`):
#: the Qwen Omni thinkers' audio masks and lengths, and their videos' ``use_audio_in_video``
_KEEP_ON_CPU_BY_FAMILY: dict[str, frozenset[str]] = {
    "Qwen2_5OmniProcessor": frozenset(
        {"feature_attention_mask", "audio_feature_lengths", "use_audio_in_video"}
    ),
    "Qwen3OmniMoeProcessor": frozenset(
        {"feature_attention_mask", "audio_feature_lengths", "use_audio_in_video"}
    ),
}


@dataclass(frozen=True)
class WireForm:
    """How vLLM 0.33's render server writes a model's items, which its multimodal processor
    decides (:meth:`of` a processor)."""

    #: each video item's flat fields describe only its own rows: vLLM's Qwen3-VL processes the
    #: videos one at a time (images are always processed in one call, so an image item's
    #: slices describe the request's whole image batch)
    per_video_slices: bool = False
    #: an item's prompt timestamps are sent as its ``timestamps`` field (Qwen3-VL's video items;
    #: GLM-4V's keep them in the prompt only)
    timestamps_field: bool = True
    #: keys the HF processor returns that vLLM's drops (:data:`_DROPPED_KEYS`)
    dropped_keys: frozenset[str] = frozenset()
    #: keys vLLM names otherwise (:data:`_RENAMED_KEYS`)
    renamed_keys: Mapping[str, str] = field(default_factory=dict)
    #: an image item's ``image_token_id`` (a ``shared`` int64 scalar kept on the CPU, batch size
    #: the request's images), as vLLM's InternVL-style items carry it; None: no such field
    image_token_id: int | None = None
    #: image items' ``pixel_values`` padded with zero patches to the most of the request's
    #: images (:data:`_PATCH_PADDED`; aiomm's items hold their own patches only)
    pad_patches: bool = False
    #: keys sent in another dtype than the items hold (:data:`_WIRE_DTYPES`)
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    #: the modality vLLM names aiomm's image items by where it differs (the adapter's
    #: ``wire_modality``: Kimi-K2.5's images are ``vision_chunk`` items)
    modality_names: Mapping[str, str] = field(default_factory=dict)
    #: keys kept on the CPU besides :data:`_KEEP_ON_CPU` (:data:`_KEEP_ON_CPU_BY_FAMILY`)
    keep_on_cpu: frozenset[str] = frozenset()
    #: the order vLLM writes the modalities of ``mm_placeholders``, ``kwargs_data`` and
    #: ``mm_metadata`` in where it is not images, videos, audio: its processor's field order
    #: (the adapter's ``wire_modality_order``: Qwen2.5-Omni's audio first)
    modality_order: tuple[str, ...] = ()

    @classmethod
    def of(cls, processor: Any) -> WireForm:
        """The wire form of ``processor``'s items (an aiomm adapter)."""
        loader = video_loader(hf_class_name(getattr(processor, "video_processor", None)))
        qwen3 = loader == "qwen3_vl"
        family = hf_class_name(getattr(processor, "hf_processor", None))
        token_attribute = _TOKEN_ID_FIELD.get(family)
        return cls(
            per_video_slices=qwen3,
            timestamps_field=qwen3 or loader is None,
            dropped_keys=_DROPPED_KEYS.get(family, frozenset()),
            renamed_keys=_RENAMED_KEYS.get(family, {}),
            image_token_id=None
            if token_attribute is None
            else int(getattr(processor, token_attribute)),
            pad_patches=family in _PATCH_PADDED,
            dtypes=_WIRE_DTYPES.get(family, {}),
            keep_on_cpu=_KEEP_ON_CPU_BY_FAMILY.get(family, frozenset()),
            modality_names=_wire_modalities(processor),
            modality_order=tuple(getattr(processor, "wire_modality_order", ())),
        )


def _wire_modalities(processor: Any) -> dict[str, str]:
    name = getattr(processor, "wire_modality", None)
    return {"image": name} if name else {}


def order_modalities(features: dict[str, Any], order: Sequence[str]) -> None:
    """Put ``features``' per-modality placeholders, items and metadata in vLLM's modality
    ``order`` (:attr:`WireForm.modality_order`), in place; ``mm_hashes`` keeps the request's."""
    if not order:
        return
    rank = {m: i for i, m in enumerate(order)}
    for part in ("mm_placeholders", "kwargs_data", "mm_metadata"):
        entries = features.get(part)
        if entries:
            features[part] = dict(sorted(entries.items(), key=lambda kv: rank.get(kv[0], 99)))


def rename_modalities(features: dict[str, Any], names: Mapping[str, str]) -> None:
    """Key ``features``' per-modality entries by vLLM's modality names (``names``:
    :attr:`WireForm.modality_names`), in place; after :func:`place_payload`, which matches the
    items' own modalities."""
    if not names:
        return
    for part in ("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"):
        entries = features.get(part)
        if entries:
            features[part] = {names.get(m, m): value for m, value in entries.items()}


def counter_ids(
    n: int,
    hashes: Mapping[str, Sequence[str]],
    uuids: Mapping[str, Sequence[str | None]],
    names: Mapping[str, str],
) -> dict[str, list[str]]:
    """The item ids vLLM's render server gives its ``n``-th multimodal request (counted from 1)
    when it hashes no content (its processor cache and prefix caching both off):
    ``renderer0-mm-<n>-<modality>-<i>`` under vLLM's modality ``names``, a client's uuid kept;
    ``hashes``: the items' ids per modality, ``uuids``: the client's (None where it gave none)."""
    out: dict[str, list[str]] = {}
    for modality, ids in hashes.items():
        given = list(uuids.get(modality) or [None] * len(ids))
        wire = names.get(modality, modality)
        out[modality] = [
            u if u is not None else f"renderer0-mm-{n}-{wire}-{i}" for i, u in enumerate(given)
        ]
    return out


def generate_request_features(
    result: Result,
    hashes: Sequence[str] | Mapping[str, Sequence[str]],
    *,
    wire: WireForm | None = None,
    tensors: bool = True,
    float_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest.features`` of an engine result made with
    ``EngineConfig(return_items=True)``: ``hashes`` are the items' mm_hashes (:func:`vllm_mm_hash`
    or the client's; a sequence for images, or a mapping per modality), ``tensors=False`` leaves
    the payload out, ``wire`` and ``float_dtype`` as :func:`encode_items` (``wire``: the
    model's, :meth:`WireForm.of` its processor). JSON-ready (plain strings)."""
    per_modality = {"image": hashes} if not isinstance(hashes, Mapping) else hashes
    per_modality = {m: list(h) for m, h in per_modality.items() if h}
    features: dict[str, Any] = {
        "mm_hashes": per_modality,
        "mm_placeholders": {
            m: [{"offset": r.offset, "length": r.length} for r in result.mm_placeholders.get(m, [])]
            for m in per_modality
        },
        "kwargs_data": None,
        "mm_metadata": None,
    }
    if tensors:
        kwargs_data, metadata = encode_items(
            result.items, wire or WireForm(), float_dtype=float_dtype
        )
        place_payload(
            features,
            result.items,
            [str(k) for k in kwargs_data],
            [None if m is None else str(m) for m in metadata],
        )
    return features


def place_payload(
    features: dict[str, Any],
    items: Sequence[MultiModalKwargsItem],
    kwargs_data: Sequence[Any],
    metadata: Sequence[Any],
) -> None:
    """``features``' ``kwargs_data`` and ``mm_metadata`` per modality, as vLLM writes them: a
    modality whose items have no metadata is left out of ``mm_metadata``, which is null when
    none has any."""
    features["kwargs_data"], features["mm_metadata"] = {}, {}
    for modality in features["mm_hashes"]:
        picked = [i for i, item in enumerate(items) if item.modality == modality]
        features["kwargs_data"][modality] = [kwargs_data[i] for i in picked]
        if any(metadata[i] is not None for i in picked):
            features["mm_metadata"][modality] = [metadata[i] for i in picked]
    features["mm_metadata"] = features["mm_metadata"] or None
    _check_metadata_modalities(features)


def _check_metadata_modalities(features: Mapping[str, Any]) -> None:
    """Refuse, as vLLM's ``MultiModalFeatures`` validator does, features whose ``mm_metadata``
    names other modalities than ``mm_hashes`` (LLaVA-OneVision's images keep ``image_sizes`` on
    the CPU, its videos nothing: a request with both is a 400 in vLLM 0.33).

    :raises ApiError: 400 with pydantic's message (its input shown cut to 25 + 24 characters).
    """
    metadata = features["mm_metadata"]
    if metadata is None or set(metadata) == set(features["mm_hashes"]):
        return
    head = repr({"mm_hashes": features["mm_hashes"]})[:25]
    last = list(metadata.values())[-1][-1]
    tail = ("None" if last is None else repr(str(last))) + "]}}"
    tail = tail[-24:]
    raise ApiError(
        "1 validation error for MultiModalFeatures\n  Value error, mm_metadata must use the same "
        f"modalities as mm_hashes [type=value_error, input_value={head}...{tail}, "
        "input_type=dict]\n    For further information visit "
        "https://errors.pydantic.dev/2.14/v/value_error"
    )


def generate_request(
    token_ids: list[int],
    features: dict[str, Any] | None,
    *,
    model: str | None,
    sampling_params: dict[str, Any],
    request_id: str | None = None,
    parse_context: dict[str, Any] | None = None,
    body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``GenerateRequest`` body for ``/inference/v1/generate`` (``vllm serve --tokens-only``),
    with vLLM 0.33's top-level keys; ``body`` is the client request it renders (stream, cache
    salt, priority and KV-transfer options come from it).

    :raises ApiError: the body's ``stream`` or ``priority`` of the wrong type.
    """
    body = body or {}
    stream = flag(body, "stream", False)
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ApiError("'cache_salt' must be a non-empty string if given", param="cache_salt")
    if salt is not None and (len(salt) > 128 or any(c in salt for c in "@/\\\0")):
        # vLLM's rule: a salt names cache entries, in keys that these characters delimit
        raise ApiError(
            "'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\' "
            "or NUL",
            param="cache_salt",
        )
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise ApiError("'kv_transfer_params' must be an object", param="kv_transfer_params")
    return_ids = body.get("return_token_ids")
    ec_params = body.get("ec_transfer_params")
    if ec_params is not None and not isinstance(ec_params, dict):
        raise ApiError("'ec_transfer_params' must be an object", param="ec_transfer_params")
    return {
        "request_id": request_id or f"aiomm-{random_hex(8)}",
        "token_ids": token_ids,
        "token_offsets": None,
        "features": features,
        "content_parts": None,
        "sampling_params": sampling_params,
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None
        if return_ids is None
        else lax_bool(return_ids, "return_token_ids"),
        "output_mode": "tokens",
        "parse_context": parse_context,
        "stream": stream,
        "stream_options": _stream_options(body.get("stream_options"), stream),
        "cache_salt": salt,
        "priority": 0 if body.get("priority") is None else lax_int(body["priority"], "priority"),
        "kv_transfer_params": kv_params or None,  # vLLM hoists only a non-empty one
        "ec_transfer_params": ec_params or None,
    }


def _stream_options(value: Any, stream: bool) -> dict[str, bool | None] | None:
    """vLLM's ``StreamOptions`` of a request, both flags written (an explicit null kept);
    non-empty ones only with ``stream``, and none at all without it."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    if value and not stream:
        raise ApiError(
            "Stream options can only be defined when `stream=True`", param="stream_options"
        )
    if not stream:
        return None
    return {key: _nullable_flag(value, key) for key in ("include_usage", "continuous_usage_stats")}


def _nullable_flag(value: Mapping[str, Any], key: str) -> bool | None:
    if key in value and value[key] is None:
        return None
    return flag(value, key, False)


def _wire_value(key: str, item: MultiModalKwargsItem, float_dtype: torch.dtype | None) -> Any:
    """``item[key]`` as vLLM's item holds it (repeated rows as a view the codec expands)."""
    value = item.data[key]
    config = item.fields[key]
    # dtype attributes and numpy views, not torch calls: each torch call releases the GIL
    # (aiomm.processing.image_ops' module docstring), and this runs once per item and response
    if (
        float_dtype is not None
        and isinstance(value, torch.Tensor)
        and value.dtype.is_floating_point
        and value.dtype != float_dtype
    ):
        value = value.to(float_dtype)  # as vLLM's processor output (BatchFeature's rule)
    if isinstance(value, torch.Tensor) and config.repeat is not None:
        # the layout is the field's (Repeat.expand_array); the codec writes it blockwise. numpy
        # has no bfloat16: its words go as int16, the bytes are the same
        raw = value.view(torch.int16) if value.dtype == torch.bfloat16 else value
        if numpy_copyable(raw):
            name = str(value.dtype).removeprefix("torch.")
            return WireRows(config.repeat.expand_array(raw.numpy()), name)
        return config.repeat.expand(value).reshape(value.shape[0], -1)
    return value


def _field(
    key: str, config: Any, slices: list[Any], keep_keys: frozenset[str], items_of_modality: int
) -> Field:
    keep = key in keep_keys
    if isinstance(config, PaddedImageField):
        # an item holds its own unpadded image: vLLM's processors unpad (Mistral 3, Pixtral)
        # and batch them
        return Field("batched", {"keep_on_cpu": keep})
    kind = config.kind if isinstance(config, MultiModalFieldConfig) else FieldKind.FLAT
    if kind is FieldKind.BATCHED:
        return Field("batched", {"keep_on_cpu": keep})
    if kind is FieldKind.SHARED:
        # shared by the request's items of the modality (each aiomm item was processed alone)
        return Field("shared", {"keep_on_cpu": keep, "batch_size": items_of_modality})
    # a flat field along another dim (Qwen2.5-Omni's feature frames: dim 1) says so
    return Field("flat", {"keep_on_cpu": keep, "slices": slices, "dim": getattr(config, "dim", 0)})


def encode_items(
    items: Sequence[MultiModalKwargsItem],
    wire: WireForm,
    *,
    float_dtype: torch.dtype | None = None,
    lazy: bool = False,
) -> tuple[list[PiecesString], list[PiecesString | None]]:
    """vLLM's ``kwargs_data`` and ``mm_metadata`` strings of a request's items, each as the
    base64 pieces the response writer sends without joining them (CPU work: call it in a
    worker thread); an item's metadata is None when it has no field kept on the CPU. ``wire``:
    the model's :class:`WireForm`. ``float_dtype``: floating-point tensors are cast to it
    (vLLM's model dtype). ``lazy``: ``kwargs_data``'s pieces are made as they are read
    (:class:`~.kwargs_codec.ItemB64`, from the items' tensors, which must stay unchanged).

    A flat field's slices describe the whole batch its item was processed in (every item of
    the batch carries all of them, as vLLM's do): the request's images are one batch; its
    videos too, or each its own with ``wire.per_video_slices`` (recorded from vLLM: two Qwen3-VL
    videos each carry ``[[[0, rows, None]]]``, two images ``[[[0, a, None]], [[a, b, None]]]``).
    """
    batches: list[list[int]] = [[], []]  # images and others, videos
    for i, item in enumerate(items):
        if wire.per_video_slices and item.modality == "video":
            batches.append([i])
        else:
            batches[item.modality == "video"].append(i)
    slices: list[dict[str, list[Any]]] = [{}] * len(items)
    batch_sizes = [0] * len(items)
    for batch in batches:
        batch_slices = _flat_slices([items[i] for i in batch])
        for i in batch:
            slices[i], batch_sizes[i] = batch_slices, len(batch)
    kwargs_data: list[PiecesString] = []
    counts = Counter(item.modality for item in items)
    keep_keys = _KEEP_ON_CPU | wire.keep_on_cpu
    metadata: list[PiecesString | None] = []
    most = _most_patches(items) if wire.pad_patches else 0
    for item, item_slices, batch_size in zip(items, slices, batch_sizes, strict=True):
        keys = [k for k in item.data if k not in wire.dropped_keys]
        names = {k: wire.renamed_keys.get(k, k) for k in keys}
        values = {names[k]: _wire_value(k, item, float_dtype) for k in keys}
        if most and item.modality == "image" and "pixel_values" in values:
            values["pixel_values"] = _padded_patches(values["pixel_values"], most)
        for key, dtype in wire.dtypes.items():
            if isinstance(values.get(key), torch.Tensor):
                values[key] = values[key].to(dtype)
        fields = {
            names[k]: _field(
                names[k], item.fields[k], item_slices.get(k, []), keep_keys, counts[item.modality]
            )
            for k in keys
        }
        if wire.image_token_id is not None and item.modality == "image":
            values["image_token_id"] = torch.tensor(wire.image_token_id)
            fields["image_token_id"] = Field(
                "shared", {"keep_on_cpu": True, "batch_size": batch_size}
            )
        seconds = item.prompt_data.get("timestamps")
        if seconds is not None and wire.timestamps_field:
            # Qwen3-VL: vLLM's video item carries its prompt's timestamps (a batched field)
            values["timestamps"] = [float(s) for s in seconds]
            fields["timestamps"] = Field("batched", {"keep_on_cpu": True})
        entries = {k: (values[k], fields[k]) for k in _ordered(values)}
        kwargs_data.append(
            PiecesString(encode_item_lazy(entries) if lazy else encode_item_pieces(entries))
        )
        meta = {k: e for k, e in entries.items() if k in keep_keys}
        metadata.append(PiecesString(encode_item_pieces(meta)) if meta else None)
    return kwargs_data, metadata


def _most_patches(items: Sequence[MultiModalKwargsItem]) -> int:
    """The most patches (rows of ``pixel_values``) of a request's image items."""
    rows = [
        int(item.data["pixel_values"].shape[0])
        for item in items
        if item.modality == "image" and isinstance(item.data.get("pixel_values"), torch.Tensor)
    ]
    return max(rows, default=0)


def _padded_patches(value: torch.Tensor, most: int) -> torch.Tensor:
    """``value``'s patches followed by zero patches, ``most`` in all."""
    if value.shape[0] >= most:
        return value
    out = value.new_zeros((most, *value.shape[1:]))
    out[: value.shape[0]] = value
    return out


def _flat_slices(items: Sequence[MultiModalKwargsItem]) -> dict[str, list[Any]]:
    """Per flat key, the slices of one batch's items that have it (an image has no video
    keys), in vLLM's nested form ``[[start, stop, None]]`` per item."""
    slices: dict[str, list[Any]] = {}
    starts: dict[str, int] = {}
    for item in items:
        for key, value in item.data.items():
            config = item.fields[key]
            if isinstance(config, MultiModalFieldConfig) and config.kind is not FieldKind.FLAT:
                continue
            dim = getattr(config, "dim", 0)
            rows = int(value.shape[dim]) if isinstance(value, torch.Tensor) and value.dim() else 1
            start = starts.get(key, 0)
            run = [start, start + rows, None]
            # vLLM's slice tuple: every index of the dims before ``dim``
            slices.setdefault(key, []).append([[None, None, None]] * dim + [run])
            starts[key] = start + rows
    return slices


def _ordered(keys: Any) -> list[str]:
    first = [k for k in _KEY_ORDER if k in keys]
    return first + [k for k in keys if k not in first]
