"""Video preprocessing, aiomm against the HF video processor, side by side in one run.

For one architecture (``--model``: Qwen2.5-VL by default, Qwen3-VL, GLM-4V, GLM-OCR, GLM-5-Next)
with the video processor's sampling (``fps`` where it takes one), per video: the HF path decodes
with transformers' own PyAV loader (``load_video(backend="pyav")`` with the video processor's
``sample_frames``) and runs the HF processor (CPU-normalised float32, its default; the prompt
expanded with its timestamps where the model has them); aiomm decodes only the sampled frames
(``aiomm.media.video.decode_video``) and runs its native transform and prompt update, once with
uint8 output (the engine's default: normalised later on the device) and once CPU-normalised (the
classic path, the same output as HF). Every path's sampled frames, grids and prompt token ids are
checked equal first. Prints videos per second and CPU milliseconds per sampled frame, and aiomm's
ratios to HF.

    python bench/video_bench.py [--model qwen2.5-vl] [--frames 96] [--height 360] [--width 640]
                                [--repeat 5] [--smoke]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

from aiomm.adapters import build_processor
from aiomm.config import MultiModalConfig
from aiomm.media.video import decode_video

#: the architectures benchmarked, and the video placeholder of each one's chat template
PROMPTS = {
    "qwen2.5-vl": "<|vision_start|><|video_pad|><|vision_end|>",
    "qwen3-vl": "<|vision_start|><|video_pad|><|vision_end|>",
    "glm-4v": "<|begin_of_video|><|video|><|end_of_video|>",
    "glm-ocr": "<|begin_of_video|><|video|><|end_of_video|>",
    "glm-5-next": "<|begin_of_video|><|video|><|end_of_video|>",
}


def make_video(frames: int, height: int, width: int, rate: int = 24) -> bytes:
    """An H.264 MP4 of moving gradients (a few hundred kilobytes)."""
    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for t in range(frames):
            rgb = np.stack(
                [np.sin((x + 4 * t) / (9 + 3 * c) + y / (13 + c)) * 100 + 120 for c in range(3)],
                axis=-1,
            ).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _timed(fn: Any, repeat: int) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds) per call, best of ``repeat`` wall times; the last output."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    best = int(np.argmin(walls))
    return walls[best], cpus[best], out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(PROMPTS), default="qwen2.5-vl")
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny video, one repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.frames, args.height, args.width, args.repeat = 24, 64, 96, 1
    torch.set_num_threads(1)  # one worker thread's cost, as the engine runs transforms

    from transformers.video_utils import load_video

    data = make_video(args.frames, args.height, args.width)
    # GLM-OCR's rate follows the duration: it takes no fps
    kwargs = {"do_sample_frames": True, **({} if args.model == "glm-ocr" else {"fps": args.fps})}
    prompt = PROMPTS[args.model]
    fast = build_processor(args.model)
    classic = build_processor(args.model, config=MultiModalConfig(mm_device_do_normalize=False))
    hf = fast.hf_processor
    ids = hf.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # Qwen: the per-frame pixel cap's default is about to change (HF warns); GLM: its token
    # type ids warn under numpy 2 (and aiomm makes none: HF is spared that work)
    qwen = args.model.startswith("qwen")
    extra = {"cap_pixels_per_frame": False} if qwen else {"return_mm_token_type_ids": False}

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.mp4"
        path.write_bytes(data)

        def run_hf() -> Any:
            sampler = partial(hf.video_processor.sample_frames, **kwargs)
            frames, meta = load_video(str(path), backend="pyav", sample_indices_fn=sampler)
            out = hf(
                text=[prompt],
                videos=[frames],
                video_metadata=[meta],
                do_sample_frames=False,
                return_tensors="pt",
                **extra,
            )
            return frames, out

        def run_aiomm(proc: Any) -> Any:
            clip = decode_video(data, lambda info: proc.sample_frames(info, kwargs))
            processed = proc.apply(ids, {"video": [clip]}, kwargs)
            return clip, (processed.prompt_token_ids, processed.merged_kwargs())

        hf_wall, hf_cpu, (hf_frames, hf_out) = _timed(run_hf, args.repeat)
        u8_wall, u8_cpu, (clip, (u8_ids, u8_out)) = _timed(lambda: run_aiomm(fast), args.repeat)
        cl_wall, cl_cpu, (_, (_, cl_out)) = _timed(lambda: run_aiomm(classic), args.repeat)

    # the same frames, grids, prompt and (classic path) pixels as HF
    assert np.array_equal(clip.frames, hf_frames), "sampled frames differ from HF's PyAV loader"
    assert torch.equal(u8_out["video_grid_thw"], hf_out["video_grid_thw"])
    assert u8_ids == hf_out["input_ids"][0].tolist(), "prompt token ids differ from HF's"
    assert torch.equal(cl_out["pixel_values_videos"], hf_out["pixel_values_videos"])
    if "second_per_grid_ts" in hf_out:
        assert torch.equal(cl_out["second_per_grid_ts"], hf_out["second_per_grid_ts"])

    n = len(clip.frames_indices)
    rows = {
        f"hf (pyav load_video + {type(hf).__name__})": (hf_wall, hf_cpu),
        "aiomm native, uint8 (device normalises)": (u8_wall, u8_cpu),
        "aiomm native, CPU-normalised": (cl_wall, cl_cpu),
    }
    print(f"{args.model} video: {args.frames} frames {args.width}x{args.height} H.264, "
          f"{len(data)} bytes; fps={kwargs.get('fps', 'by duration')} samples {n} frames; "
          f"grid {hf_out['video_grid_thw'][0].tolist()}; one torch thread; "
          f"best of {args.repeat}")  # fmt: skip
    print(f"{'path':45s} {'videos/s':>9s} {'CPU ms/frame':>13s} {'speed vs hf':>12s}")
    report: dict[str, Any] = {"sampled_frames": n}
    for name, (wall, cpu) in rows.items():
        ratio = hf_wall / wall
        print(f"{name:45s} {1 / wall:9.2f} {1000 * cpu / n:13.2f} {ratio:11.2f}x")
        report[name] = {"videos_per_s": 1 / wall, "cpu_ms_per_frame": 1000 * cpu / n, "x": ratio}
    print(json.dumps({k: v for k, v in report.items()}, default=float))
    return report


if __name__ == "__main__":
    main()
