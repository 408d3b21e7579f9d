#!/usr/bin/env python
"""Evaluate a model directory on the default model's held-out files.

Runs through cyformer (no torch) and reports:

- **bits per byte**: the summed negative log-likelihood of every token of the
  held-out files, in bits, over their UTF-8 bytes.  Tokenizer-independent, so
  models with different vocabularies compare.  Each file is one document
  that starts after the model's bos token (the ``<|endoftext|>`` that
  separates documents in training); files longer than the context are scored
  with a sliding window: windows of ``--context`` tokens (default the model's
  n_positions) every ``--stride`` tokens (default half the context), each
  token scored once, in the first window that holds it after
  ``context - stride`` tokens of history (or from the file's start).
- **nats per token**: the same sum in nats over the scored tokens (depends on
  the tokenizer).
- **code check**: ``--functions`` functions with docstrings from the held-out
  files (every ``def`` whose body is a docstring and at least one more
  statement, prompt at most ``MAX_PROMPT_BYTES``), chosen by the SHA-256 of
  ``key:qualname:line``.  The prompt is the source from the def (or its first
  decorator) to the docstring's closing quotes (without the newline after
  them, which the tokenizer merges with the next line's indentation);
  greedy completion (temperature 0, no repetition penalty) of at most
  ``--max-new-tokens`` tokens, cut before
  the first non-blank line indented no deeper than the def.  It *parses* when
  the function ended within the budget (its indentation returned, or the
  model stopped), ``ast.parse`` accepts the dedented prompt + completion, and
  the function has a statement after its docstring that is not a bare
  string.  A completion that runs to the budget counts as not parsing even
  when the text so far happens to be valid: a loop of one statement
  repeated, or of lines of three quotes, is valid Python but no function.

The held-out files come from ``train/heldout.tsv`` (written by
fetch_corpus.py) and are checked against its SHA-256; the package files need
``train/fetch_corpus.py`` to have run, the standard-library ones only this
Python (``--stdlib-only`` evaluates those alone).  ``--files``/``--functions``
take a slice for a quick smoke run: the first files in the listing's order
(the fixed standard-library modules first) and the first functions.

    python train/evaluate.py                               # the bundled model
    python train/evaluate.py --model /tmp/run --json /tmp/run/eval.json
    python train/evaluate.py --stdlib-only --files 3 --functions 3
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus as corpus_mod  # noqa: E402

MAX_PROMPT_BYTES = 400
LN2 = math.log(2.0)


# --------------------------------------------------------------------------
# held-out files
# --------------------------------------------------------------------------

def heldout_texts(listing, corpus_dir, stdlib_only=False, allow_mismatch=False, limit=None):
    """[(key, group, text)] of the listed files, in listing order.

    A file missing or different from its listed SHA-256 is an error unless
    allow_mismatch (then a missing one is skipped, a different one used as it
    is); -> (files, notes) with notes naming what differed.
    """
    files, notes = [], []
    for key, sha, _, group in corpus_mod.read_heldout_listing(listing):
        if stdlib_only and not key.startswith("stdlib/"):
            continue
        if limit is not None and len(files) >= limit:
            break
        path = corpus_mod.path_of(key, corpus_dir)
        if not path.exists():
            if not allow_mismatch:
                raise SystemExit(f"{key}: held-out file not found at {path} (run train/fetch_corpus.py, "
                                 "or pass --stdlib-only or --allow-mismatch)")
            notes.append(f"{key}: missing, skipped")
            continue
        text = corpus_mod.read_text(path)
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != sha:
            if not allow_mismatch:
                raise SystemExit(f"{key}: differs from the listed SHA-256 (another Python or package "
                                 "version?); --allow-mismatch evaluates it as it is")
            notes.append(f"{key}: differs from the listing, used as it is")
        files.append((key, group, text))
    if not files:
        raise SystemExit("no held-out files to evaluate")
    return files, notes


# --------------------------------------------------------------------------
# likelihood
# --------------------------------------------------------------------------

def doc_start(model):
    """The id a document starts after: bos, else eos, else None."""
    cfg = model.config
    for tid in (getattr(cfg, "bos_token_id", None), getattr(cfg, "eos_token_id", None)):
        if isinstance(tid, (list, tuple)):
            tid = tid[0] if tid else None
        if tid is not None:
            return int(tid)
    return None


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def token_logprobs(model, ids, context, stride):
    """Natural-log probability of ids[1:], each given up to ``context`` earlier
    ids through sliding windows (see the module docstring): float64 [len - 1]."""
    ids = np.asarray(ids, dtype=np.int64)
    n = ids.size
    out = np.empty(n - 1, dtype=np.float64)
    done = 1  # next target position to score
    begin = 0
    while done < n:
        end = min(begin + context, n)
        logits = model.forward(ids[begin:end])            # [end - begin, V]
        rows = np.arange(done - 1 - begin, end - 1 - begin)  # positions predicting done..end-1
        out[done - 1:end - 1] = log_softmax(logits[rows])[np.arange(rows.size), ids[done:end]]
        done = end
        begin += stride
    return out


def likelihood(model, files, context, stride):
    """Per group and overall: bytes, tokens, nats; -> dict group -> totals."""
    start = doc_start(model)
    totals = {}
    for key, group, text in files:
        ids = model.encode(text)
        if start is not None:
            ids = [start] + list(ids)
        lp = token_logprobs(model, ids, context, stride)
        nbytes = len(text.encode("utf-8"))
        for g in (group, "all"):
            t = totals.setdefault(g, dict(files=0, bytes=0, tokens=0, nats=0.0))
            t["files"] += 1
            t["bytes"] += nbytes
            t["tokens"] += lp.size
            t["nats"] += float(-lp.sum())
    for t in totals.values():
        t["nats_per_token"] = t["nats"] / t["tokens"]
        t["bits_per_byte"] = t["nats"] / LN2 / t["bytes"]
    return totals


# --------------------------------------------------------------------------
# code check
# --------------------------------------------------------------------------

def _functions(tree):
    """(qualname, node) of every def in the tree, nested ones included."""
    stack = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                stack.append((name + ".", child))
            else:
                stack.append((prefix, child))


def function_prompts(files, limit=30):
    """The code check's functions: [dict(key, qualname, line, indent, prompt)],
    chosen by hash (see the module docstring)."""
    found = []
    for key, _, text in files:
        lines = text.splitlines(keepends=True)
        for qualname, node in _functions(ast.parse(text)):
            body = node.body
            if len(body) < 2 or ast.get_docstring(node, clean=False) is None:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            # Up to the docstring's closing quotes, not the newline after
            # them: byte-level BPE joins that newline with the next line's
            # indentation, so a prompt ending in a bare newline leaves the
            # model a token that, in training, starts an unindented line.
            prompt = "".join(lines[first - 1:body[0].end_lineno]).rstrip("\n")
            if len(prompt.encode("utf-8")) > MAX_PROMPT_BYTES:
                continue
            indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
            tag = f"{key}:{qualname}:{node.lineno}"
            found.append((hashlib.sha256(tag.encode()).hexdigest(),
                          dict(key=key, qualname=qualname, line=node.lineno, indent=indent, prompt=prompt)))
    found.sort(key=lambda f: f[0])
    return [f[1] for f in found[:limit]]


def cut_function(completion: str, indent: int):
    """Cut before the first non-blank line indented <= indent; -> (text, finished)."""
    lines = completion.splitlines(keepends=True)
    for i, ln in enumerate(lines):
        if ln.strip() and len(ln) - len(ln.lstrip()) <= indent:
            # A last line with no newline may be unfinished: "    " then a cut.
            if i == len(lines) - 1 and not ln.endswith("\n"):
                break
            return "".join(lines[:i]), True
    return completion, False


def parses(source: str) -> bool:
    """ast accepts the dedented source and its first def has a statement after
    the docstring that is not a bare string."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None:
        return False
    return any(not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)
                    and isinstance(st.value.value, str)) for st in fn.body[1:])


