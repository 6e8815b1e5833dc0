"""The app's routes: vLLM's render endpoints, ``/tokenize``, the OpenAI gateway, ``/v1/models``
and the probes (``/health``, ``/ready``, ``/readyz``, ``/metrics``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from aiomm.server.config import ServerConfig
from aiomm.server.endpoint import (
    Handler,
    endpoint,
    header_id,
    json_response,
    parsed_media,
    render_json_response,
)
from aiomm.server.gateway import refuse_unanswerable, trace_headers
from aiomm.server.readiness import ReadinessReport
from aiomm.server.state import StateHolder
from aiomm.vllm.content import Parsed, parse_anthropic, parse_chat, parse_responses
from aiomm.vllm.errors import ApiError
from aiomm.vllm.request_fields import own_fields
from aiomm.vllm.request_values import flag

__all__ = ("Routes",)


class Routes:
    """The handlers of an app serving ``config``, reading its state from ``holder``."""

    def __init__(self, config: ServerConfig, holder: StateHolder) -> None:
        self.config = config
        self.holder = holder

    def routes(self) -> list[Route]:
        """Every route of the app."""
        return [
            self._post("/v1/chat/completions/render", "chat_render", self.chat_render, True),
            self._post("/v1/responses/render", "responses_render", self.responses_render, True),
            self._post("/v1/messages/render", "messages_render", self.messages_render, True),
            self._post("/v1/completions/render", "completions_render", self.completions_render),
            self._post("/tokenize", "tokenize", self.tokenize),
            self._post("/v1/chat/completions", "chat_completions", self.chat_completions, True),
            self._post("/v1/completions", "completions", self.completions),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/readyz", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    def _post(self, path: str, name: str, handler: Handler, lift: bool = False) -> Route:
        run = endpoint(name, handler, self.holder, self.config.max_body_bytes, lift)
        return Route(path, run, methods=["POST"])

    # -- vLLM's render endpoints ---------------------------------------------------------------

    async def _render(
        self,
        request: Request,
        body: dict[str, Any],
        parse: Callable[[dict[str, Any]], Parsed],
        **kwargs: Any,
    ) -> dict[str, Any]:
        s = self.holder.get()
        rendered = await s.service.render(parsed_media(request, body, parse), body, **kwargs)
        s.metrics.images.inc(rendered.images)
        s.metrics.cache.labels("hit").inc(rendered.cache_hits)
        s.metrics.cache.labels("miss").inc(rendered.images - rendered.cache_hits)
        s.metrics.observe_timings(rendered.timings)
        return rendered.response

    async def chat_render(self, request: Request, body: dict[str, Any]) -> Response:
        rendered = await self._render(
            request, body, parse_chat, api="chat", header_id=header_id(request)
        )
        return render_json_response(rendered)

    async def responses_render(self, request: Request, body: dict[str, Any]) -> Response:
        return render_json_response(
            await self._render(request, body, parse_responses, api="responses")
        )

    async def messages_render(self, request: Request, body: dict[str, Any]) -> Response:
        parse = functools.partial(
            parse_anthropic,
            merge_inline_system=self.holder.get().service.chat.merges_inline_system,
        )
        rendered = await self._render(
            request, body, parse, api="messages", header_id=header_id(request)
        )
        return render_json_response(rendered)

    async def completions_render(self, request: Request, body: dict[str, Any]) -> Response:
        service = self.holder.get().service
        return json_response(await service.render_text(body, header_id=header_id(request)))

    async def tokenize(self, request: Request, body: dict[str, Any]) -> Response:
        s = self.holder.get().service
        s.check_model(body)
        if "messages" in body:
            # vLLM's validator reads the raw JSON: only an explicit add_generation_prompt clashes
            if body.get("continue_final_message") and body.get("add_generation_prompt"):
                raise ApiError(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                )
            # rendered as a chat request, images expanded (vLLM's preprocess_chat), no payload
            chat = own_fields(body, "tokenize")
            if chat.get("tools") == []:  # /tokenize takes an empty list the chat route refuses
                del chat["tools"]
            rendered = await s.render(parse_chat(chat), {**chat, "mm_payload": "none"})
            ids = rendered.response["token_ids"]
        elif isinstance(body.get("prompt"), str):
            ids = await s.chat.aencode(body["prompt"])
        else:
            raise ApiError("give 'prompt' or 'messages'", param="prompt")
        return json_response(
            {
                "count": len(ids),
                "max_model_len": s.defaults.max_model_len,
                "tokens": ids,
                "token_strs": s.tokenizer.convert_ids_to_tokens(ids)
                if flag(body, "return_token_strs", False)
                else None,
            }
        )

    # -- the OpenAI gateway --------------------------------------------------------------------

    async def _gateway(self, request: Request, body: dict[str, Any], *, chat: bool) -> Response:
        s = self.holder.get()
        if s.upstream is None:
            raise ApiError("this server has no --upstream; use the /render endpoints", status=404)
        if chat:
            gen = await self._render(
                request, body, parse_chat, api="chat", header_id=header_id(request)
            )
        else:
            gens = await s.service.render_text(body, header_id=header_id(request))
            if len(gens) != 1:
                raise ApiError(
                    "the gateway takes one prompt per completion request", param="prompt"
                )
            gen = gens[0]
        refuse_unanswerable(gen, body)
        model = str(body.get("model") or s.service.served_names[0])
        if gen["stream"]:  # the body's, read as a bool field by generate_request
            return StreamingResponse(
                s.upstream.stream(gen, chat=chat, model=model, trace=trace_headers()),
                media_type="text/event-stream",
            )
        return json_response(await s.upstream.complete(gen, chat=chat, model=model))

    async def chat_completions(self, request: Request, body: dict[str, Any]) -> Response:
        return await self._gateway(request, body, chat=True)

    async def completions(self, request: Request, body: dict[str, Any]) -> Response:
        return await self._gateway(request, body, chat=False)

    # -- models and probes ---------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        config = self.config
        names = config.served_model_names or (config.model,)
        created = int(time.time())
        try:
            max_model_len = self.holder.get().service.defaults.max_model_len
        except ApiError as exc:  # before the lifespan ran, or after it: a JSON 503
            return json_response(exc.body(), exc.status)
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": n,
                        "object": "model",
                        "created": created,
                        "owned_by": "aiomm",
                        "root": config.model,
                        "parent": None,
                        "max_model_len": max_model_len,
                    }
                    for n in names
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        """Liveness, as vLLM's render server answers it: 200 once started, no body."""
        return Response(status_code=200 if self.holder.current is not None else 503)

    async def ready(self, request: Request) -> Response:
        """Readiness (:mod:`.readiness`): 200 when every required dependency answers, else 503
        naming the ones that do not."""
        s = self.holder.current
        if s is None:
            report = ReadinessReport({"server": "starting or stopping"})
        else:
            report = await s.readiness.report()
        return json_response(report.body(), 200 if report.ready else 503)

    async def metrics(self, request: Request) -> Response:
        s = self.holder.current
        if s is None:
            return Response(status_code=503)
        exposition = s.metrics.render(
            s.engine.stats(), {"encode": s.service.encode_pool.statistics()}
        )
        return Response(exposition, media_type="text/plain; version=0.0.4")
