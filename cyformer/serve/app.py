"""The FastAPI app: routes on an APIRouter, one handler per kind of error,
the API-key gate, Prometheus metrics, and Server-Sent Events.

Each route parses its body into a pydantic model (cyformer.serve.protocol),
asks OpenAIServing for a Plan, submits its generations to the engine and
answers from their events, which the engine's thread hands to the event loop
through ``call_soon_threadsafe``.  A client that goes away cancels its
streams, which frees their slots at the next step.
"""

import asyncio
import contextlib
import json
import os
import secrets
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..errors import CyformerError
from . import protocol as P
from .serving import MAX_PROMPTS, RETRY_AFTER_S, APIError, OpenAIServing, new_id

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
             "/tokenizer_info", "/health", "/metrics")

router = APIRouter()

MAX_BODY_BYTES = 8 * 2**20  # a request body above this is a 413, refused before it is read whole


def finite(value):
    """A JSON value with every float finite: OpenAI's -9999.0 floor for a
    log-probability of -inf (and the same magnitude for +inf), null for NaN."""
    if isinstance(value, float):
        if value != value:
            return None
        return value if abs(value) != float("inf") else (-9999.0 if value < 0 else 9999.0)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(payload):
    """JSON text of an answer: finite numbers only, and any text (a lone
    surrogate from the request echoed in a message) encodable as UTF-8."""
    return json.dumps(finite(payload), ensure_ascii=False, allow_nan=False).encode(
        "utf-8", "backslashreplace").decode("utf-8")


class SafeJSONResponse(JSONResponse):
    def render(self, content):
        return dumps(content).encode("utf-8")


def serving(request: Request) -> OpenAIServing:
    return request.app.state.cyformer


@router.get("/health")
async def health(request: Request):
    s = request.app.state
    ok = s.cyformer.engine.running and not s.stopping
    return JSONResponse({"status": "ok" if ok else "stopping"}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    return PlainTextResponse(generate_latest(request.app.state.registry).decode(),
                             media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [serving(request).model_card()]}


@router.get("/v1/models/{model_id:path}")
async def one_model(model_id: str, request: Request):
    serving(request).check_model(model_id)
    return serving(request).model_card()


# Planning tokenizes prompts and renders chat templates: off the event loop,
# so that a large request never stops /health or the other streams.

@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request):
    s = serving(request)
    return await answer(request, s, await asyncio.to_thread(s.completion_plan, body), chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: P.ChatCompletionRequest, request: Request):
    s = serving(request)
    return await answer(request, s, await asyncio.to_thread(s.chat_plan, body), chat=True)


@router.post("/tokenize")
async def tokenize(body: P.TokenizeRequest, request: Request):
    return await asyncio.to_thread(serving(request).tokenize, body)


@router.post("/detokenize")
async def detokenize(body: P.DetokenizeRequest, request: Request):
    return serving(request).detokenize(body)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    return serving(request).tokenizer_info()


class Waiting:
    """The next item of an asyncio.Queue, or None after a timeout, without
    losing a cancellation: before Python 3.12, asyncio.wait_for drops one
    that lands as the item arrives (a shutdown's, whose request would then
    run on to a 200 instead of its 503), so this waits with asyncio.wait
    and keeps the pending get for the next call."""

    def __init__(self, queue):
        self.queue, self.getter = queue, None

    async def next(self, timeout):
        if self.getter is None:
            self.getter = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({self.getter}, timeout=timeout)
        if not done:
            return None
        item, self.getter = self.getter.result(), None
        return item

    def close(self):
        if self.getter is not None:
            self.getter.cancel()


