"""`cyformer serve`: an OpenAI-compatible HTTP server over the engine.

    GET  /v1/models              the one model served
    POST /v1/completions         text completion (prompt: str, [str], [int] or [[int]])
    POST /v1/chat/completions    the model's chat template, then completion
    GET  /health                 200 while taking requests, 503 while shutting down
    GET  /metrics                Prometheus text: requests, tokens, queue, batch, prefix cache

Streaming answers are Server-Sent Events (``data: {chunk}`` ... ``data: [DONE]``).
Every request becomes one or more engine streams (``n`` choices, several
prompts); the engine's scheduler thread hands their events to the event loop
through ``call_soon_threadsafe``.  A client that goes away cancels its
streams, which frees their slots at the next step.

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``:
400 for malformed JSON, wrong types, values out of range or a prompt that
does not fit the context; 401 without the API key (when one is set); 404 for
an unknown model or route; 503 (with Retry-After) when the queue is full or
the server is stopping.  Bad input never gives a 500.

Needs the serve extra: pip install 'cyformer[serve]' (FastAPI, uvicorn).
"""

import asyncio
import json
import math
import os
import secrets
import threading
import time
from collections import Counter

from .chat import check_messages, chat_generation
from .engine import Engine, EngineBusy, EngineClosed
from .errors import ChatTemplateError, CyformerError, TokenizerError
from .generate import CONTEXT, EOS, LENGTH, STOP, Generation
from .model_files import DEFAULT
from .request import GenerationRequest

API_KEY_ENV = "CYFORMER_API_KEY"
MAX_N = 16                  # choices per request
MAX_STOP = 4                # stop strings per request (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_S = 1
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
FINISH = {EOS: "stop", STOP: "stop", LENGTH: "length", CONTEXT: "length"}


class APIError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(param, message):
    return APIError(400, message, param=param)


# -- reading a request ----------------------------------------------------------

class Fields:
    """Typed access to a request's JSON object; each getter raises a 400 naming the field."""

    def __init__(self, obj):
        self.obj = obj

    def get(self, name, kinds, what, default=None):
        v = self.obj.get(name)
        if v is None:
            return default
        if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
            raise _bad(name, f"'{name}' must be {what}, got {json.dumps(v)[:60]}")
        return v

    def integer(self, name, lo, hi, default=None):
        v = self.get(name, (int,), "an integer")
        if v is None:
            return default
        if not lo <= v <= hi:
            raise _bad(name, f"'{name}' must be in [{lo}, {hi}], got {v}")
        return v

    def number(self, name, lo, hi, default=None, open_lo=False):
        v = self.get(name, (int, float), "a number")
        if v is None:
            return default
        if not math.isfinite(v) or v > hi or v < lo or (open_lo and v == lo):
            raise _bad(name, f"'{name}' must be in {'(' if open_lo else '['}{lo}, {hi}], got {v}")
        return v

    def boolean(self, name, default=False):
        return self.get(name, (bool,), "true or false", default)

    def unsupported(self, name, neutral):
        """Accept a field we do not implement only at its no-op value."""
        v = self.obj.get(name)
        if v is not None and v not in neutral:
            raise _bad(name, f"'{name}' is not supported by this server (only {neutral[0]!r})")


def _sampling(f: Fields):
    """The sampling arguments every endpoint takes."""
    temperature = f.number("temperature", 0, 2, DEFAULT)
    top_p = f.number("top_p", 0, 1, DEFAULT, open_lo=True)
    seed = f.integer("seed", 0, 2**63 - 1)
    stop = f.obj.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or len(stop) > MAX_STOP
                or not all(isinstance(s, str) and s for s in stop)):
            raise _bad("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them")
    n = f.integer("n", 1, MAX_N, 1)
    for name, neutral in (("frequency_penalty", (0, 0.0)), ("presence_penalty", (0, 0.0)),
                          ("logit_bias", ({},)), ("echo", (False,)), ("suffix", ("",)),
                          ("best_of", (1, n)), ("tools", ([],)), ("response_format", ({"type": "text"},))):
        f.unsupported(name, neutral)
    return dict(temperature=temperature, top_p=top_p, stop=stop, seed=seed), n


