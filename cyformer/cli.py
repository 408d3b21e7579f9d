"""The `cyformer` command line.

    cyformer generate "def fib(n):"     stream a continuation from the default model
    cyformer chat --model M             talk to a chat model (one turn with --message)
    cyformer info                       config, size and build of a model
    cyformer inspect "def f(x):" --png attn.png    look inside one forward pass
    cyformer score|generate-corpus|collect CORPUS --out DIR    run over a corpus (cyformer.jobs)
    cyformer serve --model M            an OpenAI-compatible HTTP server on 127.0.0.1

Standard output carries only text, so it pipes cleanly; statistics and errors
go to standard error.  Errors print one line and exit non-zero.
"""

import argparse
import json
import os
import sys

from . import formats

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


GGUF_TYPES = ("q8_0", "q4_0", "f16", "f32")


def _model_args(p):
    p.add_argument("--model", metavar="DIR|FILE|NAME", default=None,
                   help="Hugging Face checkpoint directory (config.json, model.safetensors, "
                        "tokenizer.json), a GGUF file, or a Hub name such as owner/name (needs "
                        "pip install 'cyformer[hub]'; HF_HUB_OFFLINE=1 uses the local cache only); "
                        "default: the small Python-code model bundled with cyformer")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="kernel threads (default: OMP_NUM_THREADS, else the cores this process may use); "
                        "results are identical at any count")
    p.add_argument("--dtype", choices=formats.FORMATS, default=None,
                   help="weight format, converted at load (default: as stored; float32 for a Hugging "
                        "Face checkpoint); bytes per weight: "
                        + ", ".join(f"{f.name} {f.bytes_per_weight:g}" for f in formats.TABLE.values())
                        + "; see README 'Weight formats'")


def build_parser():
    parser = _Parser(
        prog="cyformer",
        description="Transformer inference on the CPU (GPT-2 and the Llama family) with Cython kernels.",
        epilog="Run 'cyformer COMMAND --help' for the options of each command.",
    )
    from . import __version__
    parser.add_argument("--version", action="version", version=f"cyformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser(
        "generate", help="continue a prompt, streaming the text to standard output",
        description="Print the prompt, then stream its continuation as it is generated. "
                    "Only text goes to standard output; --verbose adds statistics on standard error.")
    g.add_argument("prompt", help="text to continue (use $'...' in bash for newlines)")
    _model_args(g)
    from .request import CHAT_MAX_NEW_TOKENS, MAX_NEW_TOKENS
    g.add_argument("-n", "--max-new-tokens", type=_nonneg_int, default=MAX_NEW_TOKENS, metavar="N",
                   help=f"stop after N new tokens (default: {MAX_NEW_TOKENS}, as Model.generate); generation also "
                        "stops at the end-of-text token or when the context window is full")
    g.add_argument("--truncate", action="store_true",
                   help="keep the end of a prompt too long for the context (room is left for N new "
                        "tokens) instead of refusing it")
    _sampling_args(g)
    g.add_argument("--no-prompt", action="store_true",
                   help="print only the continuation (what Model.generate returns)")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="print token counts, time to first token and tokens/s to standard error")

    c = sub.add_parser(
        "chat", help="talk to a chat model: an interactive loop, or one reply with --message",
        description="Render the conversation with the model's chat template (tokenizer_config.json "
                    "or chat_template.jinja) and stream the assistant's reply, which ends at the "
                    "template's end-of-turn token.  On a terminal: type a message, read the reply, "
                    "and so on; /reset starts a new conversation, /exit, Ctrl-D or Ctrl-C ends it.  "
                    "Without a terminal each line of standard input is one user message.  With "
                    "--message: print that one reply and exit.",
        epilog="Examples: cyformer chat --model HuggingFaceTB/SmolLM2-135M-Instruct;  "
               "cyformer chat --model DIR --system 'Answer in one word.' --message 'Capital of France?'")
    _model_args(c)
    c.add_argument("--message", metavar="TEXT", default=None,
                   help="send this one user message, print only the reply, and exit")
    c.add_argument("--system", metavar="TEXT", default=None,
                   help="a system message that opens the conversation")
    c.add_argument("-n", "--max-new-tokens", type=_nonneg_int, default=CHAT_MAX_NEW_TOKENS, metavar="N",
                   help=f"at most N tokens per reply (default: {CHAT_MAX_NEW_TOKENS})")
    _sampling_args(c)
    c.add_argument("-v", "--verbose", action="store_true",
                   help="print token counts and tokens/s of each reply to standard error")

    i = sub.add_parser("info", help="show a model's config, parameter count, file size and the build",
                       description="Print the model's configuration, parameter count, weights file "
                                   "size and cyformer's build information.")
    _model_args(i)
    i.add_argument("--json", action="store_true", help="machine-readable output")

    q = sub.add_parser(
        "quantize", help="convert a model's weights to a smaller format and save it",
        description="Load SRC, convert every weight matrix (the embedding and unembedding "
                    "included; norms, biases and the KV cache stay float32) to --dtype, and write a "
                    "directory that cyformer loads without converting again.",
        epilog="Example: cyformer quantize path/to/gpt2 gpt2-int8 --dtype int8")
    q.add_argument("src", metavar="SRC", help="model directory, GGUF file or Hub name")
    q.add_argument("dst", metavar="DST", help="directory to write (created; must not be SRC), or a "
                                              "file ending in .gguf to write llama.cpp's format")
    q.add_argument("--dtype", choices=formats.PACKED + tuple(t for t in GGUF_TYPES if t not in formats.PACKED),
                   required=True,
                   help=f"the format to convert to: {', '.join(formats.PACKED)} for a directory; "
                        "q8_0, q4_0, f16, f32 for a .gguf file")

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

    from .jobs.cli import add_commands  # score, generate-corpus, collect
    add_commands(sub, _model_args, _positive_int, _nonneg_int)
    _serve_args(sub)
    return parser


