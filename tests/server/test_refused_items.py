"""Items a model's processor refuses, through ``aiomm serve``: an aspect ratio above 200 (Qwen-VL,
GLM-V), a resize that leaves a side of no pixels (Mistral 3) and a video shorter than one temporal
patch (Qwen3-VL, GLM-4V, GLM-OCR) are the client's fault, a 400 with the OpenAI error shape that
names the error, what was wrong and which item, never a 500.

vLLM 0.33's render server answers 400 to each (measured for Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
GLM-4V, GLM-OCR, Mistral 3, and Qwen2-Audio for a clip of one feature frame, at most 160
samples at 16 kHz: "too short to be represented inside the model"; Qwen3-Omni for a lone clip of
at most 160 samples, which its extractor's STFT refuses: the golden fixture
``fixtures_qwen3_omni/error_qwen3_tiny_alone.json``; the aspect-ratio case is the
golden fixture
``fixtures/error_image_aspect_ratio.json``). Every registered architecture is either covered here
or listed as one whose processor refuses none of these items.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import PIL.Image
import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient

from aiomm.adapters import supported_adapters
from aiomm.adapters.chameleon import ChameleonMultiModalProcessor
from aiomm.adapters.deepseek_ocr import DeepseekOCRProcessor
from aiomm.adapters.folders import write_model_folder
from aiomm.adapters.gemma import Gemma3MultiModalProcessor
from aiomm.adapters.gemma4 import Gemma4MultiModalProcessor
from aiomm.adapters.glm import Glm5NextMultiModalProcessor, GlmVMultiModalProcessor
from aiomm.adapters.idefics3 import Idefics3MultiModalProcessor
from aiomm.adapters.internvl import InternVLMultiModalProcessor
from aiomm.adapters.kimi_k25 import KimiK25MultiModalProcessor
from aiomm.adapters.llama4 import Llama4MultiModalProcessor
from aiomm.adapters.llava import LlavaNextMultiModalProcessor, LlavaOnevisionMultiModalProcessor
from aiomm.adapters.mistral3 import Mistral3MultiModalProcessor
from aiomm.adapters.nemotron_vl import LlamaNemotronVLProcessor
from aiomm.adapters.paddleocr_vl import PaddleOCRVLMultiModalProcessor
from aiomm.adapters.qwen2_audio import Qwen2AudioMultiModalProcessor
from aiomm.adapters.qwen3_omni import Qwen3OmniProcessor
from aiomm.adapters.qwen_omni import QwenOmniProcessor
from aiomm.adapters.qwen_vl import QWEN3, QwenVLProcessor
from aiomm.adapters.registry import AdapterInfo
from aiomm.server import ServerConfig, create_app

RENDER = "/v1/chat/completions/render"
FIXTURE = Path(__file__).parent / "fixtures" / "error_image_aspect_ratio.json"
#: processors that refuse none of the items below: their resize keeps any shape (Chameleon's
#: shortest edge and crop, GLM-5-Next's padded canvas, Nemotron's tiles, Gemma 3's fixed square
#: and crops, DeepSeek-OCR 2's padded global view) and take no videos, or resize frames to a
#: fixed square (LLaVA-OneVision)
ACCEPTING = (
    ChameleonMultiModalProcessor,
    Glm5NextMultiModalProcessor,
    LlamaNemotronVLProcessor,
    Gemma3MultiModalProcessor,
    InternVLMultiModalProcessor,
    LlavaNextMultiModalProcessor,
    LlavaOnevisionMultiModalProcessor,
    Llama4MultiModalProcessor,
    Idefics3MultiModalProcessor,
    Gemma4MultiModalProcessor,  # any aspect ratio: a thin side becomes 48 px
    DeepseekOCRProcessor,
    KimiK25MultiModalProcessor,  # any shape: each side at least 1 px, padded to 28
)


def _png(height: int, width: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _mp4(frames: int, height: int, width: int, rate: int) -> bytes:
    pytest.importorskip("av")
    from video_samples import frames_of, make_video

    return make_video(frames_of(frames, height, width), "libx264", "mp4", rate=rate)


def _part(kind: str, mime: str, data: bytes) -> dict[str, object]:
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    return {"type": kind, kind: {"url": url}}


def _image(data: bytes) -> dict[str, object]:
    return _part("image_url", "image/png", data)


def _video(data: bytes) -> dict[str, object]:
    return _part("video_url", "video/mp4", data)


def _wav(samples: int) -> bytes:
    import soundfile

    buf = io.BytesIO()
    wave = 0.3 * np.sin(np.arange(samples, dtype=np.float32) / 7)
    soundfile.write(buf, wave, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _audio(data: bytes) -> dict[str, object]:
    return _part("audio_url", "audio/wav", data)


def _body(*parts: dict[str, object]) -> dict[str, object]:
    content = [{"type": "text", "text": "describe"}, *parts]
    return {"messages": [{"role": "user", "content": content}]}


@dataclass(frozen=True)
class Refusal:
    """An item, the error that refuses it, and what its message names."""

    label: str
    part: Callable[[], dict[str, object]]
    error: str
    modality: str
    names: str


#: a 8x2000 image: an aspect ratio of 250 (above 200 for Qwen-VL and GLM-V); Pixtral keeps it
THIN_IMAGE = Refusal("thin image", lambda: _image(_png(8, 2000)), "AspectRatioError", "image",
                     "8x2000")  # fmt: skip
#: a 1x2500 image: Pixtral scales it by 2500/1540 to fit, which floors its height to 0
EMPTY_RESIZE = Refusal("image resized to nothing", lambda: _image(_png(1, 2500)),
                       "EmptyResizeError", "image", "resized to 0x1540")  # fmt: skip
#: 4x840 frames (8 at 4 fps): an aspect ratio of 210
THIN_VIDEO = Refusal("thin video", lambda: _video(_mp4(8, 4, 840, 4)), "AspectRatioError",
                     "video", "4x840 frames")  # fmt: skip
#: vLLM's loaders sample one frame of these: Qwen3-VL's of a 1-frame video, GLM-4V's (2 a
#: second) and GLM-OCR's of 8 frames at 10 fps
ONE_FRAME_QWEN3 = Refusal("one sampled frame", lambda: _video(_mp4(1, 32, 32, 8)),
                          "TooFewFramesError", "video", "1 sampled frame(s)")  # fmt: skip
ONE_FRAME_GLM = Refusal("one sampled frame", lambda: _video(_mp4(8, 32, 32, 10)),
                        "TooFewFramesError", "video", "1 sampled frame(s)")  # fmt: skip


#: 161 samples at 16 kHz: two feature frames, which the audio encoder turns into no token
SHORT_AUDIO = Refusal("too short audio", lambda: _audio(_wav(161)), "ItemRejectedError", "audio",
                      "2 feature frame(s) are too short")  # fmt: skip
#: 100 samples, padded to one hop: too short for the STFT of Qwen3-Omni's extractor, alone
TINY_AUDIO = Refusal("audio too short alone", lambda: _audio(_wav(100)), "ItemRejectedError",
                     "audio", "a clip of 160 samples")  # fmt: skip


def refusals(info: AdapterInfo) -> list[Refusal]:
    """The items ``info``'s processor refuses (none for :data:`ACCEPTING`)."""
    cls = info.processor_cls
    if cls is QwenOmniProcessor:  # Qwen2-VL images and videos, Qwen2-Audio's token rule
        return [THIN_IMAGE, THIN_VIDEO, SHORT_AUDIO]
    if cls is Qwen3OmniProcessor:  # the same images and videos; every clip has tokens
        return [THIN_IMAGE, THIN_VIDEO, TINY_AUDIO]
    if cls is QwenVLProcessor:
        timestamps = info.build_hf_processor is QWEN3  # Qwen3VLVideoProcessor
        return [THIN_IMAGE, THIN_VIDEO, *([ONE_FRAME_QWEN3] if timestamps else [])]
    if cls is GlmVMultiModalProcessor:
        return [THIN_IMAGE, THIN_VIDEO, ONE_FRAME_GLM]
    if cls is Mistral3MultiModalProcessor:
        return [EMPTY_RESIZE]
    if cls is PaddleOCRVLMultiModalProcessor:  # images only; 200 after scaling thin sides up
        return [THIN_IMAGE]
    if cls is Qwen2AudioMultiModalProcessor:
        return [SHORT_AUDIO]
    return []