class Server:
    """The app's state: the model, its engine, counters."""

    def __init__(self, model, engine, model_name, api_key=None):
        self.model, self.engine, self.model_name, self.api_key = model, engine, model_name, api_key
        self.created = int(time.time())
        self.requests = Counter()  # (endpoint, status) -> count
        self.stopping = False
        self.lock = threading.Lock()

    def check_model(self, f: Fields):
        name = f.get("model", (str,), "a string")
        if name is None:
            raise _bad("model", "'model' is required")
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server has '{self.model_name}'",
                           param="model", code="model_not_found")

    # -- building generations --

    def completion_generations(self, f: Fields):
        prompt = f.obj.get("prompt")
        prompts = _prompts(prompt, self.model.config.vocab_size)
        sampling, n = _sampling(f)
        max_tokens = f.integer("max_tokens", 0, 2**31 - 1, COMPLETIONS_MAX_TOKENS)
        logprobs = f.integer("logprobs", 0, MAX_COMPLETION_LOGPROBS)
        gens = []
        for i, p in enumerate(prompts):
            for j in range(n):
                gens.append(self._generation(
                    f"prompt{'' if len(prompts) == 1 else f'[{i}]'}",
                    lambda req, p=p: Generation(self.model, p, req, text=True),
                    max_tokens, sampling, j, logprobs is not None, logprobs or 0))
        return gens, logprobs is not None

    def chat_generations(self, f: Fields):
        messages = f.obj.get("messages")
        try:
            messages = check_messages(_flatten_content(messages))
        except ValueError as e:
            raise _bad("messages", str(e)) from None
        sampling, n = _sampling(f)
        max_tokens = f.integer("max_completion_tokens", 0, 2**31 - 1)
        if max_tokens is None:
            max_tokens = f.integer("max_tokens", 0, 2**31 - 1)
        logprobs = f.boolean("logprobs")
        top = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
        if top and not logprobs:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        gens = [self._generation("messages", lambda req: chat_generation(self.model, messages, req),
                                 max_tokens, sampling, j, logprobs, top) for j in range(n)]
        return gens, logprobs

    def _generation(self, param, make, max_tokens, sampling, choice, logprobs, top):
        seed = sampling["seed"]
        kw = dict(sampling, seed=None if seed is None else seed + choice,  # distinct choices, reproducibly
                  logprobs=logprobs, top_logprobs=top)
        try:
            # no max_tokens: up to the end of the context (finish_reason "length")
            return make(GenerationRequest(**kw, max_new_tokens=self.model.config.n_positions
                                          if max_tokens is None else max_tokens))
        except (TokenizerError, ChatTemplateError) as e:
            raise _bad(param, str(e)) from None
        except ValueError as e:
            raise _bad(param, str(e)) from None

    def submit(self, gens, sinks):
        try:
            return self.engine.submit(gens, sinks)
        except EngineBusy as e:
            raise APIError(503, str(e), kind="server_busy", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosed as e:
            raise APIError(503, str(e), kind="server_shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    # -- answers --

    def token_text(self, token):
        return self.model.tokenizer.decode([token])

    def completion_logprobs(self, entries, offset0=0):
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset0
        for e in entries:
            text = self.token_text(e.token)
            tokens.append(text)
            lps.append(e.logprob)
            tops.append({self.token_text(t): lp for t, lp in e.top} if e.top else None)
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": lps,
                "top_logprobs": tops if any(t is not None for t in tops) else None, "text_offset": offsets}

    def chat_logprobs(self, entries):
        def item(t, lp):
            text = self.token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
                            for e in entries], "refusal": None}

    def metrics(self):
        st = self.engine.stats()
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP cyformer_{name} {help_}")
            lines.append(f"# TYPE cyformer_{name} {kind}")
            for labels, v in samples:
                lines.append(f"cyformer_{name}{labels} {v}")

        with self.lock:
            reqs = sorted(self.requests.items())
        metric("http_requests_total", "counter", "HTTP requests by endpoint and status.",
               [(f'{{endpoint="{e}",status="{s}"}}', c) for (e, s), c in reqs])
        metric("requests_total", "counter", "Generations finished, by outcome.",
               [(f'{{outcome="{k}"}}', st[k]) for k in ("finished", "cancelled", "failed")])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted generations.", [("", st["prompt_tokens"])])
        metric("prefilled_tokens_total", "counter", "Prompt tokens run through the model (not from the prefix cache).",
               [("", st["prefilled_tokens"])])
        metric("generated_tokens_total", "counter", "Tokens generated.", [("", st["generated_tokens"])])
        metric("steps_total", "counter", "Scheduler steps.", [("", st["steps"])])
        metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", st["queue_depth"])])
        metric("active_sequences", "gauge", "Sequences in the running batch.", [("", st["active"])])
        metric("max_batch", "gauge", "Slots in the batch.", [("", st["max_batch"])])
        pc = st["prefix_cache"] or {"hits": 0, "misses": 0, "hit_tokens": 0, "bytes": 0, "max_bytes": 0}
        metric("prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.", [("", pc["hits"])])
        metric("prefix_cache_misses_total", "counter", "Requests that found no cached prefix.", [("", pc["misses"])])
        metric("prefix_cache_hit_tokens_total", "counter", "Prompt positions taken from the prefix cache.",
               [("", pc["hit_tokens"])])
        metric("prefix_cache_bytes", "gauge", "Memory held by the prefix cache.", [("", pc["bytes"])])
        metric("prefix_cache_max_bytes", "gauge", "The prefix cache's memory bound.", [("", pc["max_bytes"])])
        return "\n".join(lines) + "\n"


