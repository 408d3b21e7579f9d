"""Every public entry point answers any argument with a result or cyformer's own error.

The entry points are found by introspection, so a new public function or
method is fuzzed without a change here: the functions in ``cyformer.__all__``
and ``cyformer.interp.__all__``, the public methods of ``cyformer.Model``
(on the bundled model) and of the result objects the interp functions return
(RESULT_FACTORIES), the corpus jobs (cyformer.jobs: score, generate, collect,
open, open_corpus, and a JobOutput's methods), the engine (an Engine's
public methods on the bundled model, and its streams'), saving (Model.save,
with any path under the test's directory) and the TransformerLens layer
(Model's inherited HookedTransformer methods, and the methods of the
ActivationCache that run_with_cache returns).
Classes are left out: a Model is built by load(), and
the interp classes are results or plumbing that load() and run_with_cache
build (CONSTRUCTED_ELSEWHERE, checked to be complete).

Each call gets, for every parameter, either an ordinary value (GOOD, by
parameter name) or a hostile one: None, bools, huge and negative ints, NaN,
infinities, subnormals, Fractions, strings with lone surrogates, bytes,
ragged and deep lists, masked, object, float, empty and 0-d arrays,
callables, mappings.  The call must return (iterators are drained) or raise
CyformerError, ValueError or TypeError from a ``raise`` statement in the
cyformer package; anything else (an error from NumPy, tokenizers or the
interpreter, a KeyError, an IndexError), a hang (SIGALRM after 60 s) or a
crash fails.  Bounded and derandomized: ~40 cases per entry point.
"""

import contextlib
import inspect
import itertools
import math
import os
import signal
import traceback
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cyformer
import cyformer.interp as interp
from cyformer import CyformerError, jobs
from cyformer.engine import Engine
from cyformer.tl.cache import ActivationCache

PACKAGE_DIR = os.path.dirname(os.path.abspath(cyformer.__file__))
CASES = int(40 * float(os.environ.get("CYFORMER_FUZZ_SCALE", "1")))
CALL_TIMEOUT_S = 60

# Public classes of the two namespaces, and where their instances come from.
CONSTRUCTED_ELSEWHERE = {
    "Model": "cyformer.load()", "Config": "cyformer.load() reads config.json",
    "ActivationCache": "run_with_cache", "HookPoints": "run_with_cache/run_with_hooks",
    "FactoredMatrix": "Model.blocks[i].attn.heads[h] circuits", "LogitLens": "logit_lens",
    "LogitAttribution": "direct_logit_attribution",
}


@pytest.fixture(scope="module")
def model():
    return cyformer.load()


def ids_of(model):
    return model.encode("def add(a, b):\n    return a + b")


