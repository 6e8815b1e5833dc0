"""Audio content parts (``input_audio``, ``audio_url``) read as vLLM 0.33's chat parser reads
them: the data URL an ``input_audio`` part becomes, the ``{"type": "audio"}`` part the template
sees, the keys a part with a ``uuid`` or no ``type`` is found by, and the refusals."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from aiomm.server.data_urls import LIFT_MIN_CHARS, attach, lift_data_urls
from aiomm.vllm.content import media_url, parse_anthropic, parse_chat, parse_responses
from aiomm.vllm.errors import ApiError

CLIP = base64.b64encode(b"RIFF" + bytes(range(200))).decode()


TEXT = {"type": "text", "text": "Listen."}


def _chat(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def test_input_audio_becomes_vllms_data_url_and_an_audio_part() -> None:
    parsed = parse_chat(
        _chat(
            {"type": "text", "text": "Listen."},
            {"type": "input_audio", "input_audio": {"data": CLIP, "format": "mp3"}},
            {"type": "audio_url", "audio_url": {"url": "https://example.com/a.flac"}},
        )
    )
    assert [a.url for a in parsed.audios] == [
        f"data:audio/mp3;base64,{CLIP}",  # the format is only the MIME subtype
        "https://example.com/a.flac",
    ]
    assert parsed.images == parsed.videos == []
    assert parsed.conversation[0]["content"] == [
        {"type": "text", "text": "Listen."},
        {"type": "audio"},
        {"type": "audio"},
    ]


def test_a_format_vllm_does_not_name_is_kept_as_sent() -> None:
    no_format = {"type": "input_audio", "input_audio": {"data": CLIP}}
    assert parse_chat(_chat(TEXT, no_format)).audios[0].url == f"data:audio/;base64,{CLIP}"
    (flac,) = parse_chat(
        _chat(TEXT, {"type": "input_audio", "input_audio": {"data": CLIP, "format": "flac"}})
    ).audios
    assert flac.url.startswith("data:audio/flac;base64,")


def test_images_videos_and_clips_are_kept_apart_in_prompt_order() -> None:
    parsed = parse_chat(
        _chat(
            {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/1.png"}},
            {"type": "input_audio", "input_audio": {"data": CLIP, "format": "wav"}},
            {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
        )
    )
    assert [p["type"] for p in parsed.conversation[0]["content"]] == [
        "audio",
        "image",
        "audio",
        "video",
    ]
    assert [a.url[:21] for a in parsed.audios] == ["data:audio/wav;base64", "data:audio/wav;base64"]
    assert len(parsed.images) == len(parsed.videos) == 1


def test_a_part_with_a_uuid_or_no_type_is_found_by_its_key_in_vllms_order() -> None:
    parsed = parse_chat(
        _chat(
            {"uuid": "a", "input_audio": {"data": CLIP, "format": "wav"}},
            {"type": "text", "uuid": 7, "audio_url": {"url": "https://example.com/a.wav"}},
            {"audio_url": "https://example.com/b.wav"},  # no type: the URL may be a string
            # vLLM looks for image_url before audio_url, and audio_url before input_audio
            {"uuid": "i", "image_url": {"url": "https://example.com/1.png"}, "audio_url": {}},
            {"uuid": "b", "audio_url": {"url": "https://example.com/c.wav"}, "input_audio": {}},
        )
    )
    assert [(a.url[-5:], a.uuid) for a in parsed.audios] == [
        (CLIP[-5:], "a"),
        ("a.wav", "7"),
        ("b.wav", None),
        ("c.wav", "b"),
    ]
    assert [(i.url, i.uuid) for i in parsed.images] == [("https://example.com/1.png", "i")]


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "audio_url", "audio_url": "https://example.com/a.wav"}, "valid dictionary"),
        ({"type": "audio_url", "audio_url": {}}, "url is missing"),
        ({"type": "audio_url", "audio_url": {"url": 5}}, "url: Input should be a valid string"),
        ({"type": "audio_url", "audio_url": {"url": ""}}, r"\['audio'\]\[0\] is empty but"),
        ({"type": "input_audio"}, r"\['audio'\]\[0\] is empty but"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "is empty but"),
        ({"input_audio": {"data": "", "format": "wav"}}, "is empty but"),
        ({"uuid": "u", "input_audio": {"data": ""}}, "a uuid alone names no clip"),
        ({"type": "input_audio", "input_audio": {"data": 5, "format": "wav"}}, "base64 string"),
        ({"type": "input_audio", "input_audio": CLIP}, "must be an object"),
    ],
)
def test_a_part_without_a_clip_is_refused(part: dict[str, Any], words: str) -> None:
    with pytest.raises(ApiError, match=words) as caught:
        parse_chat(_chat(TEXT, part))  # with a text part: the message is vLLM's type
    assert caught.value.status == 400


def test_an_audio_url_takes_no_detail_but_keeps_its_other_checks() -> None:
    # vLLM's AudioURL has only ``url``: a detail is ignored, whatever its value
    part = {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav", "detail": "x"}}
    assert len(parse_chat(_chat(part)).audios) == 1
    with pytest.raises(ApiError, match="detail"):
        parse_chat(
            _chat({"type": "video_url", "video_url": {"url": "https://e.com/v", "detail": "x"}})
        )


def test_responses_and_anthropic_refuse_audio_as_vllm_does() -> None:
    part = {"type": "input_audio", "input_audio": {"data": CLIP, "format": "wav"}}
    with pytest.raises(ApiError) as caught:
        parse_responses({"input": [{"role": "user", "content": [part]}]})
    assert caught.value.status == 400
    block = {"type": "audio", "source": {"type": "base64", "media_type": "audio/wav", "data": CLIP}}
    with pytest.raises(ApiError) as caught:
        parse_anthropic({"messages": [{"role": "user", "content": [block]}]})
    assert caught.value.status == 400


def test_an_audio_data_url_taken_out_of_the_body_comes_back_as_its_bytes() -> None:
    import orjson

    clip = bytes(range(256)) * (LIFT_MIN_CHARS // 256 + 1)
    payload = base64.b64encode(clip).decode()
    body = _chat(
        {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{payload}"}},
        {"type": "input_audio", "input_audio": {"data": payload, "format": "wav"}},
    )
    raw = orjson.dumps(body)
    lifted_raw, lifted = lift_data_urls(raw, 1 << 20)
    assert lifted is not None and len(lifted.payloads) == 1  # input_audio is no data URL
    parsed = attach(parse_chat(orjson.loads(lifted_raw)), lifted)
    assert parsed is not None
    assert parsed.audios[0].data == clip
    assert parsed.audios[1].data is None
    assert parsed.audios[1].url == f"data:audio/wav;base64,{payload}"


@pytest.mark.parametrize(
    "content",
    [
        # a format OpenAI's type does not name: alone, the message is validated as OpenAI's
        [{"type": "input_audio", "input_audio": {"data": CLIP, "format": "flac"}}],
        ["a string", {"type": "input_audio", "input_audio": {"data": CLIP, "format": "ogg"}}],
        [{"image_url": {"url": "https://example.com/1.png"}}],
        [{"type": "text"}],
    ],
)
def test_a_content_list_of_no_declared_part_is_refused_as_vllm_refuses_it(
    content: list[Any],
) -> None:
    with pytest.raises(ApiError, match="no part is one of the part types"):
        parse_chat({"messages": [{"role": "user", "content": content}]})


def test_a_declared_part_lets_the_others_through_as_vllm_does() -> None:
    flac = {"type": "input_audio", "input_audio": {"data": CLIP, "format": "flac"}}
    for company in (
        {"type": "text", "text": "Hi"},
        {"type": "input_audio", "input_audio": {"data": CLIP, "format": "wav"}},
        {**flac, "uuid": None},  # a null uuid is a field of vLLM's own simple image part
    ):
        parsed = parse_chat(_chat(flac, company))
        assert parsed.audios[0].url.startswith("data:audio/flac;base64,")
    # a tool message is never validated as OpenAI's (it has no tool_call_id)
    tool = parse_chat({"messages": [{"role": "tool", "content": [flac]}]})
    assert len(tool.audios) == 1


def test_an_empty_clip_is_named_by_its_index_among_the_clips() -> None:
    good = {"type": "input_audio", "input_audio": {"data": CLIP, "format": "wav"}}
    with pytest.raises(ApiError, match=r"\['audio'\]\[1\] is empty") as caught:
        parse_chat(_chat(good, {"type": "audio_url", "audio_url": {"url": ""}}))
    assert caught.value.param == "multi_modal_uuids"


def test_data_urls_are_refused_with_vllms_words_and_statuses() -> None:
    with pytest.raises(ApiError, match="missing ',' separator") as caught:
        media_url("data:audio/wav;base64")
    assert caught.value.status == 400
    with pytest.raises(ApiError, match="Only base64 data URLs") as caught:
        media_url("data:audio/wav,RIFF")  # percent-encoded
    assert (caught.value.status, caught.value.type) == (501, "NotImplementedError")
    # an input_audio format with a comma makes such a URL, as in vLLM
    (clip,) = parse_chat(
        _chat(TEXT, {"type": "input_audio", "input_audio": {"data": CLIP, "format": "a,b"}})
    ).audios
    with pytest.raises(ApiError) as caught:
        media_url(clip.url)
    assert caught.value.status == 501


def test_the_random_audio_requests_carry_zero_to_two_clips_and_no_image() -> None:
    import itertools

    from random_requests import random_requests

    requests = list(itertools.islice(random_requests(3, "m", audios=1.0), 8))
    counts = []
    for path, body, what in requests:
        assert path == "/v1/chat/completions/render"
        parts = [
            p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]
        ]
        clips = [p for p in parts if p["type"] != "text"]
        assert {p["type"] for p in clips} <= {"input_audio", "audio_url"}
        assert len(clips) == len(what) <= 2
        counts.append(len(clips))
        for clip in clips:
            url = clip["audio_url"]["url"] if clip["type"] == "audio_url" else None
            payload = url.partition(",")[2] if url else clip["input_audio"]["data"]
            assert base64.b64decode(payload, validate=True)
    assert len(set(counts)) > 1
