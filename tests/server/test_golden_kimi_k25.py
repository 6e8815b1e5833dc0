"""``aiomm serve kimi-k2.5`` against responses recorded from vLLM 0.33's own render server.

The fixtures (``fixtures_kimi_k25/``, items kept as digests) were rendered for the folder
``aiomm.adapters.folders.write_model_folder("kimi-k2.5", ...)`` writes, with vLLM's processor
cache off: token ids, every image's run of ``<|media_pad|>`` as its placeholder range, uint8
``pixel_values`` (14-px patches, normalised on the device) and ``grid_thws`` (kept on the CPU, so
also in ``mm_metadata``), all keyed ``vision_chunk``. vLLM's CPU render server runs the model's
MLA text model without prefix caching, so with no processor cache it names each item by its
request's count (``renderer0-mm-<n>-vision_chunk-<i>``); the count depends on the requests a
server saw before, so the cases compare it as ``<n>``, and
:func:`test_items_are_named_by_the_request_count` checks the counting itself. A bad image is
refused (alone or beside a good one); a video, which vLLM 0.33 fails on (500), is a 400 (the
model takes no videos: a client's fault).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from render_compare import differences

from aiomm.vllm.wire import decode_item

FIXTURES = Path(__file__).parent / "fixtures_kimi_k25"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
#: the cases vLLM refuses: undecodable images (400) and a video (500; aiomm: 400)
REFUSED = {"error_bad_image", "error_one_of_two_images_bad", "video_short"}
RENDER = "/v1/chat/completions/render"
_COUNTED = re.compile(r"^renderer0-mm-(\d+)-vision_chunk-(\d+)$")


def _load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _uncounted(response: Any) -> Any:
    """``response`` with each item id's request count replaced by ``<n>``."""
    out = copy.deepcopy(response)
    features = out.get("features") if isinstance(out, dict) else None
    if features:
        features["mm_hashes"] = {
            m: [_COUNTED.sub(r"renderer0-mm-<n>-vision_chunk-\2", h) for h in ids]
            for m, ids in features["mm_hashes"].items()
        }
    return out


def test_the_fixtures_cover_successes_refusals_and_counted_ids() -> None:
    statuses = {name: _load(name)["status"] for name in CASES}
    assert {n for n, s in statuses.items() if s != 200} == REFUSED
    assert _load("video_short")["status"] == 500
    assert len(statuses) - len(REFUSED) >= 12
    grids = set()
    for name in CASES:
        features = _load(name)["response"].get("features") or {}
        ids = (features.get("mm_hashes") or {}).get("vision_chunk", [])
        given = name == "chat_uuid"  # a client's uuid is kept
        assert all(bool(_COUNTED.match(h)) != given for h in ids), (name, ids)
        for item in (features.get("mm_metadata") or {}).get("vision_chunk", []):
            grids.add(tuple(decode_item(item)["grid_thws"][0].array().reshape(-1).tolist()))
    assert len(grids) >= 4 and all(t == 1 for t, _, _ in grids)


@pytest.mark.parametrize("name", CASES)
def test_kimi_images_match_vllm(live_server_kimi_k25: Any, name: str) -> None:
    case = _load(name)
    resp = httpx.post(live_server_kimi_k25.url + case["path"], json=case["body"], timeout=120)
    if name == "video_short":  # vLLM's 500 is a client's fault: a documented 400 here
        assert resp.status_code == 400, resp.text
        assert "videos are not supported" in resp.json()["error"]["message"]
        return
    found = differences(
        resp.status_code,
        _uncounted(resp.json()),
        case["status"],
        _uncounted(case["response"]),
        body=case["body"],
        path=case["path"],
    )
    assert not found, f"{name}: " + "\n".join(found)
    if case["status"] != 200 or case["response"]["features"]["mm_metadata"] is None:
        return
    features = case["response"]["features"]
    ranges = features["mm_placeholders"]["vision_chunk"]
    for item, r in zip(features["mm_metadata"]["vision_chunk"], ranges, strict=True):
        fields = decode_item(item)
        assert list(fields) == ["grid_thws"]
        t, h, w = fields["grid_thws"][0].array().reshape(-1).tolist()
        assert r["length"] == t * h * w // 4, (name, r)


def test_items_are_named_by_the_request_count(live_server_kimi_k25: Any) -> None:
    """Each multimodal request vLLM processes takes the next count (one with a client's uuid
    too); a request refused before processing (an undecodable image) takes none."""
    cases = {n: _load(n)["body"] for n in ("chat_two_images", "chat_uuid", "error_bad_image")}

    def count(body: dict[str, Any], status: int = 200) -> int | None:
        resp = httpx.post(live_server_kimi_k25.url + RENDER, json=body, timeout=120)
        assert resp.status_code == status, resp.text
        if status != 200:
            return None
        ids = resp.json()["features"]["mm_hashes"]["vision_chunk"]
        matched = [_COUNTED.match(h) for h in ids]
        if not any(matched):
            return None
        assert [int(m[2]) for m in matched if m] == list(range(len(ids))), ids
        assert len({m[1] for m in matched if m}) == 1, ids
        return int(matched[0][1]) if matched[0] else None

    first = count(cases["chat_two_images"])
    assert first is not None
    assert count(cases["chat_uuid"]) is None  # its only item keeps the client's uuid
    count(cases["error_bad_image"], status=400)
    assert count(cases["chat_two_images"]) == first + 2
