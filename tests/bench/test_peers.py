"""``bench/peers``: the stand-in engine's checks, the exactness comparison and the command's
arguments, without smg or vLLM (neither is installed here; the benchmark runs them from their
own venvs).

No timing is asserted: speed is what the benchmark prints, side by side, in one run.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
ROW = 3 * 2 * 16 * 16  # a Qwen3-VL patch: 3 channels, 2 frames, 16x16


@pytest.fixture(scope="module")
def peers() -> Iterator[SimpleNamespace]:
    """The package's modules (bench/ is not installed: put on sys.path)."""
    import importlib

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))
        yield SimpleNamespace(
            bench=importlib.import_module("peers.bench"),
            ex=importlib.import_module("peers.exactness"),
            worker=importlib.import_module("peers.smg_worker"),
            rb=importlib.import_module("render_bench"),
        )


# -- the stand-in engine's checks, on messages shaped as smg_grpc_proto's -------------------


class _Tensor(SimpleNamespace):
    def WhichOneof(self, name: str) -> str:
        return "inline"


class _Inputs(SimpleNamespace):
    def HasField(self, name: str) -> bool:
        return getattr(self, name, None) is not None


def _mm(grids: list[tuple[int, int, int]], offset: int = 5) -> tuple[_Inputs, list[int], bytes]:
    """A request's inputs for images of ``grids`` (merge 2), its token ids and pixel bytes."""
    rows = sum(t * h * w for t, h, w in grids)
    pixels = np.random.default_rng(0).integers(0, 256, (rows, ROW), dtype=np.uint8).tobytes()
    grid = np.array(grids, dtype=np.int64)
    ids, placeholders = [1] * offset, []
    for t, h, w in grids:
        n = t * h * w // 4
        placeholders.append(SimpleNamespace(offset=len(ids), length=n))
        ids += [7] * n + [2, 2]
    mm = _Inputs(
        pixel_values=_Tensor(shape=[rows, ROW], dtype="uint8", inline=pixels),
        model_specific_tensors={
            "image_grid_thw": _Tensor(shape=list(grid.shape), dtype="int64", inline=grid.tobytes())
        },
        mm_placeholders=placeholders,
        mm_hashes=[f"h{i}" for i in range(len(grids))],
        im_token_id=7,
    )
    return mm, ids, pixels


def test_worker_accepts_what_the_model_takes(peers: SimpleNamespace) -> None:
    mm, ids, pixels = _mm([(1, 4, 6), (1, 2, 2)])
    got = peers.worker.check_inputs(mm, ids, peers.worker.VisionSpec())
    assert got.shape == (28, ROW) and got.dtype == "uint8" and got.pixels == pixels
    assert got.grid_thw == ((1, 4, 6), (1, 2, 2))
    assert got.placeholders == ((5, 6), (13, 1)) and got.hashes == ("h0", "h1")


def _broken(mm: _Inputs, ids: list[int], what: str) -> list[int]:
    """Break ``mm`` (or ``ids``) in the way ``what`` names; the ids to check with."""
    pv, grid = mm.pixel_values, mm.model_specific_tensors["image_grid_thw"]
    if what == "dtype":
        pv.dtype = "float32"
    elif what == "row":
        pv.shape = [pv.shape[0] * 2, ROW // 2]
    elif what == "bytes":
        pv.inline = pv.inline[:-1]
    elif what == "grid-sum":
        grid.inline = np.array([[1, 4, 6], [1, 2, 4]], dtype=np.int64).tobytes()
    elif what == "grid-merge":
        pv.shape = [27, ROW]
        pv.inline = pv.inline[: 27 * ROW]
        grid.inline = np.array([[1, 4, 6], [1, 1, 3]], dtype=np.int64).tobytes()
    elif what == "grid-dtype":
        grid.dtype = "float32"
    elif what == "no-grid":
        mm.model_specific_tensors = {}
    elif what == "hashes":
        mm.mm_hashes = ["h0"]
    elif what == "placeholder-length":
        mm.mm_placeholders[1] = SimpleNamespace(offset=13, length=2)
    elif what == "placeholder-tokens":
        ids = [*ids]
        ids[13] = 8
    return ids


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("dtype", "dtype float32"),
        ("row", "expected [patches, 1536]"),
        ("bytes", "shape [28, 1536] needs 43008"),
        ("grid-sum", "does not add up to 28"),
        ("grid-merge", "not whole 2x2 merge windows"),
        ("grid-dtype", "not an integer type"),
        ("no-grid", "no image_grid_thw"),
        ("hashes", "1 hashes"),
        ("placeholder-length", "placeholder of 2 tokens"),
        ("placeholder-tokens", "does not cover image tokens"),
    ],
)
def test_worker_refuses_inputs_the_model_would_not_take(
    peers: SimpleNamespace, what: str, message: str
) -> None:
    mm, ids, _ = _mm([(1, 4, 6), (1, 2, 2)])
    ids = _broken(mm, ids, what)
    with pytest.raises(peers.worker.InvalidInputs, match=message.replace("[", r"\[")):
        peers.worker.check_inputs(mm, ids, peers.worker.VisionSpec())


