"""The "numpy" backend: GPT-2's forward pass as vectorised NumPy, attention in einsum form.

A reference to check the kernels against, not a fast path: pure functions,
bottom-up, every line with its shape.  The model reads

    resid  = wte[ids] + wpe[positions]             # embed
    for each block:
        resid = resid + attn(ln_1(resid))          # the only step where positions mix
        resid = resid + mlp(ln_2(resid))           # one position at a time
    logits = ln_f(resid) @ lm_head.T               # unembed

Letters: T new positions (queries), S = past + T visible positions (keys),
C = d_model, H heads, D = d_head, M = d_mlp, V vocabulary.  In the einsum
strings s/q/k are positions, d is d_model, n is the head, h is d_head.

Everything is float32, like the compiled kernels: NumPy keeps float32 inputs
in float32 (it accumulates pairwise or in BLAS, so the last bits differ from
the kernels', well inside the tests' 1e-4).  ``threads`` is stored for
symmetry with the other backends; NumPy's BLAS picks its own thread count.
"""

import math

import numpy as np

from ..config import Config
from ..weights import BlockWeights, LayerNormWeights, Weights

F32 = np.float32

# erf has no NumPy ufunc (and scipy is no dependency): math.erf per element,
# in float64, then rounded to float32.  Only the "gelu" (erf) checkpoints use it.
_erf = np.frompyfunc(math.erf, 1, 1)


# -- building blocks ------------------------------------------------------

def layer_norm(x, w: LayerNormWeights, eps):
    """x [T, C] -> [T, C]: zero mean, unit variance per position, then gain and bias."""
    mean = x.mean(axis=-1, keepdims=True)                      # [T, 1]
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)       # [T, 1] biased variance, as in PyTorch
    return (x - mean) / np.sqrt(var + F32(eps)) * w.weight + w.bias  # [T, C]


def gelu_new(x):
    """GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F32(0.5) * x * (F32(1) + np.tanh(F32(math.sqrt(2 / math.pi)) * (x + F32(0.044715) * x ** 3)))


def gelu_erf(x):
    """The exact GELU: 0.5 x (1 + erf(x / sqrt(2)))."""
    erf = _erf(x.astype(np.float64) / math.sqrt(2)).astype(F32)  # [..] same shape as x
    return F32(0.5) * x * (F32(1) + erf)


GELU = {"gelu_new": gelu_new, "gelu": gelu_erf}


def softmax(x):
    """Softmax over the last axis; subtracting the max keeps exp() from overflowing
    (masked entries are -inf and come out exactly 0)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))  # [..., S]
    return e / e.sum(axis=-1, keepdims=True)        # [..., S]


# -- the cache ------------------------------------------------------------

class NumpyCache:
    """Keys and values of earlier positions for one sequence.

    k[layer], v[layer]  [H, capacity, D], positions 0 .. length-1 filled.
    """

    def __init__(self, cfg: Config, capacity):
        cap = int(capacity)
        if not 1 <= cap <= cfg.n_positions:
            raise ValueError(f"NumpyCache: capacity must be in [1, {cfg.n_positions}], got {capacity}")
        H, D = cfg.n_head, cfg.d_head
        self.capacity = cap
        self.k = [np.zeros((H, cap, D), dtype=F32) for _ in range(cfg.n_layer)]  # L x [H, cap, D]
        self.v = [np.zeros((H, cap, D), dtype=F32) for _ in range(cfg.n_layer)]  # L x [H, cap, D]
        self.length = 0


# -- the layers -----------------------------------------------------------

