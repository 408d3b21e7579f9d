"""`cyformer serve` through the official openai client and raw HTTP.

One server on 127.0.0.1 (a free port, a background thread) serves the
bundled model, given a small chat template; it is stopped at the end of the
module.  Every answer is compared with Model.generate on the same prompt.
"""

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import cyformer  # noqa: E402
from cyformer.engine import Engine  # noqa: E402
from cyformer.loader import default_model_path  # noqa: E402
from cyformer.serve import ServerThread, create_app  # noqa: E402

NAME = "pycode"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served") / NAME
    shutil.copytree(default_model_path(), path)
    # greedy by default: these tests compare responses with sequential runs
    (path / "generation_config.json").unlink(missing_ok=True)
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}, f)
    return str(path)


@pytest.fixture(scope="module")
def model(model_dir):
    return cyformer.load(model_dir)


@pytest.fixture(scope="module")
def server(model):
    engine = Engine(model, max_batch=8, max_queue=64)
    with ServerThread(create_app(model, engine, model_name=NAME)) as srv:
        srv.engine = engine
        yield srv
    assert engine.close(cancel=True, timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path, body, **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


# -- the openai client --

def test_models(client):
    assert [m.id for m in client.models.list()] == [NAME]


def test_completion_equals_generate(client, model):
    r = client.completions.create(model=NAME, prompt="def fib(n):", max_tokens=12, temperature=0)
    ref = model.generate("def fib(n):", max_new_tokens=12, temperature=0)
    assert r.choices[0].text == ref and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(model.encode("def fib(n):")) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_and_stop(client, model):
    ref = model.generate("import os\n", max_new_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt="import os\n", max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == "length"
    stop = ref[4:7]
    r = client.completions.create(model=NAME, prompt="import os\n", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == model.generate("import os\n", max_new_tokens=16, stop=[stop])
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_n_and_batch_prompts(client, model):
    r = client.completions.create(model=NAME, prompt=["x = 1\n", "def f("], max_tokens=8, temperature=0.9,
                                  seed=7, n=2)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    expected = [model.generate(p, max_new_tokens=8, temperature=0.9, seed=7 + j)
                for p in ("x = 1\n", "def f(") for j in range(2)]
    assert texts == expected


def test_completion_logprobs(client, model):
    r = client.completions.create(model=NAME, prompt="def fib(n):", max_tokens=6, temperature=0, logprobs=3)
    ref = model.generate("def fib(n):", max_new_tokens=6, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-9)
    assert [len(t) for t in lp.top_logprobs] == [3] * 6
    assert "".join(lp.tokens) == r.choices[0].text == ref


def test_chat_equals_model_chat(client, model):
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "A loop"}]
    # logprobs: the prompt is not healed (token_healing's default), in both
    ref = model.chat(messages, max_new_tokens=10, temperature=0, logprobs=True)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert len(r.choices[0].logprobs.content) == len(ref.token_ids)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"token_healing": False})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_api_errors_through_the_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", max_tokens=1, temperature=5)


# -- raw HTTP: every kind of malformed request --

