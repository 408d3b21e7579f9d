"""The "cython" backend: the GPT-2 forward pass wired from the compiled kernels.

The model is a residual stream that every layer reads from and adds into:

    resid  = wte[ids] + wpe[positions]                 # embed
    for each block:
        resid += attn(ln_1(resid))                     # move information between positions
        resid += mlp(ln_2(resid))                      # compute on each position
    logits = ln_f(resid) @ wte.T                       # unembed

Shapes: T positions, C = d_model, H heads, D = d_head, V vocabulary.
All numeric work happens in the kernels; this module only allocates and calls.

``run(..., hooks=...)`` takes a second, unfused path that reports named
activations (cyformer.interp.hooks) and takes replacements for them.  It
computes extra products only for the points ``hooks.wants``, and it never
writes to an array after handing it to a hook, so a cache can keep the
arrays themselves.  Without hooks the fused path below runs unchanged.

The unhooked path takes its activations and the kernels' scratch from a
per-thread ``Workspace`` (``ws``): the same memory every call, instead of
fresh pages that the OS must map and zero.  The logits, which the caller
keeps, come from a per-thread ``LogitsBuffer``: the previous call's array
once the caller has let go of it, else a new one.
"""

import sys
import threading

import numpy as np

from ..config import Config
from ..kernels import activations, attention, decode, linalg, mlp, norm
from ..kv_cache import KVCache
from ..weights import BlockWeights, LayerNormWeights, Weights


class LayerNorm:
    def __init__(self, w: LayerNormWeights, eps: float):
        self.w, self.eps = w, eps

    def __call__(self, x, threads, out=None, scale=None):
        """x [T, C] -> normalised [T, C]; ``scale`` [T] receives sqrt(var + eps)."""
        return norm.layer_norm_forward(x, self.w.weight, self.w.bias, self.eps,
                                       out=out, scale=scale, threads=threads)

    def hooked(self, x, threads, hooks, prefix):
        """ln(x) reporting ``{prefix}hook_scale`` [T, 1] and ``{prefix}hook_normalized``."""
        if not hooks.wants(prefix + "hook_scale"):
            return hooks(prefix + "hook_normalized", self(x, threads))
        scale = np.empty(len(x), dtype=np.float32)
        out = self(x, threads, scale=scale)
        scale = scale[:, None]
        new = hooks(prefix + "hook_scale", scale)
        if new is not scale:  # a frozen or patched scale: normalise by it instead
            centred = x - x.mean(axis=1, keepdims=True, dtype=np.float64)
            out = (centred / new * self.w.weight + self.w.bias).astype(np.float32)
        return hooks(prefix + "hook_normalized", out)


