#!/usr/bin/env python
"""Train the small default model that ships inside the cyformer wheel.

A small GPT-2 over Python source: the standard library plus permissively
licensed PyPI packages (train/corpus.py says which files, how they are
cleaned, deduplicated and split; train/fetch_corpus.py downloads the
packages once).  torch, transformers, tokenizers and matplotlib are needed
here only, never by cyformer itself.

Output directory (default ``cyformer/data/pycode``)::

    config.json             GPT2Config (HF format)
    model.safetensors       float32 weights (lm_head is tied to wte and not stored)
    tokenizer.json          byte-level BPE tokenizer (``tokenizers`` format)
    generation_config.json  sampling defaults for generate() and the CLI
    loss_curve.png          training and held-out loss against tokens seen
    MODEL_CARD.md           data, licences, split, geometry, run, evaluation

The training loop is limited by wall-clock time (``--minutes``) with a
warmup-stable-decay learning rate: warmup, a constant peak, then a linear
decay over the last ``--decay-frac`` of the budget.  The decay's first step
and the total are fixed when the decay starts, from the measured step rate,
so a shared machine that slows down early costs steps, not the schedule's
shape; ``--steps N --decay-start D`` replays the run without any timing.

    python train/fetch_corpus.py          # once, needs the network
    python train/train_default_model.py --minutes 80 --out /tmp/pycode
    python train/evaluate.py --model /tmp/pycode
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

# The machine is shared: keep the Rust tokenizer from spawning a thread pool.
# Must be set before `tokenizers` is imported.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus as corpus_mod  # noqa: E402
from corpus import EOT  # noqa: E402

# Geometry of the shipped model: the defaults (a run's card records what it used).
N_LAYER = 4
N_EMBD = 256
N_HEAD = 4
N_POSITIONS = 512
VOCAB_SIZE = 4096

# The wheel must stay under 30 MB: the rest of it is about 8.1 MB compressed
# and float32 weights barely compress (the 17.1 MB file zips to 15.9 MB).
MAX_MODEL_BYTES = 22_000_000

SAMPLE_PROMPTS = ["def fib(n):", "import os\n", "class Stack:"]
GENERATION_DEFAULTS = {"bos_token_id": 0, "eos_token_id": 0, "do_sample": True, "temperature": 0.8,
                       "top_k": 40, "repetition_penalty": 1.2}
BASELINE = HERE / "eval_pycode_v1.json"   # the previous default model's evaluation


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE with EOT as the only special token (id 0)."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code must round-trip byte for byte, and the
    # first token of a file has no preceding space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        # All 256 byte symbols, so any input is encodable even if a byte
        # never occurs in the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok: Tokenizer, texts, eot_id: int) -> np.ndarray:
    """Concatenate documents as ``doc EOT doc EOT ...`` into one id stream."""
    pieces = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray(enc.ids, dtype=np.int32))
        pieces.append(np.asarray([eot_id], dtype=np.int32))
    return np.concatenate(pieces)


# --------------------------------------------------------------------------
# training helpers
# --------------------------------------------------------------------------

def sample_windows(stream: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random windows of ``seq_len + 1`` ids (inputs plus shifted labels)."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (n,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


def lm_loss(model, windows: torch.Tensor, bf16: bool) -> torch.Tensor:
    # Explicit shift instead of passing labels=: exact control over what is
    # averaged, independent of the transformers version's loss plumbing.
    # bf16: the products in bfloat16 (autocast); weights, optimiser state
    # and the loss stay float32.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1)
    )


@torch.no_grad()
def mean_loss(model, batches, micro: int, bf16: bool) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, batches.size(0), micro):
        chunk = batches[i : i + micro]
        total += lm_loss(model, chunk, bf16).item() * chunk.size(0)
        count += chunk.size(0)
    model.train()
    return total / count


def lr_at(step: int, warmup: int, decay_start, total, peak: float, floor: float) -> float:
    """Warmup-stable-decay: linear warmup, ``peak`` until ``decay_start``
    (None: not yet decided), then linear to ``floor`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay_start is None or step < decay_start:
        return peak
    return peak + (floor - peak) * min(1.0, (step - decay_start) / max(1, total - decay_start))


# --------------------------------------------------------------------------
# loss curve
# --------------------------------------------------------------------------

def plot_losses(path: Path, losses, evals, tokens_per_step: int, decay_start, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(losses) + 1)
    x = steps * tokens_per_step / 1e6
    window = min(len(losses), max(10, len(losses) // 50))
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot(x, losses, color="#9ecae1", lw=0.6, label="training batch")
    ax.plot(x[window - 1:], smooth, color="#08519c", lw=1.5, label=f"training, mean of {window} steps")
    ev = np.array([(s, tr, va) for s, tr, va in evals], dtype=float)
    ax.plot(ev[:, 0] * tokens_per_step / 1e6, ev[:, 2], "o-", color="#d94801", label="held-out files")
    if decay_start is not None:
        ax.axvline(decay_start * tokens_per_step / 1e6, color="grey", ls=":", lw=1, label="LR decay starts")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(max(0.0, min(smooth.min(), ev[:, 2].min()) - 0.3), min(9.0, float(np.percentile(losses, 99)) + 0.3))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------
# card
# --------------------------------------------------------------------------

def fmt_bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def fenced(text: str) -> str:
    # Generated code may itself contain backtick fences.
    fence = "````" if "```" in text else "```"
    return f"{fence}python\n{text}\n{fence}"


def cpu_name() -> str:
    try:
        for ln in open("/proc/cpuinfo", encoding="utf-8"):
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def eval_rows(name, r):
    """Markdown table rows of one evaluate.py result."""
    lik = r["likelihood"]
    groups = [g for g in ("stdlib-modules", "hash-split") if g in lik]
    cells = [f"{lik[g]['bits_per_byte']:.3f}" for g in groups]
    return (f"| {name} | {r['parameters'] / 1e6:.2f} M | {r['context']}/{r['stride']} | "
            f"{' | '.join(cells)} | **{r['bits_per_byte']:.3f}** | {r['nats_per_token']:.3f} | "
            f"{r['parsed']}/{r['functions']} ({100 * r['parse_share']:.0f}%) |")


def write_card(out: Path, i: dict) -> None:
    c = i["corpus"]
    lines = [
        "# cyformer default model: `pycode`",
        "",
        "A small GPT-2 language model over Python source code. It ships inside the",
        "cyformer wheel so the engine has something real to run, test and inspect",
        "without downloading anything.",
        "",
        "## Intended use",
        "",
        "A demo of the engine (`cyformer generate \"def fib(n):\"`), the subject of the",
        "tutorial and a test fixture for the engine and its interpretability tools.",
        "It is **not a coding assistant**: it writes Python-looking text, often wrong,",
        "and it may reproduce fragments of its training code.",
        "",
        "Rebuild it with (after `python train/fetch_corpus.py`, which downloads the packages):",
        "",
        "```",
        i["command"],
        "```",
        "",
        "## Training data",
        "",
        f"- The `.py` files of the Python {i['python_version']} standard library (PSF-2.0),",
        "  read from the running interpreter (`sysconfig.get_paths()[\"stdlib\"]`, without",
        "  `site-packages`); its test suites count as a separate source, `stdlib-tests`.",
        f"- The `.py` files of {len(c['packages'])} PyPI packages under MIT, BSD, Apache-2.0 or",
        "  PSF licences: exact wheels pinned by hash in `train/corpus_requirements.txt`;",
        "  `train/fetch_corpus.py` reads each licence from the wheel's metadata",
        "  (License-Expression, else every License classifier and the License field",
        "  must be permissive) and refuses any other.",
        "",
        "Cleaning (`train/corpus.py`), in this order; files dropped:",
        "",
        "| reason | files |",
        "|---|---|",
    ]
    lines += [f"| {reason} | {n:,} |" for reason, n in sorted(c["dropped"].items(), key=lambda kv: -kv[1])]
    lines += [
        "",
        f"A file must be UTF-8, at most {corpus_mod.MAX_FILE_BYTES // 1000} kB, with lines under "
        f"{corpus_mod.MAX_LINE_CHARS} characters",
        f"(mean under {corpus_mod.MAX_MEAN_LINE_CHARS}), at least {corpus_mod.MIN_ALNUM_FRACTION:.0%} "
        "alphanumeric, not marked as",
        "generated in its first five lines, and accepted by `ast.parse`. Duplicates go by",
        "SHA-256 of the bytes and of the normalised text (indentation, blank lines and",
        "comment-only lines removed); the first copy wins, the standard library before",
        f"the packages. Each source except the standard library proper is then capped at "
        f"{corpus_mod.SOURCE_CAP_BYTES / 1e6:g} MB,",
        "files taken in the order of their key's SHA-256.",
        "",
        "### Split",
        "",
        "Held out by whole file, never seen by the tokenizer or the training loop:",
        "",
        "- the standard-library modules " + ", ".join(f"`{m}`" for m in corpus_mod.STDLIB_HELDOUT) + ";",
        "- every other file whose key (`stdlib/<path>` or `pypi/<package>/<path>`) hashes",
        f"  (SHA-256, first 4 bytes mod 1000) below {corpus_mod.HELDOUT_PERMILLE}.",
        "",
        "`train/heldout.tsv` lists the held-out files with their SHA-256.",
        "",
        "| split | files | bytes | tokens |",
        "|---|---|---|---|",
        f"| training | {c['train_files']:,} | {c['train_bytes']:,} | {i['train_tokens']:,} |",
        f"| held out | {c['heldout_files']:,} | {c['heldout_bytes']:,} | {i['heldout_tokens']:,} |",
        "",
        "Training files are joined in corpus order (the standard library, then the packages",
        "in pin order, each by path) with `<|endoftext|>` after each; batches are random",
        "windows of that stream.",
        "",
        "### Sources and licences",
        "",
        "| source | version | licence (from) | files | bytes | held out |",
        "|---|---|---|---|---|---|",
    ]
    for s in c["sources"]:
        lines.append(f"| {s['source']} | {s['version']} | {s['licence']} ({s['licence_from']}) | "
                     f"{s['files']:,} | {s['bytes']:,} | {s['heldout_files']} |")
    lines += [
        "",
        "The model is trained on this code and its samples may reproduce fragments of it.",
        "",
        "## Tokenizer",
        "",
        f"- Byte-level BPE (`tokenizers` {i['tokenizers_version']}), trained on the",
        "  training split only; GPT-2 pre-tokenization regex, `add_prefix_space=False`,",
        "  ByteLevel decoder; no post-processor (nothing is added when encoding).",
        f"- Vocabulary: {i['vocab_size']} tokens. `<|endoftext|>` is the only special",
        f"  token, id {i['eot_id']}; it is `bos_token_id` and `eos_token_id` in `config.json`.",
        f"- Compression: {c['train_bytes'] / i['train_tokens']:.2f} bytes per token on the training split.",
        "",
        "## Model",
        "",
        f"- `GPT2LMHeadModel`: n_layer={i['n_layer']}, n_embd={i['n_embd']}, n_head={i['n_head']},",
        f"  n_positions={i['n_positions']}, vocab_size={i['vocab_size']}, activation `gelu_new`",
        "  (trained as PyTorch's fused `gelu_pytorch_tanh`, the same formula),",
        "  layer-norm epsilon 1e-5, no dropout.",
        "- `lm_head` is tied to `transformer.wte`; `model.safetensors` stores only",
        "  `wte` (HF drops the tied copy), so readers must reuse it for the output",
        "  projection.",
        f"- Parameters: {i['n_params']:,} (unique, tied embedding counted once).",
        "- Weights: float32.",
        "",
        "## Files",
        "",
        "| file | size |",
        "|---|---|",
    ]
    for name, size in i["file_sizes"].items():
        lines.append(f"| `{name}` | {fmt_bytes(size)} |")
    lines += [
        f"| **total** | {fmt_bytes(sum(i['file_sizes'].values()))} |",
        "",
        "`generation_config.json` sets the sampling defaults that `generate` and `cyformer generate`",
        "use when no sampling argument is given: temperature 0.8, top-k 40, repetition penalty 1.2",
        "(`temperature=0` or `-t 0` asks for greedy).",
        "",
        "## Training",
        "",
        f"- Seed {i['seed']}; torch {i['torch_version']}, transformers {i['transformers_version']};",
        f"  {i['threads']} CPU thread(s) of an {i['cpu']} (`{i['machine']}`)"
        + (", products in bfloat16 (autocast), weights and optimiser state float32." if i["bf16"] else "."),
        f"- AdamW (betas 0.9/0.95, weight decay {i['weight_decay']} on matrices only), gradient",
        f"  clipping at 1.0; learning rate: {i['warmup']} warmup steps to {i['lr']:g}, constant, then",
        f"  linear to {i['min_lr']:g} from step {i['decay_start']} to the end (warmup-stable-decay).",
        f"- Batches of {i['batch_size']} random windows of {i['seq_len']} tokens",
        f"  ({i['batch_size'] * i['seq_len']:,} tokens per step).",
        f"- {i['steps']:,} steps, {i['tokens_seen']:,} tokens seen",
        f"  ({i['tokens_seen'] / i['train_tokens']:.2f} passes over the training split),",
        f"  {i['tokens_seen'] / i['train_seconds']:,.0f} tokens/s on average.",
        f"- Training loop wall time: {i['train_seconds'] / 60:.1f} min"
        f" (budget {i['budget_minutes']:g} min); whole script: {i['total_seconds'] / 60:.1f} min"
        " (corpus, tokenizer, samples and evaluation included).",
    ]
    if not i["steps_from_budget"]:
        lines.append("- Step count given explicitly with `--steps`.")
    elif i["stopped_early"]:
        lines.append(
            f"- The run stopped at the 1.25x time cap after {i['steps']} of the {i['planned_steps']}"
            " planned steps (the shared machine slowed down during the decay), so the LR had not fully"
            f" decayed. `--steps {i['steps']} --decay-start {i['decay_start']} --schedule-steps"
            f" {i['planned_steps']}` replays it without timing."
        )
    else:
        lines.append(
            f"- The decay's start and the total were fixed from the measured step rate;"
            f" `--steps {i['steps']} --decay-start {i['decay_start']}` replays this run without timing."
        )
    lines += [
        "",
        "![training and held-out loss](loss_curve.png)",
        "",
        "Mean next-token cross-entropy (nats) on fixed sets of "
        f"{i['eval_windows']} windows of {i['seq_len']} tokens",
        "from each split:",
        "",
        "| step | training | held out |",
        "|---|---|---|",
    ]
    for step, tr, va in i["evals"]:
        lines.append(f"| {step} | {tr:.4f} | {va:.4f} |")
    if i.get("evaluation"):
        r = i["evaluation"]
        lines += [
            "",
            "## Evaluation",
            "",
            "`python train/evaluate.py --model <dir>` (through cyformer): bits per byte and nats per",
            "token over every held-out file (sliding window: context/stride in tokens), and",
            f"the share of {r['functions']} greedy completions of held-out functions (the def and",
            f"its docstring as the prompt, at most {r['max_new_tokens']} new tokens, cut where",
            "the indentation returns to the def's) that end within that budget and that",
            "`ast.parse` accepts with a statement after the docstring that is not a bare string.",
            "",
            "| model | parameters | context/stride | bits/byte: stdlib modules | hash split | **all** "
            "| nats/token | functions that parse |",
            "|---|---|---|---|---|---|---|---|",
        ]
        if i.get("baseline"):
            lines.append(eval_rows("previous (4x256, stdlib only, 37 min on 1 thread)", i["baseline"]))
        lines.append(eval_rows("this model", r))
    lines += [
        "",
        "## Samples",
        "",
        f"Produced by `transformers` `generate` on the saved model, {i['sample_tokens']} new tokens each.",
        "Greedy is `do_sample=False`; sampled uses the shipped defaults",
        "(`temperature=0.8, top_k=40, repetition_penalty=1.2`)"
        f" with `torch.manual_seed({i['seed']})` before each prompt.",
        "",
    ]
    for prompt, greedy, sampled in i["samples"]:
        lines += [f"### Prompt {json.dumps(prompt)}", "", "Greedy:", "", fenced(greedy), "",
                  "Sampled:", "", fenced(sampled), ""]
    (out / "MODEL_CARD.md").write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train cyformer's default GPT-2 model on Python source code.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="cyformer/data/pycode", help="output directory")
    p.add_argument("--corpus", default=str(HERE / "corpus"), help="fetch_corpus.py's directory")
    p.add_argument("--stdlib-only", action="store_true", help="train on the standard library alone")
    p.add_argument("--limit-files", type=int, default=None, help="a toy corpus of about N files (tests)")
    p.add_argument("--minutes", type=float, default=80.0, help="wall-clock budget of the training loop")
    p.add_argument("--steps", type=int, default=None,
                   help="exact number of optimisation steps (overrides --minutes; reproduces a run)")
    p.add_argument("--decay-start", type=int, default=None,
                   help="with --steps: the step where the LR decay starts (default: --decay-frac of the steps)")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="with --steps: where the decay would have ended (replays a run cut by the time cap)")
    p.add_argument("--decay-frac", type=float, default=0.2, help="share of the budget spent decaying the LR")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bfloat16 autocast for the products")
    p.add_argument("--n-layer", type=int, default=N_LAYER)
    p.add_argument("--n-embd", type=int, default=N_EMBD)
    p.add_argument("--n-head", type=int, default=N_HEAD)
    p.add_argument("--n-positions", type=int, default=N_POSITIONS)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="training window (default: n_positions)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-windows", type=int, default=64, help="fixed windows per split for evaluation")
    p.add_argument("--evals", type=int, default=8, help="evaluations during training (plus one at the end)")
    p.add_argument("--evaluate", action=argparse.BooleanOptionalAction, default=True,
                   help="run train/evaluate.py on the saved model (needs cyformer) for the card")
    p.add_argument("--eval-functions", type=int, default=30)
    args = p.parse_args(argv)
    args.seq_len = args.seq_len or args.n_positions
    if args.seq_len > args.n_positions:
        p.error(f"--seq-len must be <= --n-positions ({args.n_positions})")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be a multiple of --n-head")
    if (args.decay_start is not None or args.schedule_steps is not None) and args.steps is None:
        p.error("--decay-start and --schedule-steps replay a run: give --steps too")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # Imported late: transformers is slow to import and --help should be fast.
    import transformers
    import tokenizers
    from tqdm import tqdm
    from transformers import GPT2Config, GPT2LMHeadModel

    def log(msg: str) -> None:
        tqdm.write(f"[{time.time() - t_start:7.1f}s] {msg}")
        sys.stdout.flush()

    # ---- corpus ----------------------------------------------------------
    corpus = corpus_mod.build(args.corpus, stdlib_only=args.stdlib_only, limit=args.limit_files)
    train_texts = [d.text for d in corpus.train]
    val_texts = [d.text for d in corpus.heldout]
    log(f"corpus: {len(train_texts)} training / {len(val_texts)} held-out files; dropped {dict(corpus.dropped)}")

    # ---- tokenizer -------------------------------------------------------
    tok = train_tokenizer(train_texts, args.vocab_size)
    eot_id = tok.token_to_id(EOT)
    vocab_size = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    log(f"tokenizer: vocab {vocab_size}, {EOT} = {eot_id}")

    train_ids = torch.from_numpy(encode_stream(tok, train_texts, eot_id)).long()
    val_ids = torch.from_numpy(encode_stream(tok, val_texts, eot_id)).long()
    log(f"tokens: training {train_ids.numel():,}, held out {val_ids.numel():,}")

    # ---- model -----------------------------------------------------------
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        # PyTorch's fused tanh GELU: GPT-2's gelu_new formula in one kernel
        # (the unfused one costs a tenth of a CPU step); saved as gelu_new.
        activation_function="gelu_pytorch_tanh",
        # Far less than one pass over the corpus: dropout would only slow learning.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())  # tied weights appear once
    log(f"model: {n_params:,} parameters ({n_params * 4:,} bytes in float32)")
    if n_params * 4 > MAX_MODEL_BYTES:
        sys.exit(f"{n_params:,} float32 parameters are {n_params * 4:,} bytes, over the "
                 f"{MAX_MODEL_BYTES:,} that keep the wheel under 30 MB")

    # Weight decay on matrices only; biases, LayerNorm gains and the
    # (tied) embeddings keep their scale.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and "wte" not in name and "wpe" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    # Separate generators: the evaluation sets must not depend on how many
    # training batches were drawn before them.
    data_gen = torch.Generator().manual_seed(args.seed)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    eval_train = sample_windows(train_ids, args.eval_windows, args.seq_len, eval_gen)
    eval_val = sample_windows(val_ids, args.eval_windows, args.seq_len, eval_gen)

    # ---- schedule --------------------------------------------------------
    # With --minutes the decay starts when (1 - decay_frac) of the budget is
    # spent; its length in steps comes from the recent step rate.  With
    # --steps everything is a function of the step.
    budget_s = args.minutes * 60.0
    steps_from_budget = args.steps is None
    if steps_from_budget:
        total_steps = stop_at = decay_start = None
        eval_times = [budget_s * k / (args.evals + 1) for k in range(1, args.evals + 1)]
    else:
        stop_at = args.steps
        total_steps = args.schedule_steps or args.steps
        decay_start = args.decay_start if args.decay_start is not None else \
            round(total_steps * (1 - args.decay_frac))
        eval_steps = {round(stop_at * k / (args.evals + 1)) for k in range(1, args.evals + 1)}
    if args.warmup >= (args.steps or 10**9):
        sys.exit("--warmup must be shorter than the run")

    evals, losses = [], []
    eval_cost = 0.0
    stopped_early = False

    def run_eval(step):
        nonlocal eval_cost
        t0 = time.time()
        tr = mean_loss(model, eval_train, args.batch_size, args.bf16)
        va = mean_loss(model, eval_val, args.batch_size, args.bf16)
        eval_cost += time.time() - t0
        evals.append((step, tr, va))
        log(f"eval step {step}: training {tr:.4f}  held out {va:.4f}")

    run_eval(0)
    eval_cost = 0.0
    t_train = time.time()
    step = 0
    recent = collections.deque(maxlen=50)   # seconds per training step, evals excluded
    bar = tqdm(total=stop_at, file=sys.stdout, disable=not sys.stdout.isatty())
    while True:
        elapsed = time.time() - t_train
        if stop_at is not None and step >= stop_at:
            break
        if steps_from_budget:
            if decay_start is None and step > args.warmup and elapsed >= (1 - args.decay_frac) * budget_s:
                per_step = sorted(recent)[len(recent) // 2]   # median: robust to a slow step
                evals_left = sum(t > elapsed for t in eval_times)
                per_eval = eval_cost / max(1, len(evals) - 1)
                left = budget_s - elapsed - evals_left * per_eval
                decay_start = step
                total_steps = stop_at = step + max(1, int(left / per_step))
                bar.reset(total=stop_at)
                bar.update(step)
                log(f"decay: {per_step:.3f} s/step -> steps {decay_start}..{total_steps}")
            if elapsed > 1.25 * budget_s:
                # The other processes on the machine slowed us down far beyond
                # the measured rate; honour the budget over finishing the decay.
                log(f"time cap hit at step {step} of {total_steps}")
                stopped_early = True
                break

        t_step = time.time()
        lr = lr_at(step, args.warmup, decay_start, total_steps, args.lr, args.min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_windows(train_ids, args.batch_size, args.seq_len, data_gen)
        loss = lm_loss(model, batch, args.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        recent.append(time.time() - t_step)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}", refresh=False)
        if step % 100 == 0 and bar.disable:
            log(f"step {step}/{total_steps or '?'}  loss {losses[-1]:.4f}  lr {lr:.2e}  "
                f"{args.batch_size * args.seq_len / recent[-1]:.0f} tokens/s")
        if steps_from_budget:
            while eval_times and time.time() - t_train >= eval_times[0]:
                eval_times.pop(0)
                run_eval(step)
        elif step in eval_steps:
            run_eval(step)
    bar.close()
    train_seconds = time.time() - t_train
    if evals[-1][0] != step:
        run_eval(step)
    log(f"trained {step} steps in {train_seconds / 60:.1f} min")

    # ---- save ------------------------------------------------------------
    # The fused activation computes gelu_new; readers (cyformer, TransformerLens,
    # older transformers) know GPT-2's own name.
    model.config.activation_function = "gelu_new"
    # transformers >= 5 always writes safetensors and ignores the flag;
    # 4.x needs it.
    model.save_pretrained(out, safe_serialization=True)
    if (out / "pytorch_model.bin").exists():
        (out / "pytorch_model.bin").unlink()
    # Sampling defaults for generate() and the CLI: greedy decoding of a model
    # this small loops, so the shipped defaults sample.
    gen_defaults = dict(GENERATION_DEFAULTS, bos_token_id=eot_id, eos_token_id=eot_id)
    (out / "generation_config.json").write_text(json.dumps(gen_defaults, indent=2) + "\n")
    tokens_per_step = args.batch_size * args.seq_len
    geometry = f"{args.n_layer}x{args.n_embd}"
    plot_losses(out / "loss_curve.png", losses, evals, tokens_per_step, decay_start,
                f"pycode {geometry}, {n_params / 1e6:.1f}M parameters: {step:,} steps, "
                f"{train_seconds / 60:.0f} min on {args.threads} CPU threads")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                 "loss_curve.png"):
        # The weights are written through a private temp file (mode 0600).
        (out / name).chmod(0o644)

    # ---- samples from the *saved* model ----------------------------------
    reloaded = GPT2LMHeadModel.from_pretrained(out).eval()
    tok2 = Tokenizer.from_file(str(out / "tokenizer.json"))
    sample_tokens = 80
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok2.encode(prompt).ids])
        outs = []
        for kw in (dict(do_sample=False),
                   dict(do_sample=True, temperature=GENERATION_DEFAULTS["temperature"],
                        top_k=GENERATION_DEFAULTS["top_k"],
                        repetition_penalty=GENERATION_DEFAULTS["repetition_penalty"])):
            torch.manual_seed(args.seed)
            with torch.no_grad():
                gen = reloaded.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=min(sample_tokens, args.n_positions - ids.size(1)),
                                        pad_token_id=eot_id, eos_token_id=eot_id, **kw)
            outs.append(tok2.decode(gen[0].tolist(), skip_special_tokens=False))
        samples.append((prompt, *outs))
        log(f"sample {prompt!r} (greedy):\n{outs[0]}")

    # ---- evaluation (cyformer) -------------------------------------------
    evaluation = None
    if args.evaluate:
        import evaluate as evaluate_mod
        try:
            evaluation = evaluate_mod.evaluate(out, stdlib_only=args.stdlib_only, functions=args.eval_functions,
                                               allow_mismatch=args.limit_files is not None,
                                               threads=args.threads, log=log)
        except ImportError as e:
            sys.exit(f"the evaluation needs cyformer importable ({e}); build it or pass --no-evaluate")
        log("evaluation:\n" + evaluate_mod.format_report(evaluation))

    # ---- card ------------------------------------------------------------
    files = ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "loss_curve.png"]
    file_sizes = {f: (out / f).stat().st_size for f in files}
    stats = corpus.source_stats()
    py = platform.python_version()
    rows = [dict(source=s, version=py, licence="PSF-2.0", licence_from="Python licence")
            for s in ("stdlib", "stdlib-tests")]
    rows += [dict(source=p["name"], version=p["version"], licence=p["licence"], licence_from=p["licence_from"])
             for p in corpus.packages]
    zero = dict(files=0, bytes=0, heldout_files=0, heldout_bytes=0)
    sources = [dict(r, **stats.get(r["source"], zero)) for r in rows]
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else None
    info = dict(
        command="python train/train_default_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
        python_version=py,
        corpus=dict(
            packages=corpus.packages,
            dropped=dict(corpus.dropped),
            sources=sources,
            train_files=len(train_texts),
            heldout_files=len(val_texts),
            train_bytes=sum(len(t.encode("utf-8")) for t in train_texts),
            heldout_bytes=sum(len(t.encode("utf-8")) for t in val_texts),
        ),
        train_tokens=train_ids.numel(),
        heldout_tokens=val_ids.numel(),
        tokenizers_version=tokenizers.__version__,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        vocab_size=vocab_size,
        eot_id=eot_id,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        n_positions=args.n_positions,
        n_params=n_params,
        file_sizes=file_sizes,
        seed=args.seed,
        threads=args.threads,
        bf16=args.bf16,
        cpu=cpu_name(),
        machine=f"{platform.machine()}, {platform.system()}",
        weight_decay=args.weight_decay,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup=args.warmup,
        decay_start=decay_start,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=step,
        planned_steps=total_steps,
        tokens_seen=step * tokens_per_step,
        train_seconds=train_seconds,
        total_seconds=time.time() - t_start,
        budget_minutes=args.minutes,
        steps_from_budget=steps_from_budget,
        stopped_early=stopped_early,
        eval_windows=args.eval_windows,
        evals=evals,
        evaluation=evaluation,
        baseline=baseline,
        sample_tokens=sample_tokens,
        samples=samples,
    )
    write_card(out, info)
    total = sum(file_sizes.values())
    log(f"wrote {out}: {', '.join(f'{k} {v:,} B' for k, v in file_sizes.items())}; total {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
