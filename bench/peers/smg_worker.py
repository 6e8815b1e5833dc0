"""A stand-in vLLM gRPC engine for smg's router: it registers, receives, checks and answers.

smg (``smg launch --mm-processing router``) preprocesses the images itself and sends each
request's pixels to an engine worker over gRPC (``vllm.grpc.engine.VllmEngine`` of
``smg_grpc_proto``). This worker implements that service enough for the router to register it
and send generates: ``GetModelInfo``, ``GetServerInfo`` (``mm_device_do_normalize=True``: the
router sends the pixels' uint8 bytes), ``GetLoads``, ``HealthCheck``, the standard gRPC health
service, and ``Generate`` answering one token. Every multimodal input is checked
(:func:`check_inputs`: dtype, shape and byte count of ``pixel_values``, ``image_grid_thw``
against the pixels and the placeholders); a request that fails is refused with
``INVALID_ARGUMENT``, so the router answers an error and the benchmark stops. With ``--dump DIR``
the first ``--dump-limit`` multimodal requests are written there as received
(:func:`write_received`), for the benchmark to compare with the HF processor.

    /tmp/smg-venv/bin/python bench/peers/smg_worker.py --port 18234 \\
        --model-folder /tmp/vllm-probe/qwen3vl [--dump DIR --dump-limit 8]

It runs in smg's interpreter (``grpcio``, ``smg_grpc_proto``) and imports nothing from aiomm or
numpy; the checks are plain Python, so the benchmark's tests run them without gRPC.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ("InvalidInputs", "Received", "VisionSpec", "check_inputs", "tensor_bytes")

#: bytes per element of the dtypes a router sends
ITEMSIZE = {
    "uint8": 1,
    "int8": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "float64": 8,
}
#: ``memoryview.cast`` formats of the integer dtypes a grid comes in (little-endian hosts)
_INT_FORMATS = {"int32": "i", "uint32": "I", "int64": "q"}
#: the token the worker answers with (``.`` in Qwen's vocabulary; any id would do)
ANSWER_TOKEN = 13


class InvalidInputs(ValueError):
    """Raised when a request's multimodal inputs are not what the model would take."""


@dataclass(frozen=True)
class VisionSpec:
    """What a Qwen-VL model takes: ``patch_size`` x ``patch_size`` patches of
    ``temporal_patch_size`` frames of 3 channels, merged ``merge_size`` x ``merge_size`` into a
    token."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    channels: int = 3

    @property
    def row(self) -> int:
        """Values per patch: one row of ``pixel_values``."""
        return self.channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_folder(cls, folder: Path) -> VisionSpec:
        """The spec in a model folder's ``preprocessor_config.json``."""
        config = json.loads((folder / "preprocessor_config.json").read_text())
        return cls(
            int(config.get("patch_size", cls.patch_size)),
            int(config.get("temporal_patch_size", cls.temporal_patch_size)),
            int(config.get("merge_size", cls.merge_size)),
        )


