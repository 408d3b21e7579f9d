"""The `cyformer` command line.

    cyformer generate "def fib(n):"     stream a continuation from the default model
    cyformer info                       config, size and build of a model
    cyformer inspect "def f(x):" --png attn.png    look inside one forward pass

Standard output carries only text, so it pipes cleanly; statistics and errors
go to standard error.  Errors print one line and exit non-zero.
"""

import argparse
import json
import os
import sys

EXIT_ERROR = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"cyformer: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _int_at_least(minimum):
    """argparse type: an integer >= minimum."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _model_args(p):
    p.add_argument("--model", metavar="DIR", default=None,
                   help="Hugging Face GPT-2 directory (config.json, model.safetensors, "
                        "tokenizer.json); default: the small Python-code model bundled with cyformer")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="kernel threads (default: OMP_NUM_THREADS, else the cores this process may use); "
                        "results are identical at any count")


def build_parser():
    parser = _Parser(
        prog="cyformer",
        description="CPU-native GPT-2 inference with Cython kernels.",
        epilog="Run 'cyformer COMMAND --help' for the options of each command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser(
        "generate", help="continue a prompt, streaming the text to standard output",
        description="Print the prompt, then stream its continuation as it is generated. "
                    "Only text goes to standard output; --verbose adds statistics on standard error.")
    g.add_argument("prompt", help="text to continue (use $'...' in bash for newlines)")
    _model_args(g)
    g.add_argument("-n", "--max-new-tokens", type=_nonneg_int, default=128, metavar="N",
                   help="stop after N new tokens (default: 128); generation also stops at the "
                        "end-of-text token or when the context window is full")
    g.add_argument("-t", "--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) is greedy decoding")
    g.add_argument("--top-k", type=_positive_int, default=None, metavar="K",
                   help="sample only from the K most likely tokens")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling: the smallest set of tokens with probability >= P, 0 < P <= 1")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="R > 1 makes tokens already in the text less likely")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when TEXT appears (not printed); may be given several times")
    g.add_argument("--seed", type=_nonneg_int, default=None,
                   help="random seed: the same seed gives the same text")
    g.add_argument("--no-prompt", action="store_true", help="print only the continuation")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="print token counts, time to first token and tokens/s to standard error")

    i = sub.add_parser("info", help="show a model's config, parameter count, file size and the build",
                       description="Print the model's configuration, parameter count, weights file "
                                   "size and cyformer's build information.")
    _model_args(i)
    i.add_argument("--json", action="store_true", help="machine-readable output")

    x = sub.add_parser(
        "inspect", help="look inside one forward pass: attention patterns and the logit lens",
        description="Run the prompt through the model once and show what happens inside: its "
                    "tokens and the next-token prediction; with --layer/--head, where those "
                    "attention heads look from the last token; with --logit-lens, what the "
                    "residual stream after each layer would predict; with --png/--html, the "
                    "attention patterns as pictures.",
        epilog="Examples: cyformer inspect 'def add(a, b): return a + b' --layer 1 --png attn.png;  "
               "cyformer inspect 'x = [1, 2, 3]' --logit-lens --html attn.html")
    x.add_argument("prompt", help="text to run (use $'...' in bash for newlines)")
    _model_args(x)
    x.add_argument("--layer", type=_nonneg_int, default=None, metavar="L",
                   help="attention of layer L only (default: every layer)")
    x.add_argument("--head", type=_nonneg_int, default=None, metavar="H",
                   help="attention head H only (default: every head)")
    x.add_argument("--logit-lens", action="store_true",
                   help="print the top token of each layer's residual stream at each position, "
                        "read through the final layer norm and the unembedding")
    x.add_argument("--png", metavar="FILE", default=None,
                   help="write the chosen heads' attention patterns as a PNG heatmap "
                        "(needs matplotlib: pip install 'cyformer[plot]')")
    x.add_argument("--html", metavar="FILE", default=None,
                   help="write them as a self-contained HTML page (one panel per head, "
                        "token labels, values on hover)")
    x.add_argument("-k", "--top-k", type=_positive_int, default=5, metavar="K",
                   help="how many next-token candidates to print (default: 5)")
    return parser


def _load(args):
    import cyformer

    return cyformer.load(args.model, threads=args.threads)


def cmd_generate(args):
    model = _load(args)
    # Validate every argument (by building the stream) before printing anything.
    stream = model.stream(args.prompt, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          repetition_penalty=args.repetition_penalty, stop=args.stop,
                          seed=args.seed)
    out = sys.stdout
    if not args.no_prompt:
        out.write(args.prompt)
        out.flush()
    for piece in stream:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    if args.verbose:
        s = stream.stats
        tps = s["decode_tokens_per_s"]
        print(f"[cyformer] prompt {s['prompt_tokens']} tokens, generated {s['new_tokens']} "
              f"({s['finish_reason']}); time to first token {s['time_to_first_token_s'] * 1e3:.1f} ms; "
              f"decode {tps:.1f} tokens/s; threads {model.threads}" if tps else
              f"[cyformer] prompt {s['prompt_tokens']} tokens, generated {s['new_tokens']} "
              f"({s['finish_reason']}); time to first token {s['time_to_first_token_s'] * 1e3:.1f} ms",
              file=sys.stderr)
    return 0


def cmd_info(args):
    import cyformer

    model = _load(args)
    cfg = model.config
    weights_file = os.path.join(model.path, "model.safetensors")
    info = {
        "path": model.path,
        "config": cfg.to_dict(),
        "d_head": cfg.d_head,
        "d_mlp": cfg.d_mlp,
        "parameters": cfg.n_params(),
        "tied_unembedding": model.weights.tied,
        "file_bytes": os.path.getsize(weights_file),
        "tokenizer": model.tokenizer.available,
        "build": cyformer.build_info(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model       {info['path']}")
    print(f"parameters  {info['parameters']:,} ({info['file_bytes'] / 1e6:.1f} MB on disk, "
          f"unembedding {'tied to wte' if info['tied_unembedding'] else 'separate'})")
    print(f"geometry    {cfg.n_layer} layers, d_model {cfg.n_embd}, {cfg.n_head} heads of {cfg.d_head}, "
          f"d_mlp {cfg.d_mlp}, vocab {cfg.vocab_size}, context {cfg.n_positions}, {cfg.activation_function}")
    print(f"tokenizer   {'yes' if info['tokenizer'] else 'none (token ids only)'}")
    print("config      " + json.dumps(info["config"]))
    b = info["build"]
    print(f"build       cyformer {b['version']}, kernels {b['isa']} {' '.join(b['isa_flags'])} "
          f"(built: {', '.join(b['isa_levels_built'])}), OpenMP {'on' if b['openmp'] else 'OFF'}, "
          f"threads {model.threads}, Cython {b['cython']}, flags {' '.join(b['compile_flags'])}")
    return 0


def cmd_inspect(args):
    import numpy as np

    from . import _checks
    from .interp import export, lens

    model = _load(args)
    cfg = model.config
    for name, value, n in (("layer", args.layer, cfg.n_layer), ("head", args.head, cfg.n_head)):
        if value is not None and value >= n:
            raise ValueError(f"--{name} {value}: this model has {name}s 0..{n - 1}")
    ids = model.encode(_checks.text("inspect", "prompt", args.prompt))
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    layers = list(range(cfg.n_layer)) if args.layer is None else [args.layer]
    heads = list(range(cfg.n_head)) if args.head is None else [args.head]
    names = [f"blocks.{i}.attn.hook_pattern" for i in layers]
    logits, cache = model.run_with_cache(ids, names=names)
    labels = lens.token_labels(model, ids)
    show = [repr(t) for t in labels]
    print(f"tokens ({len(ids)}): " + " ".join(show))
    last = logits[-1].astype(np.float64)
    probs = np.exp(last - last.max())
    probs /= probs.sum()
    k = min(args.top_k, cfg.vocab_size)
    top = np.argsort(-probs, kind="stable")[:k]
    print("next token: " + "  ".join(f"{t!r} {p:.1%}" for t, p in
                                     zip(lens.token_labels(model, top), probs[top])))
    if args.layer is not None or args.head is not None:
        print(f"attention from the last token {show[-1]} (#position token weight):")
        for i in layers:
            for h in heads:
                row = cache[f"blocks.{i}.attn.hook_pattern"][h, -1]
                best = np.argsort(-row, kind="stable")[:3]
                print(f"  L{i} H{h}  " + "  ".join(f"#{j} {show[j]} {row[j]:.2f}" for j in best))
    if args.logit_lens:
        print("logit lens: the top token that each layer's residual stream (rows) predicts "
              "at each position (columns)")
        print(lens.logit_lens(model, ids, k=1).format())
    patterns = {(i, h): cache[f"blocks.{i}.attn.hook_pattern"][h] for i in layers for h in heads}
    for path, save in ((args.png, export.save_png), (args.html, export.save_html)):
        if path:
            save(path, labels, patterns)
            print(f"[cyformer] wrote {len(patterns)} attention pattern(s) to {path}", file=sys.stderr)
    return 0


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .errors import CyformerError

    if sys.stdout is None:  # started with standard output closed (`>&-`): nowhere to write
        print("cyformer: error: standard output is closed", file=sys.stderr)
        return EXIT_ERROR
    try:
        return {"generate": cmd_generate, "info": cmd_info, "inspect": cmd_inspect}[args.command](args)
    except (CyformerError, ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError):
            # The reader went away (e.g. `| head`): not an error of ours.  Point
            # stdout at /dev/null so the interpreter's final flush stays quiet.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"cyformer: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
