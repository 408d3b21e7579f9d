"""cyformer beside the engines people know, on the same weights: llama.cpp
(llama-cpp-python, on GGUF files that cyformer's writer makes from the
checkpoint), CTranslate2 (its int8, converted by its own converter at bench
time) and PyTorch (transformers), GPT-2 small and SmolLM2-135M geometries
with random weights.

    python bench/peers.py                   # both geometries, 3 repeats (~30-40 minutes on 2 cores)
    python bench/peers.py --only gguf       # issue 25's pairs: the same GGUF file in cyformer and llama.cpp
    python bench/peers.py --only q8_0       # one Q8_0 file: cyformer native, converted to int8, llama.cpp
    python bench/peers.py --only q4_0       # one Q4_0 file: cyformer native, repacked into int4, llama.cpp
    python bench/peers.py --quick           # smoke run on a tiny geometry

Every measurement is a fresh process (load, warm up, measure, exit) and the
contenders take turns within each repeat; tables give the median and the
range (min-max) of the repeats.  Per contender, 2 threads by default:

- decode: tokens/s of 64 greedy tokens after a 32-token prompt (the first
  token, which includes the prompt, left out);
- prefill 512: seconds to the last row's logits of a 512-token prompt (no
  engine computes the other rows' logits);
- batch 8 / 16: generated tokens/s of 8 or 16 sequences at once (32-token
  prompts, 64 new tokens each), prefill included (cyformer: its Engine;
  llama.cpp: one llama_batch per step over 8/16 sequences; CTranslate2 and
  PyTorch: their batched generate);
- peak RSS (VmHWM) of the process after all of that.

Needs ``pip install 'cyformer[peers]'`` (llama-cpp-python is built from
source by pip; CTranslate2's wheel) and torch + transformers; a missing peer
is left out with a note.  Writes bench/results/<date>-peers-<cpu>.md.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import CACHE, cpu_model, stat  # noqa: E402
from weights import GPT2_SMALL, SMOLLM2_135M, TINY, make_checkpoint, make_llama_checkpoint  # noqa: E402

PROMPT, NEW, PREFILL, BATCHES = 32, 64, 512, (8, 16)
GEOMETRIES = {
    "GPT-2 small": lambda: make_checkpoint(os.path.join(CACHE, "gpt2-small-random-peers"), **GPT2_SMALL),
    "SmolLM2-135M": lambda: make_llama_checkpoint(os.path.join(CACHE, "smollm2-135m-random-peers"), **SMOLLM2_135M),
}
# issue 31's pairs: each cyformer format beside the peer format of the same width
CYFORMER = (("float32", None), ("bfloat16", None), ("int8", None), ("int4", None))
GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")
TASKS = ("decode", "prefill", "batch")


# -- the files ------------------------------------------------------------------

def add_tokenizer(path, vocab_size):
    """A byte-level BPE tokenizer.json with vocab_size tokens and one merge
    (the 256 byte symbols, a double space, then fillers), so that the GGUF
    writer and the CTranslate2 converter, which both carry a vocabulary,
    have one; the benchmark feeds token ids."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(sorted(symbols))}
    vocab["\u0120\u0120"] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "\u0120")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        last = f"<t{vocab_size - 1}>"  # CTranslate2 wants bos, eos and unk tokens by name
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": last, "eos_token": last,
                   "unk_token": last}, f)


def gguf_file(path, qtype):
    import cyformer

    out = os.path.join(path, f"model-{qtype}.gguf")
    if not os.path.exists(out):
        cyformer.load(path, threads=2).save(out, format="gguf", dtype=qtype)
    return out


def ct2_dir(path):
    """CTranslate2's int8 conversion of the checkpoint (its own converter)."""
    out = os.path.join(path, "ct2-int8")
    if not os.path.exists(os.path.join(out, "model.bin")):
        from ctranslate2.converters import TransformersConverter

        TransformersConverter(path, load_as_float16=False).convert(out, quantization="int8", force=True)
    return out


