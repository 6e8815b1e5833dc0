"""Every registered architecture through ``aiomm serve``: its offline model folder
(:mod:`aiomm.adapters.folders`) served by the app, a chat render request with one and with two
images (PNG and JPEG data URLs; the Responses and Anthropic endpoints must render the same
features, and ``mm_payload: "none"`` the same ids without tensors), checked against the reference HF
processor (``build_hf_processor``) on the same rendered prompt text and the same decoded images:

- ``token_ids`` equal the processor's ``input_ids``;
- each ``mm_placeholders`` range covers one image's tokens: every image token lies in a range,
  and a range holds only special tokens;
- every tensor of every ``kwargs_data`` item (decoded with the project's codec) equals the
  processor's output for that item bit for bit (a ``flat`` item is the run its slice names, a
  ``batched`` one the item's row, a padded image its unpadded corner);
- ``mm_hashes`` are deterministic (the same image, the same hash in another request) and differ
  per image.

A new architecture is covered by registering it (and its family's chat template).
"""

from __future__ import annotations

import base64
import io
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch

pytest.importorskip("starlette")
from starlette.testclient import TestClient

from aiomm.adapters import build_processor, get_adapter_info, supported_adapters
from aiomm.adapters.folders import write_model_folder
from aiomm.media.samples import encode, photo_like
from aiomm.server import ServerConfig, create_app
from aiomm.server.data_urls import lift_data_urls
from aiomm.vllm.generate_request import WireForm, model_float_dtype
from aiomm.vllm.wire import Field, TensorValue, decode_item

sys.path.insert(0, str(Path(__file__).parent))  # the upstream stand-in, as test_gateway does

#: the architectures that take images (an audio architecture's renders are checked by its
#: golden fixtures)
ADAPTERS = [
    info.short_name
    for info in supported_adapters()
    if "image" in info.processor_cls.supported_modalities
]
#: (height, width) of the three test images: small, odd, one wider than tall
SIZES = ((37, 52), (64, 41), (50, 50))
#: the processors' per-token text outputs (not items)
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


def _photo(seed: int, size: tuple[int, int], fmt: str) -> bytes:
    return encode(photo_like(np.random.default_rng(seed), *size), fmt)


#: PNGs and a JPEG (the JPEG goes through the server's TurboJPEG decode)
IMAGES = [_photo(i, s, "JPEG" if i == 1 else "PNG") for i, s in enumerate(SIZES)]


def test_the_server_tests_send_lifted_and_parsed_data_urls() -> None:
    # every architecture's renders below take both request paths: the PNGs' payloads decoded
    # from the body's bytes (aiomm.server.data_urls), the small JPEG's parsed with the JSON
    _, lifted = lift_data_urls(json.dumps(_body(IMAGES)).encode(), 1 << 30)
    assert lifted is not None and list(lifted.payloads) == [IMAGES[0], IMAGES[2]]


def _mime(data: bytes) -> str:
    return "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"


def _data_url(data: bytes) -> str:
    return f"data:{_mime(data)};base64," + base64.b64encode(data).decode()


def _body(images: list[bytes]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "describe"}]
    for i, data in enumerate(images):
        parts.append({"type": "text", "text": "the first image" if i == 0 else "and the second"})
        parts.append({"type": "image_url", "image_url": {"url": _data_url(data)}})
    parts.append({"type": "text", "text": "please"})
    return {"messages": [{"role": "system", "content": "look"}, {"role": "user", "content": parts}]}


def _responses_body(images: list[bytes]) -> dict[str, Any]:
    """:func:`_body` as an OpenAI Responses request."""
    system, user = _body(images)["messages"]
    parts = [
        {"type": "input_text", "text": p["text"]}
        if p["type"] == "text"
        else {"type": "input_image", "image_url": p["image_url"]["url"]}
        for p in user["content"]
    ]
    return {"instructions": system["content"], "input": [{"role": "user", "content": parts}]}


def _anthropic_body(images: list[bytes]) -> dict[str, Any]:
    """:func:`_body` as an Anthropic messages request (base64 image sources)."""
    system, user = _body(images)["messages"]
    blocks = [
        p
        if p["type"] == "text"
        else {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": p["image_url"]["url"][5:].partition(";")[0],
                "data": p["image_url"]["url"].partition(",")[2],
            },
        }
        for p in user["content"]
    ]
    return {
        "system": system["content"],
        "max_tokens": 64,  # required by the Anthropic API
        "messages": [{"role": "user", "content": blocks}],
    }


