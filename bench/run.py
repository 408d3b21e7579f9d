"""cyformer beside a naive baseline, a NumPy reference and PyTorch, in one run.

    python bench/run.py            # full run (several minutes)
    python bench/run.py --quick    # smoke run (1-2 minutes on 2 cores), written to a temporary directory

Every contender gets the same random GPT-2-small weights and the same tokens.
Contenders are interleaved and repeated; tables give the median and the
min-max over repeats.  Also measured in every repeat, between the
contenders: the machine's float32 GEMM rate (NumPy's BLAS) and its streaming
read bandwidth, so the achieved GFLOP/s of prefill and GB/s of weight reads
in decode can be put beside the best the machine showed in the same run;
decode is also paired with read probes taken right before and after it.
Writes bench/results/<date>-<cpu>.md and a PNG chart, and prints the table
(--quick writes under the system's temporary directory unless --out says
otherwise: a smoke run's figures do not belong with the results).

Decode speed is (n - 1) tokens over the time from the first generated token
to the last, within one generation, for every contender: PyTorch's is timed
in a greedy loop over its KV cache, as cyformer's generate() times itself.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from weights import GPT2_SMALL, TINY, make_checkpoint  # noqa: E402

# Rows are labelled with their thread counts: keep them exact on a busy
# machine too (cyformer would otherwise shrink its team; cyformer._cores).
os.environ.setdefault("CYFORMER_ADAPTIVE_THREADS", "0")
import cyformer  # noqa: E402

CACHE = os.environ.get("CYFORMER_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "cyformer-bench"))


# -- machine -------------------------------------------------------------------

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_threads(n):
    """Context manager limiting NumPy's BLAS (and OpenMP) pools to n threads."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=n)


def sgemm_gflops(threads, n=2048, reps=5):
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    with blas_threads(threads):
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


_READ_BUFFERS = {}


