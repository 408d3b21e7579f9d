"""Hostile input against the surfaces added in the last rounds: saving,
corpus jobs, the engine's callers, config.json, saved weights, hooks, chat
templates and the TransformerLens cache.  Each test pins one class of
failure at its root (see each docstring)."""

import json
import os
import pickle
import shutil
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import cyformer
from cyformer.errors import ChatTemplateError, CyformerError, ModelLoadError
from cyformer.loader import default_model_path


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A writable copy of the bundled model's directory."""
    d = tmp_path_factory.mktemp("hard") / "src"
    shutil.copytree(default_model_path(), d, ignore=shutil.ignore_patterns("*.png", "*.md"))
    return str(d)


def _digest(path):
    import hashlib
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# -- saving never writes into the source -------------------------------------------

def test_save_through_a_symlink_to_the_source_is_refused_before_writing(src, tmp_path):
    """Root: the check compared absolute paths; now real paths, before any write."""
    before = {f: _digest(os.path.join(src, f)) for f in os.listdir(src)}
    model = cyformer.load(src, dtype="int8", threads=1)
    alias = tmp_path / "alias"
    os.symlink(src, alias)
    with pytest.raises(CyformerError, match="loaded from"):
        model.save(str(alias))
    # a directory of its own whose weights file is a link into the source
    trap = tmp_path / "trap"
    trap.mkdir()
    os.symlink(os.path.join(src, "model.safetensors"), trap / "model.safetensors.tmp")
    with pytest.raises(CyformerError, match="source model's files"):
        model.save(str(trap))
    os.symlink(os.path.join(src, "config.json"), tmp_path / "config.json")
    with pytest.raises(CyformerError, match="source model's files"):
        model.save(str(tmp_path))
    assert {f: _digest(os.path.join(src, f)) for f in os.listdir(src)} == before


def test_quantize_cli_through_a_symlink_keeps_the_source(src, tmp_path):
    from cyformer.cli import main

    before = _digest(os.path.join(src, "model.safetensors"))
    os.symlink(src, tmp_path / "alias")
    assert main(["quantize", src, str(tmp_path / "alias"), "--dtype", "int8"]) != 0
    assert _digest(os.path.join(src, "model.safetensors")) == before


def test_model_keeps_its_absolute_directory_across_chdir(src, tmp_path, monkeypatch):
    """Root: Model.path kept the relative spelling given to load()."""
    monkeypatch.chdir(os.path.dirname(src))
    model = cyformer.load(os.path.basename(src), threads=1)
    assert model.path == src
    other = tmp_path / "elsewhere"
    shutil.copytree(src, other / os.path.basename(src))
    monkeypatch.chdir(other)
    edited = json.load(open(os.path.join(other, os.path.basename(src), "config.json")))
    edited["n_positions"] = 64  # another model by the same relative name
    json.dump(edited, open(os.path.join(other, os.path.basename(src), "config.json"), "w"))
    again = pickle.loads(pickle.dumps(model))
    assert again.path == src and again.config.n_positions == model.config.n_positions
    model.save(str(tmp_path / "saved"))
    assert json.load(open(tmp_path / "saved" / "config.json"))["n_positions"] == model.config.n_positions


# -- corpus jobs delete only what they wrote, read only their own shards ------------------------

pa = pytest.importorskip("pyarrow")


def _corpus(tmp_path, rows):
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


@pytest.fixture(scope="module")
def model():
    return cyformer.load(threads=1)


def test_job_keeps_the_users_tmp_files_and_directories(model, tmp_path):
    """Root: start() removed every *.tmp entry; now only the job's own names."""
    from cyformer import jobs

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.tmp").write_text("mine")
    (out / "build.tmp").mkdir()
    (out / "build.tmp" / "x").write_text("mine too")
    (out / "scores-00000.parquet.tmp").write_bytes(b"a partial shard of ours")
    corpus = _corpus(tmp_path, [{"text": "def f(x):\n    return x\n"}])
    jobs.score(corpus, out, model, progress=False)
    assert (out / "notes.tmp").read_text() == "mine"
    assert (out / "build.tmp" / "x").read_text() == "mine too"
    assert not (out / "scores-00000.parquet.tmp").exists()
    (out / "scores-notes.txt").write_text("mine")
    jobs.score(corpus, out, model, progress=False, overwrite=True, stride=3)
    assert (out / "scores-notes.txt").read_text() == "mine" and (out / "notes.tmp").exists()


