"""FastAPI app factory: OpenAI-compatible routes, /health, /metrics.

Handlers validate and tokenize (in the thread pool), enqueue a job for the single worker and
relay its events as JSON or SSE. A watcher task cancels the job when the client disconnects.
A prompt is refused from its byte length and its images from their headers before any
tokenizing or pixel decoding (server/budget.py); images decode under one gate (docs/api.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from edge_llm import __version__
from edge_llm.engine import Engine, GenerationRequest
from edge_llm.errors import EdgeLLMError, ImageError
from edge_llm.sampling import SamplingParams
from edge_llm.sdnotify import Notifier
from edge_llm.server import schemas as S
from edge_llm.server.errors import (
    APIError,
    RequestGate,
    bad_request,
    install_handlers,
    queue_full,
    unavailable,
)
from edge_llm.server.budget import Budget, encode_within
from edge_llm.server.events import EventHub
from edge_llm.server.hosts import HostCheck, allowed_hosts
from edge_llm.server.images import ChatOptions, decode_images, render_chat
from edge_llm.server.metrics import StatusCountMiddleware
from edge_llm.server.node import NodeHeaderMiddleware
from edge_llm.server.state import AppState
from edge_llm.server.storeview import EdgeState, EdgeStore, StoreView
from edge_llm.server.streaming import collect, sse_chat, sse_completion
from edge_llm.server.ui import SecurityHeaders, mount_ui
from edge_llm.server.worker import Job, QueueFull, ShuttingDown
from edge_llm.settings import Settings

log = logging.getLogger(__name__)

ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": S.ErrorResponse, "description": d} for c, d in (
        (400, "Invalid request, or prompt + max_tokens over the context window"),
        (401, "Missing or invalid API key"), (404, "Unknown model"), (413, "Request body too large"),
        (503, "Loading, shutting down, or queue full (see Retry-After)"))}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def create_app(settings: Settings, notifier: Notifier | None = None, loader: Callable[[], Engine] | None = None,
               on_fatal: Callable[[Exception], None] | None = None) -> FastAPI:
    """Build the app. The model loads in the background when the app starts (lifespan)."""
    state = AppState(settings, notifier=notifier, loader=loader, on_fatal=on_fatal)
    chat_options = ChatOptions(settings.image_dir, settings.max_image_bytes, settings.max_images,
                               settings.chat_special_tokens)
    decode_gate = asyncio.Semaphore(settings.max_image_decodes)  # images decoded at once (all requests)
    events = EventHub()  # log lines -> /v1/edge/events (server/events.py)
    view = StoreView(state, events)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        logging.getLogger().addHandler(events)  # from the first line: the scan's [KV-DISK] index line
        state.start_loading()
        try:
            yield
        finally:
            # the worker join and snapshot flush block: keep them off the event loop
            await run_in_threadpool(state.close)
            logging.getLogger().removeHandler(events)

    keyed = settings.api_key_file is not None
    # with an API key, the interactive docs are off and the schema is behind the key (docs/api.md)
    app = FastAPI(title="edge-llm", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API with bit-exact disk KV snapshots.",
                  **({"docs_url": None, "redoc_url": None, "openapi_url": None} if keyed else {}))
    app.state.edge = state
    install_handlers(app)

    def auth(request: Request) -> None:
        if state.keys is not None:
            state.keys.check(next((v for n, v in request.scope["headers"] if n == b"authorization"), None))

    def require_ready(model: str | None) -> None:
        if state.status == "stopping":
            raise unavailable("server is shutting down", "shutting_down")
        if not state.ready:
            raise unavailable(f"model is {state.status}" + (f": {state.error}" if state.error else ""),
                              "model_not_ready")
        if model is not None and model not in (state.model_id, settings.model):
            raise APIError(404, f"model {model!r} not found; this server serves {state.model_id!r}",
                           "invalid_request_error", "model", "model_not_found")

    # ---- introspection ----------------------------------------------------------------------
    def authorized(request: Request) -> bool:
        try:
            auth(request)
            return True
        except APIError:
            return False

    @app.get("/health", response_model=S.Health, responses={503: {"model": S.Health}})
    def health(request: Request) -> JSONResponse:
        """Liveness for anyone ({"status"}); the details (paths, namespace, counters) need the key
        when one is configured."""
        h = state.health()
        code = 200 if h["status"] == "ok" else 503
        return JSONResponse(h if authorized(request) else {"status": h["status"]}, status_code=code)

    @app.get("/metrics", response_class=Response,
             dependencies=[] if settings.metrics_public else [Depends(auth)])
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    if keyed:
        @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(auth)])
        def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

    @app.get("/v1/models", response_model=S.ModelList, responses=ERRORS, dependencies=[Depends(auth)])
    def models() -> S.ModelList:
        defaults = state.engine.sampling_defaults.to_dict() if state.engine is not None else None
        return S.ModelList(data=[S.ModelCard(id=state.model_id, created=state.created, sampling_defaults=defaults,
                                             max_model_len=settings.max_seq,
                                             default_max_tokens=settings.default_max_tokens,
                                             backend=state.backend, backend_reason=state.backend_reason)])

    # ---- the page's data (docs/api.md, "The page and its endpoints") ---------------------------
    @app.get("/v1/edge/state", response_model=EdgeState, responses={401: ERRORS[401]},
             dependencies=[Depends(auth)])
    def edge_state() -> EdgeState:
        return view.state_doc()

    @app.get("/v1/edge/store", response_model=EdgeStore, responses={401: ERRORS[401]},
             dependencies=[Depends(auth)])
    def edge_store() -> EdgeStore:  # a stat per snapshot: in the thread pool
        return view.store_doc()

    # an endless stream: documented in docs/api.md, left out of the schema (a fuzzer would wait on it)
    @app.get("/v1/edge/events", include_in_schema=False, dependencies=[Depends(auth)])
    async def edge_events(request: Request) -> StreamingResponse:
        return StreamingResponse(events.stream(request, lambda: state.status == "stopping"),
                                 media_type="text/event-stream", headers=_SSE_HEADERS)

    # ---- generation ---------------------------------------------------------------------------
    def sampling(body: S._Sampling, endpoint: str) -> tuple[SamplingParams, list[str]]:
        if body.n not in (None, 1):
            raise bad_request("only n=1 is supported", "n")
        for name, is_default in S.NOT_HONOURED[endpoint].items():  # one rule: schemas.NOT_HONOURED
            if not is_default(getattr(body, name)):
                raise bad_request(f"{name} is not supported by this server (omit it, or send its default "
                                  f"value)", name)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4:
            raise bad_request(f"at most 4 stop sequences are allowed, got {len(stop)}", "stop")
        # omitted fields: the model's recommended values (generation_config.json), else OpenAI's
        params = state.engine.sampling_defaults.params(body.temperature, body.top_p, body.top_k, body.seed)
        return params, [s for s in stop if s]

    async def submit(request: Request, greq: GenerationRequest, label: str) -> tuple[Job, asyncio.Task]:
        job = Job(greq, asyncio.get_running_loop(), label=label)
        try:
            state.worker.submit(job)
        except QueueFull:
            state.metrics.rejected_queue_full.inc()
            raise queue_full(settings.queue_size) from None
        except ShuttingDown:
            raise unavailable("server is shutting down", "shutting_down") from None
        return job, asyncio.create_task(_watch_disconnect(request, job))

    async def respond(request: Request, body, gen: GenerationRequest, chat: bool):
        """Queue the request; answer with SSE chunks (stream) or one JSON body."""
        job, watcher = await submit(request, gen, "chat" if chat else "completion")
        meta = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{job.id}", model=state.model_id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = (sse_chat if chat else sse_completion)(job, watcher, meta, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        return await collect(job, watcher, meta, chat=chat)

    @app.post("/v1/completions", response_model=S.CompletionResponse, responses=ERRORS,
              dependencies=[Depends(auth)])
    async def completions(body: S.CompletionRequest, request: Request):
        require_ready(body.model)
        params, stop = sampling(body, "completion")
        engine = state.engine
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        budget = Budget(settings.max_seq, max_tokens, "max_tokens")
        if isinstance(body.prompt, str):
            tokens = await run_in_threadpool(encode_within, engine.tokenizer, body.prompt, budget)
        else:
            vocab = engine.model.args.vocab_size
            bad = next((t for t in body.prompt if t >= vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is out of range (vocabulary size {vocab})", "prompt")
            tokens = list(body.prompt)
            budget.check(len(tokens))
        try:  # image placeholder tokens without images (they need the chat endpoint)
            engine.plan(tokens, [])
        except ImageError as e:
            raise bad_request(f"{e}; send images through /v1/chat/completions", "prompt", e.reason) from None
        return await respond(request, body, GenerationRequest(tokens, max_tokens, params, stop), chat=False)

    @app.post("/v1/chat/completions", response_model=S.ChatCompletionResponse, responses=ERRORS,
              dependencies=[Depends(auth)])
    async def chat_completions(body: S.ChatCompletionRequest, request: Request):
        require_ready(body.model)
        params, stop = sampling(body, "chat")
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        max_tokens = body.max_completion_tokens or body.max_tokens
        try:  # sized (images from their headers), refused past the window: nothing decoded yet
            prompt = await run_in_threadpool(render_chat, state.engine, body.messages, chat_options,
                                             Budget(settings.max_seq, max_tokens or 1, param))
        except EdgeLLMError as e:  # e.g. the template raises on a role order it does not accept
            raise bad_request(f"messages: {e}", "messages") from None
        n_prompt = prompt.n_tokens
        if max_tokens is None:  # the configured cap, at most whatever the context leaves (OpenAI's default)
            left = max(1, settings.max_seq - n_prompt)
            max_tokens = min(left, settings.default_max_tokens or left)
        Budget(settings.max_seq, max_tokens, param).check(n_prompt)
        if prompt.headers:  # waiting for the gate holds no thread
            async with decode_gate:
                tokens, images = await run_in_threadpool(decode_images, state.engine, prompt)
        else:
            tokens, images = await run_in_threadpool(decode_images, state.engine, prompt)
        return await respond(request, body, GenerationRequest(tokens, max_tokens, params, stop, images=images),
                             chat=True)

    if settings.ui:  # the page: public static files, its data from the keyed routes (docs/api.md)
        mount_ui(app)

    # the key and the body limit are checked from the request's head, before its body is read: the
    # paths of the routes declared with the key (docs/api.md "What is public")
    keyed_paths = frozenset(r.path for r in app.routes
                            if isinstance(r, APIRoute) and any(d.dependency is auth for d in r.dependencies))
    app.add_middleware(RequestGate, limit=settings.max_body_bytes, keys=state.keys, keyed=keyed_paths)
    # before the gate and every route: a request for a name that is not this server's (docs/api.md
    # "Allowed host names")
    allowed = allowed_hosts(settings.allowed_hosts, settings.host)
    log.info("allowed host names (setting allowed_hosts%s): %s", "" if settings.allowed_hosts else " = auto",
             ", ".join(allowed))
    app.add_middleware(HostCheck, allowed=allowed)
    # counts every status, including the Host check's 421 and the gate's 400, 401 and 413
    app.add_middleware(StatusCountMiddleware, metrics=state.metrics)
    app.add_middleware(NodeHeaderMiddleware, node_name=settings.node_name)  # docs/fleet.md
    app.add_middleware(SecurityHeaders)  # the page's headers, also on every error (docs/api.md)
    return app


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body is already read, so the next ASGI
    message is the disconnect)."""
    while not job.done:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel_with("client disconnected")
            return