@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": 3, "prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": NAME}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "9"}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ["a", 1]}, 400, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ["a" * 1000] * 17}, 400, "stop"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "colour": "red"}, 400, "colour"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": NAME, "prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x" * 2000}]},
     400, "messages"),
])
def test_malformed_requests(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and isinstance(err["message"], str) and err["message"]


def test_unknown_routes_and_methods(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "unknown route" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    assert httpx.get(server.url + "/v1/models/" + NAME).json()["id"] == NAME
    assert httpx.get(server.url + "/v1/models/other").status_code == 404


def test_health_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("cyformer_http_requests_total", "cyformer_generated_tokens_total", "cyformer_queue_depth",
                 "cyformer_active_sequences", "cyformer_prefix_cache_hits_total", "cyformer_kv_cache_bytes",
                 "cyformer_kv_cache_max_bytes", "cyformer_kv_cache_positions", "cyformer_preemptions_total"):
        assert f"# TYPE {name} " in text
    assert 'cyformer_http_requests_total{endpoint="/health",status="200"}' in text


# -- load, disconnects, the queue bound, shutdown --

def test_load_no_request_lost_or_duplicated(server, model):
    prompts = [f"def f{i}(x):\n    return x" + " +" * (i % 5) for i in range(8)]
    expected = {p: model.generate(p, max_new_tokens=8, temperature=0) for p in prompts}
    before = server.engine.stats()["finished"]

    def client_run(c):
        out = []
        for r in range(4):
            p = prompts[(c + r) % len(prompts)]
            tag = f"{c}-{r}"
            res = post(server, "/v1/completions", {"model": NAME, "prompt": p, "max_tokens": 8,
                                                   "temperature": 0, "user": tag})
            assert res.status_code == 200, res.text
            out.append((tag, p, res.json()["choices"][0]["text"], res.json()["id"]))
        return out

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = [x for chunk in pool.map(client_run, range(16)) for x in chunk]
    assert len(results) == 64 and len({r[0] for r in results}) == 64
    assert len({r[3] for r in results}) == 64  # one response per request
    assert all(text == expected[p] for _, p, text, _ in results)
    assert server.engine.stats()["finished"] - before == 64


def test_disconnect_mid_stream_frees_the_slot(server):
    engine = server.engine
    cancelled = engine.stats()["cancelled"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": "def f(x):", "max_tokens": 200, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk arrived: the generation runs; now hang up
    deadline = time.monotonic() + 30
    while engine.stats()["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats()["cancelled"] == cancelled + 1
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.active == 0


def test_full_queue_is_503(model):
    engine = Engine(model, max_batch=1, max_queue=1)
    with ServerThread(create_app(model, engine, model_name=NAME)) as srv:
        long = engine.generate("def f(x):", max_new_tokens=200)
        next(iter(long))  # running in the one slot
        waiting = engine.generate("x", max_new_tokens=1)  # the queue's one place
        r = post(srv, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        long.cancel()
        assert waiting.result(timeout=60) is not None
    engine.close(cancel=True, timeout=30)


def test_api_key(model):
    with ServerThread(create_app(model, model_name=NAME, api_key="s3cret", max_batch=2)) as srv:
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in c.models.list()] == [NAME]
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key


def test_stop_finishes_running_requests(model):
    """Stopping the server lets a running request finish, then closes the engine it made."""
    app = create_app(model, model_name=NAME, grace=10)
    srv = ServerThread(app).start()
    engine = app.state.cyformer.engine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, srv, "/v1/completions",
                          {"model": NAME, "prompt": "def f(x):", "max_tokens": 40, "temperature": 0})
        deadline = time.monotonic() + 30
        while engine.active == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.stop(timeout=60)
        r = fut.result(timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
    assert not engine.running


@pytest.mark.slow
def test_sigterm_exits_zero(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cyformer", "serve", "--model", model_dir, "--port", str(port),
                             "--threads", "1", "--grace", "5"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not come up")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "serving 'pycode' on http://127.0.0.1" in proc.stderr.read()
    assert os.path.isdir(model_dir)


# -- issue 27: what evaluation harnesses and vLLM clients send --

def _bytes_of(tokens):
    """The bytes a logprobs token list stands for (OpenAI's bytes:\\xNN for partial characters)."""
    out = b""
    for s in tokens:
        if s.startswith("bytes:"):
            out += bytes(int(h, 16) for h in s[len("bytes:"):].split("\\x")[1:])
        else:
            out += s.encode("utf-8")
    return out


def test_echo_gives_the_prompts_logprobs(client, model):
    text = "def fib(n):\n    return n"
    r = client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(list(model.score(text)), abs=1e-12)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    # token-id prompts, batched, one new token after each (lm-eval's loglikelihood request)
    a, b = model.encode("import os\nimport sys"), model.encode("x = [1, 2, 3]")
    r = client.completions.create(model=NAME, prompt=[a, b], max_tokens=1, echo=True, logprobs=1, temperature=0)
    for choice, ids in zip(sorted(r.choices, key=lambda c: c.index), (a, b)):
        got = choice.logprobs.token_logprobs
        assert len(got) == len(ids) + 1 and got[0] is None
        assert got[1:len(ids)] == pytest.approx(list(model.score(ids)), abs=1e-12)
        nxt = model.generate(ids, max_new_tokens=1, temperature=0, logprobs=True)
        assert got[-1] == pytest.approx(nxt.logprobs[0].logprob, abs=1e-9)
        assert choice.text == model.decode(ids) + model.decode(list(nxt))


def test_partial_characters_follow_openai(client):
    text = "s = 'Grüße aus Köln, 日本語 🙂'"
    r = client.completions.create(model=NAME, prompt=text, max_tokens=4, echo=True, logprobs=3, temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    assert any(t.startswith("bytes:\\x") for t in lp.tokens)
    assert _bytes_of(lp.tokens).decode("utf-8") == c.text
    assert lp.text_offset == sorted(lp.text_offset) and max(lp.text_offset) <= len(c.text)
    assert lp.text_offset[0] == 0
    for pos, tok in zip(lp.text_offset, lp.tokens):
        if not tok.startswith("bytes:"):
            assert c.text[pos:pos + len(tok)] == tok
    assert all(len(t) == 3 for t in lp.top_logprobs[1:])  # as many entries as asked
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "日本語"}],
                                          max_tokens=12, temperature=0, logprobs=True, top_logprobs=4)
    content = chat.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace").startswith(
        chat.choices[0].message.content[:1] or "")
    assert b"".join(bytes(t.bytes) for t in content) == chat.choices[0].message.content.encode("utf-8") or \
        chat.choices[0].finish_reason == "length"
    assert all(len(t.top_logprobs) == 4 for t in content)


def test_logprobs_are_the_models_whatever_the_sampling(client, model):
    kw = dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"17": 3})
    r = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=6, logprobs=0, seed=1,
                                  extra_body={"repetition_penalty": 1.3, "top_k": 5}, **kw)
    ref = model.generate("def f(x):", max_new_tokens=6, logprobs=True, seed=1, repetition_penalty=1.3, top_k=5,
                         **dict(kw, logit_bias={17: 3}))
    assert r.choices[0].text == ref
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-9)
    ids = model.encode("def f(x):") + list(ref.token_ids)
    raw = model.forward(ids)[len(ids) - len(ref.token_ids) - 1:-1]
    from cyformer.sampling import log_softmax
    assert [t.logprob for t in ref.logprobs] == pytest.approx(
        [log_softmax(row)[t] for row, t in zip(raw, ref.token_ids)], abs=1e-5)


