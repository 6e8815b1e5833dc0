"""The render response's zero-join writers equal the plain encoders byte for byte."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import msgspec
import numpy as np
import orjson
import pybase64
import pytest
import torch

from aiomm.server.json_chunks import PiecesString, dumps, dumps_chunks, plain
from aiomm.vllm.wire import (
    Field,
    WireRows,
    decode_item,
    encode_item_b64,
    encode_item_lazy,
    encode_item_pieces,
    tensor_wire,
)

FLAT = Field("flat", {"keep_on_cpu": False, "slices": [[[0, 5, None]]], "dim": 0})
BATCHED = Field("batched", {"keep_on_cpu": True})


def _torch_wire(t: torch.Tensor) -> list:
    """A tensor's ``[dtype, shape, ext]`` made with torch alone (the codec's views are numpy's)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), msgspec.msgpack.Ext(3, raw)]


def _reference(entries: dict) -> bytes:
    """One msgspec document with every tensor copied in, then base64: the plain encoder."""
    doc = {}
    for key, (value, fld) in entries.items():
        if isinstance(value, WireRows):
            raw = np.ascontiguousarray(value.array).tobytes()
            value = [value.dtype, value.shape, msgspec.msgpack.Ext(3, raw)]
        elif isinstance(value, torch.Tensor):
            value = _torch_wire(value)
        doc[key] = {"data": value, "field": fld.wire()}
    return pybase64.b64encode(msgspec.msgpack.encode(doc))


@pytest.mark.parametrize(
    ("rows", "width"), list(itertools.product([0, 1, 2, 7, 1500], [1, 2, 4, 16, 17, 588]))
)
def test_item_pieces_equal_the_plain_encoding(rows: int, width: int) -> None:
    rng = np.random.default_rng(rows * 1000 + width)
    compact = torch.from_numpy(rng.integers(0, 256, (rows, width), dtype=np.uint8))
    grid = torch.tensor([[1, 2, 3]])
    cases = [
        {"pixel_values": (compact, FLAT), "image_grid_thw": (grid, BATCHED)},
        {"pixel_values": (compact.float(), FLAT)},
        {"pixel_values": (compact.to(torch.bfloat16), FLAT), "n": (3, BATCHED)},
    ]
    if width % 2 == 0:  # a repeated-frame view (Qwen-VL's layout), written blockwise
        view = np.broadcast_to(
            compact.numpy().reshape(rows, 2, 1, width // 2), (rows, 2, 2, width // 2)
        )
        cases.append({"pixel_values": (WireRows(view, "uint8"), FLAT), "g": (grid, BATCHED)})
        wide = np.broadcast_to(
            compact.numpy().astype(np.float32).reshape(rows, 2, 1, width // 2),
            (rows, 2, 3, width // 2),
        )  # runs of 4-byte values
        cases.append({"pixel_values": (WireRows(wide, "float32"), FLAT)})
    # a last axis that is not contiguous: gathered value by value
    cases.append({"pixel_values": (WireRows(compact.numpy().T, "uint8"), FLAT)})
    for entries in cases:
        pieces = encode_item_pieces(entries)
        want = _reference(entries)
        assert b"".join(pieces) == encode_item_b64(entries) == want
        # every piece but the last is whole base64 quanta, so pieces can be sent as they are
        assert all(len(p) % 4 == 0 for p in pieces)
        # made as they are read: the size is known before, and a second reading is the same
        lazy = encode_item_lazy(entries)
        assert lazy.nbytes == len(want)
        assert b"".join(lazy) == want and b"".join(lazy) == want


def test_a_large_repeated_item_decodes_to_the_expanded_rows() -> None:
    compact = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (5000, 588), np.uint8))
    view = np.broadcast_to(compact.numpy().reshape(5000, 3, 1, 196), (5000, 3, 2, 196))
    pieces = encode_item_pieces({"pixel_values": (WireRows(view, "uint8"), FLAT)})
    assert len(pieces) > 2  # written in blocks, not one copy of the whole tensor
    value, _ = decode_item(b"".join(pieces).decode())["pixel_values"]
    assert value.shape == (5000, 1176)
    np.testing.assert_array_equal(value.array(), np.ascontiguousarray(view).reshape(5000, -1))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24, dtype=torch.int64).reshape(4, 6).t(),  # not contiguous
        torch.tensor([True, False, True]),
        torch.zeros(0, 3, dtype=torch.float32),
        torch.tensor(7, dtype=torch.int32),  # 0-d
        torch.randn(3, 5).to(torch.bfloat16)[:, ::2],  # no numpy dtype, not contiguous
        torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
    ],
)
def test_tensor_wire_is_the_c_order_bytes(tensor: torch.Tensor) -> None:
    got = tensor_wire(tensor)
    want = _torch_wire(tensor)
    assert got[:2] == want[:2]
    assert bytes(got[2].data) == want[2].data


