"""Which cells of TransformerLens 4's Main Demo and Exploratory Analysis Demo
run unchanged on cyformer's TransformerBridge, beside TransformerLens's own.

The notebooks are not part of cyformer: pass a TransformerLens checkout's
demos/ folder.  Each code cell runs as written, in order, in one namespace
per engine; the only difference between the engines is where
TransformerBridge comes from (``transformer_lens.model_bridge`` or
``cyformer.tl``) and the model name, which points at a local checkpoint
written here: random weights (GPT-2 architecture, 12 layers x 12 heads, d_model
96, so the demos' layer and head indices exist) and a word-level tokenizer
holding every word of the demos' strings, so their one-token names (" John",
" Mary") are one token.  Plots and widgets (plotly, circuitsvis, IPython
display) are stand-ins that accept anything; the cells that install packages
or load other checkpoints from the Hub are reported as such.

    python bench/tl_demos.py /path/to/TransformerLens/demos
"""

import argparse
import ast
import json
import os
import re
import sys
import tempfile
import traceback
from unittest import mock

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

DEMOS = ("Main_Demo", "Exploratory_Analysis_Demo")
VOCAB = 20480  # the demos draw random tokens up to 20000


def cells(path):
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def strings(code):
    """Every string literal of the cells that parse, and those in f-strings' text."""
    out = []
    for cell in code:
        try:
            tree = ast.parse(re.sub(r"^\s*[%!].*$", "", cell, flags=re.M))
        except SyntaxError:
            continue
        out += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return out


def write_checkpoint(path, texts):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import GPT2Config, GPT2LMHeadModel

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = {"<|endoftext|>": 0}
    for alphabet in pre_tokenizers.ByteLevel.alphabet():
        words.setdefault(alphabet, len(words))
    for t in texts:
        for piece, _ in pre.pre_tokenize_str(t):
            words.setdefault(piece, len(words))
    for i in range(len(words), VOCAB):
        words[f"<w{i}>"] = i
    tok = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:  # transformers: use tokenizer.json as is
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>"}, f)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=96, n_inner=384, n_positions=256, vocab_size=VOCAB,
                     bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(path, safe_serialization=True)
    return path


def run(code, engine, checkpoint):
    """Each cell on one engine -> list of (status, message).  A cell runs
    statement by statement, so one failing import does not hide the rest
    (the first failure is what is reported)."""
    import torch

    namespace = {"display": mock.MagicMock(), "__name__": "__demo__"}
    results = []
    for cell in code:
        src = re.sub(r"^(\s*)[%!].*$", r"\1pass", cell, flags=re.M)  # notebook magics, pip installs
        src = src.replace('"openai-community/gpt2"', repr(checkpoint)).replace('"gpt2"', repr(checkpoint))
        src = src.replace('"distilgpt2"', repr(checkpoint))
        if engine == "cyformer":
            src = src.replace("from transformer_lens.model_bridge import TransformerBridge",
                              "from cyformer.tl import TransformerBridge")
        failure = None
        for stmt in ast.parse(src).body:
            try:
                exec(compile(ast.Module([stmt], []), "<cell>", "exec"), namespace)
            except Exception as e:  # noqa: BLE001  the point is to record what fails
                if failure is None:
                    tb = traceback.extract_tb(e.__traceback__)
                    where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                                  if "cyformer" in f.filename or "transformer_lens" in f.filename), "")
                    failure = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''} {where}"
        results.append(("fails", failure) if failure else ("ok", ""))
    torch.set_grad_enabled(True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("demos", help="a TransformerLens checkout's demos/ folder")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "cyformer-tl-demos"))
    args = ap.parse_args()
    os.environ["GITHUB_ACTIONS"] = "true"  # the demos' own switch: skip the cells that fetch other models
    import transformer_lens.utilities  # noqa: F401  imported once, before the stand-ins
    for name in ("plotly", "plotly.express", "plotly.io", "circuitsvis", "circuitsvis.attention", "IPython",
                 "IPython.display", "google.colab"):
        sys.modules[name] = mock.MagicMock()  # plots and widgets accept anything
    sys.modules["google.colab"] = None  # "import google.colab" fails, as outside Colab
    code = {d: cells(os.path.join(args.demos, d + ".ipynb")) for d in DEMOS}
    checkpoint = write_checkpoint(args.dir, [s for d in DEMOS for s in strings(code[d])])
    for d in DEMOS:
        theirs = run(code[d], "transformer_lens", checkpoint)
        ours = run(code[d], "cyformer", checkpoint)
        print(f"\n## {d}: {len(code[d])} code cells\n")
        print("| cell | TransformerLens 4.3 bridge | cyformer | first failure |")
        print("|---|---|---|---|")
        for i, ((a, ma), (b, mb)) in enumerate(zip(theirs, ours)):
            why = "; ".join(x for x in (f"TL: {ma}" if ma else "", f"cyformer: {mb}" if mb else "") if x)
            print(f"| {i} | {a} | {b} | {why.replace('|', '/')} |")
        n = sum(1 for (a, _), (b, _) in zip(theirs, ours) if a == "ok")
        m = sum(1 for (a, _), (b, _) in zip(theirs, ours) if a == "ok" and b == "ok")
        print(f"\n{m} of the {n} cells that run on TransformerLens 4's bridge run unchanged on cyformer's.")


if __name__ == "__main__":
    main()