def code_check(model, prompts, max_new_tokens):
    start = doc_start(model)
    results = []
    for p in prompts:
        ids = ([start] if start is not None else []) + list(model.encode(p["prompt"]))
        new = model.generate(ids, max_new_tokens=max_new_tokens, temperature=0, top_k=None, top_p=None,
                             repetition_penalty=None, truncate=True)
        completion = model.decode([t for t in new if t != start])
        body, finished = cut_function(completion, p["indent"])
        finished = finished or getattr(new, "finish_reason", None) == "eos"
        results.append(dict(p, completion=body, finished=finished,
                            parses=finished and parses(p["prompt"] + body)))
    return results


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def evaluate(model_dir=None, listing=HERE / "heldout.tsv", corpus_dir=HERE / "corpus", stdlib_only=False,
             allow_mismatch=False, files=None, functions=30, context=None, stride=None,
             max_new_tokens=128, threads=None, log=print):
    """Run both checks; -> a JSON-ready dict of the figures (see the module docstring)."""
    import cyformer

    t0 = time.time()
    model = cyformer.load(model_dir, threads=threads)
    n_pos = model.config.n_positions
    context = min(context or n_pos, n_pos)
    stride = stride or max(1, context // 2)
    if not 0 < stride <= context:
        raise SystemExit(f"--stride must be in 1..{context}")
    texts, notes = heldout_texts(listing, corpus_dir, stdlib_only, allow_mismatch, files)
    for n in notes:
        log(f"note: {n}")
    lik = likelihood(model, texts, context, stride)
    t1 = time.time()
    prompts = function_prompts(texts, functions) if functions else []
    checks = code_check(model, prompts, max_new_tokens)
    n_parse = sum(r["parses"] for r in checks)
    return dict(
        model=str(model_dir or "bundled default model"),
        parameters=int(sum(np.asarray(w).size for w in _unique_weights(model))),
        vocab_size=model.config.vocab_size,
        n_positions=n_pos,
        context=context,
        stride=stride,
        stdlib_only=stdlib_only,
        notes=notes,
        likelihood=lik,
        bits_per_byte=lik["all"]["bits_per_byte"],
        nats_per_token=lik["all"]["nats_per_token"],
        functions=len(checks),
        max_new_tokens=max_new_tokens,
        parsed=n_parse,
        parse_share=n_parse / len(checks) if checks else float("nan"),
        finished=sum(r["finished"] for r in checks),
        completions=checks,
        seconds=dict(likelihood=t1 - t0, code_check=time.time() - t1),
    )


def _unique_weights(model):
    """The checkpoint's tensors (lm_head counted once when tied)."""
    from safetensors.numpy import load_file
    path = Path(model.path) / "model.safetensors"
    if not path.exists():
        return []
    return load_file(str(path)).values()


def format_report(r) -> str:
    lines = [
        f"model: {r['model']} ({r['parameters']:,} parameters, vocab {r['vocab_size']}, "
        f"context {r['n_positions']})",
        f"held-out files, window {r['context']} tokens, stride {r['stride']}"
        + (" (standard library only)" if r["stdlib_only"] else ""),
        "",
        "| files | group | bytes | tokens | nats/token | bits/byte |",
        "|---|---|---|---|---|---|",
    ]
    for g, t in r["likelihood"].items():
        if g != "all":
            lines.append(f"| {t['files']} | {g} | {t['bytes']:,} | {t['tokens']:,} | "
                         f"{t['nats_per_token']:.4f} | {t['bits_per_byte']:.4f} |")
    t = r["likelihood"]["all"]
    lines.append(f"| {t['files']} | **all** | {t['bytes']:,} | {t['tokens']:,} | "
                 f"**{t['nats_per_token']:.4f}** | **{t['bits_per_byte']:.4f}** |")
    if r["functions"]:
        lines += ["", f"code check: {r['parsed']}/{r['functions']} greedy completions end and parse "
                      f"({100 * r['parse_share']:.1f}%); {r['finished']} of {r['functions']} ended (returned to "
                      f"the def's indentation) within {r['max_new_tokens']} tokens"]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    p.add_argument("--heldout", default=str(HERE / "heldout.tsv"), help="listing of the held-out files")
    p.add_argument("--corpus", default=str(HERE / "corpus"), help="fetch_corpus.py's directory")
    p.add_argument("--stdlib-only", action="store_true", help="only the standard-library files")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="skip missing files and use changed ones as they are")
    p.add_argument("--files", type=int, default=None, help="only the first N files (smoke run)")
    p.add_argument("--functions", type=int, default=30, help="functions in the code check")
    p.add_argument("--context", type=int, default=None, help="window (default: n_positions)")
    p.add_argument("--stride", type=int, default=None, help="window step (default: half the window)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the figures (and completions) here")
    p.add_argument("--show", action="store_true", help="print every completion")
    args = p.parse_args(argv)
    r = evaluate(args.model, args.heldout, args.corpus, args.stdlib_only, args.allow_mismatch, args.files,
                 args.functions, args.context, args.stride, args.max_new_tokens, args.threads)
    if args.show:
        for c in r["completions"]:
            flag = "parses" if c["parses"] else "does not parse"
            print(f"--- {c['key']}:{c['line']} {c['qualname']} ({flag})\n{c['prompt']}{c['completion']}")
    print(format_report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n", encoding="utf-8")
    return r


if __name__ == "__main__":
    main()