def available(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def contenders(path, only):
    """(name, engine, file, format) per contender."""
    if only == "q8_0":  # the same Q8_0 file run natively, converted at load to int8 (the old path), by llama.cpp
        f = gguf_file(path, "q8_0")
        return [("cyformer GGUF Q8_0", "cyformer", f, None), ("cyformer GGUF Q8_0 as int8", "cyformer", f, "int8"),
                ("llama.cpp Q8_0", "llama.cpp", f, "q8_0")]
    if only == "q4_0":  # the same Q4_0 file run natively, repacked at load into int4 (the old path), by llama.cpp
        f = gguf_file(path, "q4_0")
        return [("cyformer GGUF Q4_0", "cyformer", f, None), ("cyformer GGUF Q4_0 as int4", "cyformer", f, "int4"),
                ("llama.cpp Q4_0", "llama.cpp", f, "q4_0")]
    out = []
    if only is None:
        out += [(f"cyformer {fmt}", "cyformer", path, fmt) for fmt, _ in CYFORMER]
    if available("gguf"):
        for q in GGUF_TYPES:
            if q != "f16":  # F16 runs as float32: the F32 file's numbers
                out.append((f"cyformer GGUF {q.upper()}", "cyformer", gguf_file(path, q), None))
    if available("llama_cpp"):
        out += [(f"llama.cpp {q.upper()}", "llama.cpp", gguf_file(path, q), q) for q in GGUF_TYPES]
    if only is None and available("ctranslate2"):
        out.append(("CTranslate2 int8", "ctranslate2", ct2_dir(path), "int8"))
    if only is None and available("torch") and available("transformers"):
        out += [("PyTorch float32", "torch", path, "float32"), ("PyTorch bfloat16", "torch", path, "bfloat16")]
    return out


# -- one measurement in a fresh process ---------------------------------------------

def vm_hwm_mb():
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))


