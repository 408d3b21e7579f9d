"""The corpus commands of the `cyformer` CLI: score, generate-corpus, collect.

cyformer.cli adds these subcommands with ``add_commands`` and calls
``main(args)``; the summary line goes to standard error at the end.
"""

import sys

from ..request import MAX_NEW_TOKENS

COMMANDS = ("score", "generate-corpus", "collect")

_EPILOG = ("The output directory holds Parquet shards (score, generate-corpus) or activation shards "
           "(collect) and _manifest.json (Parquet readers skip it, so pandas.read_parquet(DIR) reads the shards); read it back with cyformer.jobs.open(DIR).  Interrupted "
           "(Ctrl-C) or failed runs resume where they stopped when run again with the same "
           "arguments; the output is the same bytes at any --threads/--workers, with or without --ray.")


def _common(p, model_args, positive_int, field):
    p.add_argument("corpus", metavar="CORPUS",
                   help="a .jsonl file (one JSON object per line), a .parquet file, a .txt file or "
                        "directory of .txt files (one document each), or a directory holding a "
                        "datasets dataset saved with save_to_disk")
    model_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument("--field", default=field, metavar="NAME",
                   help=f"the JSON key or column holding the text (default: {field})")
    p.add_argument("--format", dest="corpus_format", default="auto",
                   choices=("auto", "jsonl", "parquet", "text", "datasets"),
                   help="the corpus format (default: from the file name or directory)")
    p.add_argument("--split", default=None, help="the split of a datasets DatasetDict")
    p.add_argument("--shard-rows", type=positive_int, default=None, metavar="N",
                   help="corpus rows per output shard (default: 1000; collect: 64)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the output of a different job in DIR instead of refusing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")
    p.add_argument("--ray", action="store_true",
                   help="run on Ray Data (pip install 'cyformer[ray]'): a local cluster, or the one at "
                        "--address; --threads is then each worker's thread count (default 1)")
    p.add_argument("--address", default=None, metavar="A",
                   help="the Ray cluster to join, e.g. ray://head:10001 or auto (default: start a local one)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="Ray actors, each with its own copy of the model (default: the cluster's CPUs "
                        "divided by --threads)")


def add_commands(sub, model_args, positive_int, nonneg_int):
    """Add score, generate-corpus and collect to the CLI's subparsers."""
    s = sub.add_parser(
        "score", help="log-likelihood and perplexity of every document of a corpus",
        description="Score every document: its total log-likelihood (nats), the number of tokens "
                    "scored and the perplexity, one Parquet row per document.  Documents longer than "
                    "the context run as a sliding window that moves --stride tokens at a time.",
        epilog=_EPILOG + "  Example: cyformer score test.jsonl --out scores/")
    _common(s, model_args, positive_int, "text")
    s.add_argument("--stride", type=positive_int, default=None,
                   help="window step for documents longer than the context (default: half the context)")
    s.add_argument("--per-token", action="store_true",
                   help="also store each document's token ids and per-token log-probabilities")

    g = sub.add_parser(
        "generate-corpus", help="a completion for every prompt of a corpus",
        description="Generate a completion for each prompt.  A row's own fields max_new_tokens, "
                    "temperature, top_k, top_p, repetition_penalty, stop and seed override the "
                    "options here; a row without a seed uses --seed plus its row index.",
        epilog=_EPILOG + "  Example: cyformer generate-corpus prompts.jsonl --out gen/ -n 64 -t 0.8")
    _common(g, model_args, positive_int, "prompt")
    g.add_argument("-n", "--max-new-tokens", type=nonneg_int, default=MAX_NEW_TOKENS, metavar="N",
                   help=f"new tokens per prompt at most (default: {MAX_NEW_TOKENS})")
    g.add_argument("-t", "--temperature", type=float, default=None,
                   help="sampling temperature; 0 is greedy (default: the model's generation_config.json)")
    g.add_argument("--top-k", type=positive_int, default=None, metavar="K")
    g.add_argument("--top-p", type=float, default=None, metavar="P")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop at TEXT (may be given several times)")
    g.add_argument("--seed", type=nonneg_int, default=0, help="base seed (default: 0)")

    c = sub.add_parser(
        "collect", help="activations at hook points for every token of a corpus",
        description="Run every document once and store the activations at the named hook points "
                    "for each of its tokens, with token ids, document rows and positions.",
        epilog=_EPILOG + "  Example: cyformer collect train.jsonl --out acts/ "
                         "--hooks blocks.1.hook_resid_post,blocks.1.mlp.hook_post")
    _common(c, model_args, positive_int, "text")
    c.add_argument("--hooks", required=True, metavar="NAMES",
                   help="comma-separated hook names, e.g. blocks.1.hook_resid_post "
                        "(cyformer.load().hook_names() lists them)")
    c.add_argument("--save-dtype", default="float32", choices=("float32", "float16"),
                   help="stored precision of the activations (default: float32)")
    c.add_argument("--save-as", default="safetensors", choices=("safetensors", "npy"),
                   help="one safetensors file per shard, or a directory of .npy files (default: safetensors)")
    c.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                   help="keep the first N tokens of each document (default: the context)")


def main(args):
    from . import collect, generate, score

    run = dict(model=args.model, field=args.field, corpus_format=args.corpus_format, split=args.split,
               shard_rows=args.shard_rows, engine="ray" if args.ray else "local", workers=args.workers,
               threads=args.threads, address=args.address, progress=not args.no_progress,
               overwrite=args.overwrite)
    if (args.workers is not None or args.address is not None) and not args.ray:
        raise ValueError("--workers and --address apply to --ray runs only")
    if args.command == "score":
        summary = score(args.corpus, args.out, stride=args.stride, per_token=args.per_token, **run)
    elif args.command == "generate-corpus":
        from ..request import GenerationRequest
        request = GenerationRequest.given(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                          repetition_penalty=args.repetition_penalty, stop=args.stop,
                                          max_new_tokens=args.max_new_tokens)
        summary = generate(args.corpus, args.out, request=request, seed=args.seed, **run)
    else:
        hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
        summary = collect(args.corpus, args.out, hooks=hooks, dtype=args.save_dtype, save_as=args.save_as,
                          max_tokens=args.max_tokens, **run)
    print(f"[cyformer] {summary.line()}", file=sys.stderr)
    return 0