async def answer(request, s: OpenAIServing, plan, chat):
    loop = asyncio.get_running_loop()
    events = asyncio.Queue()
    sinks = [(lambda i: lambda ev: loop.call_soon_threadsafe(events.put_nowait, (i, ev)))(i)
             for i in range(len(plan.gens))]
    streams = s.submit(plan.gens, sinks)
    rid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
    if plan.stream:
        body = sse(s, plan, events, streams, rid, created, chat)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    waiting = Waiting(events)
    try:
        prompt_lp = await s.echo_logprobs(plan)
        remaining = len(streams)
        while remaining:
            got = await waiting.next(0.5)
            if got is None:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            remaining -= got[1] is None
    finally:
        waiting.close()
        for st in streams:
            st.cancel()  # no-op for finished ones; frees the slots of a client that left
    for st in streams:
        if st.error is not None:
            raise st.error
    chosen = s.choose(plan, streams)
    if chat:
        choices = [s.chat_choice(plan, i, st) for i, st in enumerate(chosen)]
        return P.ChatCompletionResponse(id=rid, created=created, model=s.model_name, choices=choices,
                                        usage=usage(streams)).model_dump()
    choices = [s.completion_choice(plan, i, st, i // plan.n, prompt_lp[i // plan.n])
               for i, st in enumerate(chosen)]
    return P.CompletionResponse(id=rid, created=created, model=s.model_name, choices=choices,
                                usage=usage(streams)).model_dump()


def usage(streams):
    p = sum(st.generation.prompt_tokens for st in streams)  # a healed prompt's last token included
    c = sum(len(st.generation.tokens) for st in streams)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def sse(s: OpenAIServing, plan, events, streams, rid, created, chat):
    """Server-Sent Events: (with echo, the prompt first,) one chunk per text
    piece of any choice, the finish reasons, the usage when asked for, then [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    want_lp = plan.logprobs is not None
    held = [[] for _ in streams]   # logprobs of tokens whose text is still held back
    before = [b"".join(s.tokenizer.token_bytes(t) for t in st.generation.prompt_ids) for st in streams]

    def data(payload):
        return "data: " + dumps(payload) + "\n\n"

    def chunk(i, text=None, finish=None, role=False, lps=None):
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            c = {"index": i, "delta": delta, "logprobs": s.chat_logprobs(lps) if lps else None,
                 "finish_reason": finish}
        else:
            lp = None
            if lps:
                lp = s.completion_logprobs([e.token for e in lps], [e.logprob for e in lps],
                                           [e.top if plan.logprobs else None for e in lps], before[i])
                before[i] += b"".join(s.tokenizer.token_bytes(e.token) for e in lps)
            c = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
        return data({"id": rid, "object": obj, "created": created, "model": s.model_name, "choices": [c]})

    try:
        if chat:
            for i in range(len(streams)):
                yield chunk(i, text="", role=True)
        if plan.echo is not None:
            prompt_lp = await s.echo_logprobs(plan)
            for i, st in enumerate(streams):
                text, ids = plan.echo[i // plan.n]
                lp = None
                if want_lp:
                    values, tops = prompt_lp[i // plan.n]
                    lp = s.completion_logprobs([int(t) for t in ids], values, tops)
                yield data({"id": rid, "object": obj, "created": created, "model": s.model_name,
                            "choices": [{"index": i, "text": text, "finish_reason": None, "logprobs": lp}]})
        remaining = len(streams)
        while remaining:
            i, ev = await events.get()
            st = streams[i]
            if ev is None:
                remaining -= 1
                if st.error is not None:
                    yield data({"error": {"message": f"generation failed: {st.error}", "type": "server_error",
                                          "param": None, "code": None}})
                    continue
                g = st.generation
                if held[i]:
                    yield chunk(i, text="", lps=held[i])
                    held[i] = []
                from .serving import FINISH
                yield chunk(i, finish=FINISH.get(g.finish_reason, g.finish_reason))
                continue
            if want_lp and ev.logprob is not None:
                held[i].append(ev.logprob)
            if ev.text:
                yield chunk(i, text=ev.text, lps=held[i] if want_lp else None)
                held[i] = []
        if plan.include_usage:
            yield data({"id": rid, "object": obj, "created": created, "model": s.model_name,
                        "choices": [], "usage": usage(streams)})
        yield "data: [DONE]\n\n"
    finally:
        for st in streams:
            st.cancel()  # the client went away, or we are done: free the slots


# -- errors -------------------------------------------------------------------------

def error_response(e: APIError):
    return SafeJSONResponse(e.body(), status_code=e.status, headers=e.headers)


def validation_error(errors):
    """pydantic's errors -> one OpenAI-style 400 naming the first bad field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('msg', '')[:120]})")
    if not loc:
        return APIError(400, f"the request body must be a JSON object with the request's fields "
                             f"({first.get('msg', '')})")
    param = str(loc[0])
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field '{param}{where}': this server does not implement it, and "
                             "it refuses it rather than ignore what it would change", param=param)
    if kind == "missing":
        return APIError(400, f"'{param}{where}' is required", param=param)
    got = json.dumps(first.get("input"), default=str)[:60] if "input" in first else ""
    return APIError(400, f"'{param}{where}': {first.get('msg', 'invalid value')}" + (f", got {got}" if got else ""),
                    param=param)


