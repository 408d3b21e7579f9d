"""`cyformer serve`: an OpenAI-compatible HTTP server over the engine.

    GET  /v1/models              the one model served
    POST /v1/completions         text completion (prompt: str, [str], [int] or [[int]]; echo, logprobs)
    POST /v1/chat/completions    the model's chat template, then completion
    POST /tokenize               text or chat messages -> token ids (vLLM's route)
    POST /detokenize             token ids -> text (vLLM's route)
    GET  /tokenizer_info         the special tokens and chat template (vLLM's route)
    GET  /health                 200 while taking requests, 503 while shutting down
    GET  /metrics                Prometheus: requests, tokens, queue, batch, prefix cache

Modules: ``protocol`` (the requests and answers as pydantic models),
``serving`` (the logic: requests -> generations -> answers), ``app`` (the
FastAPI routes, error handlers, metrics and Server-Sent Events).  Streaming
answers are Server-Sent Events (``data: {chunk}`` ... ``data: [DONE]``).

Errors are OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``:
400 for malformed JSON, wrong types, unknown fields, values out of range or
a prompt that does not fit the context (``param`` names the field); 401
without the API key (when one is set); 404 for an unknown model or route;
503 (with Retry-After) when the queue is full or the server is stopping.
Bad input never gives a 500.

Needs the serve extra: pip install 'cyformer[serve]' (FastAPI, uvicorn, prometheus_client).
"""

import threading
import time

from ..errors import CyformerError

API_KEY_ENV = "CYFORMER_API_KEY"
NEEDS = "cyformer serve needs FastAPI, uvicorn and prometheus_client: pip install 'cyformer[serve]'"


def create_app(model, engine=None, **options):
    """The FastAPI app (cyformer.serve.app.create_app has the options)."""
    try:
        from .app import create_app as make
    except ImportError:
        raise CyformerError(NEEDS) from None
    return make(model, engine, **options)


# -- running it -------------------------------------------------------------------

def uvicorn_server(app, host="127.0.0.1", port=8000, grace=30.0, log_level="warning"):
    """A uvicorn Server for ``app``; SIGTERM/SIGINT stop admitting connections,
    wait up to ``grace`` s for running requests, then cancel the rest."""
    try:
        import uvicorn
    except ImportError:
        raise CyformerError(NEEDS) from None
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