def test_worker_reads_its_spec_and_arguments(peers: SimpleNamespace, tmp_path: Path) -> None:
    config = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    spec = peers.worker.VisionSpec.from_folder(tmp_path)
    assert (spec.patch_size, spec.row) == (14, 3 * 2 * 14 * 14)
    args = peers.worker.parse_args(["--port", "1", "--model-folder", "/m"])
    assert args.dump is None and args.dump_limit == 0
    for bad in (["--dump", "/d"], ["--dump-limit", "-1"]):
        with pytest.raises(SystemExit):
            peers.worker.parse_args(["--port", "1", "--model-folder", "/m", *bad])


def test_what_the_worker_writes_is_what_the_benchmark_reads(
    peers: SimpleNamespace, tmp_path: Path
) -> None:
    mm, ids, pixels = _mm([(1, 4, 6), (1, 2, 2)])
    received = peers.worker.check_inputs(mm, ids, peers.worker.VisionSpec())
    peers.worker.write_received(tmp_path, 3, received)
    images = peers.ex.received_images(tmp_path, 3)
    rows = np.frombuffer(pixels, np.uint8).reshape(28, ROW)
    assert [d.grid for d in images] == [(1, 4, 6), (1, 2, 2)]
    assert np.array_equal(images[0].pixels, rows[:24]) and np.array_equal(
        images[1].pixels, rows[24:]
    )
    with pytest.raises(FileNotFoundError):
        peers.ex.received_images(tmp_path, 4, wait_s=0)


# -- exactness ------------------------------------------------------------------------------


def test_compare_counts_every_differing_value(peers: SimpleNamespace) -> None:
    ex = peers.ex
    ref = ex.Delivered(np.full((8, ROW), 100, np.uint8), (1, 2, 4))
    same = ex.compare(ex.Delivered(ref.pixels.copy(), (1, 2, 4)), ref)
    assert same.equal and same.max_abs_diff == 0 and same.differing == 0
    off = ref.pixels.copy()
    off[0, :10] = 103
    off[3, 5] = 99
    check = ex.compare(ex.Delivered(off, (1, 2, 4)), ref)
    assert not check.equal and check.max_abs_diff == 3 and check.differing == 11
    assert check.values == 8 * ROW
    wrong_grid = ex.compare(ex.Delivered(ref.pixels, (1, 4, 2)), ref)
    assert not wrong_grid.equal and not wrong_grid.grid_equal and wrong_grid.differing == 0
    shape = ex.compare(ex.Delivered(ref.pixels[:4], (1, 2, 2)), ref)
    assert not shape.shape_equal and shape.differing == shape.values == 8 * ROW

    result = ex.SystemExactness("x")
    ex.check_images(result, [ref, ex.Delivered(off, (1, 2, 4))], [ref, ref, ref])
    summary = result.summary()
    assert summary["images"] == 3 and summary["equal_images"] == 1 and not summary["all_equal"]
    assert summary["share_differing"] == round((11 + 8 * ROW) / (3 * 8 * ROW), 6)