def test_manifest_naming_a_shard_outside_the_directory_is_refused(model, tmp_path):
    """Root: record["file"] was joined to the directory unchecked."""
    from cyformer import jobs

    corpus = _corpus(tmp_path, [{"text": "x = 1\n"}, {"text": "y = 2\n"}])
    out = tmp_path / "out"
    jobs.score(corpus, out, model, progress=False)
    outside = tmp_path / "x.parquet"
    shutil.copy(out / "scores-00000.parquet", outside)
    m = json.load(open(out / "_manifest.json"))
    m["shards"][0]["file"] = "../x.parquet"
    json.dump(m, open(out / "_manifest.json", "w"))
    with pytest.raises(jobs.JobOutputError, match="not a scores shard inside"):
        jobs.score(corpus, out, model, progress=False)
    with pytest.raises(jobs.JobOutputError, match="not a scores shard inside"):
        jobs.open(out)
    assert outside.exists()


@pytest.mark.parametrize("manifest, why", [
    ([1, 2], "not an object"),
    ({"identity": "x", "shards": []}, "identity"),
    ({"identity": {"job": "score", "stem": "scores", "format": "parquet"}, "shards": {}}, "not a list"),
    ({"identity": {"job": "score", "stem": "scores", "format": "parquet"}, "shards": [{"index": 0}]},
     "without an integer index"),
])
def test_malformed_manifest_is_a_clear_error(tmp_path, manifest, why):
    from cyformer import jobs

    (tmp_path / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(jobs.JobOutputError, match=why):
        jobs.open(tmp_path)


def test_empty_corpus_gives_an_empty_table_with_the_jobs_columns(model, tmp_path):
    from cyformer import jobs

    corpus = _corpus(tmp_path, [])
    jobs.score(corpus, tmp_path / "s", model, progress=False, per_token=True)
    t = jobs.open(tmp_path / "s").table()
    assert t.num_rows == 0 and "perplexity" in t.column_names and "token_logprobs" in t.column_names
    assert len(jobs.open(tmp_path / "s")["perplexity"]) == 0
    jobs.generate(corpus, tmp_path / "g", model, progress=False)
    assert jobs.open(tmp_path / "g").table().column_names[:2] == ["row", "id"]


def test_parquet_readers_see_only_shards_and_the_input_id_is_kept(model, tmp_path):
    """Issue 29 item 5: the manifest's name starts with _ and rows keep their id."""
    from cyformer import jobs

    pd = pytest.importorskip("pandas")
    corpus = _corpus(tmp_path, [{"id": "a-1", "text": "x = 1\n"}, {"text": "y = 2\n"},
                                {"id": 17, "text": "z = 3\n"}])
    jobs.score(corpus, tmp_path / "out", model, progress=False, shard_rows=2)
    df = pd.read_parquet(tmp_path / "out")
    assert list(df["row"]) == [0, 1, 2]
    assert df["id"][0] == "a-1" and pd.isna(df["id"][1]) and df["id"][2] == "17"


def test_collect_without_hooks_and_huge_row_seeds_are_clear(model, tmp_path):
    from cyformer import jobs

    corpus = _corpus(tmp_path, [{"prompt": "x = 1\n", "seed": 2 ** 70}, {"prompt": "y = 2\n", "seed": -1},
                                {"prompt": "z = 3\n"}])
    with pytest.raises(TypeError, match="hooks must be"):
        jobs.collect(corpus, tmp_path / "a", model, hooks=None, progress=False)
    with pytest.raises(TypeError, match="hooks must be"):
        jobs.collect(corpus, tmp_path / "a", model, hooks=[3], progress=False)
    s = jobs.generate(corpus, tmp_path / "g", model, max_new_tokens=2, progress=False)
    assert [r for r, _, _ in s.skipped] == [0, 1] and "2**63" in s.skipped[0][2]
    assert list(jobs.open(tmp_path / "g")["row"]) == [2]
    with pytest.raises(ValueError, match="seed"):
        jobs.generate(corpus, tmp_path / "h", model, seed=2 ** 64, progress=False)


def test_a_parquet_job_without_pyarrow_fails_before_any_work(model, tmp_path, monkeypatch):
    """Issue 29 item 3: checked in Job.check, not at the first shard write."""
    from cyformer import jobs

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    corpus = _corpus(tmp_path, [{"text": "x = 1\n"}])
    with pytest.raises(CyformerError, match="needs pyarrow"):
        jobs.score(corpus, tmp_path / "out", model, progress=False)
    assert not (tmp_path / "out").exists()


# -- the engine isolates its callers ---------------------------------------------------------

def test_a_raising_sink_ends_only_its_own_stream(model):
    """Root: a sink's exception escaped into the scheduler thread and killed it."""
    from cyformer.engine import Engine, SinkError

    with Engine(model) as engine:
        def bad(event):
            raise RuntimeError("the caller's bug")
        seen = []
        s_bad = engine.generate("def f(x):", max_new_tokens=8, temperature=0, sink=bad)
        s_ok = engine.generate("def g(y):", max_new_tokens=8, temperature=0, sink=seen.append)
        assert s_ok.wait(60) and s_bad.wait(60)
        with pytest.raises(SinkError, match="the caller's bug"):
            s_bad.result()
        assert seen[-1] is None and len(seen) > 1
        # the engine still works, for streams with and without sinks
        want = model.generate("def f(x):", max_new_tokens=8, temperature=0)
        assert str(engine.generate("def f(x):", max_new_tokens=8, temperature=0).result(60)) == str(want)
        assert engine.running and engine.stats()["failed"] == 1


def test_a_sink_may_submit_but_not_wait(model):
    """Root: waiting inside a sink blocked the only thread that makes progress."""
    from cyformer.engine import Engine, SinkError

    with Engine(model) as engine:
        inner, errors = [], []

        def submits(event):
            if event is not None and not inner:
                inner.append(engine.generate("x = ", max_new_tokens=3))

        def waits(event):
            if event is not None:
                try:
                    engine.generate("y = ", max_new_tokens=3).result()
                except RuntimeError as e:
                    errors.append(e)
                    raise
        a = engine.generate("def f(x):", max_new_tokens=4, sink=submits)
        b = engine.generate("def g(x):", max_new_tokens=4, sink=waits)
        assert a.wait(60) and b.wait(60)
        a.result()
        assert inner[0].result(60).finish_reason in ("length", "eos")
        assert errors and "would wait for itself" in str(errors[0])
        with pytest.raises(SinkError):
            b.result()


def test_a_list_of_sinks_must_match_the_generations(model):
    from cyformer.engine import Engine
    from cyformer.generate import Generation
    from cyformer.request import GenerationRequest

    with Engine(model) as engine:
        two = GenerationRequest(max_new_tokens=2)
        gens = [Generation(model, "a", two), Generation(model, "b", two)]
        with pytest.raises(ValueError, match="1 sinks for 2 generations"):
            engine.submit(gens, sink=[print])
        with pytest.raises(TypeError, match="callable"):
            engine.submit(gens, sink=[print, 3])
        assert engine.queue_depth == 0


# -- config.json booleans, saved weights, hooks, templates, cache slices -------------------------

@pytest.mark.parametrize("key, value", [("tie_word_embeddings", "false"), ("attention_bias", "true"),
                                        ("mlp_bias", 0), ("use_sliding_window", "no")])
def test_config_booleans_are_strict(key, value):
    """Root: bool() of the JSON value made the string "false" true."""
    from cyformer.config import Config

    raw = {"model_type": "qwen2" if key == "use_sliding_window" else "llama", "vocab_size": 32,
           "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 24,
           "max_position_embeddings": 32, key: value}
    with pytest.raises(ModelLoadError, match=f"{key} must be true or false"):
        Config.from_dict(raw)


def test_gpt2_config_booleans_are_strict():
    from cyformer.config import Config

    with pytest.raises(ModelLoadError, match="tie_word_embeddings must be true or false"):
        Config.from_dict({"model_type": "gpt2", "tie_word_embeddings": "false"})


def test_saved_model_with_nan_in_a_norm_warns_like_a_checkpoint(src, tmp_path):
    """Root: the saved-format loader mapped tensors without the finiteness check."""
    from cyformer.saving import write_safetensors

    cyformer.load(src, dtype="int8", threads=1).save(tmp_path / "m")
    from safetensors.numpy import load_file
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    tensors["blocks.0.ln_1.weight"] = tensors["blocks.0.ln_1.weight"].copy()
    tensors["blocks.0.ln_1.weight"][3] = np.nan
    from safetensors import safe_open
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "np") as f:
        meta = f.metadata()
    write_safetensors(str(tmp_path / "m" / "model.safetensors"), tensors, meta)
    with pytest.warns(UserWarning, match="'blocks.0.ln_1.weight' contains NaN or Inf"):
        cyformer.load(tmp_path / "m", threads=1)


