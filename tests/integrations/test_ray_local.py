"""ImagePreprocessor on a local Ray (``ray.init(num_cpus=2)``): equal to Engine.process bit for
bit, bad rows carry their errors, parquet round trip, ``iter_torch_batches``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import ray
import torch
from adapter_parity import prompt_text
from architectures import one_per_preprocessing
from ray_rows import (
    assert_row_equals,
    engine_results,
    png,
    prompt,
    ray_started_away_from_the_checkout,
    token_ids,
)

from aiomm.config import EngineConfig
from aiomm.integrations.ray import ImagePreprocessor, TorchCollate, _actor_config
from aiomm.types import Request

CONFIG = EngineConfig(device="cpu", transform_threads=1)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with ray_started_away_from_the_checkout(
        lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ):
        yield


@pytest.mark.timeout(240)
def test_bytes_rows_to_parquet_equal_the_engine(local_ray: None, tmp_path: Path) -> None:
    rows = [
        {"id": 0, "image": [png(0)], "prompt": prompt(1), "prompt_token_ids": None},
        {"id": 1, "image": [png(1), png(2, 40, 90)], "prompt": prompt(2), "prompt_token_ids": None},
        {"id": 2, "image": [b"not an image"], "prompt": prompt(1), "prompt_token_ids": None},
        # two images, one placeholder: the row fails, its batch goes on
        {"id": 3, "image": [png(3), png(4)], "prompt": prompt(1), "prompt_token_ids": None},
        {
            "id": 4,
            "image": [png(0)],
            "prompt": None,
            "prompt_token_ids": token_ids(prompt(1)),
        },
        {"id": 5, "image": [png(5, 80, 56)], "prompt": prompt(1), "prompt_token_ids": None},
    ]
    ds = ray.data.from_items(rows).map_batches(
        ImagePreprocessor,
        fn_constructor_kwargs={"model": "qwen2-vl", "config": CONFIG, "keep_columns": ["id"]},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=4,
    )
    ds.write_parquet(str(tmp_path / "out"))
    back = ray.data.read_parquet(str(tmp_path / "out"))
    got = sorted(back.take_all(), key=lambda r: r["id"])

    requests = [
        Request(prompt_token_ids=r["prompt_token_ids"], images=r["image"])
        if r["prompt_token_ids"] is not None
        else Request(prompt=r["prompt"], images=r["image"])
        for r in rows
    ]
    want = engine_results(CONFIG, requests, device=False)
    assert [r["id"] for r in got] == list(range(len(rows)))
    assert [w.ok for w in want] == [True, True, False, False, True, True]
    for row, result in zip(got, want, strict=True):
        assert_row_equals(row, result)
    assert got[0]["pixel_values"].dtype == np.uint8
    assert got[2]["error"].startswith("DecodeError")
    assert got[3]["error"].startswith("ItemCountMismatchError")

    batches = list(back.iter_torch_batches(batch_size=6, collate_fn=TorchCollate()))
    assert len(batches) == 1
    batch = batches[0]
    order = batch["id"].tolist()
    assert isinstance(batch["id"], torch.Tensor)
    for i, row_id in enumerate(order):
        assert np.array_equal(batch["pixel_values"][i].numpy(), got[row_id]["pixel_values"])
        assert batch["prompt_token_ids"][i].tolist() == list(got[row_id]["prompt_token_ids"])


@pytest.mark.timeout(240)
def test_read_images_normalised_with_a_fixed_prompt(local_ray: None, tmp_path: Path) -> None:
    sizes = [(48, 64), (72, 40), (56, 56)]
    for i, (h, w) in enumerate(sizes):
        (tmp_path / f"{i}.png").write_bytes(png(10 + i, h, w))
    ds = ray.data.read_images(str(tmp_path), include_paths=True, mode="RGB")
    out = ds.map_batches(
        ImagePreprocessor,
        fn_constructor_kwargs={
            "model": "qwen2-vl",
            "config": CONFIG,
            "normalize": True,
            "prompt": prompt(1),
            "keep_columns": ["path"],
        },
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=2,
    )
    got = sorted(out.take_all(), key=lambda r: r["path"])
    arrays = [np.asarray(PIL.Image.open(Path(r["path"])).convert("RGB")) for r in got]
    want = engine_results(
        CONFIG, [Request(prompt=prompt(1), images=[a]) for a in arrays], device=True
    )
    assert len(got) == 3 and all(w.ok for w in want)
    for row, result in zip(got, want, strict=True):
        assert row["pixel_values"].dtype == np.float32  # bfloat16, widened exactly
        assert_row_equals(row, result)


def test_an_actor_engine_gets_one_transform_thread_per_cpu(local_ray: None) -> None:
    assert ray.get(ray.remote(num_cpus=2)(_actor_config).remote()).transform_threads == 2
    assert ray.get(ray.remote(num_cpus=1)(_actor_config).remote()).transform_threads == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", one_per_preprocessing())
def test_every_architecture_on_ray_equals_the_engine(local_ray: None, name: str) -> None:
    rows = [
        {"id": 0, "image": [png(10, 60, 90)], "prompt": prompt_text(name, 1)},
        {"id": 1, "image": [png(11, 90, 50), png(12, 40, 40)], "prompt": prompt_text(name, 2)},
    ]
    ds = ray.data.from_items(rows).map_batches(
        ImagePreprocessor,
        fn_constructor_kwargs={"model": name, "config": CONFIG, "keep_columns": ["id"]},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=2,
    )
    got = sorted(ds.take_all(), key=lambda r: r["id"])
    requests = [Request(prompt=r["prompt"], images=r["image"]) for r in rows]
    want = engine_results(CONFIG, requests, device=False, model=name)
    assert all(w.ok for w in want), [w.error for w in want]
    for row, result in zip(got, want, strict=True):
        assert_row_equals(row, result)


#: the stage's rows carry one modality: clips only for an adapter that takes no images
#: (Qwen2.5-Omni's rows carry images, tested above)
AUDIO_ONLY = [n for n in one_per_preprocessing("audio") if n not in one_per_preprocessing("image")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", AUDIO_ONLY)
def test_every_audio_architecture_on_ray_equals_the_engine(local_ray: None, name: str) -> None:
    """Clips from the ``audio`` column (encoded bytes); a corrupt clip fails its row only."""
    from audio_samples import CASES, encode

    wav, flac, mp3 = (encode(CASES[i]) for i in (0, 8, 10))
    rows = [
        {"id": 0, "audio": [wav], "prompt": prompt_text(name, 1)},
        {"id": 1, "audio": [flac, mp3], "prompt": prompt_text(name, 2)},
        {"id": 2, "audio": [b"not audio at all"], "prompt": prompt_text(name, 1)},
    ]
    ds = ray.data.from_items(rows).map_batches(
        ImagePreprocessor,
        fn_constructor_kwargs={"model": name, "config": CONFIG, "keep_columns": ["id"]},
        compute=ray.data.ActorPoolStrategy(size=1),
        batch_size=3,
    )
    got = sorted(ds.take_all(), key=lambda r: r["id"])
    requests = [Request(prompt=r["prompt"], audios=r["audio"]) for r in rows]
    want = engine_results(CONFIG, requests, device=False, model=name)
    assert [w.ok for w in want] == [True, True, False], [w.error for w in want]
    assert got[2]["error"].startswith("AudioDecodeError")
    for row, result in zip(got, want, strict=True):
        assert_row_equals(row, result)