def test_render_items_decode_to_their_pixels(peers: SimpleNamespace) -> None:
    from aiomm.vllm.wire import Field, encode_item

    rows = torch.randint(0, 256, (16, ROW), dtype=torch.uint8)
    item = {
        "pixel_values": (rows, Field("flat", {"keep_on_cpu": False, "slices": [], "dim": 0})),
        "image_grid_thw": (torch.tensor([1, 4, 4]), Field("batched", {"keep_on_cpu": True})),
    }
    response = {"features": {"kwargs_data": {"image": [encode_item(item)]}}}
    (got,) = peers.ex.render_images(response)
    assert got.grid == (1, 4, 4) and np.array_equal(got.pixels, rows.numpy())
    item["pixel_values"] = (rows.float(), item["pixel_values"][1])
    with pytest.raises(ValueError, match="float32, not uint8"):
        peers.ex.render_images({"features": {"kwargs_data": {"image": [encode_item(item)]}}})


def _jpeg(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from aiomm.adapters.folders import write_model_folder

    return write_model_folder("qwen3-vl", tmp_path_factory.mktemp("qwen3vl"))


def test_reference_is_the_folder_s_processor_and_aiomm_equals_it(
    peers: SimpleNamespace, folder: Path, tmp_path: Path
) -> None:
    from aiomm.adapters import build_processor
    from aiomm.media.image import DEFAULT_MAX_PIXELS, decode_image

    processor = peers.bench.reference_processor(folder)
    jpeg = _jpeg(333, 250)
    ref = peers.ex.hf_pixels(processor, jpeg)
    assert ref.pixels.dtype == np.uint8 and ref.pixels.shape[1] == ROW
    assert ref.pixels.shape[0] == int(np.prod(ref.grid))
    # aiomm's own transform of the same JPEG, as its server renders it, is equal
    aiomm = build_processor("qwen3-vl")
    pad = aiomm.hf_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    image = decode_image(jpeg, max_pixels=DEFAULT_MAX_PIXELS)
    out = aiomm.apply([pad], {"image": [image]}).merged_kwargs()
    ours = peers.ex.Delivered(out["pixel_values"].numpy(), tuple(out["image_grid_thw"][0].tolist()))
    assert peers.ex.compare(ours, ref).equal

    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    config = json.loads((changed / "preprocessor_config.json").read_text())
    config["patch_size"], config["size"]["longest_edge"] = 14, 1 << 20
    (changed / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match=r"patch_size: 16 != 14.*longest_edge"):
        peers.bench.reference_processor(changed)


# -- the command ----------------------------------------------------------------------------


def _plan(peers: SimpleNamespace) -> list[bytes]:
    args = argparse.Namespace(
        n=6, sizes="32x24,48x32", two_image_frac=0.5, repeat_frac=0.0, mm_payload="tensors",
        model_folder="/m",
    )  # fmt: skip
    return peers.rb.build_bodies(args, seed=3)[0]


def test_every_system_gets_the_same_images_before_the_text(peers: SimpleNamespace) -> None:
    bodies = _plan(peers)
    by = {name: peers.bench.system_bodies(bodies, name) for name in peers.bench.SYSTEMS}
    for i, body in enumerate(bodies):
        images = peers.ex.body_images(body)
        for name in peers.bench.SYSTEMS:
            doc = json.loads(by[name][i])
            kinds = [p["type"] for p in doc["messages"][0]["content"]]
            assert kinds == ["image_url"] * len(images) + ["text"], name
            assert peers.ex.body_images(doc) == images
            if name == "smg":
                assert doc["max_tokens"] == 1 and "mm_payload" not in doc
            else:
                assert doc["mm_payload"] == "tensors" and "max_tokens" not in doc


def _row(peers: SimpleNamespace, server: str, images_per_s: float, cpu_s: float) -> Any:
    ms = round(cpu_s * 1000 / 100, 1)
    return peers.rb.LevelResult(server, 8, 50, 100, 2.0, images_per_s, 10.0, 20.0, ms, 0.5, 1.0,
                                0.2, 0.1, cpu_s)  # fmt: skip


def test_ratios_divide_the_cpu_measured(peers: SimpleNamespace) -> None:
    rows = [_row(peers, "aiomm", 60.0, 1.234), _row(peers, "smg", 20.0, 3.0),
            _row(peers, "vllm", 15.0, 4.0)]  # fmt: skip
    (ratio,) = peers.bench.ratios(rows)
    assert ratio["cpu_per_image_aiomm_over_smg"] == round(1.234 / 3.0, 3)
    assert ratio["images_per_s_aiomm_over_smg"] == 3.0
    assert ratio["cpu_per_image_aiomm_over_vllm"] == round(1.234 / 4.0, 3)
    lines = peers.bench.ratio_lines([ratio])
    assert lines[0] == "c=8: aiomm/smg: CPU per image x0.41, images/s x3.00"
    (alone,) = peers.bench.ratios(rows[:2])
    assert set(alone) == {"concurrency", "cpu_per_image_aiomm_over_smg",
                          "images_per_s_aiomm_over_smg"}  # fmt: skip


def test_arguments(peers: SimpleNamespace, tmp_path: Path) -> None:
    args = peers.bench.parse_args([])
    assert args.repeat_frac == 0.0 and args.mm_payload == "tensors"  # distinct images, tensors
    assert args.smg_venv is None and args.vllm_venv is None
    lib = tmp_path / "deb" / peers.bench.TURBOJPEG_LIB
    lib.mkdir(parents=True)
    (lib / "libturbojpeg.so.0").touch()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "smg").touch()
    args = peers.bench.parse_args(["--smg-venv", str(venv), "--smg-turbojpeg", str(lib.parents[2])])
    assert peers.bench.turbojpeg_dir(Path(args.smg_turbojpeg)) == lib
    assert peers.bench.turbojpeg_dir(lib) == lib and peers.bench.turbojpeg_dir(venv) is None
    for bad in (
        ["--n", "0"],
        ["--rounds", "0"],
        ["--concurrency", "8", "0"],
        ["--sizes", "640x"],
        ["--two-image-frac", "2"],
        ["--warm", "-1"],
        ["--smg-turbojpeg", str(lib)],  # without smg
        ["--smg-venv", str(venv), "--smg-turbojpeg", str(venv)],  # no library there
        ["--vllm-venv", str(venv)],  # no vllm there
    ):
        with pytest.raises(SystemExit):
            peers.bench.parse_args(bad)


