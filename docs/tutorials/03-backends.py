"""Tutorial: the three backends, and how to read the benchmark (docs/hooks.py runs it)."""
# %% [markdown]
# # Backends and the benchmark
#
# One `Model` interface sits over three implementations of the forward pass,
# chosen at load time:
#
# | backend | what it is | use it for |
# |---|---|---|
# | `"cython"` (default) | compiled kernels: register-tiled matrix products, OpenMP threads, one fused parallel region per decoded token | everything |
# | `"numpy"` | the same model as NumPy einsums, one line per step of the math | a readable reference to check against |
# | `"naive"` | pure-Python loops over a residual-stream `State`, heads and neurons as objects | reading how a transformer works; slow |

# %%
import glob
import json
import os
import time

import numpy as np

import cyformer

models = {name: cyformer.load(backend=name, threads=1) for name in ("cython", "numpy", "naive")}
ids = models["cython"].encode("def f(x):")
logits, seconds = {}, {}
for name, m in models.items():
    t = time.perf_counter()
    logits[name] = m.forward(ids)
    seconds[name] = time.perf_counter() - t
for name in ("numpy", "naive"):
    diff = np.abs(logits[name] - logits["cython"]).max()
    print(f"{name:6} vs cython: largest logit difference {diff:.1e}")

# %% [markdown]
# They agree to float32 rounding (the sums run in different orders), and so
# do their generations:

# %%
for name, m in models.items():
    print(f"{name:6}", repr(m.generate("def f(x):", max_new_tokens=4, temperature=0)))

# %% [markdown]
# ## How fast, here
#
# One forward pass of this short prompt, on one thread, on the machine that
# built these pages (a first call, on a shared machine: only the ratios mean
# much; `bench/run.py` is the careful measurement). The naive backend is
# hundreds of times slower: it is there to be read, not run.

# %%
for name in ("cython", "numpy"):  # warm: best of five more calls
    for _ in range(5):
        t = time.perf_counter()
        models[name].forward(ids)
        seconds[name] = min(seconds[name], time.perf_counter() - t)
for name, s in seconds.items():
    print(f"{name:6} {s * 1e3:9.2f} ms   {s / seconds['cython']:7.1f}x the cython time")

# %% [markdown]
# Results do not depend on the thread count: threads split outputs (rows,
# column panels, heads), never a summed dimension.

# %%
two = cyformer.load(threads=2)
print("1 and 2 threads bitwise equal:", np.array_equal(two.forward(ids), logits["cython"]))
print(cyformer.build_info()["isa"], "kernels;", "OpenMP", "on" if cyformer.build_info()["openmp"] else "off")

# %% [markdown]
# ## Reading the benchmark
#
# `bench/run.py` measures GPT-2 small's geometry (random weights) against
# PyTorch + transformers in one process, the contenders interleaved, several
# repeats, and saves the raw numbers as JSON beside the Markdown table. Per
# contender and measure it keeps every repeat; the tables give the median
# with the range. It also probes the machine between rounds (the best matrix
# product NumPy's BLAS reaches, a streaming read), because decode is bound by
# how fast the weights can be read and prefill by multiply-adds: the
# percentages of those limits say how close to the machine each one runs.
# The [performance page](../performance.md) shows the full latest tables.

# %%
results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "results")

def backends_run(path):
    """bench/run.py's results (other benchmarks write JSON there too), or None."""
    with open(path) as f:
        run = json.load(f)
    return run if isinstance(run, dict) and "gpt2_small" in run else None


latest, run = [(p, r) for p in sorted(glob.glob(os.path.join(results, "*.json")))
               if (r := backends_run(p)) is not None][-1]
print(os.path.basename(latest))
small = run["gpt2_small"]
median = {who: {k: float(np.median(v)) for k, v in m.items()} for who, m in small.items()}
for who, m in median.items():
    print(f"{who:24} prefill T=512 {m['prefill 512 s']:.3f} s   decode {m['decode tok/s']:5.1f} tokens/s")

# %%
cy, pt = median["cyformer cython 2T"], median["PyTorch 2T"]
best_read = max(run["limits"]["read GB/s 2T"])
print(f"decode: {cy['decode tok/s'] / pt['decode tok/s']:.2f}x PyTorch at 2 threads")
print(f"prefill T=512: {pt['prefill 512 s'] / cy['prefill 512 s']:.2f}x PyTorch")
print(f"streaming-read probes beside the decodes: {cy['read GB/s beside decode']:.1f} GB/s "
      f"(best of the run {best_read:.1f} GB/s): what decode, bound by reading the weights, can reach")