def good_values(model, tmp):
    """An ordinary value for each parameter name the public API uses."""
    ids = ids_of(model)
    return {
        "ids": [ids, np.array(ids), ids[:3]], "prompt": ["def f(x):", ids, "x = 1"],
        "text": ["def f(x):"], "token": [3, "x"], "position": [-1, 0],
        "k": [1, 3], "n": [2], "width": [6], "max_new_tokens": [0, 3], "temperature": [0.0, 0.8],
        "top_k": [None, 5], "top_p": [None, 0.9], "repetition_penalty": [None, 1.3],
        "stop": [None, "\n", [2]], "seed": [None, 1], "cache_names": [None, ["hook_embed"]],
        "names": [None, ["blocks.0.hook_resid_post"]], "fwd_hooks": [(), [("hook_embed", lambda a, n: None)]],
        "cache": [None], "layers": [None, 0, [1]], "heads": [None, 1],
        "path": [str(tmp / "out.html"), None], "tokens": [["a", "b"]],
        "patterns": [{(0, 0): np.array([[1.0, 0.0], [0.3, 0.7]])}], "dpi": [50],
        "cfg": [model.config], "title": ["t"], "threads": [None, 1, 2], "backend": ["cython", "numpy"], "model": [model],
        # corpus jobs
        "corpus": [_corpus(tmp)], "out": [str(tmp / "job-out")], "hooks": [["blocks.0.hook_resid_post"]],
        "shard_rows": [1, 5], "progress": [False], "engine": ["local"], "stride": [None, 8],
        "field": [None, "text"], "format": ["auto"], "mmap": [False, True], "name": ["row", "n_tokens"],
        # the engine
        "messages": [[{"role": "user", "content": "hi"}]], "sink": [None],
        "generations": [[]], "cancel": [True], "timeout": [5],
        # saving
        "directory": [str(tmp / "saved")],
        # the TransformerLens cache
        "layer": [None, 1, -1], "pos_slice": [None, -1, [0, 1]], "incl_mid": [False, True],
        "apply_ln": [False, True], "mlp_input": [False, True], "return_labels": [False, True],
        "incl_remainder": [False, True], "mode": ["all", "attn"], "activation_name": ["resid_post", "pattern"],
        "neuron_slice": [None, (0, 4), 2], "batch_slice": [None, 0], "has_batch_dim": [True],
        "residual_stack": [_tl_cache(model).accumulated_resid()], "incorrect_tokens": [None],
        "key": ["hook_embed", ("resid_post", -1)], "device": ["cpu"],
    }


def _corpus(tmp):
    path = tmp / "corpus.jsonl"
    path.write_text('{"text": "def f(x):\\n    return x"}\n{"text": "x = 1", "id": 7}\nnot json\n')
    return str(path)


def hostile():
    """Values no entry point expects."""
    masked = np.ma.masked_array([1, 2, 10**6], mask=[0, 0, 1])
    return st.sampled_from([
        None, True, False, 0, -1, -(2**63), 2**63, 2**64 + 1, 10**30, 1.5, -0.0, math.nan, math.inf,
        -math.inf, 5e-324, 1e308, Fraction(1, 3), Fraction(10**400), Fraction(1, 10**400), 1j,
        "", "abc", "\ud800", "a\udcff", "blocks.0.hook_z", "x" * 5000, b"", b"\xff\x00", bytearray(b"ab"),
        [], [[]], [[1], [2, 3]], [[[1]]], [1, None], [1.5, 2.5], ["a", "b"], [2**70], [-1], (1, 2),
        {1, 2}, {}, {"a": 1}, {(0, 0): "x"}, masked, np.array([None, 1], dtype=object),
        np.array([0.5, 1.5]), np.array([], dtype=np.int64), np.array(3), np.zeros((2, 2, 2), int),
        np.array([1, 2], dtype=np.uint64), np.array([np.nan]), np.float32(math.nan), np.int64(-5),
        np.bool_(True), lambda *a: None, print, object(), iter([1, 2]), range(10**12), Ellipsis,
    ])


def entry_points(model):
    """(label, callable) for every public function and method."""
    out = []
    for ns_name, ns in (("cyformer", cyformer), ("cyformer.interp", interp)):
        for name in ns.__all__:
            obj = getattr(ns, name)
            if inspect.isclass(obj):
                if not issubclass(obj, BaseException):
                    assert name in CONSTRUCTED_ELSEWHERE, f"new public class {ns_name}.{name}: fuzz it"
                continue
            if callable(obj):
                out.append((f"{ns_name}.{name}", obj))
    for name, fn in inspect.getmembers(cyformer.Model, inspect.isfunction):
        if not name.startswith("_"):
            out.append((f"Model.{name}", getattr(model, name)))
    for cls, make in RESULT_FACTORIES.items():
        instance = make(model)
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_") and f"{cls.__name__}.{name}" not in NOT_FUZZED:
                out.append((f"{cls.__name__}.{name}", getattr(instance, name)))
    for name in ("score", "generate", "collect", "open", "open_corpus"):
        out.append((f"cyformer.jobs.{name}", getattr(jobs, name)))
    return out