def _serve_args(sub):
    from .engine import MAX_BATCH, MAX_QUEUE, PREFILL_CHUNK
    from .prefix_cache import DEFAULT_MB

    s = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (OpenAI's API, "
                    "streaming as Server-Sent Events), /tokenize, /detokenize and /tokenizer_info "
                    "(vLLM's), /health and /metrics (Prometheus).  Requests "
                    "run together in one batch (continuous batching); prompts that start like an "
                    "earlier one reuse its keys and values (the prefix cache).  SIGTERM or Ctrl-C "
                    "stops taking requests, lets running ones finish for --grace seconds, and exits 0.  "
                    "Needs pip install 'cyformer[serve]'.",
        epilog="Example: cyformer serve --model HuggingFaceTB/SmolLM2-135M-Instruct --port 8000;  "
               "curl http://127.0.0.1:8000/v1/models")
    _model_args(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=_nonneg_int, default=8000, help="TCP port (default: 8000)")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the model directory's name)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/ routes (default: the "
                        "CYFORMER_API_KEY environment variable; unset: no key)")
    s.add_argument("--max-batch", type=_positive_int, default=MAX_BATCH, metavar="B",
                   help=f"sequences decoded together (default: {MAX_BATCH})")
    s.add_argument("--max-queue", type=_positive_int, default=MAX_QUEUE, metavar="Q",
                   help=f"requests waiting for a slot before the server answers 503 (default: {MAX_QUEUE})")
    s.add_argument("--prefill-chunk", type=_positive_int, default=PREFILL_CHUNK, metavar="T",
                   help=f"prompt tokens prefilled per step, so long prompts do not stall "
                        f"running replies (default: {PREFILL_CHUNK})")
    s.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_MB, metavar="MB",
                   help=f"memory for cached prompt keys/values; 0 turns the cache off (default: {DEFAULT_MB})")
    s.add_argument("--kv-cache-mb", type=float, default=None, metavar="MB",
                   help="memory for the running sequences' keys/values; when it is full, requests wait "
                        "and running ones are preempted and recomputed later (default: a quarter of "
                        "the machine's memory)")
    s.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds running requests get to finish (default: 30)")
    s.add_argument("--max-prompts", type=_positive_int, default=256, metavar="P",
                   help="prompts per /v1/completions request (default: 256); with n choices each, "
                        "they must fit the queue (--max-queue)")
    s.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="logprobs of the model's logits (raw, the default) or of the scores sampled "
                        "from, after logit_bias, penalties and temperature (processed)")


