"""MkDocs hooks: the pages that are made from the code, so they cannot drift from it.

api/<module>.md   one mkdocstrings page per public module of cyformer, found by
                  walking the source tree (a name starting with "_" is private):
                  a new module or public name appears without editing the docs.
cli.md            the ``--help`` of ``cyformer`` and of each subcommand, rendered
                  from cyformer.cli.build_parser().
tutorials/*.md    each docs/tutorials/*.py run cell by cell at build time (the
                  installed cyformer, a scratch directory): the page shows each
                  code cell and what it printed, and the files it wrote (PNG,
                  HTML) are published beside the page.  A failing cell fails
                  the build.
{! path !}        in a page: the repository file at path (ARCHITECTURE.md), its
                  links to files outside the site shown as code; "{! latest
                  benchmark results !}": the newest bench/results/<date>-<name>.md
                  of each name, with its chart.

The nav entries left empty in mkdocs.yml (Tutorials, Integrations, API
reference) are filled here from the files found.
"""

import contextlib
import glob
import io
import logging
import os
import re
import tempfile
import time
import traceback

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.cyformer")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
NOT_IN_API = {"cyformer.cli", "cyformer.__main__"}  # the CLI has its own page
_generated = {}  # src_uri -> content (str or bytes), made in on_config, added in on_files


# -- which pages exist ------------------------------------------------------