# Methods that end or reshape the object the other entries share and take no arguments.
NOT_FUZZED = {"Engine.close", "ActivationCache.remove_batch_dim"}


def _job_output(model):
    import tempfile

    out = os.path.join(tempfile.mkdtemp(prefix="cyformer-fuzz-"), "scores")
    jobs.score(_corpus(__import__("pathlib").Path(os.path.dirname(out))), out, model, progress=False)
    return jobs.open(out)


def _tl_cache(model):
    from cyformer.tl import HookedTransformer

    return HookedTransformer(model).run_with_cache(ids_of(model))[1]


def _engine(model):
    from cyformer.engine import Engine

    return Engine(model, max_queue=8)  # a daemon thread; it ends with the process


RESULT_FACTORIES = {
    interp.LogitLens: lambda m: interp.logit_lens(m, ids_of(m), k=2),
    interp.LogitAttribution: lambda m: interp.direct_logit_attribution(m, ids_of(m), 3),
    Engine: _engine,
    ActivationCache: lambda m: _tl_cache(m),
}
try:
    import pyarrow  # noqa: F401 - a JobOutput of Parquet shards needs it

    RESULT_FACTORIES[jobs.JobOutput] = _job_output
except ImportError:
    pass


@contextlib.contextmanager
def deadline(seconds, label):
    def expire(*_):
        raise TimeoutError(f"{label} ran for more than {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def raised_by_cyformer(exc):
    """Whether exc came from a ``raise`` statement in the cyformer package."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    inside = os.path.abspath(frame.filename).startswith(PACKAGE_DIR + os.sep)
    return inside and (frame.line or "").lstrip().startswith("raise")


def call(label, fn, kwargs):
    with deadline(CALL_TIMEOUT_S, label):
        try:
            result = fn(**kwargs)
            if hasattr(result, "__next__"):  # a stream: errors may come while it runs
                list(itertools.islice(result, 300))
        except (CyformerError, ValueError, TypeError) as e:
            if not raised_by_cyformer(e):
                frame = traceback.extract_tb(e.__traceback__)[-1]
                pytest.fail(f"{label}({_show(kwargs)}) leaked {type(e).__name__}: {e} "
                            f"from {frame.filename}:{frame.lineno}: {frame.line}")
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            frame = traceback.extract_tb(e.__traceback__)[-1]
            pytest.fail(f"{label}({_show(kwargs)}) raised {type(e).__name__}: {e} "
                        f"from {frame.filename}:{frame.lineno}")


def _show(kwargs):
    return ", ".join(f"{k}={v!r}"[:80] for k, v in kwargs.items())


def test_every_public_class_is_accounted_for(model):
    labels = [label for label, _ in entry_points(model)]
    assert "Model.generate" in labels and "cyformer.interp.logit_lens" in labels
    assert len(labels) == len(set(labels))


def pytest_generate_tests(metafunc):
    if "entry" in metafunc.fixturenames:
        labels = [label for label, _ in entry_points(cyformer.load())]
        metafunc.parametrize("entry", labels)


@pytest.fixture(scope="module")
def entries(model):
    return dict(entry_points(model))


def test_hostile_arguments_get_cyformers_own_errors(entry, entries, model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a path argument may be any string: keep files in here
    fn = entries[entry]
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    good = good_values(model, tmp_path)

    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        kwargs = {}
        for p in params:
            choices = good.get(p.name, [] if p.default is p.empty else [p.default])
            if choices and data.draw(st.booleans(), label=f"{p.name} ordinary"):
                kwargs[p.name] = data.draw(st.sampled_from(choices), label=p.name)
            elif choices or p.default is p.empty or data.draw(st.booleans()):
                kwargs[p.name] = data.draw(hostile(), label=p.name)
        call(entry, fn, kwargs)

    run()