class Attention:
    """Multi-head causal self-attention with per-head weight views.

    c_attn's weight [C, 3C] holds q | k | v side by side, each as H blocks of D
    columns; reshaping it to [C, 3, H, D] and moving axes gives W_Q, W_K, W_V
    [H, C, D] as views of the loaded array (nothing copied).  c_proj's weight
    [C, C] reads the heads' concatenated outputs, so its rows split into
    W_O [H, D, C], again a view.
    """

    def __init__(self, w: BlockWeights, cfg: Config):
        C, H, D = cfg.n_embd, cfg.n_head, cfg.d_head
        qkv = w.c_attn.weight.reshape(C, 3, H, D).transpose(1, 2, 0, 3)  # [3, H, C, D] view
        self.W_Q, self.W_K, self.W_V = qkv                                # each [H, C, D]
        self.b_Q, self.b_K, self.b_V = w.c_attn.bias.reshape(3, H, D)     # each [H, D]
        self.W_O = w.attn_c_proj.weight.reshape(H, D, C)                  # [H, D, C] view
        self.b_O = w.attn_c_proj.bias                                     # [C]
        self.scale = F32(1 / math.sqrt(D))

    def __call__(self, x, k_cache, v_cache, past):
        """x [T, C] (after ln_1) for positions past .. past+T-1 -> update [T, C].

        Writes this step's keys and values into k_cache, v_cache [H, cap, D]."""
        T = x.shape[0]
        S = past + T
        # 1. project the stream into each head's query, key and value spaces
        q = np.einsum("s d, n d h -> s n h", x, self.W_Q) + self.b_Q    # [T, H, D]
        k = np.einsum("s d, n d h -> n s h", x, self.W_K) + self.b_K[:, None]  # [H, T, D]
        v = np.einsum("s d, n d h -> n s h", x, self.W_V) + self.b_V[:, None]  # [H, T, D]
        k_cache[:, past:S] = k                                          # [H, S, D] filled
        v_cache[:, past:S] = v
        keys, values = k_cache[:, :S], v_cache[:, :S]                   # [H, S, D] incl. cached
        # 2. QK: how much each query position attends to each key position
        scores = np.einsum("q n h, n k h -> n q k", q, keys) * self.scale  # [H, T, S]
        # 3. causal mask: query i sits at position past + i and sees keys 0 .. past + i
        future = np.triu(np.ones((T, S), dtype=bool), k=past + 1)      # [T, S] True = masked
        scores = np.where(future, F32(-np.inf), scores)                # [H, T, S]
        pattern = softmax(scores)                                      # [H, T, S] rows sum to 1
        # 4. OV: mix the visible values, then write each head back to the stream
        z = np.einsum("n q k, n k h -> q n h", pattern, values)        # [T, H, D]
        return np.einsum("q n h, n h d -> q d", z, self.W_O) + self.b_O  # [T, C] summed over heads


class MLP:
    """d_mlp neurons: read from the stream (c_fc), GELU, write back (c_proj)."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.c_fc, self.c_proj = w.c_fc, w.mlp_c_proj
        self.act = GELU[cfg.gelu]

    def __call__(self, x):
        """x [T, C] (after ln_2) -> update [T, C]."""
        h = self.act(x @ self.c_fc.weight + self.c_fc.bias)  # [T, M]
        return h @ self.c_proj.weight + self.c_proj.bias     # [T, C]


class Block:
    """One residual block: resid += attn(ln_1(resid)); resid += mlp(ln_2(resid))."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.w, self.eps = w, cfg.layer_norm_epsilon
        self.attn = Attention(w, cfg)
        self.mlp = MLP(w, cfg)

    def __call__(self, resid, k_cache, v_cache, past):
        """resid [T, C] -> the next resid [T, C]."""
        resid = resid + self.attn(layer_norm(resid, self.w.ln_1, self.eps), k_cache, v_cache, past)  # [T, C]
        return resid + self.mlp(layer_norm(resid, self.w.ln_2, self.eps))  # [T, C]


class NumpyBackend:
    """The forward pass over loaded weights, one sequence at a time."""

    name = "numpy"

    def __init__(self, cfg: Config, weights: Weights, threads: int):
        self.config = cfg
        self.weights = weights
        self.threads = threads  # unused: NumPy's BLAS threads itself
        self.blocks = [Block(w, cfg) for w in weights.blocks]

    def new_cache(self, capacity, reuse=False):
        """reuse: part of the shared interface; a new cache every time here."""
        return NumpyCache(self.config, capacity)

    def run(self, ids, kv: NumpyCache, last_only=False):
        """Feed token ids [T] after the kv.length cached positions; returns
        float32 logits [T, V] (or [1, V] with last_only)."""
        w, cfg = self.weights, self.config
        ids = np.asarray(ids, dtype=np.int64)                  # [T]
        past, T = kv.length, len(ids)
        if past + T > kv.capacity:
            raise ValueError(f"run: {past} cached + {T} new positions exceed the cache's "
                             f"capacity of {kv.capacity}")
        resid = w.wte[ids] + w.wpe[past:past + T]              # [T, C]
        for i, block in enumerate(self.blocks):
            resid = block(resid, kv.k[i], kv.v[i], past)       # [T, C]
        kv.length = past + T
        if last_only:
            resid = resid[-1:]                                 # [1, C]
        x = layer_norm(resid, w.ln_f, cfg.layer_norm_epsilon)  # [T, C]
        return np.ascontiguousarray(x @ w.lm_head.T, dtype=F32)  # [T, V]
