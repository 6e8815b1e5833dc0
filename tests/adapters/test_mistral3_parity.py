"""Parity of the Mistral 3 adapter with ``PixtralProcessor``, and batch-independent items.

Every run draws fresh random images (the seed is printed on failure) of many sizes and aspect
ratios, 1 to 4 per prompt. For both HF backends and both of our transforms: token ids equal HF's
``input_ids``; each placeholder range covers exactly its image's ``[IMG]``/``[IMG_BREAK]``/
``[IMG_END]`` tokens with ``is_embed`` set on the ``[IMG]`` ones only; ``image_sizes`` are equal;
every item holds its own unpadded ``[C, h, w]`` image and merging the items reproduces HF's padded
uint8 batch bit for bit; after ``FusedMMInputNorm`` every image equals HF's default float output
to a norm-wise relative error under 1e-6 (HF's padding is 0.0 after normalising, ours is uint8 0,
which the model crops away with ``image_sizes``: compared inside each image).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import parity
import pytest
import torch
from parity import SEED, rel_err

from aiomm.adapters import build_processor, supported_adapters
from aiomm.errors import ItemCountMismatchError, ProcessorKwargsError
from aiomm.processing.fields import merge_items
from aiomm.processing.processor import MultiModalConfig
from aiomm.samples import photo_like

BACKENDS = ("torchvision", "pil")
NAME = "mistral3"


def hf_processor(backend: str) -> Any:
    return parity.hf_processor(NAME, backend)


SIZES_SMALL = [(1, 1), (3, 5), (28, 28), (29, 27), (57, 33), (1, 150), (150, 1), (199, 3),
               (240, 320), (333, 500), (480, 640), (700, 20), (56, 1000)]  # fmt: skip
SIZES_LARGE = [(1080, 1920), (1536, 2048), (1600, 900)]


def draw_sizes(rng: random.Random, count: int, *, large: bool) -> list[tuple[int, int]]:
    return parity.draw_sizes(rng, count, SIZES_SMALL + (SIZES_LARGE if large else []))


def prompt_text(n_images: int) -> str:
    return parity.prompt_text(n_images, "[IMG]", start="[INST]", end="[/INST]")


def hf_reference(proc: Any, text: str, images: list[Any], uint8: bool) -> dict[str, Any]:
    kwargs = {"do_rescale": False, "do_normalize": False} if uint8 else {}
    return proc(text=[text], images=images, return_tensors="pt", **kwargs)


def check_case(
    backend: str,
    n_images: int,
    case_seed: int,
    *,
    large: bool = False,
    sizes: list[tuple[int, int]] | None = None,
) -> None:
    rng = random.Random(case_seed)
    nrng = np.random.default_rng(case_seed)
    sizes = sizes or draw_sizes(rng, n_images, large=large)
    images = [photo_like(nrng, h, w) for h, w in sizes]
    ctx = f"[{NAME}/{backend} seed={case_seed} sizes={sizes}]"

    proc = hf_processor(backend)
    text = prompt_text(n_images)
    ref_u8 = hf_reference(proc, text, images, uint8=True)
    ref_f = hf_reference(proc, text, images, uint8=False)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    img, brk, end = proc.image_token_id, proc.image_break_token_id, proc.image_end_token_id
    expected_ids = ref_u8["input_ids"][0].tolist()
    ref_sizes = ref_u8["image_sizes"]

    outputs = {}
    for mode in ("hf", "native"):
        ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
        out = ours.apply(prompt_ids, {"image": images})
        assert out.prompt_token_ids == expected_ids, f"{ctx} {mode}: token ids differ"
        merged = out.merged_kwargs()
        assert torch.equal(merged["image_sizes"], ref_sizes), f"{ctx} {mode}: image_sizes"

        ranges = out.mm_placeholders["image"]
        assert len(ranges) == n_images, ctx
        covered = sorted(i for r in ranges for i in range(r.offset, r.offset + r.length))
        expected_pos = [i for i, t in enumerate(expected_ids) if t in (img, brk, end)]
        assert covered == expected_pos, f"{ctx} {mode}: placeholder ranges"
        patch = proc.patch_size * proc.spatial_merge_size
        for r, (h, w) in zip(ranges, ref_sizes.tolist(), strict=True):
            tokens = expected_ids[r.offset : r.offset + r.length]
            assert r.is_embed == tuple(t == img for t in tokens), f"{ctx} {mode}: is_embed"
            assert r.embed_count == (h // patch) * (w // patch), ctx
            assert tokens[-1] == end and tokens.count(brk) == h // patch - 1, ctx

        # each item holds its own unpadded image
        for item, (h, w) in zip(out.mm_kwargs["image"], ref_sizes.tolist(), strict=True):
            assert tuple(item.data["pixel_values"].shape) == (3, h, w), f"{ctx} {mode}: item"

        pv = merged["pixel_values"]
        assert pv.dtype == torch.uint8, f"{ctx} {mode}: {pv.dtype}"
        ref_pv = ref_u8["pixel_values"]
        assert pv.shape == ref_pv.shape, f"{ctx} {mode}: {pv.shape} vs {ref_pv.shape}"
        assert torch.equal(pv.double(), ref_pv.double()), f"{ctx} {mode}: uint8 differs from HF"

        norm = out.normalization
        assert norm is not None and norm.layout.name == "NCHW", ctx
        normalised = norm.module().forward_native(pv, torch.float32, layout=norm.layout)
        ref_norm = ref_f["pixel_values"]
        ours_in = torch.cat([normalised[i, :, :h, :w].flatten() for i, (h, w) in
                             enumerate(ref_sizes.tolist())])  # fmt: skip
        ref_in = torch.cat([ref_norm[i, :, :h, :w].flatten() for i, (h, w) in
                            enumerate(ref_sizes.tolist())])  # fmt: skip
        err = rel_err(ours_in, ref_in)
        assert err < 1e-6, f"{ctx} {mode}: normalised rel err {err:.3g}"
        for i, (h, w) in enumerate(ref_sizes.tolist()):  # the padding: 0 in HF's float batch
            assert not ref_norm[i, :, h:, :].any() and not ref_norm[i, :, :, w:].any(), ctx
        outputs[mode] = pv
    assert torch.equal(outputs["hf"], outputs["native"]), f"{ctx}: native != hf"


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_small_images(backend: str) -> None:
    rng = random.Random(f"{SEED}-{backend}")
    for n_images in (1, 2, 3, 4, 4):
        check_case(backend, n_images, rng.randrange(2**31))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_large_images(backend: str) -> None:
    rng = random.Random(f"{SEED}-large-{backend}")
    check_case(backend, 3, rng.randrange(2**31), large=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_huge_photo(backend: str) -> None:
    """A 12-megapixel photo, scaled down to the 1540-pixel longest edge."""
    seed = random.Random(f"{SEED}-huge-{backend}").randrange(2**31)
    check_case(backend, 2, seed, sizes=[(3024, 4032), (200, 300)])


@pytest.mark.parametrize("mode", ["hf", "native"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_items_do_not_depend_on_batch_padding(backend: str, mode: str) -> None:
    """Items processed alone equal items processed in a padded batch; any merge reproduces HF."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 90, 200), photo_like(nrng, 500, 333), photo_like(nrng, 41, 41)]
    proc = hf_processor(backend)
    ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
    batch = ours.process_items({"image": images}, {})["image"]
    alone = [ours.process_items({"image": [image]}, {})["image"][0] for image in images]
    for a, b in zip(alone, batch, strict=True):
        for key in ("pixel_values", "image_sizes"):
            assert torch.equal(a.data[key], b.data[key]), f"{backend}/{mode} seed={SEED}"
        for item in (a, b):  # no item keeps the padded batch alive
            pv = item.data["pixel_values"]
            assert pv.untyped_storage().nbytes() == pv.nbytes and pv.is_contiguous()
    # two of the cached items merge into what HF returns for those two images
    for order in ([2, 0], [1, 2], [0, 1, 2]):
        merged = merge_items([alone[i] for i in order])
        ref = hf_reference(proc, prompt_text(len(order)), [images[i] for i in order], True)
        assert torch.equal(merged["pixel_values"], ref["pixel_values"]), f"{order} seed={SEED}"
        assert torch.equal(merged["image_sizes"], ref["image_sizes"]), f"{order} seed={SEED}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_classic_cpu_path_native_equals_hf_float(backend: str) -> None:
    """With mm_device_do_normalize off, both transforms return HF's padded float batch exactly."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 97, 211), photo_like(nrng, 640, 480), photo_like(nrng, 5, 9)]
    proc = hf_processor(backend)
    text = prompt_text(3)
    ref = hf_reference(proc, text, images, uint8=False)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    for mode in ("hf", "native"):
        config = MultiModalConfig(mm_device_do_normalize=False, transform=mode)
        out = build_processor(NAME, proc, config=config).apply(prompt_ids, {"image": images})
        assert out.normalization is None
        pv = out.merged_kwargs()["pixel_values"]
        assert pv.dtype == torch.float32
        assert torch.equal(pv, ref["pixel_values"]), f"{backend}/{mode} seed={SEED}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_processor_kwargs(backend: str) -> None:
    """A smaller longest edge and a height/width bound give HF's output too."""
    nrng = np.random.default_rng(SEED)
    images = [photo_like(nrng, 300, 500), photo_like(nrng, 620, 90)]
    proc = hf_processor(backend)
    text = prompt_text(2)
    prompt_ids = proc.tokenizer(text)["input_ids"]
    for kwargs in ({"size": {"longest_edge": 224}}, {"size": {"height": 200, "width": 400}}):
        ref = proc(text=[text], images=images, return_tensors="pt", do_rescale=False,
                   do_normalize=False, **kwargs)  # fmt: skip
        for mode in ("hf", "native"):
            ours = build_processor(NAME, proc, config=MultiModalConfig(transform=mode))
            out = ours.apply(prompt_ids, {"image": images}, kwargs)
            assert out.prompt_token_ids == ref["input_ids"][0].tolist(), f"{kwargs} {mode}"
            pv = out.merged_kwargs()["pixel_values"]
            assert torch.equal(pv, ref["pixel_values"]), f"{kwargs} {mode} seed={SEED}"
    ours = build_processor(NAME, proc)
    with pytest.raises(ProcessorKwargsError, match="patch_size"):
        ours.validate_hf_kwargs({"patch_size": 16})  # the processor overrides it


def test_registry_and_errors() -> None:
    info = {i.short_name: i for i in supported_adapters()}[NAME]
    assert info.architecture == "Mistral3ForConditionalGeneration"
    assert info.mm_device_do_normalize is True
    proc = hf_processor("torchvision")
    images = [photo_like(np.random.default_rng(SEED), 30, 40)] * 2
    with pytest.raises(ItemCountMismatchError):
        build_processor(NAME, proc).apply(proc.tokenizer(prompt_text(1))["input_ids"],
                                          {"image": images})  # fmt: skip