REFUSING = [info.short_name for info in supported_adapters() if refusals(info)]


def test_every_architecture_is_covered_or_refuses_nothing() -> None:
    for info in supported_adapters():
        assert refusals(info) or issubclass(info.processor_cls, ACCEPTING), info.short_name
    assert {"qwen2-vl", "qwen2.5-vl", "qwen3-vl", "glm-4v", "glm-ocr", "mistral3"} <= set(REFUSING)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("refusing-folders")


@pytest.mark.parametrize("name", REFUSING)
def test_a_refused_item_is_a_400_naming_it(name: str, folders: Path) -> None:
    from aiomm.adapters import get_adapter_info

    folder = write_model_folder(name, folders / name)
    takes_images = "image" in get_adapter_info(name).processor_cls.supported_modalities
    good = _image(_png(40, 52, seed=1)) if takes_images else _audio(_wav(16000))
    with TestClient(create_app(ServerConfig(model=str(folder)))) as client:
        for refusal in refusals(get_adapter_info(name)):
            # a good image first: the refused item is item 1 (images, then videos)
            response = client.post(RENDER, json=_body(good, refusal.part()))
            what = f"{name}: {refusal.label}"
            assert response.status_code == 400, (what, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, what
            assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, None)
            message = error["message"]
            prefix = f"{refusal.error}: the model's processor refuses this {refusal.modality}"
            assert message.startswith(prefix), (what, message)
            assert refusal.names in message, (what, message)
            assert "item_index=1" in message, (what, message)
        # the server goes on serving
        assert client.post(RENDER, json=_body(good)).status_code == 200, name


def test_the_recorded_refusal_is_answered_as_vllm_answers_it(live_server) -> None:
    """vLLM's answer to a 600x2 image (an aspect ratio of 300) for the Qwen2-VL folder: a 400
    ``BadRequestError`` naming no parameter; aiomm's also names the error and the item."""
    case = json.loads(FIXTURE.read_text())
    response = httpx.post(live_server.url + case["path"], json=case["body"], timeout=60)
    assert response.status_code == case["status"] == 400, response.text
    ours, theirs = response.json()["error"], case["response"]["error"]
    assert set(ours) == set(theirs)
    assert (ours["type"], ours["code"], ours["param"]) == (
        theirs["type"], theirs["code"], theirs["param"],
    )  # fmt: skip
    assert ours["message"].startswith("AspectRatioError: ")
    assert "2x600 image" in ours["message"] and "item_index=0" in ours["message"]
