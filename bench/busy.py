"""cyformer on a quiet machine and on a busy one: how idle OpenMP threads should wait.

    python bench/busy.py                          # every policy on every machine state, 5 rounds
    python bench/busy.py --policy spin3000=GOMP_SPINCOUNT=3000,CYFORMER_ADAPTIVE_THREADS=0
    python bench/busy.py --figures tiny --loads quiet,niced --rounds 7    # short interleaved rounds

Each measurement runs in a fresh process, because libgomp reads its wait
policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT) once, when it loads, and cyformer
its CYFORMER_ADAPTIVE_THREADS at import.  A process
measures the bundled model's forward pass over 11 tokens and its greedy
decode (100 tokens), then GPT-2-small geometry with random weights
(bench/weights.py): prefill T=128 and decode (32 tokens), all medians.

Policies are interleaved within each round, and every round runs them once
on each machine state (--loads): "quiet" (the machine as it is), "busy" (beside
a process that busy-loops, `while True: pass`), "niced" (two such loops at
nice 5, a neighbour that would take every core: the scheduler still gives it
a share, though cyformer._cores does not count niced time as load), "niced1"
(one of them) and "intermittent" (a loop that runs for 50 ms and sleeps for
50 ms, a neighbour that comes and goes).  Other load on the machine is measured too (busy
cores from /proc/stat, less this benchmark's own processes) and reported
next to each figure, so a round disturbed by someone else can be seen.
Prints a markdown table of medians over rounds, with min-max.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# "default": what cyformer does with no settings; "spin 300k": the default
# before issue 29 (libgomp's own spin count: idle threads spin ~300,000 rounds
# before they sleep); "passive": idle threads sleep at once
# (OMP_WAIT_POLICY=passive), the usual advice for shared machines; "1 thread":
# what a busy machine should never fall below.
POLICIES = {
    "default": {},
    "spin 300k": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "1 thread": {"CYFORMER_BENCH_THREADS": "1"},
}

# The machine states: a neighbour process's code, its nice level, and how many of them.
LOADS = {
    "quiet": None,
    "busy": ("while True: pass", 0, 1),
    "niced": ("while True: pass", 5, 2),
    "niced1": ("while True: pass", 5, 1),
    "intermittent": ("import time\nwhile True:\n    t = time.monotonic() + 0.05\n"
                     "    while time.monotonic() < t: pass\n    time.sleep(0.05)", 0, 1),
}

MEASURE = r'''
import json, os, statistics, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import cyformer
from weights import GPT2_SMALL, make_checkpoint

threads = int(os.environ.get("CYFORMER_BENCH_THREADS", "0")) or None
out = {}

def median_time(fn, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

tiny = cyformer.load(threads=threads)
ids = tiny.encode("def fib(n):\n    return fib(n - 1) + fib(n - 2)")[:11]
for _ in range(5):
    tiny.forward(ids)
out["tiny forward (ms)"] = 1e3 * median_time(lambda: tiny.forward(ids), 30)
out["tiny decode (tokens/s)"] = statistics.median(
    tiny.generate("def fib(n):", max_new_tokens=100).stats["decode_tokens_per_s"] for _ in range(3))
out["threads"] = tiny.threads
if os.environ.get("CYFORMER_BENCH_FIGURES") == "tiny":
    print(json.dumps(out))
    sys.exit(0)

small = cyformer.load(make_checkpoint(sys.argv[2], seed=0, **GPT2_SMALL), threads=threads)
prompt = np.random.default_rng(0).integers(0, GPT2_SMALL["vocab_size"], 128)
small.forward(prompt)
out["GPT-2 small prefill T=128 (s)"] = median_time(lambda: small.forward(prompt), 5)
out["GPT-2 small decode (tokens/s)"] = statistics.median(
    small.generate(prompt[:16], max_new_tokens=32).stats["decode_tokens_per_s"] for _ in range(3))
out["threads"] = small.threads
print(json.dumps(out))
'''


def busy_jiffies():
    """Non-idle CPU time of the whole machine, in clock ticks."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4]  # less idle and iowait


