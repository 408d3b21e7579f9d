"""lm-evaluation-harness against `cyformer serve`, unchanged, as people run it.

`--model local-completions` (its OpenAI-completions client, token-id
requests through the server's /tokenize, batches of 20 prompts) on a small
multiple-choice task that the test writes gives the same per-item
log-likelihoods (within 1e-4) and accuracy as `--model hf` (transformers) on
the same checkpoint; a generate_until task with 5 stop strings gives
cyformer's own generate() on each prompt.  One server on 127.0.0.1, stopped
at the end; a few dozen requests.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

import cyformer  # noqa: E402
from cyformer.loader import default_model_path  # noqa: E402

NAME = "pycode"
STOPS = ["\n\n", "\ndef ", "\nclass ", "\nif ", "\nprint("]  # HumanEval's five

# Which statement comes next?  Each line: a context and four continuations, the first right.
ITEMS = [
    ("import os\nimport", [" sys", " banana", " 42", " )("]),
    ("def add(a, b):\n    return", [" a + b", " elephant", " ]]", " 3 3 3"]),
    ("for i in range(10):\n   ", [" print(i)", " zebra", " ((((", " else else"]),
    ("class Point:\n    def __init__(self, x, y):\n        self.x =", [" x", " 17 17", " def", " ]]"]),
    ("x = [1, 2, 3]\nprint(len(", ["x))", "class", " while", " ]]]]"]),
    ("if __name__ ==", [" \"__main__\":", " 5 5 5", " import", " ]"]),
    ("with open(path) as f:\n    data =", [" f.read()", " lambda lambda", " }}}", " 0x"]),
    ("try:\n    run()\nexcept", [" Exception:", " banana:", " 77", " ))"]),
]
PROMPTS = ["def fib(n):\n", "class Stack:\n", "import json\n\n", "def parse(text):\n    \"\"\"", "x = 1\nif x"]


def _task_files(root):
    data = root / "mc.jsonl"
    with open(data, "w") as f:
        for ctx, choices in ITEMS:
            f.write(json.dumps({"ctx": ctx, "choices": choices, "label": 0}) + "\n")
    (root / "cyf_mc.yaml").write_text(
        "task: cyf_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{ctx}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "target_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    gen = root / "gen.jsonl"
    with open(gen, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
    until = ", ".join(json.dumps(s) for s in STOPS)
    (root / "cyf_gen.yaml").write_text(
        "task: cyf_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "test_split: test\noutput_type: generate_until\n"
        "doc_to_text: \"{{prompt}}\"\ndoc_to_target: \"\"\n"
        f"generation_kwargs:\n  until: [{until}]\n  max_gen_toks: 24\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The bundled model with a tokenizer_config.json for transformers, greedy by default."""
    path = tmp_path_factory.mktemp("lmeval") / NAME
    shutil.copytree(default_model_path(), path)
    (path / "generation_config.json").unlink(missing_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "bos_token": "<|endoftext|>", "model_max_length": 512}))
    return str(path)


@pytest.fixture(scope="module")
def server(checkpoint):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "cyformer", "serve", "--model", checkpoint, "--port", str(port),
                             "--threads", "1", "--grace", "5"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the server did not come up: " + (proc.stderr.read() if proc.poll() is not None else ""))
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _evaluate(model, model_args, tasks, root):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                           task_manager=TaskManager(include_path=str(root), include_defaults=False), log_samples=True,
                           bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0)


def _lls(result, task):
    """doc index -> [log-likelihood of each choice]."""
    out = {}
    for s in result["samples"][task]:
        out[s["doc_id"]] = [float(r[0][0]) for r in s["resps"]]
    return out


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    _task_files(root)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return root


def test_local_completions_equals_hf(server, checkpoint, tasks):
    args = {"model": NAME, "base_url": server + "/v1/completions", "tokenizer_backend": "remote",
            "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1, "batch_size": 20,
            "max_length": 512}
    ours = _evaluate("local-completions", args, ["cyf_mc"], tasks)
    ref = _evaluate("hf", {"pretrained": checkpoint, "dtype": "float32", "device": "cpu"}, ["cyf_mc"], tasks)
    a, b = _lls(ours, "cyf_mc"), _lls(ref, "cyf_mc")
    assert sorted(a) == sorted(b) == list(range(len(ITEMS)))
    for doc in a:
        assert a[doc] == pytest.approx(b[doc], abs=1e-4), doc
    assert ours["results"]["cyf_mc"]["acc,none"] == ref["results"]["cyf_mc"]["acc,none"]
    assert 0 < ours["results"]["cyf_mc"]["acc,none"]  # the trained model gets some right


def test_generate_until_with_five_stop_strings(server, checkpoint, tasks):
    args = {"model": NAME, "base_url": server + "/v1/completions", "tokenizer_backend": "remote",
            "tokenized_requests": False, "num_concurrent": 1, "max_retries": 1, "max_gen_toks": 24}
    out = _evaluate("local-completions", args, ["cyf_gen"], tasks)
    model = cyformer.load(checkpoint)
    got = {s["doc_id"]: s["resps"][0][0] for s in out["samples"]["cyf_gen"]}
    reasons = set()
    for i, p in enumerate(PROMPTS):
        want = model.generate(p, max_new_tokens=24, temperature=0, stop=STOPS)
        assert got[i] == want
        reasons.add(want.finish_reason)
    assert reasons == {"stop", "length"}  # the stop strings did cut some
