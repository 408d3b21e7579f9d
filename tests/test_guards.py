"""The inputs issue 14 found leaking raw NumPy, tokenizers or interpreter
errors (or silently misread) now get cyformer's own error naming the
parameter, or work: one test per class of input, over every public entry
that takes it.  test_api_fuzz.py sweeps the whole surface at random; these
pin the messages and the cases that must work.
"""

import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import cyformer
from cyformer import Model
from cyformer.interp import (attention_patterns, direct_logit_attribution, logit_lens, save_html,
                             save_png, token_labels)


@pytest.fixture(scope="module")
def model():
    return cyformer.load()


@pytest.fixture(scope="module")
def ids(model):
    return model.encode("def add(a, b):\n    return a + b")


# -- interpretability helpers -------------------------------------------------

@pytest.mark.parametrize("k,match", [(None, "k must be an integer"), ("3", "k must be an integer"),
                                     (1.5, "k must be an integer"), (True, "k must be an integer"),
                                     (0, r"k must be in \[1, 4096\]"), (10**30, r"k must be in")])
def test_logit_lens_k(model, ids, k, match):
    with pytest.raises(ValueError, match=rf"^logit_lens: {match}"):
        logit_lens(model, ids, k=k)


@pytest.mark.parametrize("kw,match", [
    (dict(token=3.7), "token must be an integer, got 3.7"),       # was truncated to 3
    (dict(token=np.float64(3)), "token must be an integer"),
    (dict(token=None), "token must be an integer"),
    (dict(token=4096), r"token 4096 is outside \[0, 4096\)"),
    (dict(token=-1), r"token -1 is outside"),
    (dict(token="a b c"), "token 'a b c' is 3 tokens, not one"),
    (dict(token="\ud800"), "token holds a lone surrogate U\\+D800"),
    (dict(token=3, position=1.5), "position must be an integer"),
    (dict(token=3, position=None), "position must be an integer"),
    (dict(token=3, position=10**30), "position 10+ is outside a sequence of"),
    (dict(token=3, cache=5), "cache must be a run_with_cache cache"),
])
def test_direct_logit_attribution_arguments(model, ids, kw, match):
    with pytest.raises(ValueError, match=rf"^direct_logit_attribution: {match}"):
        direct_logit_attribution(model, ids, **kw)


def test_direct_logit_attribution_refuses_a_cache_of_another_prompt(model, ids):
    _, own = model.run_with_cache(ids)
    want = direct_logit_attribution(model, ids, 3)
    got = direct_logit_attribution(model, ids, 3, cache=own)
    assert got.logit == pytest.approx(want.logit) and got.total() == pytest.approx(want.total(), abs=1e-4)
    other = list(ids)
    other[2] = (other[2] + 1) % model.config.vocab_size
    for bad, match in [(other, "its hook_embed differs"), (ids[:-2], r"has shape \(\d+, 256\)"),
                       (ids + ids, r"has shape"), (np.array([ids, ids]), r"has shape \(2, ")]:
        _, cache = model.run_with_cache(bad)
        with pytest.raises(ValueError, match=rf"^direct_logit_attribution: cache.*{match}"):
            direct_logit_attribution(model, ids, 3, cache=cache)


@pytest.mark.parametrize("fn", [logit_lens, attention_patterns, token_labels,
                                lambda m, p: direct_logit_attribution(m, p, 3)])
def test_interp_functions_need_a_model(fn, ids):
    with pytest.raises(TypeError, match="model must be a cyformer.Model"):
        fn("not a model", ids)


def test_result_methods_check_their_arguments(model, ids):
    lens = logit_lens(model, ids, k=2)
    with pytest.raises(ValueError, match="^LogitLens.format: width must be an integer"):
        lens.format(width="wide")
    dla = direct_logit_attribution(model, ids, 3)
    with pytest.raises(ValueError, match="^LogitAttribution.top: n must be an integer"):
        dla.top(2.5)
    with pytest.raises(ValueError, match="^LogitAttribution.top: n must be >= 0"):
        dla.top(-1)


# -- attention pictures ------------------------------------------------------

@pytest.mark.parametrize("save", [save_html, save_png])
def test_pictures_refuse_nan_and_misshapen_patterns(save, tmp_path):
    name = save.__name__
    pat = np.array([[1.0, np.nan], [0.5, 0.5]])  # NaN above the diagonal is never drawn
    assert os.path.exists(save(str(tmp_path / "ok"), ["a", "b"], {(0, 0): pat}))
    cases = [
        (["a", "b"], {(0, 0): np.array([[1.0, 0.0], [np.nan, 0.5]])}, r"patterns\[\(0, 0\)\] holds NaN"),
        (["a", "b"], {(0, 0): np.array([[np.inf, 0.0], [0.5, 0.5]])}, r"patterns\[\(0, 0\)\] holds NaN or infinity"),
        (["a"], {(0, 0): np.eye(2)}, r"patterns\[\(0, 0\)\] has shape \(2, 2\); 1 tokens need \(1, 1\)"),
        ([1, 2], {(0, 0): np.eye(2)}, r"tokens\[0\] must be a str"),
        (["a", "\udcff"], {(0, 0): np.eye(2)}, r"tokens\[1\] holds the undecodable byte 0xff"),
        ("ab", {(0, 0): np.eye(2)}, "tokens must be a list of str"),
        (["a", "b"], [np.eye(2)], "patterns must be a non-empty dict"),
        (["a", "b"], {}, "patterns must be a non-empty dict"),
        (["a", "b"], {0: np.eye(2)}, r"patterns keys must be \(layer, head\) pairs"),
        (["a", "b"], {(0, 0): [["x", "y"], ["z", "w"]]}, r"patterns\[\(0, 0\)\] is not an array of numbers"),
    ]
    for tokens, patterns, match in cases:
        with pytest.raises(ValueError, match=rf"^{name}: {match}"):
            save(str(tmp_path / "x"), tokens, patterns)
    with pytest.raises(ValueError, match=rf"^{name}: path must be a str or os.PathLike"):
        save(None, ["a"], {(0, 0): np.eye(1)})


