"""Every registered adapter against its reference, on both HF backends (the parity harness).

The checks and the per-family data live in ``tests/support/adapter_parity.py``; the cases here
are generated from the registry, so a new architecture is covered as soon as it is registered.
"""

from __future__ import annotations

import random

import pytest
from adapter_parity import AUDIO_FAMILIES, FAMILIES, cases, check_case, family_of
from parity import SEED

from aiomm.adapters import supported_adapters

CASES = list(cases())


def _one_per_preprocessing() -> list[tuple[str, str]]:
    """One architecture per distinct (processor class, reference builder), on its backends:
    rows that share both (Qwen3-VL's and its later members', the Intern-S rows) preprocess alike,
    so large images run once for them."""
    seen, out = set(), []
    for info in supported_adapters():
        key = (info.processor_cls, info.build_hf_processor)
        if key not in seen:
            seen.add(key)
            out += [(info.short_name, b) for b in family_of(info).backends]
    return out


def test_every_adapter_has_a_family_and_both_backends() -> None:
    infos = supported_adapters()
    assert {name for name, _ in CASES} == {i.short_name for i in infos}
    for info in infos:
        fam = family_of(info)
        if "image" not in info.processor_cls.supported_modalities:
            # audio: no image backend, one reference
            assert fam in AUDIO_FAMILIES.values() and len(fam.backends) == 1, info.short_name
            continue
        assert fam in FAMILIES.values()
        if getattr(info.processor_cls, "has_hf_transform", True):
            assert fam.backends == ("torchvision", "pil"), info.short_name


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_parity_small_images(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-{name}-{backend}")
    for n_images in (1, 2, 3, 4):
        check_case(name, backend, n_images, rng.randrange(2**31), classic=n_images == 2)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "backend"), _one_per_preprocessing())
def test_parity_large_images(name: str, backend: str) -> None:
    rng = random.Random(f"{SEED}-large-{name}-{backend}")
    check_case(name, backend, 2, rng.randrange(2**31), large=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("qwen3-vl", [(3024, 4032)]),  # kept near full size by Qwen3-VL's 16 Mpx bound
        ("mistral3", [(3024, 4032), (200, 300)]),  # scaled down to the 1540 px longest edge
    ],
)
def test_parity_huge_photo(name: str, sizes: list[tuple[int, int]], backend: str) -> None:
    """A 12-megapixel photo."""
    seed = random.Random(f"{SEED}-huge-{name}-{backend}").randrange(2**31)
    check_case(name, backend, len(sizes), seed, sizes=sizes)