def _conversation(images: list[bytes]) -> list[dict[str, Any]]:
    """The conversation the template sees (OpenAI parts; an image part is ``{"type": "image"}``)."""
    out = []
    for message in _body(images)["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        out.append({"role": message["role"], "content": content})
    return out


class Reference:
    """The architecture's reference processor on the folder's rendered prompt text."""

    def __init__(self, name: str, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.info = get_adapter_info(name)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        #: vLLM casts floating-point outputs to the model's dtype (the folder's torch_dtype)
        self.float_dtype = model_float_dtype(folder)
        self.processor = self.info.build_hf_processor(backend="torchvision")

    def image_token_id(self) -> int:
        if getattr(self.info.processor_cls, "has_hf_transform", True):
            return int(self.processor.image_token_id)
        if self.info.short_name in ("deepseek-ocr-2", "deepseek-ocr"):
            return int(self.tokenizer.convert_tokens_to_ids("<image>"))
        if self.info.short_name == "kimi-k2.5":
            return int(self.tokenizer.convert_tokens_to_ids("<|media_pad|>"))
        return int(self.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"))

    def __call__(
        self, images: list[bytes], *, normalized: bool = True
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Token ids and item outputs; ``normalized=False``: the pixels before rescaling and
        normalisation (what a server with ``mm_device_do_normalize`` sends, as uint8)."""
        text = self.tokenizer.apply_chat_template(
            _conversation(images), tokenize=False, add_generation_prompt=True
        )
        # decoded as vLLM's loader does for RGB PNGs and JPEGs: plain RGB
        pil = [PIL.Image.open(io.BytesIO(d)).convert("RGB") for d in images]
        if self.info.short_name in ("deepseek-ocr-2", "deepseek-ocr"):
            # vLLM runs its own processor: the independent re-statement, each <image> repeated
            from deepseek_ocr_reference import reference_outputs as deepseek_outputs

            ref = deepseek_outputs(pil, strategy=self.processor.strategy)
            image_id = self.image_token_id()
            counts, ids = iter(ref["tokens"]), []
            for t in self.tokenizer.encode(text, add_special_tokens=False):
                ids.extend([t] * next(counts) if t == image_id else [t])
            return ids, {
                "images_crop": ref["images_crop"],
                "pixel_values": ref["float"] if normalized else ref["uint8"],
                "images_spatial_crop": ref["images_spatial_crop"],
            }
        if self.info.short_name == "kimi-k2.5":
            # vLLM runs its own processor: the independent re-statement, each pad repeated
            from kimi_reference import reference_outputs as kimi_outputs

            ref = kimi_outputs(pil)
            pad = self.image_token_id()
            counts, ids = iter(ref["tokens"]), []
            for t in self.tokenizer.encode(text, add_special_tokens=False):
                ids.extend([t] * next(counts) if t == pad else [t])
            return ids, {
                "pixel_values": ref["float"] if normalized else ref["uint8"],
                "grid_thws": ref["grid_thws"],
            }
        if not getattr(self.info.processor_cls, "has_hf_transform", True):
            # Llama Nemotron VL: no transformers processor; the independent re-statement
            from nemotron_vl_reference import reference_outputs, reference_prompt

            ref = reference_outputs(pil)
            ids = self.tokenizer.encode(
                reference_prompt(text, ref["num_patches"]), add_special_tokens=False
            )
            return ids, {
                "pixel_values": ref["float"] if normalized else ref["uint8"],
                "image_num_patches": torch.tensor(ref["num_patches"]),
            }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs = {} if normalized else {"do_rescale": False, "do_normalize": False}
            out = self.processor(text=[text], images=pil, return_tensors="pt", **kwargs)
        images_out = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        if type(self.processor).__name__ == "Llama4Processor":
            # vLLM's per-image fields, which the processor drops: its image processor's
            tiles = self.processor.image_processor(pil, do_rescale=False, do_normalize=False)
            images_out["aspect_ratios"] = torch.stack(tiles["aspect_ratios"])
            images_out["patches_per_image"] = torch.tensor([len(t) for t in tiles["pixel_values"]])
        if type(self.processor).__name__ == "InternVLProcessor":
            # vLLM's per-image tile counts, which the processor drops: its image processor's rule
            count = self.processor.image_processor.get_number_of_image_patches
            images_out["image_num_patches"] = torch.tensor(
                [count(p.height, p.width, {"crop_to_patches": True}) for p in pil]
            )
        if type(self.processor).__name__ == "Gemma3Processor":
            # vLLM's count of each image and its pan-and-scan crops, which the processor drops
            crops = self.processor.image_processor(pil, **self.processor.images_kwargs)
            images_out["num_patches"] = torch.tensor([1 + n for n in crops["num_crops"]])
        if type(self.processor).__name__ in ("Idefics3Processor", "SmolVLMProcessor"):
            # vLLM squeezes the one prompt's batch row and counts each image's sub-images
            count = self.processor.image_processor.get_number_of_image_patches
            for key in ("pixel_values", "pixel_attention_mask"):
                images_out[key] = images_out[key][0]
            images_out["num_patches"] = torch.tensor(
                [max(count(p.height, p.width, {})[0], 1) for p in pil]
            )
        return out["input_ids"][0].tolist(), images_out


def _tensor(value: TensorValue) -> torch.Tensor:
    array = value.array()
    if value.dtype == "bfloat16":
        return torch.from_numpy(array.copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _reference_item(
    key: str, i: int, field: Field, got: torch.Tensor, ref: torch.Tensor, offset: int = 0
) -> torch.Tensor:
    """Item ``i``'s part of the reference batch ``ref`` as the wire ``field`` describes it.
    ``offset``: the rows of the items before it, for slices that describe only their own item
    (vLLM's Qwen3-VL items: one slice from 0)."""
    if field.kind == "flat":
        slices = field.kwargs["slices"]
        if len(slices) == 1 and i > 0:  # the item's own rows
            (start, stop, step), *rest = slices[0]
            assert start == 0, (key, field)
            start, stop = offset, offset + stop
        else:
            (start, stop, step), *rest = slices[i]
        assert not rest and step is None, (key, field)
        return ref[start:stop]
    assert field.kind == "batched", (key, field)
    row = ref[i]
    if row.dim() >= 2 and tuple(row.shape) != tuple(got.shape):
        # a padded image batch: the item is the unpadded top-left corner, zeros around it
        h, w = got.shape[-2:]
        assert torch.count_nonzero(row[..., h:, :]) == 0, key
        assert torch.count_nonzero(row[..., :h, w:]) == 0, key
        row = row[..., :h, :w]
    return row


def _wire_modality(name: str) -> str:
    """The modality vLLM's render server names the model's image items by (Kimi-K2.5's:
    ``vision_chunk``)."""
    return WireForm.of(build_processor(name)).modality_names.get("image", "image")


def _check_render(
    response: dict[str, Any], images: list[bytes], reference: Reference, name: str
) -> list[str]:
    modality = _wire_modality(name)
    items = response["features"]["kwargs_data"][modality]
    # uint8 pixels: the server defers rescaling and normalisation to the model's device
    deferred = any(
        isinstance(v, TensorValue) and v.dtype == "uint8"
        for item in items
        for v, _ in decode_item(item).values()
    )
    ids, outputs = reference(images, normalized=not deferred)
    assert response["token_ids"] == ids, name
    features = response["features"]
    ranges = features["mm_placeholders"][modality]
    assert len(ranges) == len(images), name
    image_token = reference.image_token_id()
    covered = set()
    specials = {int(t) for t in reference.tokenizer.added_tokens_decoder}
    previous_end = 0
    for r in ranges:
        start, stop = r["offset"], r["offset"] + r["length"]
        assert previous_end <= start < stop <= len(ids), (name, ranges)
        previous_end = stop
        inside = ids[start:stop]
        assert image_token in inside, (name, r)
        assert set(inside) <= specials, f"{name}: a text token inside placeholder {r}"
        covered.update(range(start, stop))
    assert {i for i, t in enumerate(ids) if t == image_token} <= covered, name

    assert len(items) == len(images), name
    offsets: dict[str, int] = {}
    # the keys as vLLM's processor sends them (Mistral 3's items carry no image_sizes; Llama
    # Nemotron VL's name their tiles pixel_values_flat and carry the image token's id)
    wire = WireForm.of(build_processor(name))
    wire_names = {wire.renamed_keys.get(k, k): k for k in outputs if k not in wire.dropped_keys}
    for i, b64 in enumerate(items):
        decoded = decode_item(b64)
        if wire.image_token_id is not None:
            (token, token_field) = decoded.pop("image_token_id")
            assert _tensor(token).item() == wire.image_token_id, name
            assert token_field == Field("shared", {"keep_on_cpu": True, "batch_size": len(images)})
        assert set(decoded) == set(wire_names), (name, sorted(decoded), sorted(wire_names))
        for wire_key, (value, field) in decoded.items():
            key = wire_names[wire_key]
            got = _tensor(value)
            want = _reference_item(key, i, field, got, outputs[key], offsets.get(key, 0))
            offsets[key] = offsets.get(key, 0) + (int(got.shape[0]) if got.dim() else 1)
            if got.dtype == torch.uint8 and want.is_floating_point():
                # the HF processor's unnormalised pixels are whole numbers in a float tensor
                assert torch.equal(want, want.round().clamp(0, 255)), f"{name}: {key}"
                want = want.to(torch.uint8)
            elif want.is_floating_point() and reference.float_dtype is not None:
                want = want.to(reference.float_dtype)
            assert got.dtype == want.dtype, f"{name}: {key} dtype {got.dtype} != {want.dtype}"
            assert got.shape == want.shape, f"{name}: {key} shape {got.shape} != {want.shape}"
            assert torch.equal(got, want), f"{name}: item {i} {key} differs"
    hashes = features["mm_hashes"][modality]
    assert len(set(hashes)) == len(images), name
    return list(hashes)


class Folders:
    """Each architecture's offline folder, written once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.built:
            self.built[name] = write_model_folder(name, self.root / name)
        return self.built[name]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    return Folders(tmp_path_factory.mktemp("model-folders"))


@pytest.mark.parametrize("name", ADAPTERS)
def test_chat_render_equals_the_reference_processor(name: str, folders: Folders) -> None:
    folder = folders[name]
    reference = Reference(name, folder)
    # the items' base64 made as the response is sent here, whole before it below: same bytes
    with TestClient(create_app(ServerConfig(model=str(folder), encode_on_send=True))) as client:
        one = client.post("/v1/chat/completions/render", json=_body(IMAGES[:1]))
        assert one.status_code == 200, one.text
        (hash_a,) = _check_render(one.json(), IMAGES[:1], reference, name)
        two = client.post("/v1/chat/completions/render", json=_body(IMAGES[1:3]))
        assert two.status_code == 200, two.text
        hashes = _check_render(two.json(), IMAGES[1:3], reference, name)
        assert hash_a not in hashes
        eager_config = ServerConfig(model=str(folder), encode_on_send=False)
        with TestClient(create_app(eager_config)) as eager:
            whole = eager.post("/v1/chat/completions/render", json=_body(IMAGES[1:3]))
        assert whole.status_code == 200, whole.text
        assert {**whole.json(), "request_id": ""} == {**two.json(), "request_id": ""}, name
        again = client.post("/v1/chat/completions/render", json=_body([IMAGES[2], IMAGES[0]]))
        assert again.status_code == 200, again.text
        modality = _wire_modality(name)
        assert again.json()["features"]["mm_hashes"][modality] == [hashes[1], hash_a], name
        # the Responses and Anthropic endpoints render the same request to the same features
        for path, body in (
            ("/v1/responses/render", _responses_body(IMAGES[1:3])),
            # the Anthropic API requires the model's name
            ("/v1/messages/render", {"model": str(folder), **_anthropic_body(IMAGES[1:3])}),
        ):
            other = client.post(path, json=body)
            assert other.status_code == 200, other.text
            assert other.json()["token_ids"] == two.json()["token_ids"], (name, path)
            assert other.json()["features"] == two.json()["features"], (name, path)
        # /tokenize renders a chat as the chat route does: the same ids, images expanded
        tokens = client.post("/tokenize", json=_body(IMAGES[1:3]))
        assert tokens.status_code == 200, tokens.text
        assert tokens.json()["tokens"] == two.json()["token_ids"], name
        # the same ids and placeholders without tensors
        bare = client.post(
            "/v1/chat/completions/render", json={**_body(IMAGES[1:3]), "mm_payload": "none"}
        )
        assert bare.status_code == 200, bare.text
        features = bare.json()["features"]
        assert bare.json()["token_ids"] == two.json()["token_ids"], name
        assert features["mm_placeholders"] == two.json()["features"]["mm_placeholders"], name
        assert features["mm_hashes"][modality] == hashes, name
        assert features["kwargs_data"] is None, name


@pytest.mark.parametrize("name", ADAPTERS)
def test_gateway_with_the_official_client(name: str, folders: Folders) -> None:
    """``/v1/chat/completions`` through a loopback stand-in of ``vllm serve --tokens-only`` that
    validates the ``GenerateRequest`` (the official openai client, plain and streamed)."""
    openai = pytest.importorskip("openai")
    from upstream_standin import StandIn, UpstreamServer, validate

    folder = folders[name]
    reference = Reference(name, folder)
    tokenizer = reference.tokenizer
    script = [*tokenizer.encode("a photo of the picture", add_special_tokens=False)]
    script.append(int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)))
    reply = tokenizer.decode(script, skip_special_tokens=True)
    image_token = reference.image_token_id()
    standin = StandIn(script, image_token_id=image_token, runs=False)
    with (
        UpstreamServer(standin) as upstream,
        TestClient(create_app(ServerConfig(model=str(folder), upstream=upstream.url))) as http,
    ):
        client = openai.OpenAI(
            base_url=str(http.base_url) + "/v1", api_key="none", http_client=http, max_retries=0
        )
        messages = _body(IMAGES[:2])["messages"]
        out = client.chat.completions.create(model=str(folder), messages=messages)
        assert out.choices[0].message.content == reply, name
        assert out.choices[0].finish_reason == "stop"
        body = standin.seen[-1]
        assert validate(body, image_token_id=image_token, runs=False) == [], name
        assert len(body["features"]["mm_placeholders"][_wire_modality(name)]) == 2
        assert out.usage.prompt_tokens == len(body["token_ids"])
        assert out.usage.completion_tokens == len(script)
        stream = client.chat.completions.create(
            model=str(folder), messages=_body(IMAGES[2:])["messages"], stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream)
        assert text == reply, name
        assert standin.seen[-1]["stream"] is True


def _video_body(model: str) -> dict[str, Any]:
    """A chat render request with one short H.264 clip as a data URL (skips without PyAV)."""
    pytest.importorskip("av")
    from video_samples import frames_of, make_video

    clip = base64.b64encode(make_video(frames_of(10, 30, 40), rate=10)).decode()
    video = {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{clip}"}}
    return {"model": model, "messages": [{"role": "user", "content": [video]}]}


def test_a_short_name_serves_its_offline_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aiomm serve glm-4v``: the registered name is built into the cache and served; its
    items are hashed with the name as the model id; its chat template writes videos, whose
    ranges span ``<|begin_of_video|>`` to ``<|end_of_video|>`` (the golden GLM-4V fixtures)."""
    video_body = _video_body("glm-4v")
    monkeypatch.setenv("AIOMM_CACHE_DIR", str(tmp_path))
    with TestClient(create_app(ServerConfig(model="glm-4v"))) as client:
        out = client.post("/v1/chat/completions/render", json=_body(IMAGES[:1]))
        assert out.status_code == 200, out.text
        rendered = client.post("/v1/chat/completions/render", json=video_body)
        assert rendered.status_code == 200, rendered.text
        models = client.get("/v1/models").json()["data"]
    tok = get_adapter_info("glm-4v").build_hf_processor().tokenizer
    ids = rendered.json()["token_ids"]
    (span,) = rendered.json()["features"]["mm_placeholders"]["video"]
    first, last = ids[span["offset"]], ids[span["offset"] + span["length"] - 1]
    assert tok.convert_ids_to_tokens([first, last]) == ["<|begin_of_video|>", "<|end_of_video|>"]
    folder = next((tmp_path / "models").iterdir())
    assert folder.name.startswith("glm-4v-")
    _check_render(out.json(), IMAGES[:1], Reference("glm-4v", folder), "glm-4v")
    assert [m["id"] for m in models] == ["glm-4v"]
    from aiomm.vllm.generate_request import vllm_mm_hash

    assert out.json()["features"]["mm_hashes"]["image"] == [vllm_mm_hash(IMAGES[0], "glm-4v")]


def test_serve_refuses_an_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    from aiomm.cli import main

    assert main(["serve", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "qwen2-vl" in err
    assert len(err.strip().splitlines()) == 1


def test_glm5_next_videos_stay_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 loads GLM-5-Next videos with its own ``Glm5NextVideoBackend`` (not reproduced:
    its ``vllm launch render`` does not start for a GLM-5-Next folder, so nothing was recorded):
    a ``video_url`` part is a 400 naming the parameter, and images still render."""
    video_body = _video_body("glm-5-next")
    monkeypatch.setenv("AIOMM_CACHE_DIR", str(tmp_path))
    with TestClient(create_app(ServerConfig(model="glm-5-next"))) as client:
        refused = client.post("/v1/chat/completions/render", json=video_body)
        out = client.post("/v1/chat/completions/render", json=_body(IMAGES[:1]))
    assert refused.status_code == 400, refused.text
    assert "video" in refused.json()["error"]["param"]
    assert "not supported" in refused.json()["error"]["message"]
    assert out.status_code == 200, out.text
