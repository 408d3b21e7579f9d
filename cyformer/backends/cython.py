"""The "cython" backend: the forward pass wired from the compiled kernels.

The model is a residual stream that every layer reads from and adds into:

    resid  = wte[ids] (+ wpe[positions])               # embed
    for each block:
        resid += attn(norm_1(resid))                   # move information between positions
        resid += mlp(norm_2(resid))                    # compute on each position
    logits = norm_f(resid) @ lm_head.T                 # unembed

What each step is (layer norm or RMSNorm, learned or rotary positions, GELU
or SwiGLU, which biases) comes from the config (cyformer.arch); this module
only allocates and calls.  Shapes: T positions, C = d_model, H query heads,
G key/value heads, D = d_head, F = d_mlp, V vocabulary.

The path with hook points (reporting and replacing named activations) is in
backends/hooked.py; it reuses the layers defined here.

The plain path takes its activations and the kernels' scratch from a
per-thread ``Workspace`` (``ws``): the same memory every call, instead of
fresh pages that the OS must map and zero.  The logits, which the caller
keeps, come from a per-thread ``LogitsBuffer``: the previous call's array
once the caller has let go of it, else a new one.
"""

import sys
import threading

import numpy as np

from .. import rope
from ..config import Config
from . import forward_each
from ..kernels import attention, decode, linalg, mlp, norm
from ..kv_cache import KVCache
from ..weights import BlockWeights, NormWeights, Weights


class Norm:
    """Layer norm or RMSNorm (cfg.norm) with its gain (and bias)."""

    def __init__(self, w: NormWeights, cfg: Config):
        self.w, self.kind, self.eps = w, cfg.norm, cfg.norm_eps

    def __call__(self, x, threads, out=None, scale=None):
        """x [T, C] -> normalised [T, C]; ``scale`` [T] receives the divisor
        (sqrt(var + eps), or sqrt(mean(x^2) + eps) for RMSNorm)."""
        return norm.norm_forward(self.kind, x, self.w.weight, self.w.bias, self.eps,
                                 out=out, scale=scale, threads=threads)


class Attention:
    """Causal self-attention: c_attn makes q, k, v (rotated for rotary
    models); c_proj writes the heads back."""

    def __init__(self, w: BlockWeights, cfg: Config, rope_tables):
        self.c_attn, self.c_proj = w.c_attn, w.attn_c_proj
        self.n_head, self.n_kv_head, self.d_head = cfg.n_head, cfg.n_kv_head, cfg.d_head
        self.rope = rope_tables  # rope.Tables (cos, sin [rows, D/2], grown by the backend), or None

    def qkv(self, x, threads, ws=None):
        """x [T, C] -> [T, (H + 2G) D]: q | k | v, heads contiguous within each."""
        width = (self.n_head + 2 * self.n_kv_head) * self.d_head
        out = ws.array("qkv", (len(x), width)) if ws is not None else None
        return linalg.linear_forward(x, self.c_attn.weight, self.c_attn.bias, out=out,
                                     threads=threads, workspace=ws)

    def rotate(self, qkv, past, threads):
        """Rotary embedding of qkv's query and key heads, in place (no-op
        for learned positions)."""
        if self.rope is not None:
            attention.rope_forward(qkv, self.n_head, self.n_kv_head, past, *self.rope, threads=threads)
        return qkv

    def mix(self, qkv, k_cache, v_cache, past, threads, scores=None, pattern=None, ws=None):
        """The only step where positions mix: [T, (H + 2G) D] -> z [T, H D]."""
        out = ws.array("z", (len(qkv), self.n_head * self.d_head)) if ws is not None else None
        return attention.attention_forward(qkv, k_cache, v_cache, past, out=out, scores=scores,
                                           pattern=pattern, threads=threads, workspace=ws,
                                           n_head=self.n_head)

    def out(self, z, threads, resid=None, ws=None):
        """z [T, H D] -> the attention update; added straight into ``resid`` when given."""
        return linalg.linear_forward(z, self.c_proj.weight, self.c_proj.bias, out=resid,
                                     accumulate=resid is not None, threads=threads, workspace=ws)

    def __call__(self, x, k_cache, v_cache, past, threads, resid=None, ws=None):
        qkv = self.rotate(self.qkv(x, threads, ws), past, threads)
        return self.out(self.mix(qkv, k_cache, v_cache, past, threads, ws=ws), threads, resid, ws)

    def batched(self, x, caches, T, threads, resid, ws):
        """B sequences of T new positions each, their rows stacked in x [B T, C]:
        the products run over all rows at once (each row's sums are those of
        its own sequence's product); rotation and attention per sequence,
        each over its own cache (caches: B (k_cache, v_cache) pairs)."""
        qkv = self.qkv(x, threads, ws)
        z = ws.array("z", (len(x), self.n_head * self.d_head))
        for b, (k_cache, v_cache) in enumerate(caches):
            rows = slice(b * T, (b + 1) * T)
            q = self.rotate(qkv[rows], 0, threads)
            attention.attention_forward(q, k_cache, v_cache, 0, out=z[rows], threads=threads,
                                        workspace=ws, n_head=self.n_head)
        return self.out(z, threads, resid, ws)


