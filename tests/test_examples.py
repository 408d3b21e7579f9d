"""Every script in examples/ runs to the end (a fresh process each, bounded
in time) and prints what it promises."""

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")


def run_example(name, *args, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_every_example_is_tested():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    tested = {"score_csv.py", "serve_openai.py", "patch_activation.py"}
    assert set(scripts) == tested


def test_score_csv(tmp_path):
    pytest.importorskip("pyarrow")
    r = run_example("score_csv.py", "--out", str(tmp_path / "scores"))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["add", "fib", "noise"]
    ppl = {ln.split()[0]: float(ln.split()[-1]) for ln in lines}
    assert ppl["noise"] > ppl["fib"]  # code is likelier than noise under a code model
    # a CSV of the user's own, with another text column
    csv = tmp_path / "mine.csv"
    csv.write_text('id,body\nk1,"import os\n"\n')
    r = run_example("score_csv.py", str(csv), "--column", "body", "--out", str(tmp_path / "mine"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "k1"


def test_serve_openai():
    for mod in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(mod)
    r = run_example("serve_openai.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "completion (length)" in r.stdout and "server exited with status 0" in r.stdout


def test_patch_activation():
    r = run_example("patch_activation.py")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if "patched" in ln]
    assert len(rows) == 4 and rows[-1].endswith("(100% restored)")  # the last layer is the logits' input
