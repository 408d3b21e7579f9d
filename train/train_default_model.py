#!/usr/bin/env python
"""Train the small default model that ships inside the cyformer wheel.

The model is a 4-layer GPT-2 trained on the Python standard library's own
source code, so it can be rebuilt from nothing but a Python install, torch,
transformers and tokenizers -- no downloads, no external data set.

Output directory (default ``cyformer/data/pycode``)::

    config.json         GPT2Config (HF format)
    model.safetensors   float32 weights (lm_head is tied to wte and not stored)
    tokenizer.json      byte-level BPE tokenizer (``tokenizers`` format)
    MODEL_CARD.md       corpus, geometry, training run and measured losses

The training loop is limited by wall-clock time (``--minutes``).  The number
of optimisation steps is fixed after a short calibration so that the learning
rate schedule is a plain function of the step; the card records that number,
and ``--steps N`` replays the same run without any timing involved.

Example::

    python train/train_default_model.py --minutes 30 --seed 1234
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

# The machine is shared: keep the Rust tokenizer from spawning a thread pool.
# Must be set before `tokenizers` is imported.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

EOT = "<|endoftext|>"

# Fixed geometry of the shipped model; deliberately not command-line options
# so that "the default model" means one thing.
N_LAYER = 4
N_EMBD = 256
N_HEAD = 4
N_POSITIONS = 256

SAMPLE_PROMPTS = ["def fib(n):", "import os\n", "class Stack:"]
GENERATION_DEFAULTS = {"bos_token_id": 0, "eos_token_id": 0, "do_sample": True, "temperature": 0.8,
                       "top_k": 40, "repetition_penalty": 1.2}


# --------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------

def is_validation(rel_path: str, val_permille: int) -> bool:
    """Deterministic split keyed on the file's path, not its position.

    Hashing the relative path keeps a file on the same side of the split
    across Python patch releases that add or remove other files.
    """
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < val_permille


def collect_stdlib(val_permille: int):
    """Return (root, train_files, val_files, skipped) of stdlib ``.py`` sources.

    Each file entry is ``(relative_path, text)``.  Files that are not valid
    UTF-8 (a few deliberately broken test fixtures) are skipped rather than
    decoded lossily, so the tokenizer never learns replacement characters.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Third-party packages are not part of the stdlib (nor PSF-licensed).
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                paths.append(Path(dirpath, name))
    # Sort on the POSIX relative path so the order is platform independent.
    paths.sort(key=lambda p: p.relative_to(root).as_posix())

    train, val, skipped = [], [], []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if EOT in text:
            # Would be tokenized as a document boundary; never happens in
            # practice, but keep the separator unambiguous.
            skipped.append(rel)
            continue
        (val if is_validation(rel, val_permille) else train).append((rel, text))
    return root, train, val, skipped


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


def lm_loss(model, windows: torch.Tensor) -> torch.Tensor:
    # Explicit shift instead of passing labels=: exact control over what is
    # averaged, independent of the transformers version's loss plumbing.
    logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1)
    )


@torch.no_grad()
def evaluate(model, batches, micro: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, batches.size(0), micro):
        chunk = batches[i : i + micro]
        total += lm_loss(model, chunk).item() * chunk.size(0)
        count += chunk.size(0)
    model.train()
    return total / count


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warmup, then cosine decay from ``peak`` to ``floor``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------
# card
# --------------------------------------------------------------------------

def fmt_bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def fenced(text: str) -> str:
    # Generated code may itself contain backtick fences.
    fence = "````" if "```" in text else "```"
    return f"{fence}python\n{text}\n{fence}"


