"""What a new user meets first: the version, the bundled model's defaults,
prompts longer than the context, and errors that point the right way."""

import importlib.metadata
import os
import subprocess
import sys

import numpy as np
import pytest

import cyformer


@pytest.fixture(scope="module")
def model():
    return cyformer.load(threads=1)


def run(*args, env=None):
    exe = os.path.join(os.path.dirname(sys.executable), "cyformer")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "cyformer"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"cyformer {cyformer.__version__}"


def test_installed_metadata_has_the_licence():
    try:
        meta = importlib.metadata.metadata("cyformer")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("cyformer is not installed as a distribution (a source-tree run)")
    assert meta["License-Expression"] == "MIT" or meta["License"] == "MIT"
    assert "cyformer developers" in (meta["Author"] or "") + (meta["Author-email"] or "")
    files = [str(f) for f in importlib.metadata.files("cyformer") or ()]
    assert any(f.endswith("LICENSE") for f in files), files


def test_bundled_model_samples_by_default(model):
    g = model.generation_config
    assert g.do_sample and g.temperature == 0.8 and g.top_k == 40 and g.repetition_penalty == 1.2
    default = model.generate("def fib(n):", max_new_tokens=12, seed=5)
    explicit = model.generate("def fib(n):", max_new_tokens=12, seed=5, temperature=0.8, top_k=40,
                              repetition_penalty=1.2)
    assert default == explicit
    greedy = model.generate("def fib(n):", max_new_tokens=12, temperature=0)
    assert greedy == model.generate("def fib(n):", max_new_tokens=12, temperature=0, seed=9)


def test_truncate_keeps_the_end(model):
    n = model.config.n_positions
    ids = model.encode("x = 1\n" * 600)
    assert len(ids) > n
    with pytest.raises(ValueError, match="truncate=True"):
        model.generate(ids, max_new_tokens=4)
    out = model.generate(ids, max_new_tokens=4, temperature=0, truncate=True)
    keep = n - 4
    assert out.stats["prompt_tokens"] == keep and out.stats["truncated_tokens"] == len(ids) - keep
    assert out == model.generate(ids[-keep:], max_new_tokens=4, temperature=0)
    # a prompt that fits with room to spare is left alone
    short = model.generate(ids[:10], max_new_tokens=4, temperature=0, truncate=True)
    assert short.stats["truncated_tokens"] == 0 and short.stats["prompt_tokens"] == 10


def test_cli_truncate(model):
    prompt = "x = 1\n" * 600
    r = run("generate", prompt, "-n", "3", "-t", "0")
    assert r.returncode == 1 and "--truncate" in r.stderr
    r = run("generate", prompt, "-n", "3", "-t", "0", "--truncate", "--no-prompt")
    assert r.returncode == 0, r.stderr
    assert r.stdout == model.generate(prompt, max_new_tokens=3, temperature=0, truncate=True) + "\n"


def test_forward_with_text_says_encode(model):
    with pytest.raises(ValueError, match=r"forward takes token ids: use model\.encode\(text\)"):
        model.forward("x = 1")
    # run_with_cache takes text, encoded as generate() encodes a prompt
    logits, _ = model.run_with_cache("x = 1", names=["hook_embed"])
    assert logits.shape[-2] == len(model.tokenizer.encode("x = 1", add_special_tokens=True))


def test_part_indices_name_the_range(model):
    with pytest.raises(IndexError, match=r"layer 1: head index 7 out of range: there are 4 \(0\.\.3\)"):
        model.blocks[1].attn.heads[7]
    with pytest.raises(IndexError, match=r"block index 4 out of range: there are 4"):
        model.blocks[4]
    assert model.blocks[-1].index == 3 and model.blocks[0].attn.heads[-1].index == 3


def test_unknown_hook_names_suggest_the_nearest(model):
    ids = model.encode("x = 1")
    _, cache = model.run_with_cache(ids)
    with pytest.raises(KeyError, match=r"layers 0\.\.3 .*'blocks\.3\.hook_resid_post'"):
        cache["blocks.7.hook_resid_post"]
    with pytest.raises(KeyError, match=r"did you mean 'blocks\.0\.hook_resid_post'"):
        cache["blocks.0.hook_resid_psot"]
    _, some = model.run_with_cache(ids, names=["blocks.0.attn.hook_z"])
    with pytest.raises(KeyError, match="ask run_with_cache for it"):  # valid, just not kept
        some["blocks.0.hook_resid_post"]
    with pytest.raises(ValueError, match=r"did you mean 'blocks\.1\.attn\.hook_z'"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_zz", lambda z, name: z)])
    with pytest.raises(ValueError, match=r"layers 0\.\.3"):
        model.run_with_cache(ids, names=["blocks.9.attn.hook_pattern"])


def test_inspect_without_matplotlib_still_writes_html(tmp_path):
    # a matplotlib that cannot be imported, ahead of the real one on the path
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "matplotlib.py").write_text("raise ImportError('no matplotlib here')\n")
    path = os.pathsep.join([str(fake)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    png, page = tmp_path / "a.png", tmp_path / "a.html"
    r = run("inspect", "def f(x):", "--layer", "0", "--png", str(png), "--html", str(page),
            env={"PYTHONPATH": path})
    assert r.returncode == 1
    assert "pip install 'cyformer[plot]'" in r.stderr
    assert r.stderr.index("not writing") < r.stderr.index("wrote")  # said before the work
    assert r.stderr.count("not writing") == 1 and "warning" not in r.stderr  # and said once
    assert page.exists() and page.stat().st_size > 0 and not png.exists()
    assert "next token:" in r.stdout


def test_cli_and_python_share_the_default_length():
    from cyformer.cli import build_parser

    from cyformer.request import CHAT_MAX_NEW_TOKENS, GenerationRequest

    assert build_parser().parse_args(["generate", "x"]).max_new_tokens == GenerationRequest().max_new_tokens
    assert build_parser().parse_args(["chat"]).max_new_tokens == CHAT_MAX_NEW_TOKENS


def test_import_inside_an_unbuilt_checkout_says_what_to_do(tmp_path):
    """Python finds a source checkout's cyformer/ (the current directory
    comes first) before the installed package; without built kernels there
    it says so, instead of a circular-import error."""
    import shutil

    import cyformer

    src = os.path.dirname(cyformer.__file__)
    shutil.copytree(src, tmp_path / "cyformer",
                    ignore=shutil.ignore_patterns("*.so", "_kernels_*", "data", "__pycache__"))
    r = subprocess.run([sys.executable, "-c", "import cyformer"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 1
    assert "source checkout" in r.stderr and "pip install -e ." in r.stderr
    assert "circular import" not in r.stderr


def test_the_bundled_model_has_a_name_and_bare_names_get_the_hub_spelling(tmp_path, monkeypatch):
    from cyformer.errors import ModelLoadError

    monkeypatch.chdir(tmp_path)
    assert cyformer.load("pycode", threads=1).path == cyformer.load(threads=1).path
    with pytest.raises(ModelLoadError, match="openai-community/gpt2"):
        cyformer.load("gpt2")
    r = run("quantize", "pycode", str(tmp_path / "q8"), "--dtype", "int8",
            env={"PYTHONPATH": os.path.dirname(os.path.dirname(cyformer.__file__))})
    assert r.returncode == 0, r.stderr
    assert cyformer.load(tmp_path / "q8").dtype == "int8"
