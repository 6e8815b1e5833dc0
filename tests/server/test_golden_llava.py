"""``aiomm serve llava-next`` and ``aiomm serve llava-onevision`` against responses recorded from
vLLM 0.33's render server for the same offline folders (``fixtures_llava_next/``,
``fixtures_llava_onevision/``; items kept as digests: each is megabytes of bfloat16 patches).

vLLM's LLaVA items are rows of HF's padded batch: ``pixel_values`` ``[most patches, 3, side,
side]`` (normalised, in the model's dtype) with ``image_sizes`` kept on the CPU (``mm_metadata``);
aiomm's items hold their own patches and the server pads them per request, which
``chat_tiled_images`` (three grids in one request) pins down.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from render_compare import assert_matches_recorded

from aiomm.vllm.wire import Field, decode_item

HERE = Path(__file__).parent
FIXTURES = {"next": HERE / "fixtures_llava_next", "onevision": HERE / "fixtures_llava_onevision"}
CASES = {
    family: sorted(p.stem for p in folder.glob("*.json")) for family, folder in FIXTURES.items()
}
#: the recorded (height, width) of chat_tiled_images' three images
_TILED_SIZES = ([400, 700], [900, 300], [72, 96])


def _load(family: str, name: str) -> dict[str, Any]:
    return json.loads((FIXTURES[family] / f"{name}.json").read_text())


@pytest.mark.parametrize("name", CASES["next"])
def test_llava_next_matches_vllm(live_server_llava_next: Any, name: str) -> None:
    assert_matches_recorded(live_server_llava_next.url, _load("next", name), name)


@pytest.mark.parametrize("name", CASES["onevision"])
def test_llava_onevision_matches_vllm(live_server_llava_onevision: Any, name: str) -> None:
    assert_matches_recorded(live_server_llava_onevision.url, _load("onevision", name), name)


def test_onevision_videos_are_refused(live_server_llava_onevision: Any) -> None:
    """vLLM's OneVision video loader is not reproduced: a ``video_url`` part is a 400 naming the
    parameter (vLLM would render it), and images still render."""
    case = _load("onevision", "chat_jpeg")
    body = json.loads(json.dumps(case["body"]))
    clip = "data:video/mp4;base64," + base64.b64encode(b"\0\0\0\x18ftypmp42").decode()
    body["messages"][0]["content"].append({"type": "video_url", "video_url": {"url": clip}})
    url = live_server_llava_onevision.url + case["path"]
    refused = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert "video" in refused.json()["error"]["param"]
    assert httpx.post(url, json=case["body"], timeout=120).status_code == 200


@pytest.mark.parametrize("family", ["next", "onevision"])
def test_the_fixtures_cover_the_cases(family: str) -> None:
    assert {
        "chat_jpeg", "chat_two_images", "chat_tiled_images", "chat_rgba", "chat_greyscale",
        "chat_palette", "chat_multi_turn", "chat_system", "chat_mm_none",
        "error_one_of_two_images_bad",
    } <= set(CASES[family])  # fmt: skip
    assert _load(family, "error_one_of_two_images_bad")["status"] == 400
    # vLLM takes the LLaVA families' thinnest images (Qwen-VL's aspect-ratio refusal is not theirs)
    assert _load(family, "error_image_aspect_ratio")["status"] == 200


@pytest.mark.parametrize(
    ("family", "lengths"), [("next", [1948, 2376, 1368]), ("onevision", [2379, 2997, 1317])]
)
def test_items_are_the_requests_padded_batch(family: str, lengths: list[int]) -> None:
    """Every item of a request has the request's most patches (equal base64 lengths: same
    shapes), and ``image_sizes`` is batched and kept on the CPU."""
    features = _load(family, "chat_tiled_images")["response"]["features"]
    items = features["kwargs_data"]["image"]
    assert len(items) == 3 and len({item["chars"] for item in items}) == 1
    assert [r["length"] for r in features["mm_placeholders"]["image"]] == lengths
    for meta, size in zip(features["mm_metadata"]["image"], _TILED_SIZES, strict=True):
        ((value, field),) = decode_item(meta).values()
        assert torch.equal(torch.from_numpy(value.array().copy()), torch.tensor(size))
        assert field == Field("batched", {"keep_on_cpu": True})
