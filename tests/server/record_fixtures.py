"""Record the golden interop fixtures from vLLM 0.33's own render server.

Not a test: run it by hand against ``vllm launch render /tmp/vllm-probe/qwen2vl`` (see
``shared/vllm_render/launch.sh``; PYTHONHASHSEED=0 fixes the key order inside msgpack items;
the processor cache off, so every item's flat-field slices come from its own request)::

    PORT=18115 MM_CACHE_GB=0 shared/vllm_render/launch.sh start
    python tests/server/record_fixtures.py --url http://127.0.0.1:18115

The recorded fixtures came from vLLM 0.33.0 (the ``shared/vllm_probe`` environment) on
2026-12-01; the request-field cases (``chat_lax_values``, ``chat_max_tokens_above_the_room`` and
the ``error_*`` cases after ``error_unknown_model``) on 2026-12-03, from the same server;
``chat_phone_photo_48mp`` (its items kept as digests, :data:`DIGESTED`) and
``chat_png_without_iend`` on 2026-12-06, from the same server;
``error_image_aspect_ratio`` (an image the processor refuses) later from the same server, with
``--only error_image_aspect_ratio``.

Each case is written as ``fixtures/<case>.json``: ``{"path", "body", "status", "response"}``.
Images are small and seeded, embedded in the bodies as data URLs (the bytes the hashes cover).
The Qwen2.5-VL video fixtures (``fixtures_qwen2_5_vl/``) came from a server for the folder
``tests/support/qwen2vl_folder.py`` builds with ``variant="qwen2_5_vl"`` at
``/tmp/vllm-probe/qwen25vl`` (``--model /tmp/vllm-probe/qwen25vl --out
tests/server/fixtures_qwen2_5_vl --only video_...``). The GLM-4V video fixtures
(``fixtures_glm4v/``: ``video_short``, ``video_three_frames``, ``video_two_short``) came
from a server for ``tests/support/glm4v_folder.py``'s folder at ``/tmp/vllm-probe/glm4v``, with
``MM_CACHE_GB=0``; the GLM-OCR one (``fixtures_glm_ocr/video_one_second``) from a server for
its ``build_glm_ocr_folder`` folder at ``/tmp/vllm-probe/glmocr``. On 2026-12-06 ``video_mm_none``
was recorded into ``fixtures_glm4v/`` and ``fixtures_glm_ocr/`` from servers for those two folders
(``MM_CACHE_GB=0``), and ``chat_mm_none`` into ``fixtures_mistral3/`` and
``fixtures_nemotron_vl/`` from servers for the ``aiomm.adapters.folders.write_model_folder``
folders at ``/tmp/vllm-probe/mistral3`` and ``/tmp/vllm-probe/nemotron-embed`` (``MM_CACHE_GB=0``,
the default ``LIMIT_MM``). The Llama 4 fixtures
(``fixtures_llama4/``) were recorded on 2026-12-06 from a server for the ``write_model_folder``
folder at ``/tmp/vllm-probe/llama4`` (``MM_CACHE_GB=0``) with ``--digest``, the image cases and
``chat_tiled_images`` (images of several tiles). ``fixtures_llava_next/`` came on 2026-12-06
from a server for the ``write_model_folder("llava-next", ...)`` folder at
``/tmp/vllm-probe/llava-next`` (``MM_CACHE_GB=0``, ``--digest``; the image cases, the request of
several patch counts ``chat_tiled_images``, ``chat_mm_none`` and ``error_one_of_two_images_bad``),
and ``fixtures_llava_onevision/`` the same cases from a server for the ``llava-onevision`` folder
at ``/tmp/vllm-probe/llava-onevision``.
``fixtures_internvl/`` came on 2026-12-06 from a server for the ``write_model_folder("internvl",
...)`` folder at ``/tmp/vllm-probe/internvl`` (``MM_CACHE_GB=0``, the default ``LIMIT_MM``;
``--digest``, except ``chat_mm_none`` and ``tokenize_chat_image``, which carry no items);
InternVL accepts the ``thin`` image, so its ``error_image_aspect_ratio`` is kept as
``chat_thin_image``.
``fixtures_gemma3/`` came on 2026-12-06 from a server for the ``write_model_folder("gemma3",
...)`` folder at ``/tmp/vllm-probe/gemma3`` (``MM_CACHE_GB=0``, the default ``LIMIT_MM``;
``--digest``, except the ``mm_none`` cases and the refused ``chat_two_images``); its
``pan_and_scan/`` cases (their own bodies, with ``mm_processor_kwargs``) from a second server for
that folder started with ``--trust-request-mm-kwargs``.
``fixtures_idefics3/`` came on 2026-12-06 from a server for the ``write_model_folder("idefics3",
...)`` folder at ``/tmp/vllm-probe/idefics3`` (``MM_CACHE_GB=0``, the default ``LIMIT_MM``,
``--digest``): the image cases, ``chat_tiled_images``, ``chat_mm_none`` and the refused images.
``fixtures_paddleocr_vl/`` came on 2026-12-06 from a server for the
``write_model_folder("paddleocr-vl", ...)`` folder at ``/tmp/vllm-probe/paddleocr-vl``
(``MM_CACHE_GB=0``, the default ``LIMIT_MM``; ``--digest``, except the cases without items).
``fixtures_smolvlm/`` came on 2026-12-06 from a server for the ``write_model_folder("smolvlm",
...)`` folder at ``/tmp/vllm-probe/smolvlm`` (``MM_CACHE_GB=0``, the default ``LIMIT_MM``,
``--digest``): Idefics3's cases and ``video_short``, which vLLM refuses (SmolVLM takes no videos).
``fixtures_llava_onevision/``'s ``video_*`` cases and ``error_bad_video`` came on 2026-12-06 from a
server for the ``llava-onevision`` folder at ``/tmp/vllm-probe/llava-onevision``
(``MM_CACHE_GB=0``, ``LIMIT_MM='{"image": 4, "video": 2}'``, ``--digest``).
``fixtures_gemma4/`` came on 2026-12-06 from a server for the ``write_model_folder("gemma4",
...)`` folder at ``/tmp/vllm-probe/gemma4`` (``MM_CACHE_GB=0``, the default ``LIMIT_MM``,
``--digest``): Idefics3's image cases, ``chat_tiled_images``, ``chat_mm_none`` and the refused
images.
Its ``video_*`` cases and ``error_bad_video`` came on 2026-12-06 from a server for that folder
with the chat template's ``<|video|>`` (``MM_CACHE_GB=0``, ``LIMIT_MM='{"image": 4, "video": 2}'``,
``--digest``).
``fixtures_deepseek_ocr2/`` came on 2026-12-06 from a server for the
``write_model_folder("deepseek-ocr-2", ...)`` folder at ``/tmp/vllm-probe/deepseek-ocr-2``
(``MM_CACHE_GB=0``, the default ``LIMIT_MM``, ``--digest``): the image cases, ``chat_tiled_images``,
``chat_mm_none`` and the refused images; its ``crop_modes/`` cases (their own bodies, with
``mm_processor_kwargs``) from a second server for that folder started with
``--trust-request-mm-kwargs``.
``fixtures_deepseek_ocr/`` came on 2026-12-06 from a server for the
``write_model_folder("deepseek-ocr", ...)`` folder at ``/tmp/vllm-probe/deepseek-ocr``
(``MM_CACHE_GB=0``, the default ``LIMIT_MM``, ``--digest``): DeepSeek-OCR 2's cases.
``fixtures_qwen2_audio/`` came on 2026-12-06 from a server for the
``write_model_folder("qwen2-audio", ...)`` folder at ``/tmp/vllm-probe/qwen2-audio``
(``MM_CACHE_GB=0``, ``LIMIT_MM='{"audio": 2}'``) with ``--audio --digest`` (:func:`audio_cases`;
``error_audio_to_image_model`` left out), and ``fixtures/error_audio_to_image_model`` with
``--audio --only error_audio_to_image_model`` from the Qwen2-VL server.
``fixtures_qwen2_5_omni/`` came on 2026-12-06 from a server for the
``write_model_folder("qwen2.5-omni", ...)`` folder at ``/tmp/vllm-probe/qwen2.5-omni``
(``MM_CACHE_GB=0``, ``LIMIT_MM='{"image": 4, "video": 2, "audio": 2}'``, ``--digest``): a few
image, video and ``--audio`` cases, and the ``omni_*`` cases and ``error_audio_too_short`` (an
image and 100 samples of audio) posted with these helpers' clips, images and video.
``fixtures_kimi_k25/`` came on 2026-12-06 from a freshly started server for the
``write_model_folder("kimi-k2.5", ...)`` folder at ``/tmp/vllm-probe/kimi-k2.5``
(``MM_CACHE_GB=0``, the default ``LIMIT_MM``, ``--digest``): DeepSeek-OCR 2's cases and
``video_short``, ``error_one_of_two_images_bad`` last with ``--only`` (the server closes the
connection after the video's 500).
``fixtures_qwen3_omni/`` came on 2026-12-06 from a server for the
``write_model_folder("qwen3-omni", ...)`` folder at ``/tmp/vllm-probe/qwen3-omni``
(``MM_CACHE_GB=0``, ``LIMIT_MM='{"image": 8, "video": 4, "audio": 8}'``, ``--digest``): a few
image and video cases (``--only``), the ``--audio`` cases but the two ``error_*_model`` ones
(an omni model takes both), and the ``--omni`` cases (:func:`omni_cases`: the ``omni_*`` ones,
``error_audio_too_short`` and the ``qwen3_*`` clip lengths; vLLM refuses the 100-sample clip
alone, ``error_qwen3_tiny_alone``, with a 400).
The video cases need the server started with videos allowed
(``LIMIT_MM='{"image": 4, "video": 2}'``); their clips are made here with PyAV (seeded frames, a
few codecs and containers).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

HERE = Path(__file__).parent / "fixtures"
MODEL = "/tmp/vllm-probe/qwen2vl"


def _photo(width: int, height: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    noise = rng.normal(0, 18, size=(height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def _encode(image: PIL.Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def images() -> dict[str, tuple[str, bytes]]:
    """name -> (mime type, encoded bytes)."""
    out: dict[str, tuple[str, bytes]] = {}
    out["jpeg"] = (
        "image/jpeg",
        _encode(PIL.Image.fromarray(_photo(96, 72, 1)), "JPEG", quality=90),
    )
    out["jpeg2"] = (
        "image/jpeg",
        _encode(PIL.Image.fromarray(_photo(150, 90, 2)), "JPEG", quality=85),
    )
    out["png"] = ("image/png", _encode(PIL.Image.fromarray(_photo(80, 112, 3)), "PNG"))
    rgba = np.dstack([_photo(90, 70, 4), np.tile(np.linspace(0, 255, 90, dtype=np.uint8), (70, 1))])
    out["rgba"] = ("image/png", _encode(PIL.Image.fromarray(rgba, "RGBA"), "PNG"))
    rotated = PIL.Image.fromarray(_photo(120, 64, 5))
    exif = rotated.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    out["exif"] = ("image/jpeg", _encode(rotated, "JPEG", quality=90, exif=exif.tobytes()))
    grey = _photo(70, 84, 6)[..., 0]
    out["grey"] = ("image/png", _encode(PIL.Image.fromarray(grey, "L"), "PNG"))
    grey16 = (_photo(64, 60, 7)[..., 1].astype(np.uint16) * 257).astype(np.uint16)
    out["grey16"] = ("image/png", _encode(PIL.Image.fromarray(grey16), "PNG"))
    pal = PIL.Image.fromarray(_photo(72, 72, 8)).quantize(colors=32)
    out["palette"] = ("image/png", _encode(pal, "PNG"))
    out["webp"] = (
        "image/webp",
        _encode(PIL.Image.fromarray(_photo(66, 99, 9)), "WEBP", quality=80),
    )
    out["phone"] = ("image/jpeg", phone_photo())
    out["png_without_iend"] = ("image/png", png_without_iend())
    # 600x2, an aspect ratio of 300: Qwen2-VL's processor refuses it (above 200)
    out["thin"] = ("image/png", _encode(PIL.Image.fromarray(_photo(600, 2, 10)), "PNG"))
    # larger than one 336-px tile: Llama 4 cuts them into 2 x 3 and 3 x 1 tiles plus a global one
    out["wide"] = ("image/jpeg", _encode(PIL.Image.fromarray(_photo(700, 400, 11)), "JPEG"))
    out["tall"] = ("image/jpeg", _encode(PIL.Image.fromarray(_photo(300, 900, 12)), "JPEG"))
    return out


def phone_photo() -> bytes:
    """An 8064 x 6048 JPEG (48 megapixels, a phone's full-size photo): smooth, so it is 300 KB."""
    h, w = 6048, 8064
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    planes = [
        127 + 100 * np.sin(3 * x + 2 * y),
        127 + 100 * np.sin(2 * x - 3 * y + 1),
        127 + 100 * np.cos(4 * x * y),
    ]
    pixels = np.stack(planes, axis=-1).astype(np.uint8)
    return _encode(PIL.Image.fromarray(pixels), "JPEG", quality=30, optimize=True)


def png_without_iend() -> bytes:
    """A PNG whose final 16 bytes (the image data's CRC and the IEND chunk) are cut off: every
    row is there, and Pillow decodes it."""
    return _encode(PIL.Image.fromarray(_photo(64, 48, 21)), "PNG")[:-16]


#: cases whose items are too large to keep: their ``kwargs_data`` items are recorded as digests
#: (``{"sha256", "chars"}`` of the base64 text), compared by ``tests/support/render_compare.py``
DIGESTED = frozenset({"chat_phone_photo_48mp"})


def _digested(response: Any) -> Any:
    import hashlib

    data = (response["features"] or {}).get("kwargs_data")  # none without items
    for modality, items in (data or {}).items():  # none with mm_payload "none"
        data[modality] = [
            None
            if item is None
            else {"sha256": hashlib.sha256(item.encode()).hexdigest(), "chars": len(item)}
            for item in items
        ]
    return response


def _clip(
    codec: str,
    fmt: str,
    size: tuple[int, int],
    frames: int,
    fps: int | Fraction,
    seed: int,
    *,
    vfr: bool = False,
) -> bytes:
    """A seeded clip: a moving gradient with a little noise (compresses to a few KB); ``vfr``:
    frames 33, 66 or 100 ms apart."""
    import av

    width, height = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if vfr:
            stream.codec_context.time_base = Fraction(1, 1000)
        pts = 0
        for i in range(frames):
            rgb = np.stack(
                [(x * 255 // width + 9 * i) % 256, (y * 255 // height + 5 * i) % 256, (x + y) // 2],
                axis=-1,
            ).astype(np.float32)
            rgb = np.clip(rgb + rng.normal(0, 4, rgb.shape), 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            if vfr:
                frame.pts, frame.time_base = pts, Fraction(1, 1000)
                pts += int(rng.choice([33, 66, 100]))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _noise_clip(size: int, frames: int, fps: int, seed: int) -> bytes:
    """A nearly lossless H.264 clip of noise: larger than its sampled frames decoded, so vLLM
    hashes the frames instead of the bytes."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "5"}
        for _ in range(frames):
            rgb = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def videos() -> dict[str, tuple[str, bytes]]:
    """name -> (mime type, encoded bytes): H.264/MP4, VP9/WebM (no frame count in the header),
    MPEG-4 Part 2/MP4 and VP8/WebM, at sizes that are not multiples of the patch size."""
    return {
        "h264": ("video/mp4", _clip("libx264", "mp4", (96, 64), 20, 10, 11)),
        "vp9": ("video/webm", _clip("libvpx-vp9", "webm", (78, 54), 16, 8, 12)),
        "mpeg4": ("video/mp4", _clip("mpeg4", "mp4", (70, 50), 18, 6, 13)),
        "vp8": ("video/webm", _clip("libvpx", "webm", (66, 90), 12, 4, 14)),
        "noise": ("video/mp4", _noise_clip(24, 20, 20, 15)),
        # 34 frames at 4.5 fps: vLLM's float32 index range has 15 entries, the last one past the
        # end and read as the last frame, so 15 frames (an odd count) are processed
        "odd_count": ("video/mp4", _clip("libx264", "mp4", (56, 56), 34, Fraction(9, 2), 16)),
        # variable frame rates: vLLM replaces the header's count (MP4) or the duration's estimate
        # (Matroska) by OpenCV's position after seeking to the end
        "vfr_mkv": (
            "video/x-matroska",
            _clip("libx264", "matroska", (28, 50), 77, Fraction(30000, 1001), 17, vfr=True),
        ),
        "vfr_mp4": (
            "video/mp4",
            _clip("mpeg4", "mp4", (60, 44), 82, Fraction(30000, 1001), 17, vfr=True),
        ),
        # GLM-4V's loader reads 2 frames a second: 1 s gives one temporal patch (a small
        # fixture); 1.5 s gives 3 frames, the last repeated to 2 patches
        "short": ("video/mp4", _clip("libx264", "mp4", (40, 30), 10, 10, 18)),
        "three_frames": ("video/mp4", _clip("libx264", "mp4", (40, 30), 15, 10, 19)),
        # GLM-OCR's loader (glm46v) takes 6 of these 8 frames: 3 patches whose whole-second
        # timestamps are all 0 (the first frames at 0.375 and 0.75 s)
        "one_second": ("video/mp4", _clip("libx264", "mp4", (28, 28), 8, 8, 20)),
    }


def data_url(img: tuple[str, bytes]) -> str:
    return f"data:{img[0]};base64,{base64.b64encode(img[1]).decode()}"


def cases(model: str = MODEL) -> dict[str, tuple[str, dict[str, Any]]]:
    im = images()
    vi = videos()

    def part(name: str, **extra: Any) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": data_url(im[name])}, **extra}

    def video(name: str, **extra: Any) -> dict[str, Any]:
        return {"type": "video_url", "video_url": {"url": data_url(vi[name])}, **extra}

    def chat(messages: list[dict[str, Any]], **extra: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/chat/completions/render", {"model": model, "messages": messages, **extra}

    def user(*parts: dict[str, Any]) -> dict[str, Any]:
        return {"role": "user", "content": list(parts)}

    text = {"type": "text", "text": "Describe this image."}
    out: dict[str, tuple[str, dict[str, Any]]] = {
        "chat_jpeg": chat([user(text, part("jpeg"))]),
        "chat_two_images": chat(
            [user({"type": "text", "text": "Compare these."}, part("jpeg2"), part("png"))]
        ),
        "chat_rgba": chat([user(text, part("rgba"))]),
        "chat_exif_rotated": chat([user(text, part("exif"))]),
        "chat_greyscale": chat([user(text, part("grey"))]),
        "chat_grey16": chat([user(text, part("grey16"))]),
        "chat_palette": chat([user(text, part("palette"))]),
        "chat_webp": chat([user(text, part("webp"))]),
        "chat_image_first": chat([user(part("jpeg"), {"type": "text", "text": "What is this?"})]),
        "chat_system": chat(
            [
                {"role": "system", "content": "You are a terse assistant."},
                user(text, part("png")),
            ]
        ),
        "chat_multi_turn": chat(
            [
                user(text, part("jpeg2")),
                {"role": "assistant", "content": "A gradient with noise."},
                user({"type": "text", "text": "And this one?"}, part("grey")),
            ]
        ),
        "chat_string_content": chat([{"role": "user", "content": "Hello there, how are you?"}]),
        "chat_mm_none": chat([user(text, part("jpeg"), part("png"))], mm_payload="none"),
        # text between the images: Gemma 3 refuses two adjacent images (their placeholder
        # ranges overlap once its newline tokens merge)
        "chat_images_apart": chat([user(text, part("jpeg2"), text, part("png"))]),
        "chat_images_apart_mm_none": chat(
            [user(text, part("jpeg"), text, part("rgba"))], mm_payload="none"
        ),
        "chat_tiled_images": chat([user(text, part("wide"), part("tall"), part("jpeg"))]),
        "chat_uuid": chat([user(text, part("rgba", uuid="client-hash-0001"))]),
        "chat_sampling": chat(
            [user(text, part("jpeg"))],
            max_tokens=16,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            stop=["\n\n"],
        ),
        "responses_input_image": (
            "/v1/responses/render",
            {
                "model": MODEL,
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "Describe this image."},
                            {"type": "input_image", "image_url": data_url(im["png"])},
                        ],
                    }
                ],
            },
        ),
        "messages_anthropic": (
            "/v1/messages/render",
            {
                "model": MODEL,
                "max_tokens": 64,
                "system": "Be brief.",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/jpeg",
                                    "data": base64.b64encode(im["jpeg"][1]).decode(),
                                },
                            },
                            {"type": "text", "text": "What is this?"},
                        ],
                    }
                ],
            },
        ),
        "completions_text": (
            "/v1/completions/render",
            {
                "model": MODEL,
                "prompt": "The answer is",
                "max_tokens": 8,
            },
        ),
        "tokenize_prompt": ("/tokenize", {"model": MODEL, "prompt": "Describe this image."}),
        "tokenize_chat": (
            "/tokenize",
            {"model": MODEL, "messages": [{"role": "user", "content": "Describe this image."}]},
        ),
        "error_bad_image": chat(
            [
                user(
                    text,
                    {
                        "type": "image_url",
                        "image_url": {
                            "url": "data:image/png;base64,"
                            + base64.b64encode(b"not an image").decode()
                        },
                    },
                )
            ]
        ),
        "video_h264": chat([user({"type": "text", "text": "Describe this video."}, video("h264"))]),
        "video_short": chat([user(text, video("short"))]),
        "video_three_frames": chat([user(text, video("three_frames"))]),
        "video_one_second": chat([user(text, video("one_second"))]),
        # GLM-4V takes one video per prompt: two are a 400
        "video_two_short": chat([user(text, video("short"), video("three_frames"))]),
        "video_webm_vp9": chat([user(video("vp9"), {"type": "text", "text": "What happens?"})]),
        "video_and_image": chat(
            [user({"type": "text", "text": "Compare."}, part("jpeg"), video("mpeg4"))]
        ),
        "video_two": chat(
            [user({"type": "text", "text": "Compare."}, video("vp8"), video("h264"))]
        ),
        "video_mm_none": chat([user(text, video("vp9"), part("png"))], mm_payload="none"),
        "video_hashed_frames": chat([user(text, video("noise"))]),
        "video_odd_frame_count": chat([user(text, video("odd_count"))]),
        "video_vfr_mkv": chat([user(text, video("vfr_mkv"))]),
        "video_vfr_mp4": chat([user(text, video("vfr_mp4"))]),
        "video_uuid": chat([user(text, video("mpeg4", uuid="client-video-0001"))]),
        "error_responses_video": (
            "/v1/responses/render",
            {
                "model": MODEL,
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "Describe this video."},
                            {"type": "video_url", "video_url": {"url": data_url(vi["vp8"])}},
                        ],
                    }
                ],
            },
        ),
        "error_bad_video": chat(
            [
                user(
                    text,
                    {
                        "type": "video_url",
                        "video_url": {
                            "url": "data:video/mp4;base64,"
                            + base64.b64encode(b"not a video at all").decode()
                        },
                    },
                )
            ]
        ),
        "error_unknown_model": (
            "/v1/chat/completions/render",
            {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        ),
        # request fields as vLLM's pydantic models read them (lax mode), and what they refuse
        "chat_max_tokens_above_the_room": chat([user(text)], max_tokens=32767),
        "chat_lax_values": chat(
            [user(text, part("jpeg", uuid=123))],
            mm_payload="none",  # hashes and placeholders: the tensors are the other cases'
            max_tokens="7",
            seed=3.0,
            top_k="3",
            stop_token_ids=[3.0, "5", True],
            priority="5",
            add_generation_prompt="no",
            stream="yes",
        ),
        "error_image_aspect_ratio": chat([user(text, part("thin"))]),
        # a 48 MP photo: vLLM's limit is Pillow's bomb limit, and the processor scales it down
        "chat_phone_photo_48mp": chat([user(text, part("phone"))]),
        "chat_png_without_iend": chat([user(text, part("png_without_iend"))]),
        "error_one_of_two_images_bad": chat(
            [
                user(
                    text,
                    part("jpeg"),
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
                )
            ]
        ),
        "error_max_tokens_above_context": chat([user(text)], max_completion_tokens=40000),
        "error_seed_out_of_range": chat([user(text)], seed=2**63),
        "error_top_p_out_of_range": chat([user(text)], top_p=2.0),
        "error_stop_token_ids_not_a_list": chat([user(text)], stop_token_ids=5),
        "error_chat_template_kwargs_not_an_object": chat([user(text)], chat_template_kwargs="x"),
        "error_role_not_a_string": chat([{"role": ["user"], "content": "hi"}]),
        "error_model_not_a_string": chat([user(text)], model=["x"]),
        "error_file_url_malformed": chat(
            [user(text, {"type": "image_url", "image_url": {"url": "file://[x/y"}})]
        ),
        # sampling fields, top-level fields and truncation, as vLLM writes them
        "chat_sampling_fields": chat(
            [user(text)],
            n=2,
            logprobs=True,
            top_logprobs=3,
            prompt_logprobs=1,
            min_tokens=2,
            ignore_eos=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            include_stop_str_in_output=True,
            logit_bias={"5": 1.5},
            allowed_token_ids=[1, 2, 3],
            bad_words=["x"],
            stream_interval=2,
            thinking_token_budget=10,
            vllm_xargs={"a": 1},
        ),
        "chat_echo": chat([user(text)], echo=True),
        "chat_top_level_fields": chat(
            [user(text)],
            request_id="client-abc",
            return_token_ids=True,
            cache_salt="salt-1",
            kv_transfer_params={"do_remote_decode": True},
            stream=True,
            stream_options={"include_usage": True},
        ),
        "chat_reasoning_effort": chat([user(text)], reasoning_effort="low"),
        "chat_truncated": chat([user(text)], truncate_prompt_tokens=5),
        "completions_default_budget": ("/v1/completions/render", {"model": model, "prompt": "Hi"}),
        "completions_logprobs_echo": (
            "/v1/completions/render",
            {"model": model, "prompt": [1, 2, 3, 4, 5, 6], "logprobs": 2, "echo": True, "n": 3},
        ),
        "completions_batch_ids": (
            "/v1/completions/render",
            {"model": model, "prompt": ["Hi", "there"], "request_id": "batch"},
        ),
        "error_completion_prompts_mixed": (
            "/v1/completions/render",
            {"model": model, "prompt": ["Hi", [1, 2, 3]]},
        ),
        "completions_truncated_right": (
            "/v1/completions/render",
            {
                "model": model,
                "prompt": "one two three four five six",
                "truncate_prompt_tokens": 3,
                "truncation_side": "right",
            },
        ),
        "messages_stream": (
            "/v1/messages/render",
            {"model": model, "max_tokens": 5, "stream": True, "messages": [user(text)]},
        ),
        "chat_parallel_tool_calls_off": chat([user(text)], parallel_tool_calls=False),
        "responses_fields": (
            "/v1/responses/render",
            {
                "model": model,
                "input": "Describe this image.",
                "instructions": "",  # left out: the template's default system prompt stays
                "top_logprobs": 2,
                "include": ["message.output_text.logprobs"],
                "n": 3,  # not a Responses field: ignored
                "min_tokens": 2,
            },
        ),
        "messages_fields": (
            "/v1/messages/render",
            {
                "model": model,
                "max_tokens": 5,
                "messages": [user(text)],
                "tool_choice": {"type": "none"},
                "stop_sequences": ["a", "bb"],
                "n": 3,  # not an Anthropic field: ignored
                "seed": 4,
            },
        ),
        "tokenize_token_strs": (
            "/tokenize",
            {"model": model, "prompt": "Describe this image.", "return_token_strs": True},
        ),
        "chat_greedy": chat([user(text)], temperature=0),
        "chat_sampling_normalised": chat(
            [user(text)],
            temperature=0.001,
            seed=-1,
            thinking_token_budget=-1,
            stop_token_ids=[5, 5, 6],
            bad_words=["a", "a"],
            kv_transfer_params={},
            stop=["abc"],
            include_stop_str_in_output=True,
        ),
        "chat_nulls": chat(
            [user(text)],
            tool_choice=None,
            parallel_tool_calls=None,
            stream=True,
            stream_options={"include_usage": None},
            request_id="",
        ),
        "chat_template_kwargs_flags": chat(
            [user(text)], chat_template_kwargs={"add_generation_prompt": False, "x": 1}
        ),
        "responses_ignores_chat_fields": (
            "/v1/responses/render",
            {
                "model": model,
                "input": "Describe this image.",
                "request_id": "client-resp",
                "truncate_prompt_tokens": 3,
                "add_generation_prompt": False,
                "documents": [{"title": "a", "text": "b"}],
                "return_token_ids": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "reasoning_effort": [1],
            },
        ),
        "messages_ignores_chat_fields": (
            "/v1/messages/render",
            {
                "model": model,
                "max_tokens": 5,
                "messages": [user(text)],
                "priority": 3,
                "request_id": "zz",
                "response_format": {"type": "json_object"},
                "use_beam_search": True,
                "vllm_xargs": {"a": 1},
            },
        ),
        "chat_reasoning_off_and_ec_params": chat(
            [user(text)], include_reasoning=False, ec_transfer_params={"a": 1}
        ),
        "chat_lax_numbers": chat([user(text)], temperature=True, max_tokens="7.0"),
        "error_cache_salt_with_a_slash": chat([user(text)], cache_salt="a/b"),
        "error_truncation_side_unknown": chat([user(text)], truncation_side="middle"),
        "error_top_logprobs_a_string": chat([user(text)], logprobs=True, top_logprobs="2"),
        "error_greedy_with_n": chat([user(text)], temperature=0, n=2),
        "error_thinking_budget_a_string": chat([user(text)], thinking_token_budget="5"),
        "error_stop_empty_string": chat([user(text)], stop=[""]),
        "error_bad_words_empty_string": chat([user(text)], bad_words=[""]),
        "error_completion_logprobs_negative": (
            "/v1/completions/render",
            {"model": model, "prompt": "Hi", "logprobs": -5},
        ),
        "error_tool_choice_without_tools": chat([user(text)], tool_choice="auto"),
        "error_messages_without_max_tokens": (
            "/v1/messages/render",
            {"model": model, "messages": [user(text)]},
        ),
        "error_top_logprobs_without_logprobs": chat([user(text)], top_logprobs=2),
        "error_cache_salt_empty": chat([user(text)], cache_salt=""),
        "error_stream_options_without_stream": chat(
            [user(text)], stream_options={"include_usage": True}
        ),
        "error_min_tokens_above_max_tokens": chat([user(text)], min_tokens=5, max_tokens=3),
        "error_prompt_token_id_negative": (
            "/v1/completions/render",
            {"model": model, "prompt": [5, -1]},
        ),
        "error_beam_search": chat([user(text)], use_beam_search=True),
        "error_request_chat_template": chat([user(text)], chat_template="{{ 'x' }}"),
        "error_truncate_above_context": chat([user(text)], truncate_prompt_tokens=40000),
        "error_anthropic_source_not_an_object": (
            "/v1/messages/render",
            {
                "model": model,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [{"type": "image", "source": "abc"}]}],
            },
        ),
    }
    out.update(_conversion_cases(model, part, chat, user, text))
    return out


def _conversion_cases(
    model: str, part: Any, chat: Any, user: Any, text: dict[str, Any]
) -> dict[str, tuple[str, dict[str, Any]]]:
    """How vLLM turns each API's messages into the template's conversation (recorded on
    2026-12-04 from the same server, images with ``mm_payload: "none"``)."""
    none = {"mm_payload": "none"}
    billing = "x-anthropic-billing-header: cc_version=1; cch=abc\n"
    hi = {"role": "user", "content": "Hi"}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

    def responses(**body: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/responses/render", {"model": model, **body}

    def messages(msgs: list[dict[str, Any]], **body: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/messages/render", {"model": model, "max_tokens": 16, "messages": msgs, **body}

    anthropic_image = {
        "type": "image",
        "source": {"media_type": "image/jpeg", "data": part("jpeg")["image_url"]["url"][23:]},
    }
    return {
        # a developer message for a template without the role: system, merged at the start
        "chat_developer_role": chat(
            [{"role": "developer", "content": "Be brief."}, user(text, part("jpeg"))], **none
        ),
        "chat_developer_after_system": chat(
            [
                {"role": "system", "content": "S"},
                hi,
                {"role": "developer", "content": [{"type": "text", "text": "D1"}, text]},
            ]
        ),
        "chat_billing_header_system": chat(
            [{"role": "system", "content": billing + "You are terse."}, hi]
        ),
        "chat_history_tool_calls": chat(
            [
                hi,
                {"role": "assistant", "content": None, "tool_calls": [call, call]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ]
        ),
        "chat_without_model": ("/v1/chat/completions/render", {"messages": [hi]}),
        "chat_tiny_temperature": chat([hi], temperature=1e-6, top_p=0.5, top_k=5),
        "chat_continue_empty_text": chat(
            [hi, {"role": "assistant", "content": ""}],
            continue_final_message=True,
            add_generation_prompt=False,
        ),
        "error_chat_continue_without_text": chat(
            [hi, {"role": "assistant", "content": None}],
            continue_final_message=True,
            add_generation_prompt=False,
        ),
        "error_five_stop_strings": chat([hi], stop=["a", "b", "c", "d", "e"]),
        "error_user_content_null": chat([hi, {"role": "user", "content": None}]),
        "chat_content_missing": chat([hi, {"role": "user"}, {"role": "assistant"}, hi]),
        "responses_developer_and_instructions": responses(
            instructions="I", input=[hi, {"role": "developer", "content": "D"}]
        ),
        "responses_continue_incomplete": responses(
            input=[hi, {"role": "assistant", "content": "Once upon", "status": "incomplete"}]
        ),
        "responses_assistant_first_text": responses(
            input=[
                hi,
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "A", "annotations": []},
                        {"type": "output_text", "text": "B", "annotations": []},
                    ],
                },
                {"role": "user", "content": "And?"},
            ]
        ),
        # calls, their outputs and reasoning as vLLM turns them into chat messages: a call
        # joins the assistant turn before it, the text after calls or reasoning fills it
        "responses_function_call_items": responses(
            input=[
                hi,
                {
                    "type": "reasoning",
                    "id": "r1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Look it up."}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
                {"type": "function_call_output", "call_id": "c2", "output": "43"},
                {
                    "type": "reasoning",
                    "id": "r2",
                    "summary": [{"type": "summary_text", "text": "S"}],
                },
                {"role": "assistant", "content": "It is 42."},
                {"role": "user", "content": "Thanks."},
            ]
        ),
        "error_responses_encrypted_reasoning": responses(
            input=[hi, {"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "z"}]
        ),
        "responses_billing_instructions": responses(instructions=billing + "Be kind.", input="x"),
        "messages_billing_system_block": messages(
            [hi],
            system=[
                {"type": "text", "text": billing + "dropped"},
                {"type": "text", "text": "Kept."},
            ],
        ),
        "messages_empty_user_turn": messages(
            [
                {"role": "user", "content": [{"type": "text", "text": ""}]},
                {"role": "assistant", "content": "a"},
                hi,
            ]
        ),
        "messages_inline_system": messages(
            [hi, {"role": "system", "content": "Inline."}, {"role": "user", "content": "b"}]
        ),
        "messages_tool_use_and_result": messages(
            [
                user(text, anthropic_image),
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "t1", "name": "zoom", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "r1"}, anthropic_image],
                        }
                    ],
                },
            ],
            **none,
        ),
        "error_messages_without_model": (
            "/v1/messages/render",
            {"max_tokens": 16, "messages": [hi]},
        ),
        "error_messages_developer_role": messages([{"role": "developer", "content": "x"}, hi]),
        # the part types vLLM's chat parser reads: text ones, media found by key, skipped ones
        "chat_part_types": chat(
            [
                user(
                    {"type": "refusal", "refusal": "No."},
                    {"type": "thinking", "thinking": "Hmm."},
                    {"image_url": {"url": part("png")["image_url"]["url"]}},
                    {"type": "input_text", "text": "a"},
                    {"type": "output_text", "text": "b"},
                    {"type": "text", "text": None},
                    {
                        "type": "input_image",
                        "image_url": part("jpeg")["image_url"]["url"],
                        "detail": "auto",
                    },
                ),
                {"role": "function", "name": "f", "content": "x"},
            ],
            **none,
        ),
        # truncate_prompt_tokens with an image: cut again once the placeholders are expanded
        # (49 tokens, the image's 12 from offset 30)
        "chat_truncated_with_image": chat(
            [
                {"role": "system", "content": "Answer in one short sentence, please."},
                user(text, part("png")),
            ],
            truncate_prompt_tokens=40,
            **none,
        ),
        "error_truncate_splits_image": chat(
            [
                {"role": "system", "content": "Answer in one short sentence, please."},
                user(text, part("png")),
            ],
            truncate_prompt_tokens=35,
            truncation_side="right",
            **none,
        ),
        # empty or ignored: vLLM's answer is the default one
        "chat_empty_mm_processor_kwargs": chat([hi], mm_processor_kwargs={}),
        "responses_include_reasoning_off": responses(input="x", include_reasoning=False),
        "messages_empty_output_config": messages([hi], output_config={}),
        "messages_thinking_enabled": messages(
            [hi], max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048}
        ),
        "error_messages_thinking_budget_above_max_tokens": messages(
            [hi], thinking={"type": "enabled", "budget_tokens": 2048}
        ),
        "messages_thinking_adaptive": messages([hi], thinking={"type": "adaptive"}),
        "error_messages_thinking_budget_low": messages(
            [hi], thinking={"type": "enabled", "budget_tokens": 100}
        ),
        "messages_tool_choice_none_serial": messages(
            [hi], tool_choice={"type": "none", "disable_parallel_tool_use": True}
        ),
        # a null where vLLM's model has no None is pydantic's 400
        "error_null_ignore_eos": chat([hi], ignore_eos=None),
        "error_completion_null_n": (
            "/v1/completions/render",
            {"model": model, "prompt": "Hi", "n": None},
        ),
        "error_responses_null_tools": responses(input="x", tools=None),
        "error_image_url_a_string": chat(
            [user({"type": "image_url", "image_url": part("png")["image_url"]["url"]})], **none
        ),
        "error_image_url_detail_unknown": chat(
            [user(part("png", image_url={"url": part("png")["image_url"]["url"], "detail": "x"}))],
            **none,
        ),
        "error_chat_input_image_without_detail": chat(
            [user({"type": "input_image", "image_url": part("jpeg")["image_url"]["url"]})], **none
        ),
        # /tokenize renders a chat as the chat route does: images expanded, flags honoured
        "tokenize_chat_image": (
            "/tokenize",
            {"model": model, "messages": [user(text, part("png"))], "return_token_strs": True},
        ),
        "tokenize_chat_continue": (
            "/tokenize",
            {
                "model": model,
                "messages": [
                    {"role": "developer", "content": "D"},
                    hi,
                    {"role": "assistant", "content": "Once"},
                ],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "chat_template_kwargs": {"add_vision_id": True},
            },
        ),
        "error_tokenize_both_generation_flags": (
            "/tokenize",
            {
                "model": model,
                "messages": [hi, {"role": "assistant", "content": "Once"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
        ),
    }


#: the clips of the audio cases (``tests/support/audio_samples.py``): name -> (format of an
#: ``input_audio`` part, MIME type of a data URL, the clip's case)
AUDIO_CLIPS = {
    "wav_16k_mono": ("wav", "audio/wav", ("WAV", "PCM_16", 16000, 1, 1.0)),
    "wav_8k_stereo": ("wav", "audio/wav", ("WAV", "PCM_16", 8000, 2, 0.7)),
    "wav_48k_short": ("wav", "audio/x-wav", ("WAV", "FLOAT", 48000, 1, 0.1)),
    "flac_44k_stereo": ("flac", "audio/flac", ("FLAC", "PCM_16", 44100, 2, 0.5)),
    "mp3_22k_mono": ("mp3", "audio/mpeg", ("MP3", "MPEG_LAYER_III", 22050, 1, 1.5)),
    "ogg_48k_stereo": ("ogg", "audio/ogg", ("OGG", "VORBIS", 48000, 2, 1.2)),
    "ogg_16k_60s": ("ogg", "audio/ogg", ("OGG", "VORBIS", 16000, 1, 60.0)),
    "flac_22k_stereo": ("flac", "audio/flac", ("FLAC", "PCM_24", 22050, 2, 0.8)),
}


def audio_clips() -> dict[str, tuple[str, str, bytes]]:
    """name -> (``input_audio`` format, MIME type, encoded bytes) of :data:`AUDIO_CLIPS`."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from audio_samples import AudioCase, encode, signal

    out = {}
    for seed, (name, (fmt, mime, (kind, subtype, rate, channels, seconds))) in enumerate(
        AUDIO_CLIPS.items()
    ):
        case = AudioCase(name, kind, subtype, rate, channels, seconds)
        out[name] = (fmt, mime, encode(case, signal(rate, channels, seconds, seed=seed)))
    return out


def audio_cases(model: str = MODEL) -> dict[str, tuple[str, dict[str, Any]]]:
    """The audio cases (``--audio``): recorded from a server for the ``qwen2-audio`` folder
    with ``LIMIT_MM='{"audio": 2}'`` but ``error_audio_to_image_model``, which is recorded from
    an image model's server (vLLM refuses the clip: the model takes none)."""
    clips = audio_clips()

    def data(name: str) -> str:
        return base64.b64encode(clips[name][2]).decode()

    def clip(name: str, **extra: Any) -> dict[str, Any]:
        fmt = clips[name][0]
        return {"type": "input_audio", "input_audio": {"data": data(name), "format": fmt}, **extra}

    def url(name: str, **extra: Any) -> dict[str, Any]:
        link = f"data:{clips[name][1]};base64,{data(name)}"
        return {"type": "audio_url", "audio_url": {"url": link}, **extra}

    def chat(*messages: dict[str, Any], **extra: Any) -> tuple[str, dict[str, Any]]:
        return "/v1/chat/completions/render", {"model": model, "messages": list(messages), **extra}

    def user(*parts: dict[str, Any]) -> dict[str, Any]:
        return {"role": "user", "content": list(parts)}

    ask = {"type": "text", "text": "What do you hear?"}
    corrupt = base64.b64encode(bytes(range(256)) * 16).decode()
    photo = images()["jpeg"]
    return {
        "audio_wav_16k_mono": chat(user(ask, clip("wav_16k_mono"))),
        "audio_wav_8k_stereo_url": chat(user(url("wav_8k_stereo"), ask)),
        "audio_wav_48k_short": chat(user(ask, clip("wav_48k_short"))),
        "audio_flac_44k_stereo": chat(user(ask, clip("flac_44k_stereo"))),
        "audio_mp3_22k_mono_url": chat(user(ask, url("mp3_22k_mono"))),
        "audio_ogg_48k_stereo": chat(user(ask, clip("ogg_48k_stereo"))),
        "audio_ogg_60s": chat(user(ask, url("ogg_16k_60s"))),
        "audio_flac_22k_stereo_url": chat(user(url("flac_22k_stereo"))),
        "audio_two_clips": chat(
            user({"type": "text", "text": "Compare."}, clip("mp3_22k_mono"), url("wav_8k_stereo"))
        ),
        "audio_multi_turn": chat(
            {"role": "system", "content": "You transcribe."},
            user(ask, clip("wav_16k_mono")),
            {"role": "assistant", "content": "A chirp and a tone."},
            user({"type": "text", "text": "And this?"}, url("flac_44k_stereo")),
        ),
        "audio_uuid": chat(user(ask, clip("ogg_48k_stereo", uuid="clip-7"))),
        "audio_mm_none": chat(
            user(ask, clip("wav_8k_stereo"), url("ogg_48k_stereo")), mm_payload="none"
        ),
        "audio_text_only": chat(user(ask)),
        "error_audio_corrupt": chat(
            user(ask, {"type": "input_audio", "input_audio": {"data": corrupt, "format": "wav"}})
        ),
        "error_audio_one_of_two_corrupt": chat(
            user(
                ask,
                clip("wav_16k_mono"),
                {"audio_url": {"url": f"data:audio/wav;base64,{corrupt}"}},  # no type: by its key
            )
        ),
        "error_image_to_audio_model": chat(
            user(ask, {"type": "image_url", "image_url": {"url": data_url(photo)}})
        ),
        "error_audio_to_image_model": chat(user(ask, clip("wav_16k_mono"))),
    }


def _wav_16k(samples: int, seed: int) -> dict[str, Any]:
    """An ``input_audio`` part: a 16-kHz mono PCM WAV of exactly ``samples`` samples."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from audio_samples import AudioCase, encode, signal

    wav = encode(
        AudioCase("wav", "WAV", "PCM_16", 16000, 1), signal(16000, 1, samples / 16000, seed)
    )
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
    }


def omni_cases(model: str = MODEL) -> dict[str, tuple[str, dict[str, Any]]]:
    """The cases mixing modalities (``--omni``), for the Qwen-Omni folders: :func:`audio_clips`'
    clips beside :func:`images`' and :func:`videos`' items, and the ``qwen3_*`` clip lengths that
    matter to Qwen3-Omni, whose request pads every clip to its longest (16-kHz WAVs of exact
    sample counts: a hop is 160 samples)."""
    clips, photo, clip_h264 = audio_clips(), images()["jpeg"], videos()["h264"]

    def clip(name: str) -> dict[str, Any]:
        fmt, _, raw = clips[name]
        return {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(raw).decode(), "format": fmt},
        }

    def chat(*parts: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        body = {"model": model, "messages": [{"role": "user", "content": list(parts)}]}
        return "/v1/chat/completions/render", body

    ask = {"type": "text", "text": "What do you see and hear?"}
    image = {"type": "image_url", "image_url": {"url": data_url(photo)}}
    return {
        "omni_image_and_audio": chat(image, ask, clip("mp3_22k_mono")),
        "omni_video_and_audio": chat(
            {"type": "video_url", "video_url": {"url": data_url(clip_h264)}},
            clip("wav_16k_mono"),
            ask,
        ),
        "omni_audio_image_audio": chat(clip("wav_8k_stereo"), image, clip("flac_44k_stereo")),
        "error_audio_too_short": chat(ask, image, _wav_16k(100, 0)),
        "qwen3_two_clips_one_hop_apart": chat(ask, _wav_16k(16000, 1), _wav_16k(16160, 2)),
        "qwen3_two_clips_far_apart": chat(ask, _wav_16k(8000, 3), _wav_16k(112000, 4)),
        "qwen3_tiny_clips": chat(ask, _wav_16k(700, 5), _wav_16k(1500, 6)),
        "qwen3_tiny_beside_long": chat(ask, _wav_16k(100, 7), _wav_16k(32000, 8)),
        "error_qwen3_tiny_alone": chat(ask, _wav_16k(100, 9)),
    }


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:18100")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--model", default=MODEL, help="the model path the server was given")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument(
        "--digest", action="store_true", help="record every case's items as digests (DIGESTED)"
    )
    parser.add_argument("--audio", action="store_true", help="the audio cases (audio_cases)")
    parser.add_argument("--omni", action="store_true", help="the mixed cases (omni_cases)")
    args = parser.parse_args()
    args.out.mkdir(exist_ok=True)
    recorded = audio_cases(args.model) if args.audio else cases(args.model)
    if args.omni:
        recorded = omni_cases(args.model)
    with httpx.Client(base_url=args.url, timeout=120) as client:
        for name, (path, body) in recorded.items():
            if args.only and name not in args.only:
                continue
            resp = client.post(path, json=body)
            try:
                payload = resp.json()
            except ValueError:
                payload = resp.text
            record = {"path": path, "body": body, "status": resp.status_code, "response": payload}
            if (args.digest or name in DIGESTED) and resp.status_code == 200:
                record.update(response=_digested(payload), digests=True)
            (args.out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
            print(name, resp.status_code, len(resp.content))


if __name__ == "__main__":
    main()