def test_encoding_a_qwen_vl_item_makes_no_torch_call_that_releases_the_gil() -> None:
    """The render server writes every response's items in worker threads and, as it sends
    them, on the event loop: a torch call there releases the GIL, and the thread then waits to
    get it back (image_ops' module docstring)."""
    from torch_calls import NO_GIL_RELEASE, torch_calls

    from aiomm.adapters import build_processor
    from aiomm.vllm.generate_request import WireForm, encode_items

    pixels = np.random.default_rng(3).integers(0, 256, (100, 130, 3), dtype=np.uint8)
    items = build_processor("qwen2-vl").process_items({"image": [pixels]}, {})["image"]

    def encode() -> tuple[list[str], list[str]]:
        data, meta = encode_items(items, WireForm(), float_dtype=torch.bfloat16)  # as served
        return [str(d) for d in data], [str(m) for m in meta]  # the pieces made, as sent

    encode()
    (pieces, meta), calls = torch_calls(encode)
    assert pieces and meta
    releasing = {name: n for name, n in calls.items() if name not in NO_GIL_RELEASE}
    assert releasing == {}, f"torch calls that release the GIL: {releasing}"


def test_wire_rows_shape_keeps_the_row_width_when_empty() -> None:
    assert WireRows(np.zeros((0, 2, 2, 3), np.uint8), "uint8").shape == [0, 12]
    assert WireRows(np.zeros((5, 7), np.uint8), "uint8").shape == [5, 7]


def test_bfloat16_repeated_rows_go_blockwise_with_their_own_bytes() -> None:
    from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem, Repeat
    from aiomm.vllm.generate_request import WireForm, encode_items

    compact = torch.randn(300, 2 * 7).to(torch.bfloat16)
    config = MultiModalFieldConfig.flat_from_sizes("image", [300], repeat=(2, 2))
    item = MultiModalKwargsItem("image", {"pixel_values": compact}, {"pixel_values": config})
    (data,), _ = encode_items([item], WireForm())
    value, _ = decode_item(str(data))["pixel_values"]
    want = Repeat(2, 2).expand(compact).reshape(300, -1)
    assert value.dtype == "bfloat16" and value.shape == (300, 28)
    assert value.data == want.contiguous().view(torch.int16).numpy().tobytes()


def test_a_shared_field_counts_the_requests_items_of_its_modality() -> None:
    """vLLM's shared field (the Omni thinkers' ``use_audio_in_video``) has the request's videos
    as its batch size; aiomm's items, each processed alone, say 1."""
    from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
    from aiomm.vllm.generate_request import WireForm, encode_items

    def video() -> MultiModalKwargsItem:
        value = torch.tensor(False)
        return MultiModalKwargsItem(
            "video", {"use_audio_in_video": value},
            {"use_audio_in_video": MultiModalFieldConfig.shared("video", 1)},
        )  # fmt: skip

    image = MultiModalKwargsItem(
        "image", {"image_grid_thw": torch.tensor([1, 2, 2])},
        {"image_grid_thw": MultiModalFieldConfig.batched("image")},
    )  # fmt: skip
    data, _ = encode_items([image, video(), video(), video()], WireForm())
    for encoded in data[1:]:
        _, field = decode_item(str(encoded))["use_audio_in_video"]
        assert field.kind == "shared" and field.kwargs["batch_size"] == 3


def test_a_chunked_response_needs_a_chunk() -> None:
    from aiomm.server.json_chunks import ChunkedJSONResponse

    with pytest.raises(ValueError):
        ChunkedJSONResponse([])
    assert ChunkedJSONResponse([b"{", b"}"]).body_length == 2