class Cyformer:
    def __init__(self, path, fmt, threads):
        import cyformer
        from cyformer.model_files import GenerationConfig

        self.model = cyformer.load(path, threads=threads, dtype=fmt)
        object.__setattr__(self.model.config, "eos_token_id", None)  # random weights: run to the end
        self.model.generation_config = GenerationConfig(eos_token_ids=frozenset())

    def prefill(self, ids):
        return self.model.generate(list(ids), max_new_tokens=1, temperature=0).stats["time_to_first_token_s"]

    def decode(self, ids, n):
        return self.model.generate(list(ids), max_new_tokens=n, temperature=0).stats["decode_tokens_per_s"]

    def batch(self, prompts, n):
        from serve import engine_round

        return engine_round(self.model, [list(p) for p in prompts], n)["tokens_per_s"]


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level API: one llama_batch
    per step, greedy argmax over the logits it returns."""

    def __init__(self, path, fmt, threads):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads
        self.ctx = None

    def _context(self, n_seq, n_ctx):
        lc = self.lc
        if self.ctx is not None:
            lc.llama_free(self.ctx)
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, n_seq
        p.n_threads = p.n_threads_batch = self.threads
        self.ctx = lc.llama_init_from_model(self.model, p)

    def _run(self, seqs, pos0, last_only=True):
        """Feed seqs[s] (token lists) at positions pos0 .. for sequence s; -> argmax per sequence."""
        lc = self.lc
        n = sum(len(s) for s in seqs)
        b = lc.llama_batch_init(n, 0, len(seqs))
        i, rows = 0, []
        for s, toks in enumerate(seqs):
            for j, t in enumerate(toks):
                b.token[i], b.pos[i], b.n_seq_id[i] = int(t), pos0 + j, 1
                b.seq_id[i][0] = s
                b.logits[i] = j == len(toks) - 1
                if j == len(toks) - 1:
                    rows.append(i)
                i += 1
        b.n_tokens = n
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        lc.llama_batch_free(b)
        return [int(np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, r), shape=(self.vocab,)).argmax())
                for r in rows]

    def prefill(self, ids):
        self._context(1, len(ids) + 8)
        t = time.perf_counter()
        self._run([list(ids)], 0)
        return time.perf_counter() - t

    def decode(self, ids, n):
        self._context(1, len(ids) + n + 8)
        tok = self._run([list(ids)], 0)
        t = time.perf_counter()
        for k in range(n - 1):
            tok = self._run([tok], len(ids) + k)
        return (n - 1) / (time.perf_counter() - t)

    def batch(self, prompts, n):
        B, T = len(prompts), len(prompts[0])
        self._context(B, B * (T + n + 8))
        t = time.perf_counter()
        toks = self._run([list(p) for p in prompts], 0)
        for k in range(n - 1):
            toks = self._run([[x] for x in toks], T + k)
        return B * n / (time.perf_counter() - t)


class CTranslate2:
    def __init__(self, path, fmt, threads):
        import ctranslate2

        self.gen = ctranslate2.Generator(path, device="cpu", compute_type=fmt, intra_threads=threads,
                                         inter_threads=1)
        with open(os.path.join(path, "vocabulary.json")) as f:
            self.vocab = json.load(f)

    def _toks(self, ids):
        return [self.vocab[int(i)] for i in ids]

    def prefill(self, ids):
        t = time.perf_counter()
        self.gen.generate_batch([self._toks(ids)], max_length=1, min_length=1, include_prompt_in_result=False,
                                sampling_topk=1)
        return time.perf_counter() - t

    def decode(self, ids, n):
        times = []
        for _ in self.gen.generate_tokens(self._toks(ids), max_length=n, min_length=n, sampling_topk=1):
            times.append(time.perf_counter())
        return (len(times) - 1) / (times[-1] - times[0])

    def batch(self, prompts, n):
        t = time.perf_counter()
        out = self.gen.generate_batch([self._toks(p) for p in prompts], max_length=n, min_length=n,
                                      include_prompt_in_result=False, sampling_topk=1)
        return sum(len(r.sequences_ids[0]) for r in out) / (time.perf_counter() - t)


class Torch:
    def __init__(self, path, fmt, threads):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, fmt)).eval()
        self.kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)

    def prefill(self, ids):
        torch = self.torch
        x = torch.as_tensor(np.asarray(ids))[None]
        with torch.inference_mode():
            t = time.perf_counter()
            self.model(x, logits_to_keep=1)
            return time.perf_counter() - t

    def _generate(self, x, n):
        with self.torch.inference_mode():
            return self.model.generate(x, attention_mask=self.torch.ones_like(x), max_new_tokens=n,
                                       min_new_tokens=n, **self.kw)

    def decode(self, ids, n):
        x = self.torch.as_tensor(np.asarray(ids))[None]
        t0 = time.perf_counter()
        self._generate(x, 1)
        t1 = time.perf_counter()
        self._generate(x, n)
        t2 = time.perf_counter()
        return (n - 1) / max(t2 - t1 - (t1 - t0), 1e-9)

    def batch(self, prompts, n):
        x = self.torch.as_tensor(np.asarray(prompts))
        t = time.perf_counter()
        out = self._generate(x, n)
        return (out.shape[1] - x.shape[1]) * x.shape[0] / (time.perf_counter() - t)


ENGINES = {"cyformer": Cyformer, "llama.cpp": LlamaCpp, "ctranslate2": CTranslate2, "torch": Torch}


def worker(spec):
    engine, path, fmt, threads, vocab, quick = (spec[k] for k in ("engine", "path", "fmt", "threads", "vocab",
                                                                 "quick"))
    rng = np.random.default_rng(0)
    prefill_T = 64 if quick else PREFILL
    n_new = 8 if quick else NEW
    ids = rng.integers(0, min(vocab, 1000), size=prefill_T).tolist()
    e = ENGINES[engine](path, fmt, threads)
    e.decode(ids[:PROMPT], 4)  # warm up: the weights paged in, pools started
    tasks = spec.get("tasks") or TASKS
    out = {}
    if "prefill" in tasks:
        out["prefill_s"] = e.prefill(ids)
    if "decode" in tasks:
        out["decode_tps"] = e.decode(ids[:PROMPT], n_new)
    for B in BATCHES if "batch" in tasks else ():
        prompts = rng.integers(0, min(vocab, 1000), size=(B, PROMPT)).tolist()
        out[f"batch{B}_tps"] = e.batch(prompts, n_new)
    out["rss_mb"] = vm_hwm_mb()
    print("RESULT " + json.dumps(out), flush=True)


def run_one(name, engine, path, fmt, threads, vocab, quick, tasks=TASKS):
    spec = dict(engine=engine, path=path, fmt=fmt, threads=threads, vocab=vocab, quick=quick, tasks=list(tasks))
    # a fixed team for every engine: cyformer's adaptive cap would shrink its
    # team on a busy machine while the peers keep theirs
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), CYFORMER_ADAPTIVE_THREADS="0")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], cwd=HERE,
                       capture_output=True, text=True, timeout=1800, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    err = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    print(f"  {name}: failed ({err[:200]})", file=sys.stderr, flush=True)
    return None


# -- the report -------------------------------------------------------------------

def cpu_flags():
    try:
        flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
            "amx_tile", "amx_int8", "amx_bf16")
    return " ".join(f for f in keep if f in flags)


def fmt_cell(values, digits):
    if not values:
        return "-"
    med, lo, hi = stat(values)
    return f"{med:.{digits}f}" if len(values) == 1 else f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


PAIRS = [  # (cyformer contender, peer contender): the ratio table
    ("cyformer GGUF F32", "llama.cpp F32"), ("cyformer float32", "llama.cpp F32"),
    ("cyformer bfloat16", "llama.cpp F16"),
    ("cyformer GGUF Q8_0", "llama.cpp Q8_0"), ("cyformer GGUF Q8_0 as int8", "llama.cpp Q8_0"),
    ("cyformer GGUF Q8_0", "cyformer GGUF Q8_0 as int8"), ("cyformer int8", "llama.cpp Q8_0"),
    ("cyformer GGUF Q4_0", "llama.cpp Q4_0"), ("cyformer GGUF Q4_0 as int4", "llama.cpp Q4_0"),
    ("cyformer GGUF Q4_0", "cyformer GGUF Q4_0 as int4"), ("cyformer int4", "llama.cpp Q4_0"),
    ("cyformer int8", "CTranslate2 int8"), ("cyformer float32", "PyTorch float32"),
    ("cyformer bfloat16", "PyTorch bfloat16"),
]
METRICS = [("decode_tps", "decode (tok/s)", 1, True), ("prefill_s", "prefill 512 (s)", 3, False),
           ("batch8_tps", "batch 8 (tok/s)", 1, True), ("batch16_tps", "batch 16 (tok/s)", 1, True),
           ("rss_mb", "peak RSS (MB)", 0, False)]


def report(name, results, metrics):
    lines = [f"## {name}", "", "| contender | " + " | ".join(m[1] for m in metrics) + " |",
             "|---|" + "---|" * len(metrics)]
    for c, r in results.items():
        lines.append(f"| {c} | " + " | ".join(fmt_cell(r.get(k, []), d) for k, _, d, _ in metrics) + " |")
    lines += ["", "Ratios cyformer / peer of the medians (> 1: cyformer faster; RSS: peer / cyformer):", "",
              "| pair | " + " | ".join(m[1].split(" (")[0] for m in metrics) + " |", "|---|" + "---|" * len(metrics)]
    for a, b in PAIRS:
        if a not in results or b not in results:
            continue
        cells = []
        for k, _, _, higher in metrics:
            va, vb = results[a].get(k), results[b].get(k)
            if not va or not vb:
                cells.append("-")
                continue
            ma, mb = stat(va)[0], stat(vb)[0]
            cells.append(f"{(ma / mb if higher else mb / ma):.2f}")
        lines.append(f"| {a} / {b} | " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny geometry, short runs, 1 repeat")
    ap.add_argument("--reps", type=int, default=None, help="repeats (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("gguf", "q8_0", "q4_0"), default=None,
                    help="gguf: only the same GGUF files in cyformer and llama.cpp; q8_0 / q4_0: only the Q8_0 / "
                         "Q4_0 file, in cyformer natively and converted to int8 / int4 at load, and in llama.cpp")
    ap.add_argument("--geometry", action="append", choices=list(GEOMETRIES), default=None)
    ap.add_argument("--contenders", metavar="REGEX", default=None,
                    help="only the contenders whose name matches (e.g. 'int8|Q8_0|CTranslate2')")
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help=f"comma-separated subset of {','.join(TASKS)} (default: all)")
    ap.add_argument("--from-log", metavar="LOG", default=None,
                    help="render the tables from the progress lines of a run's output (one cut short)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.from_log:
        return print("\n".join(from_log(args.from_log)))
    reps = args.reps or (1 if args.quick else 3)
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if not tasks or set(tasks) - set(TASKS):
        ap.error(f"--tasks: choose from {', '.join(TASKS)}, got {args.tasks!r}")
    try:
        pick = re.compile(args.contenders) if args.contenders else None
    except re.error as e:
        ap.error(f"--contenders: not a regular expression: {e}")
    geoms = ({"tiny": lambda: make_checkpoint(os.path.join(CACHE, "tiny-random"), **TINY)} if args.quick
             else {g: GEOMETRIES[g] for g in (args.geometry or GEOMETRIES)})
    import cyformer

    missing = [m for m in ("llama_cpp", "ctranslate2", "torch") if not available(m)]
    lines = [f"# cyformer beside its peers ({cpu_model()}, {args.threads} threads)", "",
             f"CPU flags: {cpu_flags()}.  cyformer {cyformer.__version__} ({cyformer.build_info().get('isa')})"
             + (f"; llama-cpp-python {__import__('llama_cpp').__version__}" if available("llama_cpp") else "")
             + (f"; CTranslate2 {__import__('ctranslate2').__version__}" if available("ctranslate2") else "")
             + (f"; torch {__import__('torch').__version__}" if available("torch") else "") + ".",
             "cyformer's kernels here: " + "; ".join(f"{k}: {v}" for k, v in __import__(
                 "cyformer.kernels", fromlist=["linalg"]).linalg.format_kernels().items()) + ".",
             f"Median (min-max) of {reps} repeats, each contender a fresh process per repeat, contenders "
             f"interleaved; random weights; decode: {NEW} tokens after a {PROMPT}-token prompt; prefill: "
             f"{PREFILL} tokens to the last row's logits; batches: {PROMPT}-token prompts, {NEW} new tokens "
             "each, prefill included.  llama.cpp keeps its KV cache in F16, the others in float32.  "
             "Every engine runs a fixed team (CYFORMER_ADAPTIVE_THREADS=0).",
             "", "`python bench/peers.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`", ""]
    if missing:
        lines += [f"Not installed, left out: {', '.join(missing)}.", ""]
    for name, make in geoms.items():
        path = make()
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        add_tokenizer(path, vocab)
        cs = [c for c in contenders(path, args.only) if pick is None or pick.search(c[0])]
        results = {c[0]: {} for c in cs}
        load0 = os.getloadavg()[0]
        print(f"{name}: {len(cs)} contenders x {reps} repeats", flush=True)
        for rep in range(reps):
            for c, engine, p, f in cs:
                r = run_one(c, engine, p, f, args.threads, vocab, args.quick, tasks)
                print(f"  [{rep + 1}/{reps}] {c}: {r}", flush=True)
                for k, v in (r or {}).items():
                    results[c].setdefault(k, []).append(v)
        lines += report(name, results, METRICS)
        lines += [f"1-minute load average of the machine ({os.cpu_count()} CPUs) when {name} began and ended: "
                  f"{load0:.1f}, {os.getloadavg()[0]:.1f}.", ""]
        write(lines, args)  # after each geometry, so a long run leaves what it has


def from_log(path):
    """The tables of a run from its progress lines ("  [r/R] name: {...}"
    under "<geometry>: N contenders x R repeats"), however far it got."""
    import ast

    lines, name, results = [], None, {}
    for line in open(path):
        m = re.match(r"^(.+): \d+ contenders x (\d+) repeats$", line.rstrip())
        if m:
            if name:
                lines += report(name, results, METRICS)
            name, results = m.group(1), {}
            continue
        m = re.match(r"^  \[(\d+)/\d+\] (.+?): (\{.*\}|None)$", line.rstrip())
        if m and name:
            r = ast.literal_eval(m.group(3))
            res = results.setdefault(m.group(2), {})
            for k, v in (r or {}).items():
                res.setdefault(k, []).append(v)
    if name:
        lines += report(name, results, METRICS)
    return lines


def write(lines, args):
    md = "\n".join(lines)
    print(md)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", cpu_model().lower()).strip("-")[:40]
        tag = {"gguf": "gguf", "q8_0": "gguf-q8_0", "q4_0": "gguf-q4_0"}.get(args.only, "peers")
        out = os.path.join(args.out, f"{datetime.date.today()}-{tag}-{slug}.md")
        with open(out, "w") as f:
            f.write(md + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