def cmd_serve(args):
    from . import serve

    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.kv_cache_mb is not None and not args.kv_cache_mb > 0:
        raise ValueError(f"--kv-cache-mb must be > 0, got {args.kv_cache_mb}")
    model = _load(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get(serve.API_KEY_ENV) or None
    app = serve.create_app(model, model_name=args.model_name, api_key=api_key, grace=args.grace,
                           max_batch=args.max_batch, max_queue=args.max_queue,
                           prefill_chunk=args.prefill_chunk, prefix_cache_mb=args.prefix_cache_mb,
                           max_prompts=args.max_prompts, logprobs_mode=args.logprobs_mode,
                           kv_cache_mb=args.kv_cache_mb)
    name = app.state.cyformer.model_name
    kv_mb = app.state.cyformer.engine.scheduler.kv_budget / 2**20
    print(f"[cyformer] serving {name!r} on http://{args.host}:{args.port}/v1 "
          f"(batch {args.max_batch}, queue {args.max_queue}, KV cache {kv_mb:g} MB, "
          f"prefix cache {args.prefix_cache_mb:g} MB"
          f"{', API key required' if api_key else ''})", file=sys.stderr)
    import signal

    # uvicorn stops gracefully on SIGTERM and on SIGINT (Ctrl-C), then raises
    # the signal again under the handler that was there before it; handlers
    # that ignore them let the process say "stopped" and exit 0 after a
    # clean stop, as --help says.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    serve.uvicorn_server(app, args.host, args.port, grace=args.grace).run()
    print("[cyformer] stopped", file=sys.stderr)
    return 0


def _sampling_args(p):
    p.add_argument("-t", "--temperature", type=float, default=None,
                   help="sampling temperature; 0 is greedy decoding (default: the model's "
                        "generation_config.json, else 0)")
    p.add_argument("--top-k", type=_positive_int, default=None, metavar="K",
                   help="sample only from the K most likely tokens "
                        "(default: the model's generation_config.json, else all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling: the smallest set of tokens with probability >= P, 0 < P <= 1 "
                        "(default: the model's generation_config.json, else off)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="R > 1 makes tokens already in the text less likely")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when TEXT appears (not printed); may be given several times")
    p.add_argument("--seed", type=_nonneg_int, default=None,
                   help="random seed: the same seed gives the same text")
    p.add_argument("--no-token-healing", action="store_true",
                   help="continue after the prompt's last token as it is, instead of letting the first "
                        "new token re-spell it (token healing, on by default)")
    p.add_argument("--json-schema", metavar="JSON|FILE", default=None,
                   help="constrain the output to JSON valid for this schema (JSON text or a file; "
                        "needs pip install 'cyformer[structured]')")
    p.add_argument("--grammar", metavar="FILE", default=None,
                   help="constrain the output to a Lark grammar read from FILE (llguidance's dialect)")


def _request(args, **more):
    """The GenerationRequest of the command line; a sampling option not given
    takes the model's default."""
    from .request import GenerationRequest

    return GenerationRequest.given(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                   repetition_penalty=args.repetition_penalty, stop=args.stop,
                                   seed=args.seed, max_new_tokens=args.max_new_tokens, **more)


def _structure(args):
    """token_healing, json_schema and grammar from the command line."""
    schema = args.json_schema
    if schema is not None and os.path.isfile(schema):
        with open(schema, encoding="utf-8") as f:
            schema = f.read()
    grammar = None
    if args.grammar is not None:
        with open(args.grammar, encoding="utf-8") as f:
            grammar = f.read()
    return dict(token_healing=False if args.no_token_healing else None, json_schema=schema, grammar=grammar)


def _load(args):
    import cyformer

    return cyformer.load(args.model, threads=args.threads, dtype=args.dtype)


def cmd_generate(args):
    model = _load(args)
    # Validate every argument (by building the stream) before printing anything.
    stream = model.stream(args.prompt, request=_request(args, truncate=args.truncate, **_structure(args)))
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
        _print_stats(stream.stats, model.threads)
    return 0


def _print_stats(s, threads):
    tps = s["decode_tokens_per_s"]
    print(f"[cyformer] prompt {s['prompt_tokens']} tokens, generated {s['new_tokens']} "
          f"({s['finish_reason']}); time to first token {s['time_to_first_token_s'] * 1e3:.1f} ms; "
          f"decode {tps:.1f} tokens/s; threads {threads}" if tps else
          f"[cyformer] prompt {s['prompt_tokens']} tokens, generated {s['new_tokens']} "
          f"({s['finish_reason']}); time to first token {s['time_to_first_token_s'] * 1e3:.1f} ms",
          file=sys.stderr)


def _read_message(interactive):
    """The next user line, or None at the end of input."""
    try:
        line = input("> ") if interactive else sys.stdin.readline()
    except EOFError:
        return None
    if not interactive and not line:
        return None
    return line.rstrip("\n")


def cmd_chat(args):
    from .chat import ChatTemplate

    model = _load(args)
    ChatTemplate.of(model)  # no template: say so before reading anything
    opening = [] if args.system is None else [{"role": "system", "content": args.system}]
    request = _request(args, **_structure(args))
    request.sampling(model.generation_config)  # bad values fail here, before any input is read
    out = sys.stdout

    def reply(messages):
        stream = model.chat_stream(messages, request=request)
        pieces = []
        for piece in stream:
            pieces.append(piece)
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()
        if args.verbose:
            _print_stats(stream.stats, model.threads)
        return "".join(pieces)

    if args.message is not None:
        reply(opening + [{"role": "user", "content": args.message}])
        return 0

    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # pragma: no cover - not on every platform
            pass
        print(f"[cyformer] chatting with {model.path}; /reset starts over, /exit or Ctrl-D ends",
              file=sys.stderr)
    messages = list(opening)
    try:
        while True:
            text = _read_message(interactive)
            if text is None or text.strip() == "/exit":
                break
            if text.strip() == "/reset":
                messages = list(opening)
                continue
            if not text.strip():
                continue
            turn = messages + [{"role": "user", "content": text}]
            try:
                answer = reply(turn)
            except ValueError as e:  # the conversation outgrew the context: keep the loop
                print(f"cyformer: error: {e}; /reset starts a new conversation", file=sys.stderr)
                continue
            messages = turn + [{"role": "assistant", "content": answer}]
    except KeyboardInterrupt:
        print(file=sys.stderr)
    if interactive:
        print(file=sys.stderr)
    return 0


def cmd_info(args):
    import cyformer

    from .engine import default_kv_cache_mb
    from .prefix_cache import DEFAULT_MB

    model = _load(args)
    cfg = model.config
    info = {
        "path": model.path,
        "config": cfg.to_dict(),
        "d_head": cfg.d_head,
        "d_mlp": cfg.d_mlp,
        "parameters": cfg.n_params(),
        "tied_unembedding": model.weights.tied,
        "file_bytes": (os.path.getsize(model.path) if os.path.isfile(model.path) else
                       sum(os.path.getsize(os.path.join(model.path, f)) for f in os.listdir(model.path)
                           if f.endswith(".safetensors"))),
        "dtype": model.dtype,
        "tokenizer": model.tokenizer.available,
        "prefix_cache_mb": DEFAULT_MB,  # cyformer serve's default (--prefix-cache-mb)
        "kv_cache_mb": round(default_kv_cache_mb()),  # cyformer serve's default (--kv-cache-mb)
        "kv_bytes_per_position": 2 * cfg.n_layer * cfg.n_kv_head * cfg.d_head * 4,
        "build": cyformer.build_info(),
    }
    if getattr(model, "gguf_tensors", None):
        info["gguf_tensors"] = model.gguf_tensors
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model       {info['path']}")
    print(f"parameters  {info['parameters']:,} ({info['file_bytes'] / 1e6:.1f} MB on disk, {info['dtype']} in memory, "
          f"unembedding {'tied to wte' if info['tied_unembedding'] else 'separate'})")
    print(f"geometry    {cfg.n_layer} layers, d_model {cfg.n_embd}, {cfg.n_head} heads of {cfg.d_head}, "
          f"d_mlp {cfg.d_mlp}, vocab {cfg.vocab_size}, context {cfg.n_positions}, {cfg.activation_function}")
    print(f"tokenizer   {'yes' if info['tokenizer'] else 'none (token ids only)'}")
    for kind, t in (info.get("gguf_tensors") or {}).items():  # GGUF: the file's type and what runs
        print(f"gguf        {kind:<18} {t['file']} -> {t['runs']} ({t['how']})")
    per = info["kv_bytes_per_position"]
    print(f"kv cache    {per / 1024:.1f} KB per position; serve's prefix cache {DEFAULT_MB} MB "
          f"(--prefix-cache-mb) holds {DEFAULT_MB * 2**20 // per:,} positions, its KV budget "
          f"{info['kv_cache_mb']} MB (--kv-cache-mb) {info['kv_cache_mb'] * 2**20 // per:,}")
    print("config      " + json.dumps(info["config"]))
    b = info["build"]
    print(f"build       cyformer {b['version']}, kernels {b['isa']} {' '.join(b['isa_flags'])} "
          f"(built: {', '.join(b['isa_levels_built'])}), OpenMP {'on' if b['openmp'] else 'OFF'}, "
          f"threads {model.threads}, Cython {b['cython']}, flags {' '.join(b['compile_flags'])}")
    print("cpu         x86-64 level " + str(b["cpu_x86_level"]) + "; "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in b["cpu_features"].items()))
    print("formats     " + "; ".join(f"{name} {f['bytes_per_weight']:g} B/weight: {f['kernels']}"
                                     for name, f in b["formats"].items()))
    return 0


