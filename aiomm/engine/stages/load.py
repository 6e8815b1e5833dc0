"""The load stage: an image source -> encoded bytes, or the in-memory image as given.

Input: a source (bytes, a path, a ``data:``, ``file:`` or ``http(s)://`` URL, a PIL image or an
array). Output: encoded bytes, or the in-memory object untouched (converted by the hash stage).
Runs on the event loop (async I/O). Only network URLs hold one of the ``fetch_concurrency`` slots:
inline bytes, ``data:`` URLs and local files never wait behind slow downloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ._stage import Stage

__all__ = ("Fetcher", "LoadStage", "is_in_memory", "is_network")

_NETWORK_SCHEMES = ("http://", "https://")


class Fetcher(Protocol):
    """What the load stage needs of a fetcher (:class:`aiomm.media.fetch.MediaFetcher`, or a test's
    own, as httpx's ``MockTransport`` stands in for the network)."""

    async def fetch(self, source: Any) -> bytes: ...

    def statistics(self) -> Any: ...


def is_in_memory(source: Any) -> bool:
    """Whether ``source`` is an image object (PIL, array) rather than bytes or a location."""
    return not isinstance(source, (bytes, bytearray, memoryview, str, Path)) and not hasattr(
        source, "__fspath__"
    )


def is_network(source: Any) -> bool:
    """Whether ``source`` is fetched from the network (an ``http(s)://`` URL)."""
    return isinstance(source, str) and source[:8].lower().startswith(_NETWORK_SCHEMES)


class LoadStage(Stage):
    """Fetches encoded bytes; network fetches are bounded by ``fetch_concurrency``."""

    name = "fetch"

    def __init__(self, fetcher: Fetcher, fetch_concurrency: int) -> None:
        super().__init__(fetch_concurrency)
        self.fetcher = fetcher

    async def load(self, source: Any) -> Any:
        """Encoded bytes of ``source``, or ``source`` itself when it is an in-memory image.

        :raises FetchError: (a subclass naming the source) when it cannot be read.
        """
        if is_in_memory(source):
            return source
        with self.counted():
            if is_network(source):
                assert self.limiter is not None
                async with self.limiter:
                    return await self.fetcher.fetch(source)
            return await self.fetcher.fetch(source)
