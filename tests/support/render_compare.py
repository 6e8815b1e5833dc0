"""Compare two render servers' answers to one request: aiomm's and vLLM's (recorded or live).

:func:`differences` lists every way ``ours`` differs from ``theirs`` (empty when they are the
same render): status code, error shape, token ids, placeholders, mm_hashes, sampling params and
every top-level key, and each msgpack item decoded (dtype, shape, every byte, field kind and
slices), and the item's bytes too where the key order is the same; an item recorded as a digest
(``{"sha256", "chars"}`` of its base64 text) is compared by it. A response's random
``request_id`` is compared by its prefix only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx

from aiomm.vllm.wire import decode_item

__all__ = ("differences", "feature_differences")

_RANDOM_KEYS = {"request_id"}


def differences(
    status_ours: int,
    ours: Any,
    status_theirs: int,
    theirs: Any,
    *,
    body: Any = None,
    path: str = "",
) -> list[str]:
    """What differs between two answers to the request ``body`` sent to ``path`` (each a status
    and its JSON)."""
    if status_ours != status_theirs:
        return [f"status {status_ours} != {status_theirs}: {_short(ours)} | {_short(theirs)}"]
    if status_theirs != 200:
        a, b = ours.get("error", {}), theirs.get("error", {})
        out = []
        if set(a) != set(b):
            out.append(f"error keys {sorted(a)} != {sorted(b)}")
        if a.get("code") != b.get("code"):
            out.append(f"error code {a.get('code')} != {b.get('code')}")
        return out
    out: list[str] = []
    if isinstance(theirs, list):
        if not isinstance(ours, list) or len(ours) != len(theirs):
            return [f"a list of {len(theirs)} responses expected, got {_short(ours)}"]
        pairs = list(zip(ours, theirs, strict=True))
    else:
        pairs = [(ours, theirs)]
    # a client's id is vLLM's to compose (Anthropic bodies have no such field: random)
    client_id = (
        isinstance(body, dict)
        and isinstance(body.get("request_id"), str)
        and "messages" not in path
    )
    for i, (a, b) in enumerate(pairs):
        where = f"[{i}]" if len(pairs) > 1 else ""
        if not isinstance(a, dict) or not isinstance(b, dict):
            if a != b:
                out.append(f"{where} {_short(a)} != {_short(b)}")
            continue
        out += _response(a, b, where, client_id=client_id)
    return out


def assert_matches_recorded(
    url: str, case: dict[str, Any], name: str, timeout: float = 120
) -> httpx.Response:
    """POST a recorded case (``{"path", "body", "status", "response"}``) to the server at
    ``url`` and assert its answer equals the recorded one (:func:`differences`); the answer."""
    resp = httpx.post(url + case["path"], json=case["body"], timeout=timeout)
    found = differences(
        resp.status_code,
        resp.json(),
        case["status"],
        case["response"],
        body=case["body"],
        path=case["path"],
    )
    assert not found, f"{name}: " + "\n".join(found)
    return resp


def assert_modalities_in_recorded_order(
    url: str, case: dict[str, Any], timeout: float = 120
) -> None:
    """POST a recorded case with items of several modalities and assert the answer keys
    ``mm_hashes``, ``mm_placeholders``, ``kwargs_data`` and ``mm_metadata`` by modality in the
    recorded order (vLLM's: :func:`differences` compares JSON, which does not see key order)."""
    resp = httpx.post(url + case["path"], json=case["body"], timeout=timeout)
    assert resp.status_code == 200, resp.text
    got, want = resp.json()["features"], case["response"]["features"]
    for part in ("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"):
        assert list(got[part]) == list(want[part]), (part, list(got[part]), list(want[part]))


def _response(
    ours: dict[str, Any], theirs: dict[str, Any], where: str, *, client_id: bool
) -> list[str]:
    if "features" not in theirs:  # /tokenize and the like: plain JSON
        return [] if ours == theirs else [f"{where} {_short(ours)} != {_short(theirs)}"]
    out = []
    if set(ours) != set(theirs):
        out.append(f"{where} keys {sorted(set(ours) ^ set(theirs))} differ")
    for key in theirs.keys() & ours.keys():
        a, b = ours[key], theirs[key]
        if key in _RANDOM_KEYS:
            if client_id:
                if a != b:
                    out.append(f"{where} request_id {a!r} != {b!r}")
            elif str(a).split("-")[0].split("_")[0] != str(b).split("-")[0].split("_")[0]:
                out.append(f"{where} request_id prefix {a!r} vs {b!r}")
        elif key == "features" and b is not None and a is not None:
            out += feature_differences(a, b, f"{where}features")
        elif a != b:
            out.append(f"{where}{key}: {_short(a)} != {_short(b)}")
    return out


def feature_differences(
    ours: dict[str, Any], theirs: dict[str, Any], where: str = "features"
) -> list[str]:
    """What differs between two ``GenerateRequest.features`` (see the module docstring)."""
    out = []
    for key in ("mm_hashes", "mm_placeholders"):
        if ours.get(key) != theirs.get(key):
            out.append(f"{where}.{key}: {_short(ours.get(key))} != {_short(theirs.get(key))}")
    for part in ("kwargs_data", "mm_metadata"):
        a, b = ours.get(part), theirs.get(part)
        if b is None or a is None:
            if a is not b:
                out.append(f"{where}.{part}: {_short(a)} != {_short(b)}")
            continue
        if set(a) != set(b):
            out.append(f"{where}.{part} modalities {sorted(a)} != {sorted(b)}")
            continue
        for modality in b:
            out += _items(a[modality], b[modality], f"{where}.{part}.{modality}")
    return out


def _items(ours: list[str | None], theirs: list[str | None], where: str) -> list[str]:
    if len(ours) != len(theirs):
        return [f"{where}: {len(ours)} items != {len(theirs)}"]
    out = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a is None or b is None:
            if a is not b:
                out.append(f"{where}[{i}]: {_short(a)} != {_short(b)}")
            continue
        if isinstance(b, dict):  # a recorded digest of an item too large to keep
            digest = {"sha256": hashlib.sha256(a.encode()).hexdigest(), "chars": len(a)}
            if digest != b:
                out.append(f"{where}[{i}] digest {digest} != {b}")
            continue
        da, db = decode_item(a), decode_item(b)
        if set(da) != set(db):
            out.append(f"{where}[{i}] keys {sorted(da)} != {sorted(db)}")
            continue
        for key in db:
            (va, fa), (vb, fb) = da[key], db[key]
            if fa != fb:
                out.append(f"{where}[{i}].{key} field {fa} != {fb}")
            if va != vb:  # dtype, shape, every byte
                out.append(f"{where}[{i}].{key} tensor differs")
        if list(da) == list(db) and a != b:
            out.append(f"{where}[{i}] bytes differ with the same key order")
    return out


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