def _prompts(prompt, vocab_size):
    """The completion prompts: a str, a list of str, a list of ids or a list of id lists."""
    def ids_ok(p):
        return (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p))

    if isinstance(prompt, str):
        out = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        out = list(prompt)
    elif ids_ok(prompt):
        out = [prompt]
    elif isinstance(prompt, list) and prompt and all(ids_ok(p) for p in prompt):
        out = list(prompt)
    elif prompt is None:
        raise _bad("prompt", "'prompt' is required")
    else:
        raise _bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids "
                             "or a list of lists of token ids (none empty)")
    if len(out) > MAX_N:
        raise _bad("prompt", f"at most {MAX_N} prompts per request, got {len(out)}")
    for p in out:
        if isinstance(p, str) and not p:
            raise _bad("prompt", "'prompt' must not be empty")
        if isinstance(p, list) and not all(0 <= t < vocab_size for t in p):
            raise _bad("prompt", f"token ids must be in [0, {vocab_size})")
    return out


def _flatten_content(messages):
    """OpenAI's content parts [{"type": "text", "text": ...}] -> one str; other shapes are left
    for check_messages to refuse."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = m["content"]
            if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in parts):
                m = dict(m, content="".join(p["text"] for p in parts))
        out.append(m)
    return out


def _id(prefix):
    return f"{prefix}-{secrets.token_hex(12)}"


# -- the app ---------------------------------------------------------------------

def create_app(model, engine=None, *, model_name=None, api_key=None, grace=30.0, **engine_args):
    """The FastAPI app serving ``model`` through ``engine`` (a new Engine
    with engine_args when None; on shutdown the app gives the engine it made
    ``grace`` s to finish, then cancels what is left)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException
    except ImportError:
        raise CyformerError("cyformer serve needs FastAPI and uvicorn: pip install 'cyformer[serve]'") from None
    if not model.tokenizer.available:
        raise CyformerError(f"{model.path}: serving needs the checkpoint's tokenizer.json")
    import contextlib

    owns = engine is None
    engine = engine if engine is not None else Engine(model, **engine_args)
    name = model_name or os.path.basename(os.path.normpath(model.path or "model"))
    state = Server(model, engine, name, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.stopping = True
        if owns:  # finish what is running, then cancel what is left
            await asyncio.to_thread(_drain, engine, grace)

    app = FastAPI(title="cyformer", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.cyformer = state

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request, e):
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        msg = (f"unknown route {request.method} {request.url.path}" if e.status_code == 404 else
               f"{request.method} is not allowed on {request.url.path}" if e.status_code == 405 else str(e.detail))
        return JSONResponse({"error": {"message": msg, "type": kind, "param": None, "code": None}},
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e):
        return JSONResponse({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    app.add_middleware(Gate, state=state, api_key=api_key, reject=error)

    @app.get("/health")
    async def health():
        ok = engine.running and not state.stopping
        return JSONResponse({"status": "ok" if ok else "stopping"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "cyformer"}]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return {"id": name, "object": "model", "created": state.created, "owned_by": "cyformer"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        f = Fields(await _json(request))
        state.check_model(f)
        gens, want_lp = state.completion_generations(f)
        return await _answer(request, f, gens, chat=False, want_lp=want_lp)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        f = Fields(await _json(request))
        state.check_model(f)
        gens, want_lp = state.chat_generations(f)
        return await _answer(request, f, gens, chat=True, want_lp=want_lp)

    async def _answer(request, f, gens, chat, want_lp):
        stream = f.boolean("stream")
        opts = f.get("stream_options", (dict,), "an object", {})
        include_usage = bool(opts.get("include_usage")) if stream else False
        loop = asyncio.get_running_loop()
        events = asyncio.Queue()
        sinks = [(lambda i: lambda ev: loop.call_soon_threadsafe(events.put_nowait, (i, ev)))(i)
                 for i in range(len(gens))]
        streams = state.submit(gens, sinks)
        rid, created = _id("chatcmpl" if chat else "cmpl"), int(time.time())
        obj = ("chat.completion" if chat else "text_completion")
        if stream:
            body = _sse(state, events, streams, rid, created, chat, want_lp, include_usage)
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            remaining = len(streams)
            while remaining:
                try:
                    _, ev = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return PlainTextResponse("", status_code=499)
                    continue
                remaining -= ev is None
        finally:
            for s in streams:
                s.cancel()  # no-op for finished ones; frees the slots of a client that left
        for s in streams:
            if s.error is not None:
                raise s.error
        choices = []
        for i, s in enumerate(streams):
            g = s.generation
            choice = {"index": i, "finish_reason": FINISH.get(g.finish_reason, g.finish_reason), "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": g.text}
                if want_lp:
                    choice["logprobs"] = state.chat_logprobs(g.logprobs)
            else:
                choice["text"] = g.text
                if want_lp:
                    choice["logprobs"] = state.completion_logprobs(g.logprobs)
            choices.append(choice)
        return {"id": rid, "object": obj, "created": created, "model": name, "choices": choices,
                "usage": _usage(streams)}

    return app


class Gate:
    """ASGI middleware: counts requests by endpoint and status, and checks
    the API key on /v1/ routes.  (Plain ASGI, so that streaming responses
    still see the client's disconnect.)"""

    def __init__(self, app, state, api_key, reject):
        self.app, self.state, self.api_key, self.reject = app, state, api_key, reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        if self.api_key is not None and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
                _count(self.state, endpoint, 401)
                response = self.reject(APIError(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                                kind="authentication_error", code="invalid_api_key"))
                return await response(scope, receive, send)
        status = [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            _count(self.state, endpoint, status[0])


def _drain(engine, grace=None):
    if not engine.close(timeout=grace):
        engine.close(cancel=True, timeout=30)


def _count(state, endpoint, status):
    with state.lock:
        state.requests[(endpoint, status)] += 1


async def _json(request):
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


def _usage(streams):
    p = sum(int(s.generation.prompt_ids.size) for s in streams)
    c = sum(len(s.generation.tokens) for s in streams)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _sse(state, events, streams, rid, created, chat, want_lp, include_usage):
    """Server-Sent Events: one chunk per text piece of any choice, the finish
    reasons, the usage when asked for, then [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    name = state.model_name
    held = [[] for _ in streams]   # logprobs of tokens whose text is still held back
    offsets = [0] * len(streams)

    def chunk(i, text=None, finish=None, role=False, lps=None):
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            c = {"index": i, "delta": delta, "logprobs": state.chat_logprobs(lps) if lps else None,
                 "finish_reason": finish}
        else:
            c = {"index": i, "text": text or "", "finish_reason": finish,
                 "logprobs": state.completion_logprobs(lps, offsets[i]) if lps else None}
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": name,
                                      "choices": [c]}) + "\n\n"

    try:
        if chat:
            for i in range(len(streams)):
                yield chunk(i, text="", role=True)
        remaining = len(streams)
        while remaining:
            i, ev = await events.get()
            s = streams[i]
            if ev is None:
                remaining -= 1
                if s.error is not None:
                    err = {"error": {"message": f"generation failed: {s.error}", "type": "server_error",
                                     "param": None, "code": None}}
                    yield "data: " + json.dumps(err) + "\n\n"
                    continue
                g = s.generation
                if held[i]:
                    yield chunk(i, text="", lps=held[i])
                    held[i] = []
                yield chunk(i, finish=FINISH.get(g.finish_reason, g.finish_reason))
                continue
            if want_lp and ev.logprob is not None:
                held[i].append(ev.logprob)
            if ev.text:
                yield chunk(i, text=ev.text, lps=held[i] if want_lp else None)
                offsets[i] += len(ev.text)
                held[i] = []
        if include_usage:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": name,
                                         "choices": [], "usage": _usage(streams)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.cancel()  # the client went away, or we are done: free the slots


# -- running it -------------------------------------------------------------------

def uvicorn_server(app, host="127.0.0.1", port=8000, grace=30.0, log_level="warning"):
    """A uvicorn Server for ``app``; SIGTERM/SIGINT stop admitting connections,
    wait up to ``grace`` s for running requests, then cancel the rest."""
    try:
        import uvicorn
    except ImportError:
        raise CyformerError("cyformer serve needs FastAPI and uvicorn: pip install 'cyformer[serve]'") from None
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace,
                            access_log=False, lifespan="on")
    return uvicorn.Server(config)


class ServerThread:
    """A server on 127.0.0.1 in a background thread, for tests and benchmarks:
    ``with ServerThread(app) as srv: srv.url``.  Leaving the block stops it."""

    def __init__(self, app, host="127.0.0.1", port=0, grace=5.0):
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn_server(app, self.host, self.port, grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="cyformer-server", daemon=True)

    def start(self, timeout=30):
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout=30):
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        return not self.thread.is_alive()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