def process_jiffies(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def measure(policy_env, cache, hogs, figures="all"):
    """One measuring process -> (figures, other load in cores during it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "CYFORMER_ADAPTIVE_THREADS")}
    env.update(policy_env)
    env["CYFORMER_BENCH_FIGURES"] = figures
    hz = os.sysconf("SC_CLK_TCK")
    t0, b0 = time.perf_counter(), busy_jiffies()
    h0 = sum(process_jiffies(h.pid) for h in hogs)
    c0 = os.times()
    r = subprocess.run([sys.executable, "-c", MEASURE, HERE, cache], env=env, capture_output=True,
                       text=True, timeout=900)
    c1 = os.times()
    wall = time.perf_counter() - t0
    ours = (c1.children_user + c1.children_system - c0.children_user - c0.children_system) * hz
    hog_j = sum(process_jiffies(h.pid) for h in hogs) - h0
    other = max(0.0, (busy_jiffies() - b0 - ours - hog_j) / hz / wall)
    if r.returncode:
        raise SystemExit(f"measurement failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), other


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=VAR=VALUE[,VAR=VALUE]",
                    help="an extra policy to compare, e.g. spin3000=GOMP_SPINCOUNT=3000")
    ap.add_argument("--only-extra", action="store_true", help="compare only the --policy ones")
    ap.add_argument("--loads", default=",".join(LOADS),
                    help=f"machine states to measure on, of {', '.join(LOADS)} (default: all)")
    ap.add_argument("--figures", choices=("all", "tiny"), default="all",
                    help="tiny: only the bundled model's figures (a round takes seconds, not minutes)")
    ap.add_argument("--json", default=None, help="also write every raw figure here")
    ap.add_argument("--table", nargs="+", metavar="JSON", default=None,
                    help="only print the table of figures saved earlier with --json")
    args = ap.parse_args()
    if args.table:
        print(table(*from_json(args.table)))
        return
    policies = {} if args.only_extra else dict(POLICIES)
    for spec in args.policy:
        name, _, assignments = spec.partition("=")
        policies[name] = dict(a.split("=", 1) for a in assignments.split(",") if a)
    cache = os.environ.get("CYFORMER_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                                 "cyformer-bench"))
    cache = os.path.join(cache, "gpt2-small-random")
    loads = [lo.strip() for lo in args.loads.split(",")]
    unknown = [lo for lo in loads if lo not in LOADS]
    if unknown:
        ap.error(f"unknown --loads {', '.join(unknown)}; choose from {', '.join(LOADS)}")
    raw = []  # (load, policy, round, figures, other load)
    for rnd in range(args.rounds):
        for load in loads:
            hogs = []
            if LOADS[load] is not None:
                code, nice, count = LOADS[load]
                hogs = [subprocess.Popen([sys.executable, "-c", code],
                                         preexec_fn=(lambda n=nice: os.nice(n)) if nice else None)
                        for _ in range(count)]
            try:
                time.sleep(0.5 if hogs else 0)
                names = list(policies)
                names = names[rnd % len(names):] + names[:rnd % len(names)]  # rotate the order
                for name in names:
                    figures, other = measure(policies[name], cache, hogs, args.figures)
                    raw.append((load, name, rnd, figures, other))
                    print(f"round {rnd} {load:9} {name}: "
                          + ", ".join(f"{k} {v:.4g}" for k, v in figures.items() if isinstance(v, float))
                          + f"; other load {other:.2f} cores", file=sys.stderr, flush=True)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(load=a, policy=b, round=c, figures=d, other_load=e) for a, b, c, d, e in raw], f,
                      indent=1)
    print(table(raw, policies))


def table(raw, policies):
    """Medians (min-max) per machine state and policy.  Runs are grouped by
    the other load measured during them, rounded to whole cores, as well as
    by whether our busy loop ran: on a shared machine other users' work
    comes and goes, and a run beside it is a busier machine than planned."""
    metrics = [k for k, v in raw[0][3].items() if isinstance(v, float)]
    lines = ["| machine | others' load | policy | runs | " + " | ".join(metrics) + " |",
             "|---" * (len(metrics) + 4) + "|"]
    order = {name: i for i, name in enumerate(LOADS)}
    states = sorted({(lo, round(o)) for lo, _, _, _, o in raw}, key=lambda s: (order.get(s[0], 99), s))
    for load, others in states:
        for name in policies:
            rows = [f for lo, n, _, f, o in raw if lo == load and n == name and round(o) == others]
            if not rows:
                continue
            cells = []
            for m in metrics:
                v = [f[m] for f in rows]
                cells.append(f"{statistics.median(v):.4g} ({min(v):.3g}-{max(v):.3g})"
                             if len(v) > 1 else f"{v[0]:.4g}")
            lines.append(f"| {load} | ~{others} core{'s' if others != 1 else ''} | {name} | {len(rows)} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def from_json(paths):
    """Raw figures saved with --json, as measure() returned them."""
    raw, policies = [], {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                raw.append((r["load"], r["policy"], r["round"], r["figures"], r["other_load"]))
                policies.setdefault(r["policy"], None)
    return raw, policies


if __name__ == "__main__":
    main()
