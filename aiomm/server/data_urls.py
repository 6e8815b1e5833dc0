"""Base64 ``data:`` URLs taken out of a request body before it is parsed as JSON.

A render request carries its images as data URLs of hundreds of kilobytes each. Parsing such a
body makes every payload a ``str`` (orjson checks and copies each byte), the payload is then
sliced out of its URL (another copy) and decoded: about 0.33 ms of the event loop's time for the
benchmark's 0.7 MB bodies, where the decode alone is 0.1. :func:`lift_data_urls` decodes each
payload straight from the body's bytes and hands orjson a body with a short reference in its
place (0.13 ms all together); the parsed media parts then get their bytes back from the
references (:func:`attach`).

Only what would parse and decode the same either way is taken out: a JSON string value that
opens with ``data:``, has no backslash escape, a ``;base64`` header, a payload within the size
limit that decodes as strict base64 (any other byte, one JSON would refuse included, fails that).
The rest stays in the body for the usual path, with its usual errors. A reference is a random
per-process token plus the payload's index; a body whose references do not all come back as
media URLs (a text that happened to be a data URL) is parsed again as it was sent.
"""

from __future__ import annotations

import binascii
import dataclasses
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import pybase64

from aiomm.vllm.content import ImagePart, Parsed, is_base64_header

__all__ = (
    "LIFT_MIN_CHARS",
    "LiftedDataUrls",
    "attach",
    "lift_data_urls",
    "payload_size",
    "payload_too_large",
)

#: payloads shorter than this stay in the body (nothing to gain)
LIFT_MIN_CHARS = 4096
#: a data URL's header (between ``data:`` and the comma) longer than this is left alone
_MAX_HEADER = 256
#: a reference: this token, then the payload's index (no base64 payload starts with '#')
_TOKEN_STR = "#aiomm-" + secrets.token_hex(12) + "-"
_TOKEN = _TOKEN_STR.encode()
_OPEN = b'"data:'


def payload_size(chars: int) -> int:
    """The decoded size of a base64 payload of ``chars`` characters, before its padding."""
    return chars // 4 * 3


def payload_too_large(chars: int, max_bytes: int) -> bool:
    """Whether a payload of ``chars`` characters decodes to more than ``max_bytes`` (the two
    bytes padding may take off are given the benefit of the doubt)."""
    return payload_size(chars) > max_bytes + 2


@dataclass(frozen=True)
class LiftedDataUrls:
    """The payloads taken out of one body (decoded), and the body as it was sent."""

    raw: bytes | bytearray
    payloads: Sequence[bytes]


def lift_data_urls(
    raw: bytes | bytearray, max_bytes: int
) -> tuple[bytes | bytearray, LiftedDataUrls | None]:
    """``raw`` with its large base64 data-URL payloads replaced by references, and those
    payloads decoded (None, and ``raw`` itself, when there is none). ``max_bytes``: the
    largest decoded payload taken out (a larger one stays, for the usual size error)."""
    start = raw.find(_OPEN)
    if start < 0:
        return raw, None
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    payloads: list[bytes] = []
    done = 0  # raw[:done] is in pieces
    while start >= 0:
        comma = raw.find(b",", start + len(_OPEN), start + len(_OPEN) + _MAX_HEADER)
        end = raw.find(b'"', start + 1)
        # an escaped quote is inside a string: not a string of its own (in valid JSON a
        # string's opening quote never follows a backslash)
        if comma < 0 or end < 0 or comma > end or raw[start - 1 : start] == b"\\":
            start = raw.find(_OPEN, start + 1)
            continue
        data = _decoded(raw, view, start, comma, end, max_bytes)
        if data is not None:
            pieces += (view[done : comma + 1], _TOKEN, b"%d" % len(payloads))
            payloads.append(data)
            done = end
        start = raw.find(_OPEN, end + 1)
    if not payloads:
        return raw, None
    pieces.append(view[done:])
    return b"".join(pieces), LiftedDataUrls(raw, payloads)


def _decoded(
    raw: bytes | bytearray, view: memoryview, start: int, comma: int, end: int, max_bytes: int
) -> bytes | None:
    """The decoded payload of the string ``raw[start:end + 1]`` when it is taken out."""
    if end - comma - 1 < LIFT_MIN_CHARS or raw.find(b"\\", start, end) >= 0:
        return None  # small, or escapes in it: JSON's own reading decides
    header = raw[start + len(_OPEN) : comma]
    if not header.isascii() or not is_base64_header(header.decode("ascii")):
        return None
    if payload_too_large(end - comma - 1, max_bytes):  # left for the usual size error
        return None
    try:
        return pybase64.b64decode(view[comma + 1 : end], validate=True)
    except (binascii.Error, ValueError):
        return None


def attach(parsed: Parsed, lifted: LiftedDataUrls) -> Parsed | None:
    """``parsed`` with each media part's lifted payload in its ``data``; None when the
    references are not exactly the media parts' URLs (then parse ``lifted.raw`` instead)."""
    seen: set[int] = set()

    def resolved(parts: list[ImagePart]) -> list[ImagePart] | None:
        out = []
        for part in parts:
            at = part.url.find(",") + 1
            if at and part.url.startswith(_TOKEN_STR, at) and part.url.startswith("data:"):
                digits = part.url[at + len(_TOKEN_STR) :]
                index = int(digits) if digits.isascii() and digits.isdigit() else -1
                if not 0 <= index < len(lifted.payloads) or index in seen:
                    return None
                seen.add(index)
                part = dataclasses.replace(part, data=lifted.payloads[index])
            out.append(part)
        return out

    images, videos, audios = (resolved(p) for p in (parsed.images, parsed.videos, parsed.audios))
    if images is None or videos is None or audios is None or len(seen) != len(lifted.payloads):
        return None
    return dataclasses.replace(parsed, images=images, videos=videos, audios=audios)
