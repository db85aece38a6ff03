"""The FastAPI app factory: the same app runs in-process (tests) and as the Ray Serve Router's ingress."""

from __future__ import annotations

import importlib.metadata

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ninfer.protocol.errors import ProtocolError, model_not_found
from ninfer.server import openapi
from ninfer.server.chat_completions import chat_completions
from ninfer.server.context import ServerContext, effective_max_model_len
from ninfer.server.messages import count_tokens, create_message
from ninfer.server.metrics import EngineClientFeed, MetricsFeed, ServerFacts, metrics_endpoint
from ninfer.server.middleware import EdgeMiddleware, error_response_parts
from ninfer.server.observer import RequestObserver
from ninfer.server.responses import add_responses_routes


def create_app(ctx: ServerContext, *, behind_serve_proxy: bool = False, response_store=None,
               observer: RequestObserver | None = None, metrics_feed: MetricsFeed | None = None) -> FastAPI:
    """`observer` and `metrics_feed` default to this process alone (the Ray Router passes its own)."""
    # /docs and /openapi.json sit behind --api-key like every route but /health (server.middleware)
    app = FastAPI(title="ninfer", version=_version(), docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.ctx = ctx
    # Request lifecycle (JSONL, metrics, stderr) and /metrics; the endpoints reach them via app.state.
    app.state.observer = observer = observer or RequestObserver.for_config(
        ctx.config, engine=getattr(ctx.engine, "engine", None))  # an engine in this process
    app.state.metrics_feed = metrics_feed or EngineClientFeed(ctx.engine, observer.figures)
    app.state.server_facts = ServerFacts.of(ctx.config, observer.model, ctx.max_model_len)
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"])
    app.add_exception_handler(ProtocolError, _protocol_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    add_responses_routes(app, response_store)  # None: an in-process ResponseStore
    app.add_api_route("/v1/messages", create_message, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
    openapi.install(app, api_key=bool(ctx.config.api_key))  # after the routes: it declares their bodies
    app.add_middleware(EdgeMiddleware, api_key=ctx.config.api_key,
                       max_request_bytes=ctx.config.max_request_mib * 1024 * 1024,
                       upstream_request_id=behind_serve_proxy)
    if ctx.config.cors:  # outermost: preflights are answered before auth, and errors carry CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-request-id", "request-id"])
    return app


def _version() -> str:
    try:
        return importlib.metadata.version("ninfer")
    except importlib.metadata.PackageNotFoundError:
        return "0"


async def health(request: Request) -> JSONResponse:
    """Engine readiness; queue saturation does not count as unavailable."""
    if await request.app.state.ctx.engine.ready():
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def _model_object(ctx: ServerContext) -> dict:
    return {"id": ctx.model_id, "object": "model", "created": ctx.created, "owned_by": "ninfer",
            "max_model_len": await effective_max_model_len(ctx)}


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [await _model_object(request.app.state.ctx)]})


async def get_model(model_id: str, request: Request) -> JSONResponse:
    ctx = request.app.state.ctx
    if model_id != ctx.model_id:
        raise model_not_found(model_id)
    return JSONResponse(await _model_object(ctx))


def _render(request: Request, err: ProtocolError) -> Response:
    status, body = error_response_parts(err, request.url.path, request.state.request_id)
    return Response(content=body, status_code=status, media_type="application/json")


async def _protocol_error(request: Request, exc: ProtocolError) -> Response:
    return _render(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and wrong methods, in the protocol's error shape instead of FastAPI's."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _render(request, ProtocolError(f"{request.method} {request.url.path}: {exc.detail}", code=code,
                                          status=exc.status_code))
