"""The HTTP API under hostile requests: every answer is JSON, a client's fault
is a 4xx, and the server keeps serving (issue 30).

One server on 127.0.0.1 (a free port, a background thread, a small queue so
that no request can run long).  A property test (hypothesis, a bounded
number of requests) breaks one field at a time of a valid request to each
generation endpoint, with wrong types, sizes, unicode and nesting, and also
sends bodies that are not JSON objects; then /health must answer and a known
greedy request must give the known text.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cyformer  # noqa: E402
from cyformer.engine import Engine  # noqa: E402
from cyformer.loader import default_model_path  # noqa: E402
from cyformer.serve import ServerThread, create_app  # noqa: E402

NAME = "pycode"
TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
CASES = int(60 * float(os.environ.get("CYFORMER_FUZZ_SCALE", "1")))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / NAME
    shutil.copytree(default_model_path(), path)
    (path / "generation_config.json").unlink(missing_ok=True)  # greedy by default
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}, f)
    return cyformer.load(path)


@pytest.fixture(scope="module")
def server(model):
    engine = Engine(model, max_batch=4, max_queue=8)
    app = create_app(model, engine, model_name=NAME, max_body_bytes=256 * 1024)
    with ServerThread(app) as srv:
        yield srv
    assert engine.close(cancel=True, timeout=30)


def strict_json(text):
    """JSON as the standard has it: NaN and Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def post(server, path, content, **headers):
    if isinstance(content, (dict, list)):
        content = json.dumps(content)
    return httpx.post(server.url + path, content=content,
                      headers={"Content-Type": "application/json", **headers}, timeout=60)


def error_of(r):
    body = strict_json(r.text)
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


# -- the classes of issue 30, one by one ------------------------------------------------

def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    big = json.dumps({"model": NAME, "prompt": "x" * 300_000})
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and "larger than" in error_of(r)["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 10_000
    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_request_that_can_never_be_admitted_is_a_400(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["param"] == "n"
    assert "never be admitted" in error_of(r)["message"]


def test_logprobs_stay_finite_at_a_subnormal_temperature(server):
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 4, "temperature": 5e-324, "logprobs": 3}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    lp = strict_json(r.text)["choices"][0]["logprobs"]
    values = lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in top.values()]
    assert all(math.isfinite(v) and v <= 0 for v in values)
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert lines and all(strict_json(ln) for ln in lines)
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 3, "temperature": 5e-324, "logprobs": True,
                                              "top_logprobs": 2})
    assert r.status_code == 200 and strict_json(r.text)["choices"][0]["logprobs"]["content"]


def test_processed_logprobs_at_a_subnormal_temperature_are_a_point_mass_not_nan():
    """Root: log_softmax of scores that overflowed to inf gave NaN; the
    sampler samples a point mass there, and its logprobs now say so (0 and
    -inf), which JSON answers floor at OpenAI's -9999.0."""
    import numpy as np

    from cyformer.sampling import Sampler, SamplingParams
    from cyformer.serve.app import dumps

    logits = np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)
    lp = Sampler(SamplingParams(temperature=5e-324)).logprobs(logits, [])
    assert not np.isnan(lp).any() and lp[1] == 0.0 and np.isneginf(lp[[0, 2, 3]]).all()
    assert strict_json(dumps({"v": list(lp), "nan": float("nan")})) == {"v": [-9999.0, 0.0, -9999.0, -9999.0],
                                                                        "nan": None}


def test_tool_choice_without_tools_is_refused(server):
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                              "tool_choice": "auto"})
    assert r.status_code == 400 and error_of(r)["param"] == "tool_choice"


def test_a_bad_stop_is_reported_against_stop(server):
    r = post(server, "/v1/completions", '{"model": "pycode", "prompt": "x", "stop": "\\ud800"}')
    assert r.status_code == 400 and error_of(r)["param"] == "stop"


def test_a_lone_surrogate_model_name_is_a_json_404(server):
    r = post(server, "/v1/completions", '{"model": "\\udcff", "prompt": "x"}')
    assert r.status_code == 404 and error_of(r)["param"] == "model"