class MLP:
    """Two products with an activation between (a GELU, or SwiGLU's gate):
    F neurons, each reading from and writing to the residual stream."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.c_fc, self.c_proj, self.act = w.c_fc, w.mlp_c_proj, cfg.mlp_activation

    def __call__(self, x, threads, resid=None, ws=None):
        """x [T, C] -> the MLP update; added straight into ``resid`` when given."""
        return mlp.mlp_forward(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                               self.c_proj.bias, out=resid, activation=self.act,
                               accumulate=resid is not None, threads=threads, workspace=ws)


class Block:
    """One residual block: an attention update, then an MLP update."""

    def __init__(self, index: int, w: BlockWeights, cfg: Config, rope_tables):
        self.index = index
        self.prefix = f"blocks.{index}."
        self.ln_1 = Norm(w.ln_1, cfg)
        self.attn = Attention(w, cfg, rope_tables)
        self.ln_2 = Norm(w.ln_2, cfg)
        self.mlp = MLP(w, cfg)

    def __call__(self, resid, kv: KVCache, past, threads, ws=None):
        """Update ``resid`` [T, C] in place; this layer's keys/values go into
        ``kv``.  ws: the Workspace for activations and scratch (a new one
        when None)."""
        k_cache, v_cache = kv.layer(self.index)
        ws = ws if ws is not None else linalg.Workspace()
        x = ws.array("x", resid.shape)
        self.attn(self.ln_1(resid, threads, out=x), k_cache, v_cache, past, threads, resid=resid, ws=ws)
        self.mlp(self.ln_2(resid, threads, out=x), threads, resid=resid, ws=ws)
        return resid

    def batched(self, resid, kvs, T, threads, ws):
        """The block over B sequences whose T rows each are stacked in resid [B T, C]."""
        x = ws.array("x", resid.shape)
        self.attn.batched(self.ln_1(resid, threads, out=x), [kv.layer(self.index) for kv in kvs], T,
                          threads, resid, ws)
        self.mlp(self.ln_2(resid, threads, out=x), threads, resid=resid, ws=ws)
        return resid


class LogitsBuffer:
    """Memory for the logits of a plain forward, handed out again once
    nothing outside refers to it.

    Logits are the largest array of a forward (103 MB for 512 positions of
    GPT-2 small), and a fresh one costs more than its size suggests: the
    first write to each page faults, and NumPy advises huge pages, for which
    the kernel may stop to compact memory.  In a process set up like the
    benchmark's, a 512-token prefill took 0.71 s with fresh logits and
    0.60 s with reused ones at 2 threads (1.44 s and 1.15 s at 1).  A
    caller that drops the logits before the next forward (an evaluation
    loop, the benchmark) gets the same memory back; a caller that keeps
    them, or any view of them, gets a new array, so results are never
    overwritten.  The buffer is the largest asked for so far; one is held
    per calling thread.
    """

    def __init__(self):
        self.buf = None
        self.idle_refs = 0  # sys.getrefcount(buf) in take() when only we hold it

    def take(self, rows, cols):
        """A float32 [rows, cols] C-contiguous array for a result."""
        buf = self.buf
        # Views keep their base alive, so any array that shares this memory
        # raises its reference count.  The idle count is measured at the
        # same point, with the same locals, as this check.
        if (buf is not None and buf.shape[0] >= rows and buf.shape[1] == cols
                and sys.getrefcount(buf) == self.idle_refs):
            return buf[:rows]
        buf = np.empty((rows, cols), dtype=np.float32)
        self.buf = buf
        self.idle_refs = sys.getrefcount(buf)
        return buf[:rows]


class PerThread(threading.local):
    """Each calling thread's reusable memory, made on its first use."""

    def __init__(self):
        self.ws = linalg.Workspace()
        self.logits = LogitsBuffer()