def test_dumps_chunks_splices_pieces_into_orjson_output() -> None:
    big = [pybase64.b64encode(bytes([i]) * 300_000) for i in range(3)]
    doc = {
        "token_ids": [1, 2, 3],
        "features": {
            "kwargs_data": {"image": [PiecesString(big), PiecesString([b"QUJD"])]},
            "mm_metadata": {"image": [PiecesString([b"eHl6"])]},
        },
        "echo": 'a client string with "quotes" and \u00e9',
    }
    from aiomm.server.json_chunks import ChunkedJSONResponse, iter_chunks

    chunks = dumps_chunks(doc)
    expected = orjson.dumps(plain(doc))
    assert b"".join(iter_chunks(chunks)) == dumps(doc) == expected
    messages, body = _send_through(ChunkedJSONResponse(chunks))
    assert body == expected
    # the big pieces are sent as they are (the same objects), small ones merged around them
    sent = [m["body"] for m in messages[1:]]
    assert [b is p for b, p in zip(sent[1:4], big, strict=True)] == [True] * 3
    assert len(sent) == 6  # the head, 3 big pieces, the merged rest, the end
    assert dumps_chunks({"a": 1}) == [b'{"a":1}']
    with pytest.raises(TypeError):
        dumps_chunks({"a": object()})


@pytest.mark.parametrize(
    ("model", "field"),
    [("qwen3-vl", True), ("glm-4v", False), ("glm-ocr", False), ("qwen2-vl", False), (None, True)],
)
def test_request_features_send_timestamps_as_the_models_vllm_processor_does(
    model: str | None, field: bool
) -> None:
    from aiomm.adapters import build_processor
    from aiomm.processing.fields import MultiModalFieldConfig, MultiModalKwargsItem
    from aiomm.types import Result
    from aiomm.vllm.generate_request import WireForm, generate_request_features

    rows = torch.zeros(4, 6)
    config = MultiModalFieldConfig.flat_from_sizes("video", [4])
    item = MultiModalKwargsItem(
        "video", {"pixel_values_videos": rows}, {"pixel_values_videos": config}
    )
    item.prompt_data["timestamps"] = [0.0, 1.0]
    result = Result("r", items=[item])
    wire = WireForm() if model is None else WireForm.of(build_processor(model))
    features = generate_request_features(result, {"video": ["h"]}, wire=wire)
    # vLLM's Qwen3-VL video items carry their prompt's timestamps; GLM's keep them in the prompt
    # (an item with no field kept on the CPU has no metadata, and then no modality has any)
    assert (features["mm_metadata"] is not None) is field
    if field:
        assert "timestamps" in decode_item(features["mm_metadata"]["video"][0])
        assert decode_item(features["kwargs_data"]["video"][0])["timestamps"][0] == [0.0, 1.0]


def _big_item(seed: int, rows: int = 3000) -> dict[str, Any]:
    compact = np.random.default_rng(seed).integers(0, 256, (rows, 588), np.uint8)
    view = np.broadcast_to(compact.reshape(rows, 3, 1, 196), (rows, 3, 2, 196))
    return {"pixel_values": (WireRows(view, "uint8"), FLAT)}


def test_lazy_items_read_in_turns_on_one_thread_keep_their_own_bytes() -> None:
    """Two responses' items made piece by piece in turns on one thread (the event loop sends
    two responses at once): their blocks share the thread's row buffer, and neither sees the
    other's rows."""
    entries = [_big_item(1), _big_item(2, rows=2000)]
    made: list[list[bytes]] = [[], []]
    readers = [iter(encode_item_lazy(e)) for e in entries]
    for pair in itertools.zip_longest(*readers):
        for i, piece in enumerate(pair):
            if piece is not None:
                made[i].append(piece)
    for pieces, e in zip(made, entries, strict=True):
        assert len(pieces) > 2  # made in blocks, so the turns interleaved them
        assert b"".join(pieces) == _reference(e)


def _send_through(
    response: Any, leave_after: int | None = None
) -> tuple[list[dict[str, Any]], bytes]:
    """The ASGI messages ``response`` sends, and its body. The client's request was read
    whole; with ``leave_after`` it disconnects once that many body messages were sent."""
    messages: list[dict[str, Any]] = []
    gone = anyio.Event()

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        if leave_after is not None and len(messages) > leave_after:
            gone.set()

    async def receive() -> dict[str, Any]:
        await gone.wait()  # as a server does once the request's body was read
        return {"type": "http.disconnect"}

    anyio.run(response, {"type": "http"}, receive, send)
    return messages, b"".join(m.get("body", b"") for m in messages[1:])


