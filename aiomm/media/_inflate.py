"""Bounded decoding of an HTTP body's ``Content-Encoding``.

httpx inflates whatever encoding a server names and hands out each inflated chunk whole, so a
size cap counted after inflation comes too late: a 590-byte ``gzip, gzip`` body inflates to
256 MiB in one allocation. Here every ``decompress`` call is given the room left under the cap
(``max_length``), so no step produces more than one byte past it, whatever the ratio.
"""

from __future__ import annotations

import zlib

__all__ = ("BodyDecoder", "EncodingRefused", "InflateLimitExceeded", "body_decoder")

# Encodings decoded here (one layer at most); anything else was not asked for and is refused.
_GZIP = ("gzip", "x-gzip")
_DEFLATE = ("deflate",)


class EncodingRefused(Exception):
    """The response's ``Content-Encoding`` is not one the fetcher decodes."""


class InflateLimitExceeded(Exception):
    """The decoded body grew past the limit."""


class BodyDecoder:
    """Decodes one body incrementally; never holds more than ``limit + 1`` decoded bytes."""

    def __init__(self, encoding: str, limit: int) -> None:
        self.encoding = encoding
        self.limit = limit
        self.produced = 0
        self._obj = self._new() if encoding != "identity" else None
        self._first = True

    def _new(self, wbits: int | None = None) -> zlib._Decompress:
        if wbits is None:
            wbits = 16 + zlib.MAX_WBITS if self.encoding in _GZIP else zlib.MAX_WBITS
        return zlib.decompressobj(wbits)

    def feed(self, data: bytes) -> bytes:
        """The decoded bytes of the next wire chunk.

        :raises InflateLimitExceeded: the decoded body is now above ``limit``.
        :raises zlib.error: corrupt compressed data.
        """
        if self._obj is None:
            self.produced += len(data)
            if self.produced > self.limit:
                raise InflateLimitExceeded
            return data
        if self._first and self.encoding in _DEFLATE and data:
            self._first = False
            try:  # RFC "deflate" is zlib-wrapped, but some servers send raw deflate
                return self._inflate(data)
            except zlib.error:
                self._obj = self._new(-zlib.MAX_WBITS)
                self.produced = 0
        return self._inflate(data)

    def _inflate(self, data: bytes) -> bytes:
        assert self._obj is not None
        out: list[bytes] = []
        while data:
            piece = self._obj.decompress(data, self.limit - self.produced + 1)
            self.produced += len(piece)
            if self.produced > self.limit:
                raise InflateLimitExceeded
            out.append(piece)
            if self._obj.eof:
                data = self._obj.unused_data
                if data and self.encoding in _GZIP:  # a gzip file may hold several members
                    self._obj = self._new()
                    continue
                break  # trailing bytes after a deflate stream are ignored, as browsers do
            tail = self._obj.unconsumed_tail
            if not piece and len(tail) == len(data):
                break  # no progress: zlib needs more input
            data = tail
        return b"".join(out)


def body_decoder(content_encoding: str | None, limit: int) -> BodyDecoder:
    """The decoder for a response's ``Content-Encoding`` header.

    :raises EncodingRefused: an encoding other than identity, gzip or deflate, or more than one.
    """
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return BodyDecoder("identity", limit)
    if len(codings) > 1:
        raise EncodingRefused(
            f"Content-Encoding {', '.join(codings)!r} stacks {len(codings)} encodings; at most "
            "one (gzip or deflate) is decoded"
        )
    if codings[0] not in _GZIP + _DEFLATE:
        raise EncodingRefused(
            f"Content-Encoding {codings[0][:40]!r} was not asked for (the fetcher asks for "
            "identity and decodes only gzip and deflate)"
        )
    return BodyDecoder(codings[0], limit)
