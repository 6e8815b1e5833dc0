"""Items a model's processor refuses reach the caller as typed errors naming the item: an
:class:`~aiomm.errors.ItemRejectedError` leaf in ``Result.error`` (or raised by ``process``) with
the request id, the item's ``item_index`` and what was wrong, with either transform (the HF one
refuses before the HF processor is called, the native one before it resizes)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL.Image
import pytest

from aiomm.adapters import glm, mistral3, qwen_vl
from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import (
    AspectRatioError,
    EmptyResizeError,
    ItemRejectedError,
    ProcessingError,
    TooFewFramesError,
)
from aiomm.types import Request

TRANSFORMS = ["native", "hf"]
#: each adapter's image and video placeholder text
PLACEHOLDERS = {
    "qwen2-vl": (qwen_vl.IMAGE_PLACEHOLDER, qwen_vl.VIDEO_PLACEHOLDER),
    "qwen3-vl": (qwen_vl.IMAGE_PLACEHOLDER, qwen_vl.VIDEO_PLACEHOLDER),
    "glm-4v": (glm.IMAGE_PLACEHOLDER, glm.VIDEO_PLACEHOLDER),
    "glm-ocr": (glm.IMAGE_PLACEHOLDER, glm.VIDEO_PLACEHOLDER),
    "mistral3": (mistral3.IMAGE_PLACEHOLDER, None),
}


def _png(height: int, width: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


GOOD = _png(40, 52, seed=1)


def _request(
    name: str, images: Sequence[Any], videos: Sequence[Any] = (), **kwargs: Any
) -> Request:
    image, video = PLACEHOLDERS[name]
    text = " ".join(["look", *[image] * len(images), *[video] * len(videos)])
    return Request(
        prompt=text, images=images, videos=list(videos), request_id="req-9",
        mm_processor_kwargs=kwargs or None,
    )  # fmt: skip


async def _refusal(make_processor: Any, name: str, transform: str, request: Request) -> Any:
    """The error of ``request`` (item 1 refused): ``process`` raises what ``process_safe``
    returns."""
    processor = make_processor(name, transform=transform)
    async with Engine(processor, EngineConfig(device="cpu")) as engine:
        result = await engine.process_safe(request)
        with pytest.raises(ItemRejectedError) as raised:
            await engine.process(request)
    error = result.error
    assert type(raised.value) is type(error) and str(raised.value) == str(error)
    assert isinstance(error, ItemRejectedError) and isinstance(error, ProcessingError)
    assert isinstance(error, ValueError)
    assert (error.request_id, error.item_index) == ("req-9", 1), repr(error)
    assert str(error).endswith("[request_id='req-9', item_index=1]")
    return error


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", ["qwen2-vl", "glm-4v"])
async def test_an_image_above_the_aspect_ratio_limit(make_processor, name, transform) -> None:
    request = _request(name, [GOOD, _png(8, 2000)])
    error = await _refusal(make_processor, name, transform, request)
    assert isinstance(error, AspectRatioError)
    assert (error.modality, error.height, error.width, error.ratio) == ("image", 8, 2000, 250)
    assert error.limit == 200
    assert "8x2000 image" in str(error) and "aspect ratio of 250" in str(error)


@pytest.mark.parametrize("transform", TRANSFORMS)
async def test_an_image_resized_to_no_pixels(make_processor, transform) -> None:
    request = _request("mistral3", [GOOD, _png(1, 2500)])
    error = await _refusal(make_processor, "mistral3", transform, request)
    assert isinstance(error, EmptyResizeError)
    assert (error.modality, error.height, error.width) == ("image", 1, 2500)
    assert error.target == (0, 1540)
    assert "1x2500 image" in str(error) and "resized to 0x1540" in str(error)


@pytest.mark.parametrize("transform", TRANSFORMS)
async def test_a_video_above_the_aspect_ratio_limit(make_processor, transform) -> None:
    frames = np.random.default_rng(2).integers(0, 256, (4, 4, 840, 3), np.uint8)
    request = _request("qwen2-vl", [GOOD], [frames])
    error = await _refusal(make_processor, "qwen2-vl", transform, request)
    assert isinstance(error, AspectRatioError)
    assert (error.modality, error.height, error.width, error.ratio) == ("video", 4, 840, 210)
    assert "video of 4x840 frames" in str(error)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", ["qwen3-vl", "glm-ocr"])
async def test_a_video_of_one_frame(make_processor, name, transform) -> None:
    """One frame is fewer than a temporal patch of 2 (Qwen3-VL samples a 1-frame video to one
    frame; GLM-V is given its frames unsampled)."""
    pytest.importorskip("av")
    from video_samples import frames_of, make_video

    if name == "qwen3-vl":
        request = _request(name, [GOOD], [make_video(frames_of(1, 32, 32))])
    else:
        request = _request(name, [GOOD], [frames_of(1, 32, 32)], do_sample_frames=False)
    error = await _refusal(make_processor, name, transform, request)
    assert isinstance(error, TooFewFramesError)
    assert (error.modality, error.frames, error.minimum) == ("video", 1, 2)
    assert "1 sampled frame(s) is shorter than temporal_patch_size 2" in str(error)
