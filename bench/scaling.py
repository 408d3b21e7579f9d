"""OpenMP scaling of cyformer beside PyTorch on one machine, at several thread counts.

    python bench/scaling.py --threads 1,2,4,8,16 --reps 3

GPT-2 small (random weights, as bench/run.py): prefill T=512 (full logits)
and greedy decode (64 new tokens after 16), interleaved, median of --reps.
Prints a Markdown table with speed-ups over one thread.  A companion to
bench/run.py for machines with more cores than the 2-core reference machine.
"""

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run  # noqa: E402
from weights import GPT2_SMALL, make_checkpoint  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2,4,8", help="thread counts (default 1,2,4,8)")
    ap.add_argument("--reps", type=int, default=3, help="repeats (default 3)")
    ap.add_argument("--no-torch", action="store_true", help="skip PyTorch even when installed")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    path = make_checkpoint(os.path.join(run.CACHE, "gpt2-small-random"), **GPT2_SMALL)
    contenders = [run.Cyformer(path, t) for t in threads]
    if run.torch_available() and not args.no_torch:
        contenders += [run.Torch(path, t) for t in threads]
    ids, prompt = run.prompt_T(512), np.arange(16)
    tasks = {"prefill": lambda c: {"prefill 512 s": run._timed(lambda: c.prefill(ids))},
             "decode": lambda c: {"decode tok/s": c.generate(prompt, 64)[1]}}
    res = run.measure(contenders, tasks, args.reps)
    print(f"{run.cpu_model()}, {os.cpu_count()} CPUs, kernels {run.cyformer.build_info()['isa']}, "
          f"{args.reps} repeats, median (min-max)\n")
    print("| contender | prefill T=512 (s) | speed-up | decode (tokens/s) | speed-up |")
    print("|---|---|---|---|---|")
    for c in contenders:
        m = res[c.name]
        base = res[c.name.replace(f" {c.threads}T", f" {threads[0]}T")]
        p = run.stat(base["prefill 512 s"])[0] / run.stat(m["prefill 512 s"])[0]
        d = run.stat(m["decode tok/s"])[0] / run.stat(base["decode tok/s"])[0]
        print(f"| {c.name} | {run.fmt(m['prefill 512 s'], digits=3)} | {p:.2f}x | "
              f"{run.fmt(m['decode tok/s'])} | {d:.2f}x |")


if __name__ == "__main__":
    main()
