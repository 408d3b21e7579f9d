"""Score every row of a CSV file: log-likelihood and perplexity per document.

    python examples/score_csv.py [texts.csv] [--column text] [--out DIR]

Without a CSV it writes a small one of its own.  The CSV's rows become a
JSONL corpus (keeping each row's ``id``), cyformer.jobs.score runs over it
with the bundled model, and the result is read back and joined to the input
on ``id``.  Needs pyarrow (pip install 'cyformer[jobs]').
"""

import argparse
import csv
import json
import os
import sys
import tempfile

from cyformer import jobs

SAMPLE = [
    ("add", "def add(a, b):\n    return a + b\n"),
    ("fib", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"),
    ("noise", "qz xv 7 !! ]] wq ,, zzz 11 k"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="?", help="a CSV file with a header row (default: a small sample)")
    ap.add_argument("--column", default="text", help="the column holding the text (default: text)")
    ap.add_argument("--out", default=None, help="the output directory (default: a temporary one)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="cyformer-example-")
    path = args.csv
    if path is None:
        path = os.path.join(work, "texts.csv")
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "text"])
            w.writerows(SAMPLE)
    corpus = os.path.join(work, "corpus.jsonl")
    with open(path, newline="", encoding="utf-8") as f, open(corpus, "w", encoding="utf-8") as out:
        for i, row in enumerate(csv.DictReader(f)):
            if args.column not in row:
                sys.exit(f"{path}: no column {args.column!r} (columns: {', '.join(row)})")
            out.write(json.dumps({"id": row.get("id", str(i)), "text": row[args.column]}) + "\n")
    out_dir = args.out or os.path.join(work, "scores")
    summary = jobs.score(corpus, out_dir, progress=False)
    print(summary.line(), file=sys.stderr)
    table = jobs.open(out_dir).table()
    for ident, n, ppl in zip(table["id"].to_pylist(), table["n_tokens"].to_pylist(),
                             table["perplexity"].to_pylist()):
        print(f"{ident:>10}  {n:4d} tokens  perplexity {ppl:8.2f}" if ppl is not None
              else f"{ident:>10}  {n:4d} tokens  (too short to score)")


if __name__ == "__main__":
    main()
