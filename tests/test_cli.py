"""The cyformer command line, run as a user would run it."""

import os
import subprocess
import sys

import pytest


def run(*args, env=None):
    exe = os.path.join(os.path.dirname(sys.executable), "cyformer")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "cyformer"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("sub", [[], ["generate"], ["info"]])
def test_help(sub):
    r = run(*sub, "--help")
    assert r.returncode == 0
    assert "usage: cyformer" in r.stdout
    if sub == ["generate"]:
        for opt in ("--model", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                    "--threads", "--verbose"):
            assert opt in r.stdout


def test_generate_streams_prompt_then_text(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    r = run("generate", "def fib(n):", "--model", path, "-n", "12", "--seed", "1", "-t", "0.8", "--verbose")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def fib(n):") and len(r.stdout) > len("def fib(n):\n")
    assert "tokens/s" in r.stderr and "[cyformer]" not in r.stdout
    again = run("generate", "def fib(n):", "--model", path, "-n", "12", "--seed", "1", "-t", "0.8")
    assert again.stdout == r.stdout and again.stderr == ""


@pytest.mark.parametrize("args,code,needle", [
    (["generate", "x", "--model", "/no/such/dir"], 1, "not found"),
    (["generate", "x", "--top-p", "2"], 1, "top_p"),
    (["generate", "x", "--max-new-tokens", "lots"], 2, "integer"),
    (["generate", "x", "--threads", "0"], 2, ">= 1"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_errors_are_one_line_without_traceback(args, code, needle, tokenized_checkpoint):
    if "--model" not in args and args[0] == "generate":
        args = args + ["--model", tokenized_checkpoint[0]]
    r = run(*args)
    assert r.returncode == code
    assert "Traceback" not in r.stderr and needle in r.stderr
    assert r.stdout == ""


def test_bad_token_error(checkpoint):
    path, _ = checkpoint("odd")  # no tokenizer.json: text prompts cannot be encoded
    r = run("generate", "hello", "--model", path)
    assert r.returncode == 1 and "tokenizer.json" in r.stderr and "Traceback" not in r.stderr


def test_info(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    r = run("info", "--model", path)
    assert r.returncode == 0, r.stderr
    assert "parameters" in r.stdout and "OpenMP on" in r.stdout and "2 layers" in r.stdout
    r = run("info", "--model", path, "--json")
    import json
    info = json.loads(r.stdout)
    assert info["config"]["n_layer"] == 2 and info["file_bytes"] > 0 and info["build"]["openmp"]


def test_default_model_ships_in_the_package():
    """The bundled model loads with no path and generates, as a new user's first command."""
    import cyformer

    m = cyformer.load()
    assert m.tokenizer.available and m.config.n_layer == 4
    assert os.path.getsize(os.path.join(m.path, "model.safetensors")) < 20e6
    r = run("generate", "def fib(n):", "-n", "24")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def fib(n):") and len(r.stdout.strip()) > len("def fib(n):")