def read_bandwidth(threads, mb=512, reps=5):
    """GB/s of a streaming read of a large float32 array by `threads` threads,
    each taking one contiguous part: the best of two probes, so that the
    reference is not understated.
      - NumPy: Python threads each taking the max of a slice (a SIMD
        reduction that releases the GIL);
      - cyformer's linalg.stream_sum: four independent vector chains at this
        kernel level's widest loads (about 10 % faster than np.max here).
    The array is large enough to leave the caches, and NumPy backs it with
    huge pages as cyformer does its weights.  It is kept between calls, so
    that a probe costs only its reads."""
    from cyformer.kernels import linalg

    if mb not in _READ_BUFFERS:
        _READ_BUFFERS[mb] = np.ones(mb * 2 ** 20 // 4, dtype=np.float32)
    x = _READ_BUFFERS[mb]
    parts = np.array_split(x, threads)

    def numpy_max():
        ts = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    best = float("inf")
    for probe in (numpy_max, lambda: linalg.stream_sum(x, threads=threads)):
        probe()
        best = min(best, min(_timed(probe) for _ in range(reps)))
    return x.nbytes / best / 1e9


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- model arithmetic ------------------------------------------------------------

def prefill_flops(cfg, T):
    """Multiply-adds x 2 of a full forward over T tokens with logits for every position."""
    C, D, L, V = cfg["n_embd"], 4 * cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    matmul = L * (C * 3 * C + C * C + 2 * C * D) + V * C
    attn = L * 2 * C * T * (T + 1) / 2  # q.k and weights.v over the causal triangle
    return 2 * (T * matmul + attn)


def decode_bytes(cfg):
    """float32 weight bytes read per decoded token (every matrix once, plus wte as unembedding)."""
    C, D, L, V = cfg["n_embd"], 4 * cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    return 4 * (L * (C * 3 * C + C * C + 2 * C * D) + V * C)


# -- contenders ------------------------------------------------------------------

class Cyformer:
    def __init__(self, path, threads, backend="cython"):
        self.model = cyformer.load(path, threads=threads, backend=backend)
        object.__setattr__(self.model.config, "eos_token_id", None)  # always run to the end
        self.name = f"cyformer {backend}" + (f" {threads}T" if backend == "cython" else "")
        self.threads = threads
        self.blas = threads

    def prefill(self, ids):
        self.model.forward(ids)

    def generate(self, ids, n):
        """-> (time to first token, decode tokens/s)."""
        out = self.model.generate(list(ids), max_new_tokens=n)
        return out.stats["time_to_first_token_s"], out.stats["decode_tokens_per_s"]

    def generate_without_cache(self, ids, n):
        """Greedy decode tokens/s when every token reruns the whole sequence
        (what the KV cache saves)."""
        seq = list(ids)
        seq.append(int(self.model.forward(seq)[-1].argmax()))
        t = time.perf_counter()
        for _ in range(n - 1):
            seq.append(int(self.model.forward(seq)[-1].argmax()))
        return (n - 1) / (time.perf_counter() - t)


class Torch:
    """transformers' AutoModelForCausalLM on PyTorch (any family), float32 or
    bfloat16 (weights and activations, PyTorch's own CPU kernels)."""

    def __init__(self, path, threads, dtype="float32"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.threads = threads
        self.blas = threads
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.name = f"PyTorch {threads}T" if dtype == "float32" else f"PyTorch {dtype} {threads}T"

    def prefill(self, ids):
        torch = self.torch
        torch.set_num_threads(self.threads)
        with torch.inference_mode():
            self.model(torch.as_tensor(ids)[None]).logits

    def generate(self, ids, n):
        """-> (time to first token, decode tokens/s), both from one greedy
        generation of n >= 2 tokens over the model's KV cache.  (Timing two
        separate generate() calls of 1 and n tokens and dividing by the
        difference gave absurd figures whenever the shorter call happened to
        be the slower one.)"""
        torch = self.torch
        torch.set_num_threads(self.threads)
        if n < 2:
            raise ValueError("decode speed needs at least 2 new tokens")
        x = torch.as_tensor(ids)[None]
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(x, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            for _ in range(n - 1):
                out = self.model(tok, past_key_values=out.past_key_values, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tn = time.perf_counter()
        return t1 - t0, (n - 1) / (tn - t1)


def make_contenders(path, threads_list, with_numpy, with_torch):
    cs = [Cyformer(path, t) for t in threads_list]
    if with_numpy:
        cs.append(Cyformer(path, max(threads_list), backend="numpy"))
    if with_torch:
        cs += [Torch(path, t) for t in threads_list]
    return cs


def torch_available():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


# -- measurement -----------------------------------------------------------------

def settle():
    """Let the previous contender's thread pools go idle.  OpenBLAS and OpenMP
    workers spin for a while after a call; on 2 cores they halved the read
    bandwidth measured right after an sgemm (16-17 against 31-35 GB/s, which
    a 50 ms pause restored)."""
    gc.collect()
    time.sleep(0.1)


def machine_limits(threads_list, quick):
    """sgemm GFLOP/s and streaming-read GB/s at each thread count."""
    out = {}
    for t in threads_list:
        settle()
        out[f"sgemm GFLOP/s {t}T"] = sgemm_gflops(t, n=1024 if quick else 2048, reps=3)
        settle()
        out[f"read GB/s {t}T"] = read_bandwidth(t, mb=128 if quick else 512, reps=3)
    return out


def measure(contenders, tasks, reps, progress=None, limits=None):
    """Interleave: for each repeat, each contender runs each task once.
    tasks: name -> fn(contender) -> dict of metric -> value.  Returns
    {contender name: {metric: [values]}}.  limits: a () -> {measure: value}
    probe of the machine, run once per repeat beside the contenders (so a
    busy or quiet spell reaches both); its values go under "machine"."""
    results = {c.name: {} for c in contenders}
    if limits:
        results["machine"] = {}
    for c in contenders:  # warm-up: page in weights, JIT-free but cache-cold
        with blas_threads(c.blas):
            for fn in tasks.values():
                fn(c)
    for rep in range(reps):
        for c in contenders:
            with blas_threads(c.blas):
                for fn in tasks.values():
                    settle()
                    for k, v in fn(c).items():
                        results[c.name].setdefault(k, []).append(v)
            if progress:
                progress.update(1)
        if limits:
            for k, v in limits().items():
                results["machine"].setdefault(k, []).append(v)
    return results


def stat(values):
    v = np.asarray(values, dtype=float)
    return float(np.median(v)), float(v.min()), float(v.max())


def fmt(values, unit="", digits=1):
    if not values:
        return "-"
    med, lo, hi = stat(values)
    if len(values) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def rss_probe(path, contender, threads, n_new):
    """Peak RSS (MB) of a fresh process that loads the model and generates."""
    code = f"""
import sys, resource
sys.path.insert(0, {HERE!r})
import run
c = run.Torch({path!r}, {threads}) if {contender!r} == 'torch' else run.Cyformer({path!r}, {threads}, backend={contender!r})
c.generate(list(range(16)), {n_new})
# VmHWM: ru_maxrss would carry over this benchmark's own peak across fork+exec
print(next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""
    # cwd: `python -c` puts it first on sys.path, and a source checkout's
    # cyformer/ (without compiled kernels) must not shadow the installed one
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=HERE)
    if out.returncode != 0:
        err = out.stderr.strip().splitlines()
        print(f"peak RSS probe of {contender} failed: {err[-1] if err else out.returncode}", file=sys.stderr)
        return None
    return float(out.stdout.strip().splitlines()[-1])


# -- main ------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: fewer repeats and tokens (1-2 minutes on 2 cores; the report gives its "
                         "own duration), written under the temporary directory unless --out is given")
    ap.add_argument("--reps", type=int, default=None, help="repeats per measurement (default 5, quick 1)")
    ap.add_argument("--threads", default="1,2", help="thread counts to compare (default 1,2)")
    ap.add_argument("--no-torch", action="store_true", help="skip PyTorch even when installed")
    ap.add_argument("--out", default=None,
                    help="directory for the .md and .png (default bench/results; --quick: a temporary one)")
    args = ap.parse_args(argv)
    if args.out is None:
        import tempfile
        args.out = os.path.join(tempfile.gettempdir(), "cyformer-bench") if args.quick else os.path.join(HERE, "results")
    threads_list = [int(t) for t in args.threads.split(",")]
    quick = args.quick
    reps = args.reps or (1 if quick else 5)
    with_torch = torch_available() and not args.no_torch
    n_new = 16 if quick else 128
    prompt = np.arange(16) % 1000
    prefill_T = [128] if quick else [128, 512]
    from tqdm import tqdm

    t_start = time.perf_counter()
    info = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": cyformer.build_info()["threads"],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cyformer": cyformer.__version__,
        "build": cyformer.build_info(),
    }
    if with_torch:
        import torch
        import transformers
        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    print(f"cyformer {info['cyformer']} on {info['cpu']} ({info['cores']} cores), kernels {info['build']['isa']}",
          file=sys.stderr)

    # GPT-2 small
    big = make_checkpoint(os.path.join(CACHE, "gpt2-small-random"), **GPT2_SMALL)
    contenders = make_contenders(big, threads_list, with_numpy=True, with_torch=with_torch)
    tasks = {f"prefill {T}": (lambda T: lambda c: {f"prefill {T} s": _timed(lambda: c.prefill(prompt_T(T)))})(T)
             for T in prefill_T}

    def gen_task(c):
        # The machine is shared, so its bandwidth drifts within a run: the
        # read probe is also taken right before and right after each decode,
        # and decode GB/s is set against the mean of that pair as well as
        # against the best probe of the whole run.
        mb = 128 if quick else 512
        before = read_bandwidth(c.threads, mb=mb, reps=1)
        settle()
        ttft, tps = c.generate(prompt, n_new)
        settle()
        after = read_bandwidth(c.threads, mb=mb, reps=1)
        return {"ttft s": ttft, "decode tok/s": tps, "read GB/s beside decode": (before + after) / 2}

    tasks["generate"] = gen_task
    n_nocache = 8 if quick else 32

    def nocache_task(c):
        # the KV cache's effect, on the largest thread count only
        if not (c.name.startswith("cyformer cython") and c.threads == max(threads_list)):
            return {}
        cached = c.generate(prompt, n_nocache)[1]
        return {"cached tok/s (short)": cached,
                "no-cache tok/s (short)": c.generate_without_cache(prompt, n_nocache)}

    tasks["kv cache effect"] = nocache_task
    with tqdm(total=reps * len(contenders), desc="GPT-2 small", unit="round", file=sys.stderr) as bar:
        small = measure(contenders, tasks, reps, bar, limits=lambda: machine_limits(threads_list, quick))
    limit_runs = small.pop("machine")
    cache_cost = measure_cache_cost(contenders[0].model, reps) if hasattr(contenders[0].model, "run_with_cache") else None
    del contenders
    gc.collect()

    rss = {}
    if not quick:
        for name, kind, t in [("cyformer cython 2T", "cython", max(threads_list)),
                              ("PyTorch 2T", "torch", max(threads_list))]:
            if kind == "torch" and not with_torch:
                continue
            rss[name] = rss_probe(big, kind, t, n_new)

    # tiny geometry: where the naive backend can run too
    tiny = make_checkpoint(os.path.join(CACHE, "tiny-random"), **TINY)
    tiny_contenders = make_contenders(tiny, threads_list, with_numpy=True, with_torch=with_torch)
    tiny_contenders.append(Cyformer(tiny, 1, backend="naive"))
    tiny_T, tiny_new = 32, 8 if quick else 32
    tiny_tasks = {
        "prefill": lambda c: {f"prefill {tiny_T} s": _timed(lambda: c.prefill(np.arange(tiny_T) % 500))},
        "generate": lambda c: dict(zip(("ttft s", "decode tok/s"), c.generate(np.arange(8), tiny_new))),
    }
    with tqdm(total=reps * len(tiny_contenders), desc="tiny (with naive)", unit="round", file=sys.stderr) as bar:
        tinyres = measure(tiny_contenders, tiny_tasks, reps, bar)

    report = render(info, limit_runs, small, tinyres, rss, cache_cost, threads_list, prefill_T, n_new,
                    tiny_T, tiny_new, reps, time.perf_counter() - t_start, n_nocache)
    print(report)
    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", info["cpu"].lower()).strip("-")
    base = os.path.join(args.out, f"{info['date']}-{slug}{'-quick' if quick else ''}")
    with open(base + ".md", "w") as f:
        f.write(report)
    with open(base + ".json", "w") as f:
        json.dump({"info": info, "limits": limit_runs, "gpt2_small": small, "tiny": tinyres, "rss_mb": rss,
                   "cache_cost": cache_cost}, f, indent=1, default=str)
    chart(small, prefill_T, base + ".png")
    print(f"wrote {base}.md, .json and .png", file=sys.stderr)


def prompt_T(T):
    return np.arange(T) % 50000


def measure_cache_cost(model, reps):
    """run_with_cache (every hook point) / plain forward, GPT-2 small, T = 128."""
    ids = prompt_T(128)
    model.forward(ids)
    model.run_with_cache(ids)
    plain, cached = [], []
    for _ in range(max(reps, 3)):
        plain.append(_timed(lambda: model.forward(ids)))
        cached.append(_timed(lambda: model.run_with_cache(ids)))
    return {"plain s": plain, "cached s": cached, "threads": model.threads,
            "ratio": [c / p for c, p in zip(cached, plain)]}


def render(info, limit_runs, small, tinyres, rss, cache_cost, threads_list, prefill_T, n_new,
           tiny_T, tiny_new, reps, elapsed, n_nocache):
    cfg = GPT2_SMALL
    limits = {k: max(v) for k, v in limit_runs.items()}  # percentages against the best
    lines = [f"# cyformer benchmark, {info['date']}", "",
             f"- CPU: {info['cpu']}, {info['cores']} cores usable; kernels: {info['build']['isa']} "
             f"({' '.join(info['build']['isa_flags'])}), OpenMP {'on' if info['build']['openmp'] else 'off'}",
             f"- versions: cyformer {info['cyformer']}, numpy {info['numpy']}, Python {info['python']}"
             + (f", torch {info['torch']}, transformers {info['transformers']}" if "torch" in info else ""),
             f"- {reps} interleaved repeat(s); median (min-max). Float32, batch 1, random weights.",
             f"- run time {elapsed:.0f} s", "",
             "## Machine limits, measured in this run", "",
             "Probed once per repeat, between the contenders' rounds; the percentages below are taken "
             "against the best value.  The last column of the ratio table instead sets each decode against "
             "read probes taken right before and right after it (the mean of the two), one percentage per "
             "repeat, given as median (min-max).", "",
             "| measure | best | median (min-max) |", "|---|---|---|"]
    lines += [f"| {k} | {max(v):.1f} | {fmt(v)} |" for k, v in limit_runs.items()]
    lines += ["", f"## GPT-2 small (12 layers, d_model 768, vocab 50257)", "",
              "Prefill: full logits for every position. Decode: greedy, KV cache, "
              f"{n_new} new tokens after a 16-token prompt.", ""]
    head = ["contender"] + [f"prefill T={T} (s)" for T in prefill_T] + ["time to first token (ms)", "decode (tokens/s)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in small.items():
        row = [name] + [fmt(m.get(f"prefill {T} s", []), digits=3) for T in prefill_T]
        row += [fmt([v * 1e3 for v in m.get("ttft s", [])]), fmt(m.get("decode tok/s", []))]
        lines.append("| " + " | ".join(row) + " |")
    # ratios and achieved rates
    lines += ["", "### Ratios and achieved rates", "",
              "| contender | " + " | ".join(f"prefill {T}: speed-up vs PyTorch same threads" for T in prefill_T)
              + " | decode: speed-up vs PyTorch | prefill " + str(prefill_T[-1]) + " GFLOP/s (% of sgemm) "
              "| decode GB/s (% of the best read) | decode GB/s / read probe beside it |",
              "|" + "---|" * (5 + len(prefill_T))]
    for name, m in small.items():
        t = _threads_of(name, threads_list)
        torch_m = small.get(f"PyTorch {t}T")
        row = [name]
        for T in prefill_T:
            row.append(_ratio(torch_m, m, f"prefill {T} s", lower_is_better=True) if torch_m and not name.startswith("PyTorch") else "-")
        row.append(_ratio(torch_m, m, "decode tok/s", lower_is_better=False) if torch_m and not name.startswith("PyTorch") else "-")
        T = prefill_T[-1]
        if m.get(f"prefill {T} s"):
            gf = prefill_flops(cfg, T) / stat(m[f"prefill {T} s"])[0] / 1e9
            row.append(f"{gf:.0f} ({100 * gf / limits[f'sgemm GFLOP/s {t}T']:.0f}%)")
        else:
            row.append("-")
        if m.get("decode tok/s"):
            gb = decode_bytes(cfg) * stat(m["decode tok/s"])[0] / 1e9
            row.append(f"{gb:.1f} ({100 * gb / limits[f'read GB/s {t}T']:.0f}%)")
            beside = m.get("read GB/s beside decode", [])
            paired = [100 * decode_bytes(cfg) * d / 1e9 / r for d, r in zip(m["decode tok/s"], beside)]
            row.append(fmt(paired, "%", 0) if paired else "-")
        else:
            row += ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    cy = [n for n in small if n.startswith("cyformer cython")]
    if len(cy) >= 2:
        a, b = small[cy[0]], small[cy[-1]]
        T = prefill_T[-1]
        lines += ["", f"Thread scaling of cyformer prefill T={T}: {cy[0]} / {cy[-1]} = "
                  f"{stat(a[f'prefill {T} s'])[0] / stat(b[f'prefill {T} s'])[0]:.2f}x; decode: "
                  f"{stat(b['decode tok/s'])[0] / stat(a['decode tok/s'])[0]:.2f}x"]
    for name, m in small.items():
        if m.get("no-cache tok/s (short)"):
            lines += ["", f"KV cache effect, {name}, 16-token prompt, {n_nocache} new tokens: "
                      f"{fmt(m['cached tok/s (short)'])} tokens/s with the cache, "
                      f"{fmt(m['no-cache tok/s (short)'])} tokens/s rerunning the full sequence per token "
                      f"({stat(m['cached tok/s (short)'])[0] / stat(m['no-cache tok/s (short)'])[0]:.1f}x)"]
    if rss:
        lines += ["", "Peak RSS of a fresh process that loads GPT-2 small and generates "
                  f"{n_new} tokens: " + ", ".join(f"{k} {v:.0f} MB" if v else f"{k} failed" for k, v in rss.items())
                  + f" (weights {decode_bytes(cfg) / 1e6 + 4 * 1024 * 768 / 1e6:.0f} MB; cyformer's KV cache holds the "
                  f"{16 + n_new} positions the generation can reach, {2 * 4 * 12 * (16 + n_new) * 768 / 1e6:.0f} MB)."]
    if cache_cost:
        lines += ["", "run_with_cache (every hook point) vs plain forward, GPT-2 small, T=128, "
                  f"{cache_cost['threads']} thread(s): "
                  f"{fmt(cache_cost['ratio'], 'x', 2)} (plain {fmt(cache_cost['plain s'], ' s', 3)}, "
                  f"cached {fmt(cache_cost['cached s'], ' s', 3)})"]
    lines += ["", f"## Tiny geometry ({TINY['n_layer']} layers, d_model {TINY['n_embd']}, vocab {TINY['vocab_size']}), "
              "where the naive pure-Python backend runs too", "",
              f"| contender | prefill T={tiny_T} (ms) | decode (tokens/s, {tiny_new} new) | prefill speed-up vs naive |",
              "|---|---|---|---|"]
    naive = tinyres.get("cyformer naive", {})
    for name, m in tinyres.items():
        ratio = _ratio(naive, m, f"prefill {tiny_T} s", lower_is_better=True) if naive else "-"
        lines.append(f"| {name} | {fmt([v * 1e3 for v in m.get(f'prefill {tiny_T} s', [])], digits=2)} | "
                     f"{fmt(m.get('decode tok/s', []))} | {ratio} |")
    return "\n".join(lines) + "\n"


def _threads_of(name, threads_list):
    m = re.search(r"(\d+)T$", name)
    return int(m.group(1)) if m else max(threads_list)


def _ratio(ref, m, key, lower_is_better):
    if not ref or not ref.get(key) or not m.get(key):
        return "-"
    r, v = stat(ref[key])[0], stat(m[key])[0]
    return f"{(r / v if lower_is_better else v / r):.2f}x"


def chart(small, prefill_T, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart", file=sys.stderr)
        return
    names = list(small)
    T = prefill_T[-1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title, scale in [(axes[0], f"prefill {T} s", f"prefill T={T} (s, lower is better)", 1),
                                  (axes[1], "decode tok/s", "decode (tokens/s, higher is better)", 1)]:
        meds = [stat(small[n][key])[0] * scale if small[n].get(key) else 0 for n in names]
        los = [m - stat(small[n][key])[1] * scale if small[n].get(key) else 0 for n, m in zip(names, meds)]
        his = [stat(small[n][key])[2] * scale - m if small[n].get(key) else 0 for n, m in zip(names, meds)]
        colors = ["#1f77b4" if n.startswith("cyformer cython") else "#ff7f0e" if n.startswith("PyTorch") else "#7f7f7f"
                  for n in names]
        ax.barh(names, meds, xerr=[los, his], color=colors)
        ax.set_title(title)
        ax.invert_yaxis()
    fig.suptitle("GPT-2 small, float32, batch 1 (median, min-max bars)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