class CythonBackend:
    """Embedding, blocks, final norm and unembedding over loaded weights."""

    name = "cython"
    supports_hooks = True  # run(..., hooks=) takes the hooked path
    # A run of this many positions or more takes the GEMM path, whose rows do
    # not depend on how many there are (linalg's MATVEC_ROWS); fewer take the
    # matrix-vector path, whose sums differ in the last bits.  A prefill cut
    # into pieces of at least this many positions is therefore bitwise one
    # prefill (engine.py chunks prompts and reuses cached keys this way).
    exact_chunk = 4

    def __init__(self, cfg: Config, weights: Weights, threads: int):
        self.config = cfg
        self.weights = weights
        self.threads = threads
        self.rope = rope.Tables(cfg) if cfg.position == "rotary" else None  # grown as caches grow
        self.blocks = [Block(i, w, cfg, self.rope) for i, w in enumerate(weights.blocks)]
        self.ln_f = Norm(weights.ln_f, cfg)
        self._local = PerThread()
        # Generation's one-token steps: every layer in one kernel call.
        self.step = decode.DecodeStep(cfg, weights, *(self.rope if self.rope is not None else (None, None)))

    def workspace(self):
        """The calling thread's Workspace."""
        return self._local.ws

    def new_cache(self, capacity, reuse=False):
        """A KV cache for at most ``capacity`` positions, whose arrays grow as
        ``run`` fills it (kv_cache.py).  reuse=True: for a caller that drops
        the cache when ``run`` returns (a plain forward); its memory then
        comes from this thread's Workspace, whole, and is the same on every
        such call."""
        self.positions(capacity)
        if reuse:
            return KVCache(self.config, capacity, alloc=self.workspace().array)
        return KVCache(self.config, capacity)

    def positions(self, n):
        """Make the rotary tables cover positions 0 .. n-1 (built on demand,
        not for the whole configured context)."""
        if self.rope is not None and self.rope.ensure(min(n, self.config.n_positions)):
            self.step.set_rope(self.rope.cos, self.rope.sin)

    def step_batch(self, tokens, caches):
        """One decode step for B sequences: tokens [B] (one new id each),
        caches B KVCaches, each at its own ``length`` and advanced by one.
        Returns logits [B, V], bitwise those of stepping each sequence alone:
        the fused step's batched form (DecodeStep.batch) reads each weight
        block once for all B rows."""
        caches = list(caches)
        self.positions(max((kv.length for kv in caches), default=0) + 1)
        for kv in caches:
            kv.reserve(kv.length + 1)
        logits = self.step.batch(tokens, [kv.k for kv in caches], [kv.v for kv in caches],
                                 [kv.length for kv in caches], self.threads)
        for kv in caches:
            kv.length += 1
        return logits

    def embed(self, ids, past, threads, out=None):
        """ids [T] -> resid [T, C] = wte[ids] (+ wpe[past : past + T])."""
        return linalg.embedding(ids, self.weights.wte, self.weights.wpe, pos0=past, out=out,
                                threads=threads)

    def unembed(self, x, threads, out=None, ws=None):
        """x [T, C] (after the final norm) -> logits [T, V] = x @ lm_head.T."""
        return linalg.linear_forward(x, self.weights.lm_head, self.weights.lm_head_bias, out=out,
                                     w_transposed=True,
                                     threads=threads, workspace=ws)

    def run_hooked_batch(self, batch, hooks):
        """Logits [T, V] of each sequence of ids [B, T] from position 0 through
        the hook points, the sequences in step so that hooks see the batch."""
        from .hooked import forward
        return hooks.run([forward(self, seq, self.new_cache(len(seq)), False, hooks) for seq in batch])

    def forward_batch(self, batch):
        """Logits [B, T, V] of B fresh sequences (batch [B, T], validated).
        With T >= exact_chunk in one pass: every weight matrix is read once
        for all B T rows, and each sequence's logits are bitwise those of
        running it alone (the same GEMM sums per row; attention per
        sequence).  Shorter ones run one at a time (the matrix-vector path's
        sums depend on the row count)."""
        B, T = batch.shape
        if T < self.exact_chunk:
            return forward_each(self, batch)
        threads, ws, C = self.threads, self.workspace(), self.config.n_embd
        kvs = [KVCache(self.config, T, capacity=T) for _ in range(B)]
        resid = ws.array("resid", (B * T, C))
        for b in range(B):
            self.embed(batch[b], 0, threads, out=resid[b * T:(b + 1) * T])
        for block in self.blocks:
            block.batched(resid, kvs, T, threads, ws)
        x = self.ln_f(resid, threads, out=ws.array("x", resid.shape))
        logits = np.empty((B * T, self.config.vocab_size), dtype=np.float32)
        return self.unembed(x, threads, out=logits, ws=ws).reshape(B, T, -1)

    def run(self, ids, kv: KVCache, last_only=False, hooks=None):
        """Feed token ids [T] (already validated) after the kv.length cached
        positions; returns logits [T, V] (or [1, V] with last_only).

        hooks: a cyformer.hooks.HookPoints to run the hooked path."""
        self.positions(kv.length + len(ids))
        kv.reserve(kv.length + len(ids))
        if hooks is not None:
            from .hooked import run_hooked
            return run_hooked(self, ids, kv, last_only, hooks)
        threads = self.threads
        past = kv.length
        if len(ids) == 1:  # a decode step: the fused kernel, bitwise the same logits
            logits = self.step(ids[0], kv.k, kv.v, past, threads)
            kv.length = past + 1
            return logits
        ws = self.workspace()
        resid = self.embed(ids, past, threads, out=ws.array("resid", (len(ids), self.config.n_embd)))
        for block in self.blocks:
            block(resid, kv, past, threads, ws)
        kv.length = past + len(ids)
        if last_only:
            resid = resid[-1:]
        x = self.ln_f(resid, threads, out=ws.array("x", resid.shape))
        out = self._local.logits.take(len(x), self.config.vocab_size)
        return self.unembed(x, threads, out=out, ws=ws)
