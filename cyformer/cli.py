"""The `cyformer` command line.

    cyformer generate "def fib(n):"     stream a continuation from the default model
    cyformer info                       config, size and build of a model

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


def _positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonneg_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


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


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .errors import CyformerError

    try:
        return {"generate": cmd_generate, "info": cmd_info}[args.command](args)
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