def install_error_handlers(app):
    @app.exception_handler(APIError)
    async def api_error(request, e):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request, e):
        return error_response(validation_error(e.errors()))

    @app.exception_handler(ValidationError)
    async def model_validation(request, e):
        return error_response(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        msg = (f"unknown route {request.method} {request.url.path}" if e.status_code == 404 else
               f"{request.method} is not allowed on {request.url.path}" if e.status_code == 405 else str(e.detail))
        return SafeJSONResponse({"error": {"message": msg, "type": kind, "param": None, "code": None}},
                                status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e):
        return SafeJSONResponse({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                           "type": "server_error", "param": None, "code": None}}, status_code=500)


# -- metrics --------------------------------------------------------------------------

class EngineCollector:
    """The engine's counters and gauges, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        st = self.engine.stats()
        c = CounterMetricFamily("cyformer_requests", "Generations finished, by outcome.", labels=["outcome"])
        for k in ("finished", "cancelled", "failed"):
            c.add_metric([k], st[k])
        yield c
        for name, key, help_ in (
                ("prompt_tokens", "prompt_tokens", "Prompt tokens of admitted generations."),
                ("prefilled_tokens", "prefilled_tokens", "Prompt tokens run through the model (not from the prefix cache)."),
                ("generated_tokens", "generated_tokens", "Tokens generated."),
                ("steps", "steps", "Scheduler steps.")):
            yield CounterMetricFamily(f"cyformer_{name}", help_, value=st[key])
        for name, key, help_ in (("queue_depth", "queue_depth", "Requests waiting for a slot."),
                                 ("active_sequences", "active", "Sequences in the running batch."),
                                 ("max_batch", "max_batch", "Slots in the batch.")):
            yield GaugeMetricFamily(f"cyformer_{name}", help_, value=st[key])
        kv = st["kv_cache"]
        for name, key, help_ in (("kv_cache_bytes", "bytes", "Memory held by the running sequences' KV caches."),
                                 ("kv_cache_max_bytes", "max_bytes", "The KV cache budget (--kv-cache-mb)."),
                                 ("kv_cache_peak_bytes", "peak_bytes", "The most the KV caches have held at once."),
                                 ("kv_cache_positions", "positions",
                                  "Token positions held in the running sequences' KV caches.")):
            yield GaugeMetricFamily(f"cyformer_{name}", help_, value=kv[key])
        yield CounterMetricFamily("cyformer_preemptions", "Sequences whose KV cache was dropped for memory, "
                                  "to be recomputed.", value=st["preempted"])
        pc = st["prefix_cache"] or {"hits": 0, "misses": 0, "hit_tokens": 0, "bytes": 0, "max_bytes": 0}
        yield CounterMetricFamily("cyformer_prefix_cache_hits", "Requests that reused a cached prefix.", value=pc["hits"])
        yield CounterMetricFamily("cyformer_prefix_cache_misses", "Requests that found no cached prefix.",
                                  value=pc["misses"])
        yield CounterMetricFamily("cyformer_prefix_cache_hit_tokens", "Prompt positions taken from the prefix cache.",
                                  value=pc["hit_tokens"])
        yield GaugeMetricFamily("cyformer_prefix_cache_bytes", "Memory held by the prefix cache.", value=pc["bytes"])
        yield GaugeMetricFamily("cyformer_prefix_cache_max_bytes", "The prefix cache's memory bound.",
                                value=pc["max_bytes"])


class Gate:
    """ASGI middleware: counts requests by endpoint and status, and checks
    the API key on /v1/ routes.  (Plain ASGI, so that streaming responses
    still see the client's disconnect.)"""

    def __init__(self, app, counter, api_key, max_body_bytes=MAX_BODY_BYTES):
        self.app, self.counter, self.api_key = app, counter, api_key
        self.max_body = max_body_bytes

    def too_large(self):
        return error_response(APIError(413, f"the request body is larger than {self.max_body} bytes",
                                       code="request_too_large"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            self.counter.labels(endpoint, "413").inc()
            return await self.too_large()(scope, receive, send)
        # a chunked body has no length up front: count it as it arrives
        received, started = [0], [False]

        async def receive_counted():
            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > self.max_body:
                    raise _TooLarge()
            return message
        if self.api_key is not None and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
                self.counter.labels(endpoint, "401").inc()
                response = error_response(APIError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                                   kind="authentication_error", code="invalid_api_key"))
                return await response(scope, receive, send)
        status = [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                started[0] = True
            await send(message)

        try:
            await self.app(scope, receive_counted, send_counted)
        except _TooLarge:
            if started[0]:
                raise
            status[0] = 413
            await self.too_large()(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when a shutdown's grace
            # ends, and would answer them with a plain-text 500: say it in JSON
            if started[0]:
                raise
            status[0] = 503
            await error_response(APIError(503, "the server shut down before this request finished",
                                          kind="server_shutting_down", code="shutting_down",
                                          headers={"Retry-After": str(RETRY_AFTER_S)}))(scope, receive, send)
        finally:
            self.counter.labels(endpoint, str(status[0])).inc()


class _TooLarge(BaseException):
    """A chunked request body went past the limit while it was read (a
    BaseException, so that the body parser's ``except Exception`` does not
    turn it into a 400 about malformed JSON)."""


# -- the app ----------------------------------------------------------------------------

def create_app(model, engine=None, *, model_name=None, api_key=None, grace=30.0, max_prompts=MAX_PROMPTS,
               logprobs_mode="raw", max_body_bytes=MAX_BODY_BYTES, **engine_args):
    """The FastAPI app serving ``model`` through ``engine`` (a new Engine
    with engine_args when None; on shutdown the app gives the engine it made
    ``grace`` s to finish, then cancels what is left).  max_prompts: prompts
    per completions request; logprobs_mode: "raw" (the model's) or
    "processed" (of the scores sampled from); max_body_bytes: the largest
    request body (larger ones get a 413 before they are read)."""
    if not model.tokenizer.available:
        raise CyformerError(f"{model.path}: serving needs the checkpoint's tokenizer.json")
    owns = engine is None
    engine = engine if engine is not None else Engine(model, **engine_args)
    name = model_name or os.path.basename(os.path.normpath(model.path or "model"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        app.state.stopping = True
        if owns:  # finish what is running, then cancel what is left
            await asyncio.to_thread(_drain, engine, grace)

    app = FastAPI(title="cyformer", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None,
                  default_response_class=SafeJSONResponse)
    app.state.cyformer = OpenAIServing(model, engine, name, max_prompts=max_prompts, logprobs_mode=logprobs_mode)
    app.state.stopping = False
    registry = app.state.registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    counter = Counter("cyformer_http_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                      registry=registry)
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(Gate, counter=counter, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


def _drain(engine, grace=None):
    if not engine.close(timeout=grace):
        engine.close(cancel=True, timeout=30)