class Attention:
    """Causal self-attention: c_attn makes q, k, v; c_proj writes the heads back."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.c_attn, self.c_proj = w.c_attn, w.attn_c_proj
        self.n_head, self.d_head = cfg.n_head, cfg.d_head

    def qkv(self, x, threads, ws=None):
        """x [T, C] -> [T, 3C]: q | k | v, heads contiguous within each."""
        out = ws.array("qkv", (len(x), 3 * self.n_head * self.d_head)) if ws is not None else None
        return linalg.linear_forward(x, self.c_attn.weight, self.c_attn.bias, out=out,
                                     threads=threads, workspace=ws)

    def mix(self, qkv, k_cache, v_cache, past, threads, scores=None, pattern=None, ws=None):
        """The only step where positions mix: [T, 3C] -> z [T, C] (heads concatenated)."""
        out = ws.array("z", (len(qkv), self.n_head * self.d_head)) if ws is not None else None
        return attention.attention_forward(qkv, k_cache, v_cache, past, out=out, scores=scores,
                                           pattern=pattern, threads=threads, workspace=ws)

    def out(self, z, threads, resid=None, ws=None):
        """z [T, C] -> the attention update; added straight into ``resid`` when given."""
        return linalg.linear_forward(z, self.c_proj.weight, self.c_proj.bias, out=resid,
                                     accumulate=resid is not None, threads=threads, workspace=ws)

    def __call__(self, x, k_cache, v_cache, past, threads, resid=None, ws=None):
        z = self.mix(self.qkv(x, threads, ws), k_cache, v_cache, past, threads, ws=ws)
        return self.out(z, threads, resid, ws)

    def head_writes(self, z, threads):
        """z [T, C] -> [H, T, C]: head h's write z_h @ W_O[h], one product per head.

        W_O[h] is the h-th block of D rows of c_proj's weight, already
        contiguous; z_h is gathered into [H, T, D] once.  The writes sum over
        heads (plus the bias) to the attention update.
        """
        H, D = self.n_head, self.d_head
        T, C = z.shape
        z_heads = np.ascontiguousarray(z.reshape(T, H, D).transpose(1, 0, 2))
        out = np.empty((H, T, C), dtype=np.float32)
        W = self.c_proj.weight
        for h in range(H):
            linalg.linear_forward(z_heads[h], W[h * D:(h + 1) * D], None, out=out[h], threads=threads)
        return out

    def hooked(self, x, k_cache, v_cache, past, threads, hooks, prefix):
        """z [T, C] from x [T, C], reporting q, k, v, scores, pattern and z.

        A replaced score or pattern is applied by recomputing z = pattern @ v
        from the cache; replaced q/k/v go in before the kernel runs.
        """
        H, D = self.n_head, self.d_head
        T, C = len(x), H * D
        qkv = self.qkv(x, threads)
        copied = False
        for j, point in enumerate(("hook_q", "hook_k", "hook_v")):
            if hooks.wants(prefix + point):
                part = qkv[:, j * C:(j + 1) * C].reshape(T, H, D)
                new = hooks(prefix + point, part)
                if new is not part:
                    if not copied:  # views already handed out keep the old values
                        qkv, copied = qkv.copy(), True
                    qkv[:, j * C:(j + 1) * C] = new.reshape(T, C)
        S = past + T
        want_scores = hooks.wants(prefix + "hook_attn_scores")
        want_pattern = hooks.wants(prefix + "hook_pattern")
        scores = np.empty((H, T, S), dtype=np.float32) if want_scores else None
        pattern = np.empty((H, T, S), dtype=np.float32) if want_pattern else None
        z = self.mix(qkv, k_cache, v_cache, past, threads, scores=scores, pattern=pattern)
        changed = False
        if want_scores:
            new = hooks(prefix + "hook_attn_scores", scores)
            if new is not scores:
                pattern = activations.softmax_inplace(new.copy(), threads=threads)
                changed = True
        if want_pattern:
            new = hooks(prefix + "hook_pattern", pattern)
            changed = changed or new is not pattern
            pattern = new
        if changed:
            z_heads = np.matmul(pattern, v_cache[:, :S, :])  # [H, T, D]
            z = np.ascontiguousarray(z_heads.transpose(1, 0, 2)).reshape(T, C)
        zv = z.reshape(T, H, D)
        new = hooks(prefix + "hook_z", zv)
        return z if new is zv else new.reshape(T, C)


class MLP:
    """Two linear maps with a GELU between: d_mlp neurons, each reading from and
    writing to the residual stream."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.c_fc, self.c_proj, self.act = w.c_fc, w.mlp_c_proj, cfg.gelu

    def __call__(self, x, threads, resid=None, ws=None):
        """x [T, C] -> the MLP update; added straight into ``resid`` when given."""
        return mlp.mlp_forward(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                               self.c_proj.bias, out=resid, activation=self.act,
                               accumulate=resid is not None, threads=threads, workspace=ws)

    def hooked(self, x, threads, hooks, prefix):
        """The MLP update [T, C], reporting ``mlp.hook_pre``, ``mlp.hook_post``
        and ``hook_mlp_out`` on the way; None when none of them is wanted
        (the caller then adds the update with the fused kernel)."""
        if hooks.wants(prefix + "mlp.hook_pre"):
            pre = hooks(prefix + "mlp.hook_pre",
                        linalg.linear_forward(x, self.c_fc.weight, self.c_fc.bias, threads=threads))
            post = activations.gelu_inplace(pre.copy(), kind=self.act, threads=threads)
        elif hooks.wants(prefix + "mlp.hook_post"):
            post = linalg.linear_forward(x, self.c_fc.weight, self.c_fc.bias,
                                         activation=self.act, threads=threads)
        elif hooks.wants(prefix + "hook_mlp_out"):
            return hooks(prefix + "hook_mlp_out", self(x, threads))
        else:
            return None
        post = hooks(prefix + "mlp.hook_post", post)
        out = linalg.linear_forward(post, self.c_proj.weight, self.c_proj.bias, threads=threads)
        return hooks(prefix + "hook_mlp_out", out)