def test_a_hook_returning_complex_values_is_refused(model):
    """Root: the float32 cast dropped the imaginary part with only a ComplexWarning."""
    ids = model.encode("x = 1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="not a real float array"):
            model.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_post",
                                                  lambda a, name: a.astype(np.complex64) * 1j)])
        with pytest.raises(ValueError, match="not a real float array"):
            model.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_post",
                                                  lambda a, name: np.full(a.shape, "x"))])


@pytest.mark.parametrize("template, what", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within"),
    ("{{ 'x' * 10**8 }}", "repeats a value"),
    ("{{ 10 ** 100000000 }}", "power"),
    ("{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}",
     "rendered over"),
    ("{{ 'ab'.center(10**8) }}", "built a value"),
    ("{{ lipsum(10**6) }}", "lipsum"),
])
def test_chat_template_rendering_is_bounded(template, what, monkeypatch):
    """Root: an untrusted template ran unbounded in time and size."""
    from cyformer import chat

    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.5)
    monkeypatch.setattr(chat, "MAX_RENDER_CHARS", 1_000_000)
    with pytest.raises(ChatTemplateError, match=what):
        chat.ChatTemplate(template).render([{"role": "user", "content": "hi"}])
    # the next rendering in the same thread is unaffected
    assert chat.ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize("bad, error", [("abc", TypeError), (1.5, TypeError), ((0, "x"), TypeError),
                                        (99, IndexError), ([0, 99], IndexError), ([0.5], TypeError),
                                        (slice(0, 2, 0), TypeError), (True, TypeError)])