def write_card(out: Path, info: dict) -> None:
    i = info
    lines = [
        "# cyformer default model: `pycode`",
        "",
        "A tiny GPT-2 language model over Python source code. It ships inside the",
        "cyformer wheel so the engine has something real to run, test and inspect",
        "without downloading anything. It writes Python-*looking* text; it is",
        "not a useful code assistant.",
        "",
        "Rebuild it with:",
        "",
        "```",
        i["command"],
        "```",
        "",
        "## Corpus",
        "",
        f"- The `.py` files of the Python {i['python_version']} standard library",
        f"  found at `{i['stdlib_root']}` (everything under",
        "  `sysconfig.get_paths()[\"stdlib\"]`, including its `test/` and",
        "  `idlelib/` packages, excluding `site-packages`).",
        f"- {i['n_files']} files read; {i['n_skipped']} skipped (not valid UTF-8):",
        f"  {', '.join('`' + s + '`' for s in i['skipped']) or 'none'}.",
        f"- Split by SHA-256 of the relative path: {i['n_train_files']} training files",
        f"  ({i['train_chars']:,} characters, {i['train_tokens']:,} tokens) and",
        f"  {i['n_val_files']} validation files ({i['val_chars']:,} characters,",
        f"  {i['val_tokens']:,} tokens; {i['val_permille'] / 10:.1f}% target).",
        "- Files are concatenated in sorted path order with `<|endoftext|>` after each.",
        "- Licence: the Python standard library is distributed under the",
        "  Python Software Foundation License (PSF License Agreement, version 2).",
        "  This model is trained on that code and its samples may reproduce",
        "  fragments of it.",
        "",
        "## Tokenizer",
        "",
        f"- Byte-level BPE (`tokenizers` {i['tokenizers_version']}), trained on the",
        "  training split only; GPT-2 pre-tokenization regex, `add_prefix_space=False`,",
        "  ByteLevel decoder; no post-processor (nothing is added when encoding).",
        f"- Vocabulary: {i['vocab_size']} tokens. `<|endoftext|>` is the only special",
        f"  token, id {i['eot_id']}; it is `bos_token_id` and `eos_token_id` in `config.json`.",
        f"- Compression: {i['train_chars'] / i['train_tokens']:.2f} characters per token on the training split.",
        "",
        "## Model",
        "",
        f"- `GPT2LMHeadModel`: n_layer={N_LAYER}, n_embd={N_EMBD}, n_head={N_HEAD},",
        f"  n_positions={N_POSITIONS}, vocab_size={i['vocab_size']}, activation `gelu_new`,",
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
        "(greedy decoding of a model this small repeats itself: see the samples below;",
        "`temperature=0` or `-t 0` asks for greedy).",
        "",
        "## Training",
        "",
        f"- Seed {i['seed']}; torch {i['torch_version']}, transformers {i['transformers_version']},",
        f"  {i['threads']} CPU thread(s) on `{i['machine']}`.",
        f"- AdamW (betas 0.9/0.95, weight decay {i['weight_decay']} on matrices only),",
        f"  peak LR {i['lr']:g}, {i['warmup']} warmup steps, cosine decay to {i['min_lr']:g};",
        "  gradient clipping at 1.0.",
        f"- Batches of {i['batch_size']} random windows of {i['seq_len']} tokens",
        f"  ({i['batch_size'] * i['seq_len']:,} tokens per step).",
        f"- {i['steps']} steps, {i['tokens_seen']:,} tokens seen",
        f"  ({i['tokens_seen'] / i['train_tokens']:.2f} passes over the training split).",
        f"- Training loop wall time: {i['train_seconds'] / 60:.1f} min"
        f" (budget {i['budget_minutes']:g} min); whole script incl. tokenizer: {i['total_seconds'] / 60:.1f} min.",
    ]
    if not i["steps_from_budget"]:
        lines.append("- Step count given explicitly with `--steps`.")
    elif i["stopped_early"]:
        lines.append(
            f"- The schedule was fixed at {i['planned_steps']} steps after timing the first"
            f" {i['calib_steps']}, but the run stopped at the 1.25x time cap after {i['steps']}"
            " (the shared machine got busier than during calibration), so the LR had not fully"
            f" decayed. `--steps {i['steps']} --schedule-steps {i['planned_steps']}` replays it"
            " without timing."
        )
    else:
        lines.append(
            f"- The step count was fixed after timing the first {i['calib_steps']} steps;"
            f" `--steps {i['steps']}` replays this run without timing."
        )
    lines += [
        "",
        "## Losses (measured)",
        "",
        f"Mean next-token cross-entropy (nats) on fixed sets of {i['eval_windows']} windows",
        f"of {i['seq_len']} tokens drawn from each split:",
        "",
        "| step | train | validation |",
        "|---|---|---|",
    ]
    for step, tr, va in i["evals"]:
        lines.append(f"| {step} | {tr:.4f} | {va:.4f} |")
    tr, va = i["evals"][-1][1:]
    lines += [
        "",
        f"Final: train {tr:.4f} (ppl {math.exp(tr):.1f}), validation {va:.4f} (ppl {math.exp(va):.1f}).",
        "",
        "## Samples",
        "",
        "Produced by `transformers` `generate` on the saved model, "
        f"{i['sample_tokens']} new tokens each. Greedy is `do_sample=False`; sampled is",
        f"`do_sample=True, temperature={i['temperature']}, top_k={i['top_k']}`"
        f" with `torch.manual_seed({i['seed']})` before each prompt.",
        "",
    ]
    for prompt, greedy, sampled in i["samples"]:
        lines += [
            f"### Prompt {json.dumps(prompt)}",
            "",
            "Greedy:",
            "",
            fenced(greedy),
            "",
            "Sampled:",
            "",
            fenced(sampled),
            "",
        ]
    (out / "MODEL_CARD.md").write_text("\n".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train cyformer's default GPT-2 model on the Python standard library.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="cyformer/data/pycode", help="output directory")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget of the training loop")
    p.add_argument("--steps", type=int, default=None,
                   help="exact number of optimisation steps (overrides --minutes; reproduces a run)")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="length of the LR schedule when it differs from --steps "
                        "(replays a run that was cut short by the time cap)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--val-permille", type=int, default=20, help="share of files held out, in 1/1000")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=N_POSITIONS)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-windows", type=int, default=64, help="fixed windows per split for evaluation")
    p.add_argument("--evals", type=int, default=5, help="evaluations during training (plus one at the end)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.seq_len > N_POSITIONS:
        sys.exit(f"--seq-len must be <= {N_POSITIONS}")

    # Imported late: transformers is slow to import and --help should be fast.
    import transformers
    import tokenizers
    from tqdm import tqdm
    from transformers import GPT2Config, GPT2LMHeadModel

    def log(msg: str) -> None:
        tqdm.write(f"[{time.time() - t_start:7.1f}s] {msg}")
        sys.stdout.flush()

    # ---- corpus ----------------------------------------------------------
    root, train_docs, val_docs, skipped = collect_stdlib(args.val_permille)
    train_texts = [t for _, t in train_docs]
    val_texts = [t for _, t in val_docs]
    log(f"stdlib {root}: {len(train_docs)} train / {len(val_docs)} val files, {len(skipped)} skipped")

    # ---- tokenizer -------------------------------------------------------
    tok = train_tokenizer(train_texts, args.vocab_size)
    eot_id = tok.token_to_id(EOT)
    vocab_size = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    log(f"tokenizer: vocab {vocab_size}, {EOT} = {eot_id}")

    train_ids = torch.from_numpy(encode_stream(tok, train_texts, eot_id)).long()
    val_ids = torch.from_numpy(encode_stream(tok, val_texts, eot_id)).long()
    log(f"tokens: train {train_ids.numel():,}, val {val_ids.numel():,}")

    # ---- model -----------------------------------------------------------
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=N_POSITIONS,
        n_embd=N_EMBD,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        activation_function="gelu_new",
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
    log(f"model: {n_params:,} parameters")

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

    # ---- step budget -----------------------------------------------------
    # The LR schedule needs a known end. With --minutes, time a few real
    # steps at a provisional LR-less warmup and derive the total from them.
    budget_s = args.minutes * 60.0
    calib_steps = 20
    steps_from_budget = args.steps is None
    # total_steps is the length of the LR schedule; stop_at is where the
    # loop ends. They differ only when replaying a run cut short by the cap.
    total_steps = args.schedule_steps or args.steps
    stop_at = args.steps
    # Warmup must not depend on the (not yet known) total so that a replay
    # with --steps sees exactly the same learning rates during calibration.
    warmup = args.warmup
    if steps_from_budget and warmup <= calib_steps:
        sys.exit(f"--warmup must exceed the {calib_steps} calibration steps")

    evals = []
    eval_cost = 0.0
    stopped_early = False

    def run_eval(step):
        nonlocal eval_cost
        t0 = time.time()
        tr = evaluate(model, eval_train, args.batch_size)
        va = evaluate(model, eval_val, args.batch_size)
        eval_cost += time.time() - t0
        evals.append((step, tr, va))
        log(f"eval step {step}: train {tr:.4f}  val {va:.4f}")

    run_eval(0)
    t_train = time.time()
    eval_cost = 0.0
    step = 0
    bar = None
    eval_at = set()
    while True:
        if total_steps is None and step == calib_steps:
            per_step = (time.time() - t_train - eval_cost) / calib_steps
            # Reserve room for the periodic and final evaluations.
            # (A forward-only batch costs roughly half a training step.)
            eval_s = (args.evals + 1) * 2 * args.eval_windows / args.batch_size * per_step / 2
            total_steps = max(calib_steps + 1, int((budget_s - eval_s) / per_step))
            stop_at = total_steps
            log(f"calibration: {per_step:.3f} s/step -> {total_steps} steps")
        if total_steps is not None and bar is None:
            eval_at = {round(total_steps * k / (args.evals + 1)) for k in range(1, args.evals + 1)}
            # A bar for terminals; a log file gets plain periodic lines instead.
            bar = tqdm(total=stop_at, initial=step, file=sys.stdout, disable=not sys.stdout.isatty())
        if stop_at is not None and step >= stop_at:
            break
        if steps_from_budget and time.time() - t_train > 1.25 * budget_s:
            # The other processes on the machine slowed us down far beyond the
            # calibration; honour the budget over finishing the schedule.
            log(f"time cap hit at step {step} of {total_steps}")
            stopped_early = True
            break

        # Calibration steps lie inside the warmup, where the total is irrelevant.
        lr = lr_at(step, total_steps or warmup, warmup, args.lr, args.min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_windows(train_ids, args.batch_size, args.seq_len, data_gen)
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", refresh=False)
        if step % 50 == 0 and bar is not None and bar.disable:
            log(f"step {step}/{total_steps}  loss {loss.item():.4f}  lr {lr:.2e}")
        if step in eval_at:
            run_eval(step)
    if bar is not None:
        bar.close()
    train_seconds = time.time() - t_train
    if evals[-1][0] != step:
        run_eval(step)
    log(f"trained {step} steps in {train_seconds / 60:.1f} min")

    # ---- save ------------------------------------------------------------
    # transformers >= 5 always writes safetensors and ignores the flag;
    # 4.x needs it.
    model.save_pretrained(out, safe_serialization=True)
    if (out / "pytorch_model.bin").exists():
        (out / "pytorch_model.bin").unlink()
    # Sampling defaults for generate() and the CLI: greedy decoding of a model
    # this small loops ("get_get_get..."), so the shipped defaults sample.
    (out / "generation_config.json").write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        # The weights are written through a private temp file (mode 0600).
        (out / name).chmod(0o644)

    # ---- samples from the *saved* model ----------------------------------
    reloaded = GPT2LMHeadModel.from_pretrained(out).eval()
    tok2 = Tokenizer.from_file(str(out / "tokenizer.json"))
    sample_tokens, temperature, top_k = 80, 0.8, 40
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok2.encode(prompt).ids])
        outs = []
        for do_sample in (False, True):
            torch.manual_seed(args.seed)
            kw = dict(do_sample=True, temperature=temperature, top_k=top_k) if do_sample else dict(do_sample=False)
            with torch.no_grad():
                gen = reloaded.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=sample_tokens, pad_token_id=eot_id, eos_token_id=eot_id, **kw
                )
            outs.append(tok2.decode(gen[0].tolist(), skip_special_tokens=False))
        samples.append((prompt, *outs))
        log(f"sample {prompt!r} (greedy):\n{outs[0]}")

    # ---- card ------------------------------------------------------------
    files = ["config.json", "model.safetensors", "tokenizer.json"]
    file_sizes = {f: (out / f).stat().st_size for f in files}
    info = dict(
        command="python train/train_default_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
        python_version=platform.python_version(),
        stdlib_root=str(root),
        n_files=len(train_docs) + len(val_docs) + len(skipped),
        n_skipped=len(skipped),
        skipped=skipped,
        n_train_files=len(train_docs),
        n_val_files=len(val_docs),
        train_chars=sum(map(len, train_texts)),
        val_chars=sum(map(len, val_texts)),
        train_tokens=train_ids.numel(),
        val_tokens=val_ids.numel(),
        val_permille=args.val_permille,
        tokenizers_version=tokenizers.__version__,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        vocab_size=vocab_size,
        eot_id=eot_id,
        n_params=n_params,
        file_sizes=file_sizes,
        seed=args.seed,
        threads=torch.get_num_threads(),
        machine=f"{platform.machine()}, {platform.system()}",
        weight_decay=args.weight_decay,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup=warmup,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=step,
        tokens_seen=step * args.batch_size * args.seq_len,
        train_seconds=train_seconds,
        total_seconds=time.time() - t_start,
        budget_minutes=args.minutes,
        calib_steps=calib_steps,
        steps_from_budget=steps_from_budget,
        stopped_early=stopped_early,
        planned_steps=total_steps,
        eval_windows=args.eval_windows,
        evals=evals,
        sample_tokens=sample_tokens,
        temperature=temperature,
        top_k=top_k,
        samples=samples,
    )
    write_card(out, info)
    total = sum(file_sizes.values())
    log(f"wrote {out}: {', '.join(f'{k} {v:,} B' for k, v in file_sizes.items())}; total {total / 2**20:.2f} MiB")
    if total > 20 * 10**6:
        sys.exit(f"model + tokenizer is {total:,} bytes, over the 20 MB limit")


if __name__ == "__main__":
    main()