def test_png_is_png_whatever_the_file_is_called(tmp_path):
    path = save_png(str(tmp_path / "attn.html"), ["a", "b"], {(0, 0): np.eye(2)})
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# -- token ids -----------------------------------------------------------------

def test_masked_arrays_are_refused_everywhere(model):
    # min() and max() of a masked array skip the masked entry; the kernels
    # would read it (here an id far out of range)
    masked = np.ma.masked_array([1, 2, 10**6], mask=[0, 0, 1])
    for call, where in [(model.forward, "forward: ids"), (model.decode, "decode: ids"),
                        (lambda a: model.generate(a, max_new_tokens=2), "generate: prompt"),
                        (lambda a: list(model.stream(a, max_new_tokens=2)), "generate: prompt"),
                        (model.run_with_cache, "run_with_cache: ids"),
                        (lambda a: token_labels(model, a), "token_labels: ids"),
                        (lambda a: logit_lens(model, a), "logit_lens: ids")]:
        with pytest.raises(ValueError, match=rf"^{where} is a masked array"):
            call(masked)


class Tagged(np.ndarray):
    """An ndarray subclass whose min() lies, as a masked array's does."""

    def min(self, *args, **kwargs):
        return 0


def test_other_ndarray_subclasses_are_read_as_their_data(model, ids):
    tagged = np.array(ids).view(Tagged)
    assert np.array_equal(model.forward(tagged), model.forward(ids))
    bad = np.array([1, -5]).view(Tagged)
    with pytest.raises(ValueError, match=r"^forward: ids contains token id -5"):
        model.forward(bad)


def test_ids_too_many_to_hold_are_refused(model):
    with pytest.raises(ValueError, match="^forward: ids holds more token ids than fit in memory"):
        model.forward(range(10**13))


# -- text ----------------------------------------------------------------------

@pytest.mark.parametrize("text,what", [("def \ud800", "a lone surrogate U\\+D800 at index 4"),
                                       ("x\udcff", "the undecodable byte 0xff at index 1")])
def test_text_that_is_not_unicode(model, text, what):
    for call, where in [(model.encode, "encode: text"),
                        (lambda t: model.generate(t, max_new_tokens=2), "generate: prompt"),
                        (lambda t: model.stream(t), "generate: prompt"),
                        (lambda t: model.generate("x", stop=t), "generate: stop"),
                        (lambda t: logit_lens(model, t), "logit_lens: prompt"),
                        (lambda t: attention_patterns(model, t), "attention_patterns: prompt")]:
        with pytest.raises(ValueError, match=rf"^{where} holds {what}"):
            call(text)


def run_cli(*args, shell_suffix=""):
    cmd = [sys.executable, "-m", "cyformer", *args]
    if shell_suffix:
        return subprocess.run(["bash", "-c", " ".join(f"'{a}'" for a in cmd) + shell_suffix],
                              capture_output=True, timeout=300)
    return subprocess.run(cmd, capture_output=True, timeout=300)


@pytest.mark.parametrize("args", [["generate", b"def \xff(x):", "-n", "3"], ["inspect", b"x = \xfe"],
                                  ["generate", "x", "-n", "3", "--stop", b"\xff"]])
def test_cli_undecodable_bytes_are_one_line(args):
    r = run_cli(*args)
    err = r.stderr.decode()
    assert r.returncode == 1 and r.stdout == b""
    assert err.count("\n") == 1 and err.startswith("cyformer: error: ") and "undecodable byte 0xf" in err


@pytest.mark.parametrize("sub", [["generate", "def f(x):", "-n", "3"], ["info"], ["inspect", "x = 1"]])
def test_cli_with_standard_output_closed(sub):
    r = run_cli(*sub, shell_suffix=" >&-")
    assert r.returncode == 1
    assert r.stderr.decode() == "cyformer: error: standard output is closed\n"


# -- paths ----------------------------------------------------------------------

def test_bytes_and_pathlike_paths_load(model, ids):
    path = model.path
    for p in (os.fsencode(path), __import__("pathlib").Path(path)):
        m = cyformer.load(p)
        assert isinstance(m.path, str) and np.array_equal(m.forward(ids), model.forward(ids))


# -- pickle and copy ------------------------------------------------------------

def test_pickle_and_copies_load_the_directory_again(model, ids, tmp_path, monkeypatch):
    m = cyformer.load(model.path, threads=1, backend="numpy")
    monkeypatch.chdir(tmp_path)  # the copy's path must not depend on the working directory
    for clone in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m), copy.copy(m)):
        assert clone is not m and clone.threads == 1 and clone.backend.name == "numpy"
        assert np.array_equal(clone.forward(ids), m.forward(ids))
        assert os.path.isabs(clone.path)


def test_a_model_built_in_memory_says_why_it_cannot_be_pickled(model):
    m = Model(model.config, model.weights)
    for attempt in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be pickled or copied: only one loaded with "
                                            r"cyformer.load\(path\) can"):
            attempt(m)