def cmd_inspect(args):
    import numpy as np

    from . import _checks
    from .interp import export, lens

    # An optional dependency that is missing is found before the work and
    # said once, then; the rest (text, HTML) is still produced, and the exit
    # status (1) says that not everything asked for was.
    png_missing = None
    if args.png:
        try:
            export.require_matplotlib()
        except export.PlotUnavailable as e:
            png_missing = e
            print(f"cyformer: error: not writing {args.png}: {e}; writing the rest", file=sys.stderr)
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
        if path and not (save is export.save_png and png_missing):
            save(path, labels, patterns)
            print(f"[cyformer] wrote {len(patterns)} attention pattern(s) to {path}", file=sys.stderr)
    return 1 if png_missing else 0


def cmd_quantize(args):
    import cyformer

    if args.dst.endswith(".gguf") or args.dtype not in formats.PACKED:
        if not args.dst.endswith(".gguf") or args.dtype not in GGUF_TYPES:
            raise ValueError(f"a .gguf file takes --dtype {', '.join(GGUF_TYPES)}; a directory "
                             f"{', '.join(formats.PACKED)}")
        out = cyformer.load(args.src, threads=1).save(args.dst, format="gguf", dtype=args.dtype)
        print(f"wrote {out} (GGUF, matrices {args.dtype.upper()}, {os.path.getsize(out) / 1e6:.1f} MB)")
        return 0
    model = cyformer.load(args.src, threads=1, dtype=args.dtype)
    out = model.save(args.dst)
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(f"wrote {out} ({args.dtype}, {size / 1e6:.1f} MB of weights)")
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
        if args.command in ("score", "generate-corpus", "collect"):
            from .jobs.cli import main as jobs_main
            return jobs_main(args)
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info,
                "inspect": cmd_inspect, "quantize": cmd_quantize, "serve": cmd_serve}[args.command](args)
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
