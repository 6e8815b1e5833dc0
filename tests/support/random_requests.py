"""Seeded random render requests, as clients send them: the inputs of the randomized comparison
of ``aiomm serve`` with vLLM's render server (``tests/server/compare_vllm.py``).

Each request is ``(path, body)``: mostly chat, some Responses and Anthropic bodies; one to three
images in the common formats and modes (JPEG grey/RGB/CMYK with any EXIF orientation, PNG in
every colour type, 16-bit, palettes with transparency, WebP, GIF, BMP, TIFF), from a pixel to
2,500 px a side, a few with extreme aspect ratios or a cut-off tail; multi-turn conversations
with system prompts; sampling fields; ``mm_payload`` tensors or none; with ``videos`` a share
of requests with a short clip; with ``audios`` a share of chat requests with zero to two audio
clips in place of the images (WAV, FLAC, MP3, Ogg Vorbis/Opus, M4A/AAC, WebM/Opus; mono or
stereo; 8 to 48 kHz; 0.05 s to a minute; a few cut short or not audio at all) as ``input_audio``
parts or ``audio_url`` data URLs.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import PIL.Image

__all__ = ("ImageSpec", "random_audio", "random_image", "random_requests")

_WORDS = (
    "describe the image what is shown here how many people are there read the text on the "
    "sign which colour is the car left right top bottom count objects explain briefly"
).split()


class ImageSpec:
    """What a random image is, for the report: format, mode, size, orientation, cut."""

    def __init__(self, fmt: str, mode: str, size: tuple[int, int], **extra: Any) -> None:
        self.fmt, self.mode, self.size, self.extra = fmt, mode, size, extra

    def __repr__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        return f"{self.fmt}/{self.mode} {self.size[0]}x{self.size[1]}{extra}"


def _pixels(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    phase = rng.uniform(0, 6.3, 3)
    planes = [127 + 100 * np.sin(rng.uniform(2, 9) * x + 3 * y + p) for p in phase]
    image = np.stack(planes, axis=-1) + rng.normal(0, 12, (height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def _size(rng: random.Random) -> tuple[int, int]:
    roll = rng.random()
    if roll < 0.1:
        side = (1, 28)
    elif roll < 0.6:
        side = (28, 400)
    elif roll < 0.92:
        side = (400, 1300)
    else:
        side = (1300, 2500)
    width, height = rng.randint(*side), rng.randint(*side)
    if rng.random() < 0.04:  # an extreme aspect ratio: most processors refuse it
        long, short = rng.randint(800, 2500), rng.randint(1, 8)
        width, height = (long, short) if rng.random() < 0.5 else (short, long)
    return width, height


def random_image(rng: random.Random) -> tuple[str, bytes, ImageSpec]:
    """(mime type, encoded bytes, spec) of one random image."""
    width, height = _size(rng)
    pixels = _pixels(np.random.default_rng(rng.randrange(2**32)), width, height)
    image = PIL.Image.fromarray(pixels)
    buf = io.BytesIO()
    kind = rng.choices(["jpeg", "png", "webp", "gif", "bmp", "tiff"], weights=[45, 35, 8, 4, 4, 4])[
        0
    ]
    extra: dict[str, Any] = {}
    if kind == "jpeg":
        mode = rng.choices(["RGB", "L", "CMYK"], weights=[80, 15, 5])[0]
        options: dict[str, Any] = {
            "quality": rng.randint(30, 95),
            "progressive": rng.random() < 0.2,
        }
        if mode == "RGB":
            options["subsampling"] = rng.choice([0, 1, 2])
        if rng.random() < 0.3:
            exif = PIL.Image.Exif()
            exif[0x0112] = extra["orientation"] = rng.randint(1, 8)
            options["exif"] = exif.tobytes()
        image.convert(mode).save(buf, "JPEG", **options)
        mime = "image/jpeg"
    elif kind == "png":
        mode = rng.choice(["RGB", "RGBA", "L", "LA", "P", "P+tRNS", "I;16", "1"])
        if mode == "RGBA":
            alpha = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (height, width))
            converted = PIL.Image.fromarray(np.dstack([pixels, alpha.astype(np.uint8)]), "RGBA")
        elif mode == "LA":
            converted = image.convert("LA")
        elif mode.startswith("P"):
            converted = image.quantize(colors=rng.choice([2, 16, 256]))
            if mode == "P+tRNS":
                converted.info["transparency"] = 0
        elif mode == "I;16":
            grey = np.asarray(image.convert("L")).astype(np.uint16) * 257
            converted = PIL.Image.fromarray(grey)
        else:
            converted = image.convert(mode)
        save: dict[str, Any] = {}
        if "transparency" in converted.info:
            save["transparency"] = converted.info["transparency"]
        converted.save(buf, "PNG", **save)
        mime = "image/png"
    elif kind == "webp":
        mode = rng.choice(["RGB", "RGBA"])
        lossless = rng.random() < 0.3
        image.convert(mode).save(buf, "WEBP", quality=rng.randint(40, 95), lossless=lossless)
        extra["lossless"] = lossless
        mime = "image/webp"
    elif kind == "gif":
        mode = "P"
        image.quantize(colors=64).save(buf, "GIF")
        mime = "image/gif"
    elif kind == "bmp":
        mode = rng.choice(["RGB", "L"])
        image.convert(mode).save(buf, "BMP")
        mime = "image/bmp"
    else:
        mode = rng.choice(["RGB", "RGBA", "L"])
        image.convert(mode).save(buf, "TIFF", compression=rng.choice([None, "tiff_lzw"]))
        mime = "image/tiff"
    data = buf.getvalue()
    if kind == "png" and rng.random() < 0.05:  # the IEND chunk and the checksums cut off
        cut = rng.choice([12, 16, 20])
        data, extra["cut"] = data[:-cut], cut
    return mime, data, ImageSpec(kind, mode, (width, height), **extra)


def random_clip(rng: random.Random) -> tuple[str, bytes, str]:
    """(mime type, encoded bytes, description) of a short random clip (PyAV)."""
    import av

    codec, fmt, mime = rng.choice(
        [
            ("libx264", "mp4", "video/mp4"),
            ("mpeg4", "mp4", "video/mp4"),
            ("libvpx-vp9", "webm", "video/webm"),
        ]
    )
    width, height = rng.randrange(32, 200, 2), rng.randrange(32, 160, 2)
    fps = rng.choice([Fraction(8), Fraction(10), Fraction(24), Fraction(30000, 1001)])
    frames = rng.randint(4, 40)
    nrng = np.random.default_rng(rng.randrange(2**32))
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = _pixels(nrng, width, height)
        for i in range(frames):
            frame = np.roll(base, 3 * i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return mime, buf.getvalue(), f"{codec}/{fmt} {width}x{height} {frames}f@{float(fps):.2f}"


#: audio codecs of the random clips: (soundfile format or PyAV container, subtype or codec,
#: ``input_audio`` format, MIME type, weight)
_AUDIO_CODECS = (
    ("WAV", "PCM_16", "wav", "audio/wav", 30),
    ("WAV", "FLOAT", "wav", "audio/x-wav", 5),
    ("FLAC", "PCM_16", "flac", "audio/flac", 15),
    ("MP3", "MPEG_LAYER_III", "mp3", "audio/mpeg", 20),
    ("OGG", "VORBIS", "ogg", "audio/ogg", 15),
    ("OGG", "OPUS", "ogg", "audio/ogg", 5),
    ("mp4", "aac", "m4a", "audio/mp4", 5),
    ("webm", "libopus", "webm", "audio/webm", 5),
)


def random_audio(rng: random.Random) -> tuple[str, str, bytes, str]:
    """(``input_audio`` format, MIME type, encoded bytes, description) of one random clip."""
    from audio_samples import AudioCase, encode, signal

    fmt, subtype, short, mime, _ = rng.choices(_AUDIO_CODECS, [c[-1] for c in _AUDIO_CODECS])[0]
    rates = [8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000]
    if subtype in ("OPUS", "libopus"):
        rates = [8000, 12000, 16000, 24000, 48000]  # the rates Opus encodes
    rate, channels = rng.choice(rates), rng.choice([1, 2])
    low, high = rng.choices([(0.05, 5), (5, 30), (30, 62)], weights=[70, 20, 10])[0]
    seconds = round(rng.uniform(low, high), 3)
    samples = signal(rate, channels, seconds, seed=rng.randrange(2**31))
    if fmt in ("mp4", "webm"):
        data = encode(AudioCase("random", fmt, subtype, rate, channels, seconds), samples)
    else:
        import soundfile

        buf = io.BytesIO()
        with soundfile.SoundFile(buf, "w", rate, channels, format=fmt, subtype=subtype) as out:
            # in blocks: libsndfile's Vorbis encoder crashes on a minute at 48 kHz in one write
            for start in range(0, len(samples), 1 << 15):
                out.write(samples[start : start + (1 << 15)])
        data = buf.getvalue()
    described = f"{short}/{subtype} {rate} Hz x{channels} {seconds} s"
    roll = rng.random()
    if roll < 0.03:  # cut short: a decoder may still read its head
        data = data[: rng.randint(1, len(data) - 1)]
        described += f" cut to {len(data)} bytes"
    elif roll < 0.06:  # not audio at all
        data = rng.randbytes(rng.randint(1, 4096))
        described = f"{len(data)} random bytes as {short}"
    return short, mime, data, described


def _audio_part(rng: random.Random, short: str, mime: str, data: bytes) -> dict[str, Any]:
    """An ``input_audio`` part (its format sometimes missing) or an ``audio_url`` data URL."""
    payload = base64.b64encode(data).decode()
    if rng.random() < 0.5:
        clip: dict[str, Any] = {"data": payload, "format": short}
        if rng.random() < 0.1:
            del clip["format"]  # vLLM makes ``data:audio/;base64,...`` of it
        part: dict[str, Any] = {"type": "input_audio", "input_audio": clip}
    else:
        part = {"type": "audio_url", "audio_url": {"url": f"data:{mime};base64,{payload}"}}
    if rng.random() < 0.05:
        part["uuid"] = f"clip-{rng.randrange(10**6)}"
    return part


def _text(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 12))]
    return " ".join(words).capitalize() + rng.choice([".", "?", ""])


def _url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _sampling(rng: random.Random) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if rng.random() < 0.4:
        fields["temperature"] = rng.choice([0, 0.2, 0.7, 1.0, 1.3])
    if rng.random() < 0.3:
        fields["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.2:
        fields["top_k"] = rng.choice([-1, 1, 20, 50])
    if rng.random() < 0.4:
        fields[rng.choice(["max_tokens", "max_completion_tokens"])] = rng.randint(1, 512)
    if rng.random() < 0.2:
        fields["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        fields["stop"] = rng.choice(["\n", ["END", "STOP"], "."])
    if rng.random() < 0.15:
        fields["presence_penalty"] = rng.choice([-0.5, 0.0, 0.8])
    if rng.random() < 0.15:
        fields["frequency_penalty"] = rng.choice([0.0, 0.5])
    if rng.random() < 0.1:
        fields["repetition_penalty"] = rng.choice([1.0, 1.1])
    if rng.random() < 0.1:
        fields["stream"] = True
    if rng.random() < 0.1:
        fields["user"] = "u" + str(rng.randint(0, 99))
    return fields


def _chat(rng: random.Random, model: str, media: list[dict[str, Any]]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _text(rng)})
    turns = rng.randint(1, 3)
    # each medium goes to a random user turn, in order
    where = sorted(rng.randrange(turns) for _ in media)
    for turn in range(turns):
        parts: list[dict[str, Any]] = [media[i] for i, t in enumerate(where) if t == turn]
        text = {"type": "text", "text": _text(rng)}
        if rng.random() < 0.5:
            parts.insert(0, text)
        else:
            parts.append(text)
        if not parts[1:] and rng.random() < 0.3:
            messages.append({"role": "user", "content": text["text"]})
        else:
            messages.append({"role": "user", "content": parts})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": _text(rng)})
    body = {"model": model, "messages": messages, **_sampling(rng)}
    if rng.random() < 0.2:
        body["mm_payload"] = "none"
    return body


def random_requests(
    seed: int,
    model: str,
    *,
    videos: float = 0.0,
    none: float | None = None,
    audios: float = 0.0,
) -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    """Endless ``(path, body, what)`` requests for a server whose model is named ``model``;
    ``videos``: the share of chat requests that carry a clip; ``none``: the share of chat
    requests with ``mm_payload: "none"`` (routing plans; default one in five, drawn with the
    rest); ``audios``: the share of requests that are chats with zero to two audio clips and no
    image (drawn apart: the other requests are those of ``audios=0``); ``what`` describes the
    media."""
    rng = random.Random(seed)
    choose = random.Random(seed + 1)
    listen = random.Random(seed + 2)
    while True:
        if audios and listen.random() < audios:
            clips = [random_audio(listen) for _ in range(listen.choice([0, 1, 1, 1, 2, 2]))]
            media = [_audio_part(listen, short, mime, data) for short, mime, data, _ in clips]
            body = _chat(listen, model, media)
            if none is not None:
                body.pop("mm_payload", None)
                if choose.random() < none:
                    body["mm_payload"] = "none"
            yield "/v1/chat/completions/render", body, [c[3] for c in clips]
            continue
        images = [random_image(rng) for _ in range(rng.randint(1, 3))]
        what = [repr(spec) for _, _, spec in images]
        api = rng.choices(["chat", "responses", "messages"], weights=[80, 10, 10])[0]
        if api == "chat":
            media = [
                {"type": "image_url", "image_url": {"url": _url(mime, data)}}
                for mime, data, _ in images
            ]
            if rng.random() < videos:
                mime, clip, described = random_clip(rng)
                media.insert(
                    rng.randint(0, len(media)),
                    {"type": "video_url", "video_url": {"url": _url(mime, clip)}},
                )
                what.append(described)
            body = _chat(rng, model, media)
            if none is not None:  # drawn apart: the same seed gives the same media
                body.pop("mm_payload", None)
                if choose.random() < none:
                    body["mm_payload"] = "none"
            yield "/v1/chat/completions/render", body, what
        elif api == "responses":
            content: list[dict[str, Any]] = [{"type": "input_text", "text": _text(rng)}]
            content += [{"type": "input_image", "image_url": _url(m, d)} for m, d, _ in images]
            body = {"model": model, "input": [{"role": "user", "content": content}]}
            yield "/v1/responses/render", body, what
        else:
            blocks: list[dict[str, Any]] = [
                {
                    "type": "image",
                    "source": {
                        "type": "base64",
                        "media_type": mime,
                        "data": base64.b64encode(data).decode(),
                    },
                }
                for mime, data, _ in images
            ]
            blocks.append({"type": "text", "text": _text(rng)})
            body = {
                "model": model,
                "max_tokens": rng.randint(16, 512),
                "messages": [{"role": "user", "content": blocks}],
            }
            yield "/v1/messages/render", body, what