def test_runs_as_a_folder_from_the_checkout() -> None:
    out = subprocess.run(
        [sys.executable, "bench/peers", "--help"], cwd=REPO, capture_output=True, text=True,
        check=True, timeout=120,
    )  # fmt: skip
    assert "--smg-venv" in out.stdout and "--smg-turbojpeg" in out.stdout


def test_a_run_of_aiomm_alone_reports_its_rows_and_exactness(
    peers: SimpleNamespace, folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "peers.json"
    port = str(peers.rb._free_port())
    argv = ["--model-folder", str(folder), "--n", "4", "--rounds", "2", "--warm", "2",
            "--exact-requests", "2", "--sizes", "64x48,96x64", "--concurrency", "2",
            "--port-base", port, "--logs", str(tmp_path), "--json", str(out)]  # fmt: skip
    assert peers.bench.main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    (row,) = report["combined"]
    assert row["server"] == "aiomm" and row["requests"] == 8 and row["images"] >= 8
    assert [r["server"] for r in report["rounds"]] == ["aiomm", "aiomm"]
    assert report["worker"] == [] and report["ratios"] == [{"concurrency": 2}]
    exact = report["exactness"]["aiomm"]
    assert exact["images"] >= 2 and exact["all_equal"], exact
    assert report["conditions"]["versions"]["aiomm"]
    assert "aiomm/smg" not in printed and "exactness against the HF processor" in printed