def test_errors_do_not_show_the_servers_file_system(model, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(default_model_path(), plain)  # no chat template
    m = cyformer.load(plain)
    with ServerThread(create_app(m, model_name="plain", max_queue=4)) as srv:
        r = post(srv, "/v1/chat/completions", {"model": "plain", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "no chat template" in error_of(r)["message"]
    assert str(plain) not in r.text and str(tmp_path) not in r.text


def _serve(*args):
    """``cyformer serve`` (the bundled model) in a subprocess on a free 127.0.0.1 port,
    once /health answers: (process, base url).  The caller stops it."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-m", "cyformer", "serve", "--port", str(port), *args],
                            stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def test_ctrl_c_stops_the_server_cleanly():
    """Issue 29 item 6: SIGINT drains as SIGTERM does, says "stopped" and exits 0."""
    proc, _ = _serve("--grace", "5")
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "[cyformer] stopped" in err and "Traceback" not in err


def test_waiting_for_events_keeps_a_cancellation():
    """A request waits for its streams' events with serve.app.Waiting: a
    cancellation that lands in the same turn of the loop as an event must
    still cancel (asyncio.wait_for lost all 200 of these before Python
    3.12), and a timeout gives None with the get kept for the next call."""
    import asyncio

    from cyformer.serve.app import Waiting

    async def consume(queue):
        waiting = Waiting(queue)
        try:
            while await waiting.next(0.5) != "last":
                pass
            return "ran on"
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            waiting.close()

    async def trials():
        outcomes = []
        for _ in range(200):
            queue = asyncio.Queue()
            task = asyncio.ensure_future(consume(queue))
            await asyncio.sleep(0)
            for i in range(20):
                queue.put_nowait(i)
                if i == 5:
                    task.cancel()  # in the turn its event arrives
                await asyncio.sleep(0)
            queue.put_nowait("last")
            outcomes.append(await task)
        return outcomes

    async def timeout():
        queue = asyncio.Queue()
        waiting = Waiting(queue)
        assert await waiting.next(0.01) is None and waiting.getter is not None
        queue.put_nowait("x")
        assert await waiting.next(1) == "x" and waiting.getter is None

    assert asyncio.run(trials()) == ["cancelled"] * 200
    asyncio.run(timeout())


def test_requests_cut_by_the_shutdown_get_json():
    """Issue 30: a request still running when SIGTERM's grace ends gets an
    OpenAI-style JSON 503 (uvicorn's own answer would be a plain-text 500),
    and the server still exits 0."""
    import threading
    import time

    proc, url = _serve("--grace", "0.5", "--threads", "1")
    try:
        # 32 prompts x 400 tokens: far longer than the half-second grace
        body = {"model": NAME, "prompt": ["def f(x):"] * 32, "max_tokens": 400, "ignore_eos": True,
                "temperature": 0}
        answer = {}

        def post():
            answer["r"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        t = threading.Thread(target=post)
        t.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/metrics", timeout=5).text.find("cyformer_active_sequences 0.0") >= 0 \
                and time.monotonic() < deadline:
            time.sleep(0.05)  # until the generation is running
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    r = answer["r"]
    assert r.status_code == 503, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "server_shutting_down" and r.headers["retry-after"] == "1"
    assert proc.returncode == 0, err[-2000:]


# -- the property test ----------------------------------------------------------------

VALID = {
    "/v1/completions": {"model": NAME, "prompt": "def f(x):", "max_tokens": 3, "temperature": 0},
    "/v1/chat/completions": {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                             "temperature": 0},
}
FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream",
                        "stream_options", "logprobs", "echo", "best_of", "suffix", "logit_bias", "top_k",
                        "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                        "stop_token_ids", "ignore_eos", "user", "skip_special_tokens", "no_such_field"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "temperature",
                             "top_p", "n", "seed", "stop", "stream", "stream_options", "logprobs",
                             "top_logprobs", "logit_bias", "tools", "tool_choice", "response_format",
                             "chat_template_kwargs", "top_k", "min_p", "repetition_penalty", "min_tokens",
                             "stop_token_ids", "user", "no_such_field"],
}

HOSTILE_TEXT = st.sampled_from(["", "\ud800", "a\udcffb", "\x00", "🙂" * 50, "x" * 20_000, "<|endoftext|>",
                                "{% for i in range(10**9) %}", "\u202e\u2066", "1e999", "NaN"])
SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 10**40]),
                    st.sampled_from([0.5, -0.0, 1e-308, 5e-324, 1e308, -1e308, 3.0, 100.0]), HOSTILE_TEXT,
                    st.integers(-10, 10))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(HOSTILE_TEXT | st.text(max_size=5), inner,
                                                                       max_size=4)), max_leaves=12)
RAW = ["NaN", "Infinity", "-Infinity", "[]", "null", "1", '"x"', "{", '{"model": }', "\xff\xfe", "",
       '{"model": "pycode", "prompt": NaN}', '{"model": "pycode", "prompt": "x", "temperature": Infinity}',
       '{"model": "pycode", "prompt": [1e999]}', '{"a": ' * 2000 + "1" + "}" * 2000]


@pytest.mark.parametrize("path", list(VALID))
def test_hostile_requests_get_json_4xx_and_the_server_keeps_serving(server, path):
    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        if data.draw(st.integers(0, 9), label="raw body") == 0:
            content = data.draw(st.sampled_from(RAW), label="body")
        else:
            body = dict(VALID[path])
            for _ in range(data.draw(st.integers(1, 3), label="fields broken")):
                field = data.draw(st.sampled_from(FIELDS[path]), label="field")
                if data.draw(st.booleans(), label="drop it") and field in body:
                    del body[field]
                else:
                    body[field] = data.draw(VALUES, label=field)
            content = json.dumps(body)  # lone surrogates travel as \\udXXX escapes
        r = post(server, path, content)
        answer = strict_json(r.text) if "event-stream" not in r.headers.get("content-type", "") else None
        if r.status_code == 200:
            return  # a mutation that happened to be valid
        assert 400 <= r.status_code < 500, (r.status_code, content[:300], r.text[:500])
        assert set(answer["error"]) >= {"message", "type", "param", "code"}

    one()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "def fib(n):", "max_tokens": 8,
                                         "temperature": 0})
    ref = cyformer.load(server_model_dir(server)).generate("def fib(n):", max_new_tokens=8, temperature=0)
    assert r.status_code == 200 and strict_json(r.text)["choices"][0]["text"] == ref


def server_model_dir(server):
    return server.server.config.app.state.cyformer.model.path
