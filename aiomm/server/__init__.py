"""``aiomm serve``: vLLM's render API and an OpenAI-compatible gateway (the ``serve`` extra).

``create_app(ServerConfig(model_folder))`` returns the ASGI application.
"""

from __future__ import annotations

from aiomm.server.app import ServerConfig, create_app

__all__ = ("ServerConfig", "create_app")