def test_cache_slices_are_checked(model, bad, error):
    from cyformer.tl import HookedTransformer

    _, cache = HookedTransformer(model).run_with_cache(model.encode("x = 1"))
    with pytest.raises(error, match="slice"):
        cache.accumulated_resid(pos_slice=bad)
    assert cache.accumulated_resid(pos_slice=[0, -1]).shape[-2] == 2


# -- rotary tables are built up to what is used ------------------------------------------------

def test_rotary_tables_grow_with_use_not_with_the_configured_context(tmp_path):
    """Root: [n_positions, D/2] cos and sin tables were built at load (3 GB for
    a config claiming 16 M positions); now only the positions caches reach."""
    import resource

    from helpers import edit_config, make_hf_llama

    make_hf_llama(str(tmp_path), vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=48, max_position_embeddings=600)
    want = {}
    for backend in ("cython", "numpy"):
        m = cyformer.load(tmp_path, backend=backend, threads=1)
        ids = list(np.random.default_rng(0).integers(0, 64, 300))  # past the first 256 rows
        want[backend] = (m.forward(ids), m.generate(ids, max_new_tokens=20, temperature=0))
    np.testing.assert_allclose(want["cython"][0], want["numpy"][0], rtol=1e-4, atol=1e-4)
    assert list(want["cython"][1]) == list(want["numpy"][1])
    m = cyformer.load(tmp_path, threads=1)
    assert m.backend.rope.rows == 256
    m.generate([1, 2, 3], max_new_tokens=300, temperature=0)
    assert 303 <= m.backend.rope.rows <= 600
    # the same model claiming 16 M positions loads and runs without the 3 GB
    edit_config(str(tmp_path), max_position_embeddings=2 ** 24)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    huge = cyformer.load(tmp_path, threads=1)
    assert list(huge.generate(ids, max_new_tokens=20, temperature=0)) == list(want["cython"][1])
    assert huge.backend.rope.rows == 512
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB: far below 3 GB


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("bad", ["a\0b", b"\xff\x00", "", 3])
def test_save_names_a_bad_path(tmp_path, fmt, bad):
    """A path that can name no file is an error saying so, before anything is written."""
    model = cyformer.load()
    with pytest.raises((TypeError, ValueError), match=r"save: (directory|path) must"):
        model.save(bad, format=fmt)
