"""README.md and the docs' pages run as written, against the installed package.

Every ```python block of a page runs, in page order, in one namespace per page
(a later block may use an earlier one's names), so a snippet that no longer
works fails here.  A block that needs what is not available offline (a Hub
download, a GPT-2 or SmolLM2 directory) is skipped explicitly: its first line
is "# docs: skip (reason)"; nothing is substituted for it.

Every ```console block's "$ cyformer ..." line is run and its standard output
must equal the lines shown under it, so README's example output is the real
output of the command shown.

The tutorials (docs/tutorials/*.py) run when the docs are built (docs/hooks.py).
"""

import contextlib
import glob
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
SKIP = re.compile(r"#\s*docs:\s*skip\b")
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(page, lang):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1) == lang]


def rel(page):
    return os.path.relpath(page, ROOT)


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=rel)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    namespace = {"__name__": "__docs__"}
    ran = 0
    for line, code in blocks(page, "python"):
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        if SKIP.match(first):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"{rel(page)}:{line}", "exec"), namespace)
        except Exception as e:
            pytest.fail(f"{rel(page)}, the python block at line {line} raised "
                        f"{type(e).__name__}: {e}\n{code}")
        ran += 1
    if not ran:
        pytest.skip(f"every python block of {rel(page)} is marked '# docs: skip'")


def _cyformer():
    exe = os.path.join(os.path.dirname(sys.executable), "cyformer")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "cyformer"]


CONSOLE = [(page, line, body) for page in PAGES for line, body in blocks(page, "console")]


@pytest.mark.parametrize("page,line,body", CONSOLE, ids=[f"{rel(p)}:{n}" for p, n, _ in CONSOLE])
def test_console_output_is_real(page, line, body):
    commands = re.split(r"^\$ ", body, flags=re.M)[1:]
    assert commands, f"{rel(page)}:{line}: a console block with no '$ ' command"
    for chunk in commands:
        command, _, shown = chunk.partition("\n")
        argv = shlex.split(command)
        assert argv[0] == "cyformer", f"{rel(page)}:{line}: only cyformer commands are run, got {command!r}"
        r = subprocess.run(_cyformer() + argv[1:], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip("\n") == shown.rstrip("\n"), (
            f"{rel(page)}:{line}: `{command}` printed\n{r.stdout}\nbut the page shows\n{shown}")


def test_skip_markers_say_why():
    for page in PAGES:
        for line, code in blocks(page, "python"):
            if SKIP.search(code):
                assert re.search(r"#\s*docs:\s*skip \(.+\)", code), \
                    f"{rel(page)}:{line}: '# docs: skip' needs a reason in parentheses"