def test_vllm_fields_are_honoured(client, model):
    stops = ["\n\n", "return", "pass", "#", "class", "print"]  # more than OpenAI's 4
    body = dict(max_tokens=24, temperature=0, stop=stops)
    r = client.completions.create(model=NAME, prompt="def f(x):", **body)
    assert r.choices[0].text == model.generate("def f(x):", max_new_tokens=24, temperature=0, stop=stops)
    extra = {"min_p": 0.1, "ignore_eos": True, "min_tokens": 3, "stop_token_ids": [0], "top_k": 20,
             "skip_special_tokens": True}
    r = client.completions.create(model=NAME, prompt="x = ", max_tokens=8, temperature=0.8, seed=3, extra_body=extra)
    ref = model.generate("x = ", max_new_tokens=8, temperature=0.8, seed=3, min_p=0.1, ignore_eos=True, min_tokens=3,
                         stop=[0], top_k=20)
    assert r.choices[0].text == ref
    many = [f"v{i} = " for i in range(20)]  # more prompts than the old limit of 16
    r = client.completions.create(model=NAME, prompt=many, max_tokens=2, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [model.generate(p, max_new_tokens=2, temperature=0) for p in many]


def test_best_of_returns_the_most_likely(client, model):
    r = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=5, temperature=1.0, seed=4, n=1,
                                  best_of=3)
    cands = [model.generate("def f(x):", max_new_tokens=5, temperature=1.0, seed=4 + j, logprobs=True)
             for j in range(3)]
    best = max(cands, key=lambda c: sum(t.logprob for t in c.logprobs) / len(c.logprobs))
    assert [c.text for c in r.choices] == [best]


def test_tokenize_and_detokenize(server, model):
    r = post(server, "/tokenize", {"model": NAME, "prompt": "def f(x):", "return_token_strs": True}).json()
    assert r["tokens"] == model.encode("def f(x):") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == model.config.n_positions and "".join(r["token_strs"]) == "def f(x):"
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "def f(x):"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert model.decode(chat["tokens"]) == "<|user|>\nhi\n<|assistant|>\n"  # special tokens left out
    bad = post(server, "/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == TEMPLATE


def test_streamed_echo_and_logprobs_equal_the_whole_answer(client):
    kw = dict(model=NAME, prompt="s = 'Köln 日本'\n", max_tokens=6, echo=True, logprobs=2, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    lps = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((lp.tokens for lp in lps), []) == whole.logprobs.tokens
    assert sum((lp.token_logprobs for lp in lps), []) == pytest.approx(whole.logprobs.token_logprobs, abs=1e-12)
    assert sum((lp.text_offset for lp in lps), []) == whole.logprobs.text_offset


def test_processed_logprobs_mode(model):
    with ServerThread(create_app(model, model_name=NAME, logprobs_mode="processed", max_batch=2)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model=NAME, prompt="def f(x):", max_tokens=5, temperature=0.5, seed=2, logprobs=1,
                                 frequency_penalty=1.0)
    ref = model.generate("def f(x):", max_new_tokens=5, temperature=0.5, seed=2, logprobs=True,
                         frequency_penalty=1.0, logprobs_mode="processed")
    raw = model.generate("def f(x):", max_new_tokens=5, temperature=0.5, seed=2, logprobs=True,
                         frequency_penalty=1.0)
    assert r.choices[0].text == ref == raw
    got = r.choices[0].logprobs.token_logprobs
    assert got == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-9)
    assert got != pytest.approx([t.logprob for t in raw.logprobs], abs=1e-3)


def test_more_generations_than_the_queue_holds_is_a_400(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": ["x"] * 100, "n": 100, "max_tokens": 1})
    assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"]
