#!/usr/bin/env python
"""Training throughput of candidate geometries for the default model.

Times real optimisation steps (forward, backward, AdamW) of a GPT-2 of each
geometry on random token ids (speed does not depend on the data) and prints
tokens per second, parameters and the float32 weight size, so the geometry
can be chosen by the compute a run will have.

    python train/measure_speed.py --threads 2 --seconds 60 4x256 6x256 8x192

A geometry is ``LAYERSxWIDTH`` (heads = width / 64).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def build(n_layer: int, n_embd: int, vocab: int, n_positions: int, activation="gelu_pytorch_tanh"):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=max(1, n_embd // 64), activation_function=activation,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def measure(spec, args):
    n_layer, n_embd = map(int, spec.lower().split("x"))
    torch.manual_seed(0)
    model = build(n_layer, n_embd, args.vocab_size, args.seq_len, args.activation).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if args.compile else model
    gen = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = forward(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                 ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(args.warmup_steps):
        step()
    # The machine may be shared: the fastest steps show what the geometry
    # does on idle cores, the median what this run actually got.
    times, cpu0, t0 = [], time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    dt_all = time.perf_counter() - t0
    cpu = (time.process_time() - cpu0) / dt_all
    times.sort()
    tokens = args.batch_size * args.seq_len
    best = tokens / (sum(times[:max(1, len(times) // 4)]) / max(1, len(times) // 4))
    median = tokens / times[len(times) // 2]
    tok_s = best
    print(f"{spec:>8}  params {n_params / 1e6:5.2f} M  float32 {n_params * 4 / 1e6:5.1f} MB  "
          f"{len(times):3d} steps  best quarter {best:6.0f} tok/s, median {median:6.0f} tok/s "
          f"(CPU use {cpu:.2f} cores, {tokens * len(times) / (cpu * dt_all):6.0f} tok per CPU-s)  -> {best * args.budget_minutes * 60 / 1e6:5.1f} M tokens "
          f"in {args.budget_minutes:g} min at the best rate", flush=True)
    return tok_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("geometries", nargs="+", help="LAYERSxWIDTH, e.g. 4x256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0, help="timed seconds per geometry")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--activation", default="gelu_pytorch_tanh",
                   help="gelu_pytorch_tanh (fused) or gelu_new (the same formula, unfused)")
    p.add_argument("--budget-minutes", type=float, default=85.0, help="for the tokens-per-run column")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, batch {args.batch_size} x {args.seq_len}, "
          f"vocab {args.vocab_size}, {'bfloat16 autocast' if args.bf16 else 'float32'}, "
          f"{args.activation}{', compiled' if args.compile else ''}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for spec in args.geometries:
        measure(spec, args)


if __name__ == "__main__":
    main()