@dataclass(frozen=True)
class Received:
    """One request's checked image inputs: the pixels' bytes as sent, and what frames them."""

    shape: tuple[int, ...]
    dtype: str
    pixels: bytes
    grid_thw: tuple[tuple[int, int, int], ...]
    placeholders: tuple[tuple[int, int], ...]
    hashes: tuple[str, ...]

    def meta(self) -> dict[str, Any]:
        """Everything but the pixels, as JSON."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "image_grid_thw": [list(g) for g in self.grid_thw],
            "mm_placeholders": [list(p) for p in self.placeholders],
            "mm_hashes": list(self.hashes),
        }


def tensor_bytes(tensor: Any) -> bytes:
    """A ``TensorData``'s bytes, inline or in a ``/dev/shm`` segment.

    :raises InvalidInputs: a transport this worker does not read (a remote handle), or none.
    """
    payload = tensor.WhichOneof("payload") if hasattr(tensor, "WhichOneof") else "inline"
    if payload == "inline":
        return bytes(tensor.inline)
    if payload == "shm":
        handle = tensor.shm
        with open(f"/dev/shm/{handle.name.lstrip('/')}", "rb") as f:
            f.seek(handle.offset)
            return f.read(handle.nbytes)
    raise InvalidInputs(f"tensor payload {payload!r} is not read by this worker")


def _ints(tensor: Any, data: bytes) -> list[int]:
    fmt = _INT_FORMATS.get(tensor.dtype)
    if fmt is None:
        raise InvalidInputs(f"image_grid_thw has dtype {tensor.dtype}, not an integer type")
    return list(memoryview(data).cast(fmt))


def check_inputs(
    mm: Any, input_ids: Sequence[int], spec: VisionSpec, dtype: str = "uint8"
) -> Received:
    """``mm`` (a ``MultimodalInputs``) checked as the model would take it.

    ``pixel_values`` must be ``dtype`` with shape ``[patches, spec.row]`` and exactly that many
    bytes; ``image_grid_thw`` (``[images, 3]``, integers) must account for every patch and be
    whole merge windows; one placeholder and one hash per image, each placeholder as long as
    its image's tokens and covering only ``im_token_id`` in ``input_ids``.

    :raises InvalidInputs: naming the first thing that is not so.
    """
    pv = mm.pixel_values
    shape = tuple(int(d) for d in pv.shape)
    if pv.dtype != dtype:
        raise InvalidInputs(f"pixel_values dtype {pv.dtype}, expected {dtype}")
    if len(shape) != 2 or shape[1] != spec.row:
        raise InvalidInputs(f"pixel_values shape {list(shape)}, expected [patches, {spec.row}]")
    pixels = tensor_bytes(pv)
    if len(pixels) != math.prod(shape) * ITEMSIZE[dtype]:
        raise InvalidInputs(
            f"pixel_values holds {len(pixels)} bytes, its shape {list(shape)} needs "
            f"{math.prod(shape) * ITEMSIZE[dtype]}"
        )
    tensors: Mapping[str, Any] = mm.model_specific_tensors
    if "image_grid_thw" not in tensors:
        raise InvalidInputs(f"no image_grid_thw among {sorted(tensors)}")
    grid_tensor = tensors["image_grid_thw"]
    grid_shape = [int(d) for d in grid_tensor.shape]
    values = _ints(grid_tensor, tensor_bytes(grid_tensor))
    if len(grid_shape) != 2 or grid_shape[1] != 3 or len(values) != grid_shape[0] * 3:
        raise InvalidInputs(f"image_grid_thw shape {grid_shape} with {len(values)} values")
    grid = tuple((values[i], values[i + 1], values[i + 2]) for i in range(0, len(values), 3))
    if sum(t * h * w for t, h, w in grid) != shape[0]:
        raise InvalidInputs(f"image_grid_thw {list(grid)} does not add up to {shape[0]} patches")
    m = spec.merge_size
    for t, h, w in grid:
        if t < 1 or h % m or w % m or h < m or w < m:
            raise InvalidInputs(f"grid {(t, h, w)} is not whole {m}x{m} merge windows")
    placeholders = tuple((int(p.offset), int(p.length)) for p in mm.mm_placeholders)
    hashes = tuple(str(h) for h in mm.mm_hashes)
    if len(placeholders) != len(grid) or len(hashes) != len(grid):
        raise InvalidInputs(
            f"{len(grid)} images, {len(placeholders)} placeholders, {len(hashes)} hashes"
        )
    im_token = int(mm.im_token_id) if mm.HasField("im_token_id") else None
    for (offset, length), (t, h, w) in zip(placeholders, grid, strict=True):
        if length != t * h * w // (m * m):
            raise InvalidInputs(f"placeholder of {length} tokens for grid {(t, h, w)}")
        ids = input_ids[offset : offset + length]
        if len(ids) != length or (im_token is not None and any(i != im_token for i in ids)):
            raise InvalidInputs(f"placeholder {(offset, length)} does not cover image tokens")
    return Received(shape, pv.dtype, pixels, grid, placeholders, hashes)


def write_received(folder: Path, index: int, received: Received) -> None:
    """``received`` as ``folder/NNNNN.bin`` (the pixels' bytes) and ``NNNNN.json`` (the rest);
    the JSON is written last, under a temporary name: a reader that sees it sees both."""
    stem = folder / f"{index:05d}"
    stem.with_suffix(".bin").write_bytes(received.pixels)
    part = stem.with_suffix(".json.part")
    part.write_text(json.dumps(received.meta()))
    part.replace(stem.with_suffix(".json"))


def serve(args: argparse.Namespace) -> None:
    """Serve the engine service on ``args.port`` until SIGTERM."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from smg_grpc_proto import vllm_engine_pb2 as pb
    from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

    folder = Path(args.model_folder).resolve()
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    spec = VisionSpec.from_folder(folder)
    started = time.time()
    lock = threading.Lock()
    state = {"active": 0, "dumped": 0, "seen": 0}
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)

    class Engine(pb_grpc.VllmEngineServicer):
        def Generate(self, request: Any, context: Any) -> Iterator[Any]:
            with lock:
                state["active"] += 1
            try:
                ids = list(request.tokenized.input_ids)
                if request.HasField("mm_inputs"):
                    try:
                        received = check_inputs(request.mm_inputs, ids, spec)
                    except InvalidInputs as exc:
                        print(f"refused {request.request_id}: {exc}", file=sys.stderr, flush=True)
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    with lock:
                        state["seen"] += 1
                        index = state["dumped"]
                        dump = bool(args.dump) and index < args.dump_limit
                        state["dumped"] += dump
                    if dump:
                        write_received(Path(args.dump), index, received)
                if request.stream:
                    yield pb.GenerateResponse(
                        chunk=pb.GenerateStreamChunk(
                            token_ids=[ANSWER_TOKEN], prompt_tokens=len(ids), completion_tokens=1
                        )
                    )
                yield pb.GenerateResponse(
                    complete=pb.GenerateComplete(
                        output_ids=[ANSWER_TOKEN],
                        finish_reason="length",
                        prompt_tokens=len(ids),
                        completion_tokens=1,
                    )
                )
            finally:
                with lock:
                    state["active"] -= 1

        def HealthCheck(self, request: Any, context: Any) -> Any:
            return pb.HealthCheckResponse(healthy=True, message="ok")

        def Abort(self, request: Any, context: Any) -> Any:
            return pb.AbortResponse()

        def GetModelInfo(self, request: Any, context: Any) -> Any:
            return pb.GetModelInfoResponse(
                model_path=str(folder),
                is_generation=True,
                max_context_length=int(text.get("max_position_embeddings", 32768)),
                vocab_size=int(text.get("vocab_size", 0)),
                supports_vision=True,
                served_model_name=str(folder),
                tokenizer_path=str(folder),
                model_type=str(config.get("model_type", "")),
                architectures=list(config.get("architectures", [])),
                eos_token_ids=[int(config.get("eos_token_id", text.get("eos_token_id", 0)))],
                pad_token_id=int(config.get("bos_token_id", 0)),
                bos_token_id=int(config.get("bos_token_id", 0)),
                max_req_input_len=int(text.get("max_position_embeddings", 32768)),
            )

        def GetServerInfo(self, request: Any, context: Any) -> Any:
            return pb.GetServerInfoResponse(
                active_requests=state["active"],
                last_receive_timestamp=time.time(),
                uptime_seconds=time.time() - started,
                server_type="vllm-grpc",
                data_parallel_size=1,
                kv_cache_dtype="auto",
                block_size=16,
                model_dtype="torch.bfloat16",
                mm_device_do_normalize=True,
                max_num_seqs=256,
                mm_item_limits=f"image={args.max_images}",
            )

        def GetLoads(self, request: Any, context: Any) -> Any:
            load = pb.SchedulerLoad(
                dp_rank=0,
                num_running_reqs=state["active"],
                num_total_reqs=state["active"],
                max_running_requests=256,
            )
            return pb.GetLoadsResponse(
                timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                version="0.33.0",
                dp_rank_count=1,
                loads=[load],
            )

    unlimited = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = grpc.server(ThreadPoolExecutor(max_workers=args.threads), options=unlimited)
    pb_grpc.add_VllmEngineServicer_to_server(Engine(), server)
    health_servicer = health.HealthServicer()
    for name in ("", "vllm.grpc.engine.VllmEngine"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"stand-in engine on 127.0.0.1:{args.port} for {folder}", flush=True)
    import signal

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(2).wait()
    print(f"received {state['seen']} multimodal requests", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The worker's arguments.

    :raises SystemExit: on bad arguments (argparse's exit code 2).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-folder", required=True)
    parser.add_argument("--dump", help="write the first --dump-limit requests' inputs here")
    parser.add_argument("--dump-limit", type=int, default=0)
    parser.add_argument("--max-images", type=int, default=4, help="images per prompt")
    parser.add_argument("--threads", type=int, default=16, help="gRPC handler threads")
    args = parser.parse_args(argv)
    if args.dump_limit < 0:
        parser.error(f"--dump-limit must be 0 or more, got {args.dump_limit}")
    if args.dump and not args.dump_limit:
        parser.error("--dump needs --dump-limit N (N > 0)")
    return args


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    serve(parse_args())
