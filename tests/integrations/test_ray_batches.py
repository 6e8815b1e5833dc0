"""ImagePreprocessor's batch handling, called directly on one event loop (no Ray cluster):
batch formats, row errors, the fixed schema, job-level mistakes."""

from __future__ import annotations

import io

import anyio
import numpy as np
import pandas as pd
import PIL.Image
import pyarrow as pa
import pytest
import torch
from ray_rows import engine_results, png, prompt, token_ids

from aiomm.config import EngineConfig
from aiomm.errors import ConfigError, EngineClosedError, ProcessorKwargsError
from aiomm.integrations.ray import ImagePreprocessor
from aiomm.types import Request

CONFIG = EngineConfig(device="cpu", transform_threads=1)


def _decoded(seed: int) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(png(seed))).convert("RGB"))


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def test_formats_row_errors_and_a_fixed_schema() -> None:
    pre = ImagePreprocessor("qwen2-vl", config=CONFIG, keep_columns=["id"])
    stack = np.stack([_decoded(i) for i in range(2)])  # read_images' fixed shape
    ids = token_ids(prompt(1))
    batch = {
        "id": np.arange(5),
        "image": _objects([png(0), stack[0], [png(1), png(2)], None, png(3)]),
        "prompt": _objects([prompt(1), None, prompt(2), "no image here", prompt(1)]),
        "prompt_token_ids": _objects([None, ids, None, None, ["x"]]),
    }

    async def main() -> tuple[pa.Table, pa.Table, pa.Table]:
        # one loop for every call, as Ray Data's actor loop
        try:
            table = await pre(batch)
            from_pandas = await pre(pd.DataFrame({k: list(v) for k, v in batch.items()}))
            empty = await pre({k: v[:0] for k, v in batch.items()})
            with pytest.raises(ConfigError, match="no column"):
                await pre({"id": np.arange(1), "prompt": _objects([prompt(1)])})
        finally:
            await pre.aclose()
        with pytest.raises(EngineClosedError):
            await pre(batch)
        return table, from_pandas, empty

    table, from_pandas, empty = anyio.run(main)

    rows = table.to_pylist()
    assert table.equals(from_pandas)
    assert empty.num_rows == 0 and empty.schema == table.schema
    assert [r["error"] is None for r in rows] == [True, True, True, True, False]
    assert rows[4]["error"].startswith("InvalidRequestError: row 4 of the batch")
    assert rows[3]["mm_hashes"] == [] and len(rows[3]["prompt_token_ids"]) > 0  # text only
    want = engine_results(
        CONFIG,
        [
            Request(prompt=prompt(1), images=[png(0)]),
            Request(prompt_token_ids=ids, images=[stack[0]]),
            Request(prompt=prompt(2), images=[png(1), png(2)]),
        ],
        device=False,
    )
    pixels = table.column("pixel_values").chunk(0).to_numpy()
    for i, result in enumerate(want):
        assert rows[i]["prompt_token_ids"] == result.prompt_token_ids
        assert rows[i]["mm_hashes"] == result.item_hashes
        assert torch.equal(torch.from_numpy(pixels[i].copy()), result.pixel_values)


def test_bad_processor_kwargs_fail_at_construction() -> None:
    with pytest.raises(ProcessorKwargsError):
        ImagePreprocessor("qwen2-vl", config=CONFIG, mm_processor_kwargs={"no_such": 1})
