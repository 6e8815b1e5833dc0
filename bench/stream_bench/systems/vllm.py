"""``vllm``: vLLM's own processor path, run by ``bench/_vllm_worker.py`` in a vLLM environment.

This side writes the model folder (the reference processor, no weights) and the job, starts
the worker in the interpreter given by ``--vllm-python``, and compares its outputs with aiomm's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..processors import hf_processor

#: bench/, where ``_vllm_worker.py`` lives next to this package
BENCH_DIR = Path(__file__).resolve().parents[2]


def write_vllm_model_dir(path: Path) -> Path:
    """The reference HF processor (aiomm's offline Qwen2-VL one) saved as a weight-less model
    folder, so vLLM runs the very same transform parameters and tokenizer."""
    if (path / "config.json").is_file():
        return path
    hf = hf_processor()
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(path))
    tok = hf.tokenizer
    ids = {
        name: tok.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    # the published Qwen2-VL-2B-Instruct architecture values; no weights are ever loaded
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
        "vision_token_id": ids["image_token_id"],
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": 1536,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        **ids,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def run_vllm(job: dict[str, Any], python: str | None, out: Path) -> dict[str, Any]:
    """Run the worker on ``job`` in ``python``; skipped without it, failed with its log's tail."""
    if not python:
        return {
            "status": "skipped",
            "reason": "no vLLM environment given: pass --vllm-python PATH, the python of an "
            "environment with vllm 0.33 installed (CPU is enough)",
        }
    t = time.perf_counter()
    print("  vllm ...", end="", flush=True, file=sys.stderr)
    job = {**job, "model_dir": str(write_vllm_model_dir(out / "vllm_model"))}
    jobs = out / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    path = jobs / "vllm.json"
    path.write_text(json.dumps(job))
    result_path = path.with_suffix(".result.json")
    result_path.unlink(missing_ok=True)
    log = out / "vllm_worker.log"
    with log.open("w") as sink:
        proc = subprocess.run(
            [python, str(BENCH_DIR / "_vllm_worker.py"), str(path), str(result_path)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    else:
        tail = log.read_text()[-3000:]
        result = {
            "status": "failed",
            "reason": f"worker exited {proc.returncode}; see {log}",
            "traceback": tail,
        }
    print(f" {result.get('status')} ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    return result


def same_as_aiomm(rec: dict[str, Any], exact_rows: list[dict[str, Any]]) -> bool | None:
    """Whether vLLM's pixels and token ids equal aiomm's on the checked requests (None: unknown)."""
    if rec.get("status") != "ok" or not rec.get("exact") or not exact_rows:
        return None
    ours = {r["request"]: r for r in exact_rows}
    return all(
        v["image_sha"] == ours[v["request"]]["image_sha"]
        and v["prompt_token_ids_sha"] == ours[v["request"]].get("prompt_ids_sha")
        for v in rec["exact"]
        if v["request"] in ours
    )