def test_a_response_sends_a_lazy_value_as_it_is_made_with_its_length() -> None:
    from aiomm.server.json_chunks import ChunkedJSONResponse

    entries = _big_item(3)
    doc = {
        "token_ids": [1, 2],
        "features": {
            "kwargs_data": {"image": [PiecesString(encode_item_lazy(entries))]},
            "mm_metadata": {"image": [PiecesString([b"eHl6"])]},
        },
    }
    chunks = dumps_chunks(doc)
    assert [type(c) for c in chunks] == [bytes, PiecesString, bytes, PiecesString, bytes]
    response = ChunkedJSONResponse(chunks)
    want = orjson.dumps(plain(doc))
    assert dumps(doc) == want and response.body_length == len(want)
    headers = dict(ChunkedJSONResponse(dumps_chunks(doc)).raw_headers)
    assert headers[b"content-length"] == str(len(want)).encode()
    messages, body = _send_through(response)
    assert body == want
    assert len(messages) > 4  # the value's pieces went one by one
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert all(m["more_body"] for m in messages[1:-1])


class _Lying:
    """Pieces whose stated size is not theirs."""

    def __init__(self, pieces: list[bytes], nbytes: int) -> None:
        self.pieces, self.nbytes = pieces, nbytes

    def __iter__(self) -> Any:
        return iter(self.pieces)


@pytest.mark.parametrize("nbytes", [3, 5])
def test_a_value_that_is_not_its_stated_size_never_ends_as_a_response(nbytes: int) -> None:
    """The Content-Length went out with the headers: a body of another size must fail the
    response (the server then drops the connection), not end it as if it were whole."""
    from aiomm.server.json_chunks import ChunkedJSONResponse

    response = ChunkedJSONResponse(dumps_chunks({"v": PiecesString(_Lying([b"QUJD"], nbytes))}))
    with pytest.raises(RuntimeError, match="Content-Length"):
        _send_through(response)


class _Counted:
    """Lazy pieces that count how many were made."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces, self.made = pieces, 0
        self.nbytes = sum(len(p) for p in pieces)

    def __iter__(self) -> Any:
        for piece in self.pieces:
            self.made += 1
            yield piece


def test_a_client_that_leaves_stops_the_making_of_the_rest() -> None:
    from aiomm.server.json_chunks import ChunkedJSONResponse

    # 16 MiB in 1 MiB pieces: the response checks for the client every 4 MiB it sends
    value = _Counted([pybase64.b64encode(bytes([i]) * (3 << 18)) for i in range(16)])
    response = ChunkedJSONResponse(dumps_chunks({"v": PiecesString(value)}))
    messages, _ = _send_through(response, leave_after=2)
    # stopped within two checkpoints (8 MiB) of the client leaving, not at the end
    assert value.made <= 8, value.made
    assert messages[-1]["more_body"]  # never ended as a whole response
    whole = _Counted(value.pieces)
    _, body = _send_through(ChunkedJSONResponse(dumps_chunks({"v": PiecesString(whole)})))
    assert whole.made == 16 and body == orjson.dumps({"v": str(PiecesString(value.pieces))})


def test_a_large_contiguous_tensor_is_made_in_blocks_without_small_pieces() -> None:
    from aiomm.vllm.wire import _BLOCK_BYTES

    tensor = torch.from_numpy(np.random.default_rng(5).integers(0, 256, 3_000_001, np.uint8))
    entries = {"pixel_values": (tensor.to(torch.bfloat16), FLAT)}
    pieces = list(encode_item_lazy(entries))
    assert b"".join(pieces) == _reference(entries)
    big = [len(p) for p in pieces if len(p) > 1000]
    assert len(big) >= 6_000_002 // _BLOCK_BYTES  # block by block, not one call
    # only the document's head and tail are small: every block ends on a whole quantum
    assert len(pieces) - len(big) <= 2


def test_repeated_rows_blocks_leave_no_small_pieces_between_them() -> None:
    for rows, width in ((3000, 588), (2000, 590)):  # rows of a multiple of 3 bytes, and not
        compact = np.random.default_rng(rows).integers(0, 256, (rows, width), np.uint8)
        view = np.broadcast_to(compact.reshape(rows, 2, 1, width // 2), (rows, 2, 2, width // 2))
        entries = {"pixel_values": (WireRows(view, "uint8"), FLAT), "n": (3, BATCHED)}
        pieces = list(encode_item_lazy(entries))
        assert b"".join(pieces) == _reference(entries)
        assert sum(len(p) < 1000 for p in pieces) <= 2, [len(p) for p in pieces]