class Block:
    """One residual block: an attention update, then an MLP update."""

    def __init__(self, index: int, w: BlockWeights, cfg: Config):
        self.index = index
        self.prefix = f"blocks.{index}."
        self.ln_1 = LayerNorm(w.ln_1, cfg.layer_norm_epsilon)
        self.attn = Attention(w, cfg)
        self.ln_2 = LayerNorm(w.ln_2, cfg.layer_norm_epsilon)
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

    def hooked(self, resid, kv: KVCache, past, threads, hooks):
        """The same block through named hook points; returns a new resid.

        An update is computed on its own only when it (or a part of it) is
        wanted, and then added with one float32 add per element: bitwise what
        the kernels' accumulate (out += x @ W + b) gives, so hooks that return
        None change nothing.
        """
        p = self.prefix
        k_cache, v_cache = kv.layer(self.index)
        resid = hooks(p + "hook_resid_pre", resid)
        z = self.attn.hooked(self.ln_1.hooked(resid, threads, hooks, p + "ln1."),
                             k_cache, v_cache, past, threads, hooks, p + "attn.")
        attn_out = None
        if hooks.wants(p + "attn.hook_result"):
            writes = self.attn.head_writes(z, threads).transpose(1, 0, 2)  # [T, H, C]
            new = hooks(p + "attn.hook_result", writes)
            if new is not writes:  # changed writes: the update is their sum
                attn_out = new.sum(axis=1, dtype=np.float32) + self.attn.c_proj.bias
        if attn_out is None and hooks.wants(p + "hook_attn_out"):
            attn_out = self.attn.out(z, threads)
        if attn_out is None:
            resid = resid.copy()
            self.attn.out(z, threads, resid=resid)
        else:
            resid = resid + hooks(p + "hook_attn_out", attn_out)
        resid = hooks(p + "hook_resid_mid", resid)
        x = self.ln_2.hooked(resid, threads, hooks, p + "ln2.")
        mlp_out = self.mlp.hooked(x, threads, hooks, p)
        if mlp_out is None:
            resid = resid.copy()
            self.mlp(x, threads, resid=resid)
        else:
            resid = resid + mlp_out
        return hooks(p + "hook_resid_post", resid)


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
    """Embedding, blocks, final layer norm and unembedding over loaded weights."""

    name = "cython"
    supports_hooks = True  # run(..., hooks=) takes the hooked path

    def __init__(self, cfg: Config, weights: Weights, threads: int):
        self.config = cfg
        self.weights = weights
        self.threads = threads
        self.blocks = [Block(i, w, cfg) for i, w in enumerate(weights.blocks)]
        self.ln_f = LayerNorm(weights.ln_f, cfg.layer_norm_epsilon)
        self._local = PerThread()
        # Generation's one-token steps: every layer in one kernel call.
        self.step = decode.DecodeStep(
            weights.wte, weights.wpe,
            [(w.ln_1.weight, w.ln_1.bias, w.c_attn.weight, w.c_attn.bias,
              w.attn_c_proj.weight, w.attn_c_proj.bias, w.ln_2.weight, w.ln_2.bias,
              w.c_fc.weight, w.c_fc.bias, w.mlp_c_proj.weight, w.mlp_c_proj.bias)
             for w in weights.blocks],
            weights.ln_f.weight, weights.ln_f.bias, weights.lm_head,
            cfg.n_head, cfg.layer_norm_epsilon, cfg.gelu)

    def workspace(self):
        """The calling thread's Workspace."""
        return self._local.ws

    def new_cache(self, capacity, reuse=False):
        """A KV cache for ``capacity`` positions.  reuse=True: for a caller
        that drops the cache when ``run`` returns (a plain forward); its
        memory then comes from this thread's Workspace and is the same on
        every such call."""
        if reuse:
            return KVCache(self.config, capacity, alloc=self.workspace().array)
        return KVCache(self.config, capacity)

    def embed(self, ids, past, threads, out=None):
        """ids [T] -> resid [T, C] = wte[ids] + wpe[past : past + T]."""
        return linalg.embedding(ids, self.weights.wte, self.weights.wpe, pos0=past, out=out,
                                threads=threads)

    def unembed(self, x, threads):
        """x [T, C] (after ln_f) -> logits [T, V] = x @ lm_head.T."""
        return linalg.linear_forward(x, self.weights.lm_head, None, w_transposed=True, threads=threads)

    def run(self, ids, kv: KVCache, last_only=False, hooks=None):
        """Feed token ids [T] (already validated) after the kv.length cached
        positions; returns logits [T, V] (or [1, V] with last_only).

        hooks: a cyformer.interp.hooks.HookPoints to run the hooked path."""
        if hooks is not None:
            return self._run_hooked(ids, kv, last_only, hooks)
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
        return linalg.linear_forward(x, self.weights.lm_head, None, out=out, w_transposed=True,
                                     threads=threads, workspace=ws)

    def _run_hooked(self, ids, kv: KVCache, last_only, hooks):
        threads = self.threads
        past = kv.length
        if hooks.wants("hook_embed") or hooks.wants("hook_pos_embed"):
            tok = hooks("hook_embed", self.weights.wte[ids])
            pos = hooks("hook_pos_embed", self.weights.wpe[past:past + len(ids)].copy())
            resid = tok + pos  # the embedding kernel's sum, element for element
        else:
            resid = self.embed(ids, past, threads)
        for block in self.blocks:
            resid = block.hooked(resid, kv, past, threads, hooks)
        kv.length = past + len(ids)
        if hooks.wants("ln_final.hook_scale") or hooks.wants("ln_final.hook_normalized"):
            x = self.ln_f.hooked(resid, threads, hooks, "ln_final.")
            x = x[-1:] if last_only else x
        else:
            x = self.ln_f(resid[-1:] if last_only else resid, threads)
        return self.unembed(x, threads)
