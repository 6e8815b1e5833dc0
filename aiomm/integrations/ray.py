"""aiomm as a Ray Data stage: :class:`ImagePreprocessor` for ``Dataset.map_batches``.

Each actor builds one :class:`~aiomm.Engine` and keeps it for its lifetime. Ray Data runs an
async callable class on one event loop per actor (a thread of its own) and each batch in a fresh
task of that loop; the engine's task group must be entered and left by one task, so the engine
is opened lazily, on the first batch, in a host task that lives until the actor goes. A batch's
rows go through the engine concurrently (bounded by ``EngineConfig.max_in_flight``), so fetch,
decode, resize and the device stage of different rows overlap inside the actor; Ray Data also
runs several batches of one actor at once on the same loop and engine.

Output columns (one row per input row, schema fixed by the adapter, never by the data):

- ``prompt_token_ids``: ``list<int64>``, placeholders expanded.
- ``mm_placeholders``: a tensor ``[images, 2]`` of ``(offset, length)`` per image (per clip for
  an audio adapter).
- ``pixel_values``: a tensor, the request's rows in the model's layout: as the transform made
  them (uint8, not normalised, for adapters that normalise on the device) or, with
  ``normalize=True``, exactly what :meth:`Engine.process` returns (``bfloat16`` widened to
  ``float32``, which is exact: NumPy and Arrow have no bfloat16).
- every other model kwarg of the adapter (the grid fields, e.g. ``image_grid_thw``): a tensor.
- ``mm_hashes``: ``list<string>``, the items' cache keys.
- ``error``: null, or ``"ErrorType: message"`` for a row that failed (its other columns empty);
  the batch and the job go on.
- with ``vllm_model_id``: ``features``, vLLM 0.33's ``GenerateRequest.features`` of the row as
  JSON text (mm_hashes in vLLM's scheme for a server of that model id, placeholders, the items'
  msgpack payload); :func:`generate_request` turns a row into the body a
  ``vllm serve --tokens-only`` engine takes at ``/inference/v1/generate``. Needs the ``serve``
  extra and encoded image bytes (an audio adapter's rows have no ``features``: refused).

An audio adapter (Qwen2-Audio) takes each row's clips from ``audio_column`` instead (encoded
bytes, a path or URL, or a list of those); its tensor columns are its features
(``input_features``, ``feature_attention_mask``).

Tensors are Ray's variable-shaped tensor extension type, so ``ds.write_parquet`` round-trips
them; :class:`TorchCollate` turns batches into tensors for ``iter_torch_batches``. Needs the
``ray`` extra (``pip install "aiomm[ray]"``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pyarrow as pa
import ray
import torch
from ray.data.collate_fn import NumpyBatchCollateFn
from ray.data.extensions import ArrowVariableShapedTensorArray, ArrowVariableShapedTensorType

from aiomm.config import EngineConfig
from aiomm.engine import Engine
from aiomm.errors import AiommError, ConfigError, EngineClosedError, InvalidRequestError
from aiomm.logging import get_logger
from aiomm.processing.fields import merge_items
from aiomm.types import Request, Result

__all__ = ("ImagePreprocessor", "TorchCollate", "generate_request")

log = get_logger(__name__)

#: an image small enough to cost nothing, used once per actor to learn the adapter's outputs
_PROBE = np.zeros((64, 64, 3), np.uint8)
#: a clip as cheap, for an audio adapter (a tenth of a second at its rate)
_PROBE_SECONDS = 0.1


class ImagePreprocessor:
    """A Ray Data callable class running a batch's rows through one long-lived aiomm Engine.

    ``ds.map_batches(ImagePreprocessor, fn_constructor_kwargs={"model": "qwen2-vl"},
    compute=ray.data.ActorPoolStrategy(size=N), batch_size=B)``.

    A row's images come from ``image_column``: encoded bytes (``read_binary_files``' ``bytes``),
    a path or URL, an ``H x W x C`` uint8 array (``read_images``' ``image``), or a list of those;
    a null takes none. Its prompt is ``prompt_token_ids_column`` when the batch has it and the
    row's value is not null, else ``prompt_column``, else the fixed ``prompt``.
    ``keep_columns`` are copied from the input (e.g. an id). ``config`` defaults to an engine
    with one transform thread per CPU Ray gave the actor. ``model`` is a registered
    architecture or short name, or a local model folder (as :meth:`Engine.from_pretrained`).

    :raises UnknownArchitectureError: ``model`` has no adapter.
    :raises ProcessorKwargsError: ``mm_processor_kwargs`` the processor does not take.
    :raises ConfigError: a batch lacks the image (or audio) column, has no prompt source, or
        lacks a ``keep_columns`` column (a job-level mistake: the job stops); ``vllm_model_id``
        with ``normalize=True`` or with an audio adapter.
    """

    def __init__(
        self,
        model: str,
        *,
        config: EngineConfig | None = None,
        normalize: bool = False,
        image_column: str = "image",
        prompt_column: str = "prompt",
        prompt_token_ids_column: str = "prompt_token_ids",
        prompt: str | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        keep_columns: Sequence[str] = (),
        backend: str = "torchvision",
        vllm_model_id: str | None = None,
        audio_column: str = "audio",
    ) -> None:
        # set first: __del__ runs even when construction fails below
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._host: asyncio.Task[None] | None = None
        self._open_error: BaseException | None = None
        config = config or _actor_config()
        if vllm_model_id is not None:
            if normalize:
                raise ConfigError(
                    "vllm_model_id ships the items' uint8 rows to vLLM: it excludes normalize=True"
                )
            config = replace(config, return_items=True)
        self.config = config
        self.vllm_model_id = vllm_model_id
        self.normalize = normalize
        self.image_column = image_column
        self.prompt_column = prompt_column
        self.prompt_token_ids_column = prompt_token_ids_column
        self.prompt = prompt
        self.mm_processor_kwargs = dict(mm_processor_kwargs or {})
        self.keep_columns = tuple(keep_columns)
        self.engine = Engine.from_pretrained(model, self.config, backend=backend)
        modalities = self.engine.processor.supported_modalities
        #: what a row's items are: images, or clips for an adapter that takes only audio
        self.modality = "image" if "image" in modalities or "audio" not in modalities else "audio"
        #: the column a row's items come from
        self.item_column = image_column if self.modality == "image" else audio_column
        if vllm_model_id is not None and self.modality == "audio":
            raise ConfigError("vllm_model_id: GenerateRequest features are made for images only")
        wire_modality = getattr(self.engine.processor, "wire_modality", None)
        if vllm_model_id is not None and wire_modality is not None:
            # vLLM keys such a model's items by another modality and hashes decoded pixels
            raise ConfigError(
                f"vllm_model_id: GenerateRequest features are not made for {model}'s "
                f"{wire_modality} items"
            )
        self._tensor_columns = self._probe()

    def _probe(self) -> dict[str, tuple[np.dtype[Any], tuple[int, ...]]]:
        """Each tensor column's dtype and empty shape, from one tiny image: an all-failed batch
        gets the schema of a good one, so blocks concatenate and write to one parquet schema.

        :raises ProcessorKwargsError: ``mm_processor_kwargs`` the processor does not take.
        """
        processor = self.engine.processor
        probe: Any = _PROBE
        if self.modality == "audio":
            probe = np.zeros(int(processor.audio_sampling_rate * _PROBE_SECONDS), np.float32)
        modality = self.modality
        items = processor.process_items({modality: [probe]}, self.mm_processor_kwargs)
        columns = {}
        for key, value in merge_items(items[modality]).items():
            if not isinstance(value, torch.Tensor):
                continue
            dtype = value.dtype
            if key == "pixel_values" and self.normalize:
                dtype = getattr(torch, self.config.visual_dtype)
            columns[key] = (_numpy_dtype(dtype), (0, *value.shape[1:]))
        return columns

    # ------------------------------------------------------------------ engine lifecycle

    async def _open(self) -> Engine:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._ready, self._stop = loop, asyncio.Event(), asyncio.Event()
            # Not a bare fire-and-forget task: it owns the engine's task group (which one task
            # must enter and leave), and Ray Data, not we, owns the loop and each batch's task.
            self._host = loop.create_task(self._serve())
        elif loop is not self._loop:
            raise EngineClosedError(
                "ImagePreprocessor is bound to the event loop of its first batch; "
                "call it from that loop only"
            )
        assert self._ready is not None
        await self._ready.wait()
        if self._open_error is not None:
            raise self._open_error
        return self.engine

    async def _serve(self) -> None:
        assert self._ready is not None and self._stop is not None
        try:
            async with self.engine:
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._open_error = exc
            raise
        finally:
            if self._open_error is None:
                self._open_error = EngineClosedError("this ImagePreprocessor has been closed")
            self._ready.set()

    def close(self) -> None:
        """Close the actor's engine (Ray Data calls ``__del__`` when the actor goes)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed in between: nothing left to stop
                pass

    async def aclose(self) -> None:
        """Close the engine and wait for it, from the event loop that runs the batches."""
        self.close()
        if self._host is not None:
            await self._host

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ batches

    async def __call__(self, batch: Any) -> pa.Table:
        """Preprocess one batch (a dict of NumPy arrays, a pandas DataFrame or an Arrow table).

        :raises ConfigError: the batch lacks a configured column (see the class docstring).
        :raises EngineClosedError: called from another event loop than the first batch's.
        """
        columns = _columns(batch)
        self._check_columns(columns)
        n = _num_rows(columns)
        engine = await self._open()
        results: list[Result | AiommError | None] = [None] * n

        async def one(i: int, request: Request) -> None:
            results[i] = await engine.process_safe(request, device=self.normalize)

        async with anyio.create_task_group() as tg:
            for i in range(n):
                try:
                    request = self._request(columns, i)
                except AiommError as exc:
                    results[i] = exc
                    continue
                except (TypeError, ValueError) as exc:
                    # a malformed value (token ids that are not integers, ...) fails its row
                    results[i] = InvalidRequestError(
                        f"row {i} of the batch: {type(exc).__name__}: {exc}"
                    )
                    continue
                tg.start_soon(one, i, request)
        features: list[str | None] = [None] * n
        if self.vllm_model_id is not None:
            for i, r in enumerate(results):
                if isinstance(r, Result) and r.ok:
                    results[i], features[i] = self._with_features(columns, i, r)
        failed = sum(1 for r in results if not isinstance(r, Result) or not r.ok)
        if failed:
            log.info("ray_batch_errors", rows=n, failed=failed)
        return self._table(columns, results, features)

    def _with_features(
        self, columns: Mapping[str, Any], i: int, result: Result
    ) -> tuple[Result | AiommError, str | None]:
        """The row's result and its ``GenerateRequest.features`` as JSON (or the row's
        error)."""
        import orjson

        from aiomm.vllm.generate_request import (
            WireForm,
            generate_request_features,
            vllm_mm_hash,
        )

        images = _images(columns[self.image_column][i])
        if not all(isinstance(x, (bytes, bytearray)) for x in images):
            return InvalidRequestError(
                f"row {i}: vLLM's mm_hashes are taken over encoded image bytes; this row's "
                f"images are {sorted({type(x).__name__ for x in images})}"
            ), None
        assert self.vllm_model_id is not None
        try:
            hashes = [vllm_mm_hash(bytes(x), self.vllm_model_id) for x in images]
        except AiommError as exc:
            return exc, None
        features = generate_request_features(
            result, hashes, wire=WireForm.of(self.engine.processor)
        )
        return result, orjson.dumps(features).decode()

    def _check_columns(self, columns: Mapping[str, Any]) -> None:
        missing = [c for c in (self.item_column, *self.keep_columns) if c not in columns]
        if self.prompt is None and not (
            self.prompt_column in columns or self.prompt_token_ids_column in columns
        ):
            missing.append(f"{self.prompt_column} or {self.prompt_token_ids_column}")
        if missing:
            raise ConfigError(
                f"the batch has no column {missing} (it has {sorted(columns)}); set the "
                "column names or a fixed prompt in fn_constructor_kwargs"
            )

    def _request(self, columns: Mapping[str, Any], i: int) -> Request:
        value = columns[self.item_column][i]
        items: dict[str, Any] = (
            {"images": _images(value)} if self.modality == "image" else {"audios": _audios(value)}
        )
        ids = columns.get(self.prompt_token_ids_column)
        if ids is not None and not _is_null(ids[i]):
            return Request(
                prompt_token_ids=[int(t) for t in ids[i]],
                mm_processor_kwargs=self.mm_processor_kwargs or None,
                **items,
            )
        text = columns.get(self.prompt_column)
        prompt = self.prompt if text is None or _is_null(text[i]) else text[i]
        return Request(
            prompt=None if prompt is None else str(prompt),
            mm_processor_kwargs=self.mm_processor_kwargs or None,
            **items,
        )

    def _table(
        self,
        columns: Mapping[str, Any],
        results: Sequence[Result | AiommError | None],
        features: Sequence[str | None],
    ) -> pa.Table:
        good = [r if isinstance(r, Result) and r.ok else None for r in results]
        out: dict[str, pa.Array] = {c: _arrow_column(columns[c]) for c in self.keep_columns}
        out["prompt_token_ids"] = pa.array(
            [[] if r is None else r.prompt_token_ids for r in good], pa.list_(pa.int64())
        )
        out["mm_placeholders"] = _tensors(
            [
                np.array(
                    [(p.offset, p.length) for p in r.mm_placeholders.get(self.modality, [])],
                    np.int64,
                ).reshape(-1, 2)
                if r is not None
                else np.empty((0, 2), np.int64)
                for r in good
            ],
            np.dtype(np.int64),
            2,
        )
        for key, (dtype, empty_shape) in self._tensor_columns.items():
            out[key] = _tensors(
                [
                    np.empty(empty_shape, dtype)
                    if r is None or key not in r.mm_kwargs
                    else _numpy(r.mm_kwargs[key])
                    for r in good
                ],
                dtype,
                len(empty_shape),
            )
        out["mm_hashes"] = pa.array(
            [[] if r is None else r.item_hashes for r in good], pa.list_(pa.string())
        )
        out["error"] = pa.array([_error_text(r) for r in results], pa.string())
        if self.vllm_model_id is not None:
            out["features"] = pa.array(list(features), pa.string())
        return pa.table(out)


def generate_request(
    row: Mapping[str, Any],
    *,
    model: str,
    sampling_params: Mapping[str, Any] | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """The ``GenerateRequest`` body of one output row of an ``ImagePreprocessor`` made with
    ``vllm_model_id``, for ``POST /inference/v1/generate`` on ``vllm serve --tokens-only``
    (``model``: its served model name; ``sampling_params`` as vLLM's ``SamplingParams``).

    :raises InvalidRequestError: a row that failed (its ``error``) or has no ``features``.
    """
    import json

    from aiomm.vllm.generate_request import generate_request as body

    if row.get("error"):
        raise InvalidRequestError(f"the row failed: {row['error']}")
    if not row.get("features"):
        raise InvalidRequestError(
            "the row has no features: make the ImagePreprocessor with vllm_model_id="
        )
    return body(
        [int(t) for t in row["prompt_token_ids"]],
        json.loads(row["features"]),
        model=model,
        sampling_params=dict(sampling_params or {}),
        request_id=request_id,
    )


class TorchCollate(NumpyBatchCollateFn):
    """``iter_torch_batches(collate_fn=TorchCollate())`` for ImagePreprocessor's columns.

    A numeric column becomes one tensor; a ragged one (tensors of different shapes, token id
    lists) a list of tensors, one per row; strings and lists of strings stay Python lists.
    """

    # Ray annotates the result with CollatedData, a TypeVar bound to nothing (no return type
    # can match it)
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:  # type: ignore[override]
        return {name: _torch_column(values) for name, values in batch.items()}


# ---------------------------------------------------------------------- helpers


def _actor_config() -> EngineConfig:
    """One transform thread per CPU Ray gave this actor (not per core of the node), and one
    torch thread when there are several: the actor's process exists for this stage, and
    torch's own pool would spin on the cores the transform threads use."""
    cpus = 1.0
    if ray.is_initialized():
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    threads = max(1, round(cpus))
    return replace(
        EngineConfig(), transform_threads=threads, torch_threads=1 if threads > 1 else None
    )


def _columns(batch: Any) -> dict[str, Any]:
    if isinstance(batch, pa.Table):
        return {name: batch.column(name).to_pylist() for name in batch.column_names}
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # a pandas DataFrame
        return {str(name): batch[name].to_numpy() for name in batch.columns}
    return dict(batch)


def _num_rows(columns: Mapping[str, Any]) -> int:
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise InvalidRequestError(f"the batch's columns differ in length: {sorted(lengths)}")
    return lengths.pop() if lengths else 0


def _images(value: Any) -> list[Any]:
    """A row's image value as a list of image sources."""
    if _is_null(value):
        return []
    if isinstance(value, (bytes, str, Path)):
        return [value]
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return [_image(v) for v in value]
        if value.dtype.kind == "S":
            return [bytes(v) for v in value.reshape(-1)]
        if value.ndim == 3:
            return [value]
        if value.ndim == 4:
            return list(value)
        raise InvalidRequestError(
            f"an image array must be H x W x C (or a stack of them), got shape {value.shape}"
        )
    if isinstance(value, (list, tuple)):
        return [_image(v) for v in value]
    return [value]


def _audios(value: Any) -> list[Any]:
    """A row's audio value as a list of audio sources (encoded bytes, paths or URLs)."""
    if _is_null(value):
        return []
    if isinstance(value, (bytes, str, Path)):
        return [value]
    if isinstance(value, np.ndarray) and value.dtype.kind == "S":
        return [bytes(v) for v in value.reshape(-1)]
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_image(v) for v in value]
    return [value]


def _is_null(value: Any) -> bool:
    """None, or the NaN a null becomes in a NumPy batch (a column of nulls is float)."""
    return value is None or (isinstance(value, (float, np.floating)) and bool(np.isnan(value)))


def _image(value: Any) -> Any:
    return bytes(value) if isinstance(value, np.bytes_) else value


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()  # exact: every bfloat16 is a float32
        return value.numpy()
    return np.asarray(value)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return torch.empty(0, dtype=dtype).numpy().dtype


def _tensors(arrays: list[np.ndarray], dtype: np.dtype[Any], ndim: int) -> pa.Array:
    if not arrays:
        type_ = ArrowVariableShapedTensorType(pa.from_numpy_dtype(dtype), ndim)
        return pa.ExtensionArray.from_storage(type_, pa.array([], type_.storage_type))
    return ArrowVariableShapedTensorArray.from_numpy(
        [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    )


def _arrow_column(values: Any) -> pa.Array:
    if isinstance(values, np.ndarray) and values.dtype != object and values.ndim == 1:
        return pa.array(values)
    return pa.array(list(values))


def _error_text(result: Result | AiommError | None) -> str | None:
    error = result if isinstance(result, AiommError) else None
    if isinstance(result, Result):
        error = result.error
    return None if error is None else f"{type(error).__name__}: {error}"


def _torch_column(values: np.ndarray) -> Any:
    if values.dtype != object:
        return _tensor(values)
    return [
        _tensor(v)
        if isinstance(v, np.ndarray) and v.dtype.kind in "biuf"
        else (list(v) if isinstance(v, np.ndarray) else v)
        for v in values
    ]


def _tensor(array: np.ndarray) -> torch.Tensor:
    # Ray's zero-copy batches are read-only; torch would share (and warn about) them
    return torch.from_numpy(array if array.flags.writeable else array.copy())
