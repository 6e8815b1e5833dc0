"""ImagePreprocessor on a two-node ``ray.cluster_utils.Cluster`` on this machine: path rows, an
actor on each node, outputs equal to Engine.process bit for bit, bad rows carry their errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray_rows import (
    assert_row_equals,
    engine_results,
    png,
    prompt,
    ray_started_away_from_the_checkout,
    token_ids,
)

from aiomm.config import EngineConfig
from aiomm.integrations.ray import ImagePreprocessor
from aiomm.media.fetch import FetchConfig
from aiomm.types import Request


def _start() -> Cluster:
    # one CPU per node and one CPU per actor: the pool's two actors land one on each node
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    holder: list[Cluster] = []

    def start() -> Cluster:
        holder.append(_start())
        return holder[0]

    def stop() -> None:
        ray.shutdown()
        if holder:
            holder[0].shutdown()

    with ray_started_away_from_the_checkout(start, stop) as cluster:
        yield cluster


@pytest.mark.timeout(300)
def test_path_rows_on_two_nodes_equal_the_engine(two_nodes: Cluster, tmp_path: Path) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    paths = []
    for i in range(8):
        path = tmp_path / f"{i}.png"
        path.write_bytes(png(20 + i, 40 + 8 * i, 64))
        paths.append(str(path))
    (tmp_path / "broken.png").write_bytes(png(99)[:60])
    paths[3] = str(tmp_path / "broken.png")
    paths[6] = str(tmp_path / "missing.png")
    ids = token_ids(prompt(1))
    rows: list[dict[str, Any]] = [
        {"id": i, "path": p, "prompt_token_ids": ids} for i, p in enumerate(paths)
    ]
    config = EngineConfig(
        device="cpu", transform_threads=1, fetch=FetchConfig(allowed_local_root=tmp_path)
    )
    out = ray.data.from_items(rows).map_batches(
        ImagePreprocessor,
        fn_constructor_kwargs={
            "model": "qwen2-vl",
            "config": config,
            "image_column": "path",
            "keep_columns": ["id"],
        },
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=1,
        batch_size=2,
    )
    got = sorted(out.take_all(), key=lambda r: r["id"])

    want = engine_results(
        config, [Request(prompt_token_ids=ids, images=[p]) for p in paths], device=False
    )
    assert [r["id"] for r in got] == list(range(8))
    assert [w.ok for w in want] == [i not in (3, 6) for i in range(8)]
    for row, result in zip(got, want, strict=True):
        assert_row_equals(row, result)
    assert got[3]["error"].startswith("DecodeError")
    assert got[6]["error"] is not None