def public_modules():
    """cyformer's public modules, from the source tree: packages first, in path order."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "cyformer", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
        if rel[-1] == "__init__":
            rel = rel[:-1]
        if any(part.startswith("_") for part in rel):
            continue
        name = ".".join(rel)
        if name not in NOT_IN_API:
            out.append(name)
    return out


def tutorials():
    return sorted(glob.glob(os.path.join(DOCS, "tutorials", "*.py")))


def _title(md_text, fallback):
    m = re.search(r"^# (.+)$", md_text, re.M)
    return m.group(1).strip() if m else fallback


def on_config(config):
    _generated.clear()
    # One thread unless asked: a busy machine makes an OpenMP team wait on its
    # slowest member, and the tutorials' output is the same at any count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for mod in public_modules():
        _generated[f"api/{mod}.md"] = f"::: {mod}\n"
    _generated["cli.md"] = cli_page()
    t0 = time.perf_counter()
    for script in tutorials():
        stem = os.path.splitext(os.path.basename(script))[0]
        page, files = run_tutorial(script)
        _generated[f"tutorials/{stem}.md"] = page
        for name, data in files.items():
            _generated[f"tutorials/{name}"] = data
    log.info("tutorials executed in %.1f s", time.perf_counter() - t0)

    def fill(section, entries):
        for item in config["nav"]:
            if isinstance(item, dict) and section in item and not item[section]:
                item[section] = entries

    fill("Tutorials", [{_title(_generated[f"tutorials/{_stem(s)}.md"], _stem(s)): f"tutorials/{_stem(s)}.md"}
                       for s in tutorials()])
    integrations = sorted(glob.glob(os.path.join(DOCS, "integrations", "*.md")))
    fill("Integrations", [f"integrations/{os.path.basename(p)}" for p in integrations
                          if os.path.basename(p) == "index.md"]
         + [f"integrations/{os.path.basename(p)}" for p in integrations
            if os.path.basename(p) != "index.md"])
    fill("API reference", [{mod: f"api/{mod}.md"} for mod in public_modules()])
    return config


def _stem(path):
    return os.path.splitext(os.path.basename(path))[0]


def on_files(files, config):
    for uri, content in _generated.items():
        files.append(File.generated(config, uri, content=content))
    return files


# -- the command line -------------------------------------------------------

def cli_page():
    from cyformer.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps --help to the terminal width
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    parts = ["# Command line", "",
             "Generated from the argument parser (`cyformer.cli.build_parser`) when the docs are "
             "built, so every option here is one the installed command takes.", "",
             "```text", parser.format_help().rstrip(), "```", ""]
    for name, p in sub.choices.items():
        parts += [f"## cyformer {name}", "", "```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


# -- tutorials --------------------------------------------------------------

_CELL = re.compile(r"^# %%(.*)$", re.M)


def split_cells(source):
    """A percent-format script -> [(kind, text)], kind "markdown" or "code".

    ``# %% [markdown]`` starts a cell of comment lines that is Markdown;
    ``# %%`` starts a code cell.  Text before the first marker is dropped
    (the script's own docstring or shebang)."""
    cells = []
    marks = list(_CELL.finditer(source))
    for i, m in enumerate(marks):
        body = source[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(source)].strip("\n")
        if "[markdown]" in m.group(1):
            lines = [re.sub(r"^# ?", "", line) for line in body.splitlines()]
            cells.append(("markdown", "\n".join(lines)))
        elif body.strip():
            cells.append(("code", body))
    return cells


def run_tutorial(script):
    """Execute a tutorial; returns (page markdown, {file name: bytes} it wrote)."""
    with open(script, encoding="utf-8") as f:
        source = f.read()
    name = os.path.basename(script)
    out = [f"!!! note \"Run it yourself\"\n    This page is [`{name}`]({name}) run when the docs were "
           f"built; `python {name}` runs the same code.\n"]
    env = {"__name__": "__main__", "__file__": script}
    os.environ.setdefault("MPLBACKEND", "Agg")
    with tempfile.TemporaryDirectory() as scratch:
        here = os.getcwd()
        os.chdir(scratch)
        try:
            for n, (kind, text) in enumerate(split_cells(source)):
                if kind == "markdown":
                    if n == 0:  # the title goes above the note
                        out.insert(0, text + "\n")
                    else:
                        out.append(text + "\n")
                    continue
                buf = io.StringIO()
                try:
                    with contextlib.redirect_stdout(buf):
                        exec(compile(text, f"{name} (cell {n})", "exec"), env)
                except Exception:
                    raise PluginError(f"tutorial {name}, cell {n} failed:\n{text}\n\n"
                                      + traceback.format_exc()) from None
                out.append(f"```python\n{text}\n```\n")
                printed = buf.getvalue().rstrip()
                if printed:
                    out.append(f"```text\n{printed}\n```\n")
            files = {}
            for f in sorted(os.listdir(scratch)):
                if f.endswith((".png", ".html", ".svg")):
                    with open(f, "rb") as fh:
                        files[f] = fh.read()
        finally:
            os.chdir(here)
    return "\n".join(out), files


# -- including repository files ---------------------------------------------

_INCLUDE = re.compile(r"\{!\s*(\S+?)\s*!\}")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def include(rel):
    path = os.path.join(ROOT, rel)
    if not os.path.isfile(path):
        raise PluginError(f"{{! {rel} !}}: no such file in the repository")
    with open(path, encoding="utf-8") as f:
        text = f.read()

    def link(m):  # the site does not carry the repository's files: name them instead
        target = m.group(2)
        if re.match(r"[a-z]+://|#", target):
            return m.group(0)
        where = os.path.normpath(os.path.join(os.path.dirname(rel), target))
        return f"{m.group(1)} (`{where}`)"

    return _LINK.sub(link, text)


def on_page_markdown(markdown, page, config, files):
    markdown = markdown.replace("{! latest benchmark results !}", results_markdown())
    return _INCLUDE.sub(lambda m: include(m.group(1)), markdown)


# -- the performance page's results -----------------------------------------

def latest_results():
    """The newest bench/results/<date>-<name>.md of each name, newest first."""
    newest = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "results", "*.md"))):
        m = re.match(r"(\d{4}-\d{2}-\d{2})-(.+)\.md$", os.path.basename(path))
        if m:
            newest[m.group(2)] = path  # sorted by date, so the last one wins
    return sorted(newest.values(), reverse=True)


def on_pre_build(config):
    # the charts beside the latest results are published with the page
    for path in latest_results():
        png = path[:-3] + ".png"
        if os.path.exists(png):
            with open(png, "rb") as f:
                _generated[f"performance/{os.path.basename(png)}"] = f.read()


def results_markdown():
    """Every latest result, headings one level down, each with its chart."""
    parts = []
    for path in latest_results():
        rel = os.path.relpath(path, ROOT)
        text = re.sub(r"^(#+) ", r"#\1 ", include(rel), flags=re.M)
        parts += [text.rstrip(), "", f"*From `{rel}`.*", ""]
        png = path[:-3] + ".png"
        if os.path.exists(png):
            parts += [f"![chart of {os.path.basename(path)}](performance/{os.path.basename(png)})", ""]
    return "\n".join(parts)
