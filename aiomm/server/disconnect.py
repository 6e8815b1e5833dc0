"""Waiting for an ASGI client to leave."""

from __future__ import annotations

from starlette.types import Receive

__all__ = ("until_disconnect",)


async def until_disconnect(receive: Receive) -> None:
    """Return once ``receive`` gives ``http.disconnect`` (after the request's body was read, a
    server's ``receive`` waits until then)."""
    while (await receive())["type"] != "http.disconnect":
        pass
