"""The "cython" backend: the GPT-2 forward pass wired from the compiled kernels.

The model is a residual stream that every layer reads from and adds into:

    resid  = wte[ids] + wpe[positions]                 # embed
    for each block:
        resid += attn(ln_1(resid))                     # move information between positions
        resid += mlp(ln_2(resid))                      # compute on each position
    logits = ln_f(resid) @ wte.T                       # unembed

Shapes: T positions, C = d_model, H heads, D = d_head, V vocabulary.
All numeric work happens in the kernels; this module only allocates and calls.
"""

from ..config import Config
from ..kernels import attention, linalg, mlp, norm
from ..kv_cache import KVCache
from ..weights import BlockWeights, LayerNormWeights, Weights


class LayerNorm:
    def __init__(self, w: LayerNormWeights, eps: float):
        self.w, self.eps = w, eps

    def __call__(self, x, threads, out=None, scale=None):
        """x [T, C] -> normalised [T, C]; ``scale`` [T] receives sqrt(var + eps)."""
        return norm.layer_norm_forward(x, self.w.weight, self.w.bias, self.eps,
                                       out=out, scale=scale, threads=threads)


class Attention:
    """Causal self-attention: c_attn makes q, k, v; c_proj writes the heads back."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.c_attn, self.c_proj = w.c_attn, w.attn_c_proj
        self.n_head, self.d_head = cfg.n_head, cfg.d_head

    def qkv(self, x, threads):
        """x [T, C] -> [T, 3C]: q | k | v, heads contiguous within each."""
        return linalg.linear_forward(x, self.c_attn.weight, self.c_attn.bias, threads=threads)

    def mix(self, qkv, k_cache, v_cache, past, threads, scores=None, pattern=None):
        """The only step where positions mix: [T, 3C] -> z [T, C] (heads concatenated)."""
        return attention.attention_forward(qkv, k_cache, v_cache, past, scores=scores,
                                           pattern=pattern, threads=threads)

    def out(self, z, threads, resid=None):
        """z [T, C] -> the attention update; added straight into ``resid`` when given."""
        return linalg.linear_forward(z, self.c_proj.weight, self.c_proj.bias, out=resid,
                                     accumulate=resid is not None, threads=threads)

    def __call__(self, x, k_cache, v_cache, past, threads, resid=None):
        z = self.mix(self.qkv(x, threads), k_cache, v_cache, past, threads)
        return self.out(z, threads, resid)


class MLP:
    """Two linear maps with a GELU between: d_mlp neurons, each reading from and
    writing to the residual stream."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.c_fc, self.c_proj, self.act = w.c_fc, w.mlp_c_proj, cfg.gelu

    def __call__(self, x, threads, resid=None):
        """x [T, C] -> the MLP update; added straight into ``resid`` when given."""
        return mlp.mlp_forward(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                               self.c_proj.bias, out=resid, activation=self.act,
                               accumulate=resid is not None, threads=threads)


class Block:
    """One residual block: an attention update, then an MLP update."""

    def __init__(self, index: int, w: BlockWeights, cfg: Config):
        self.index = index
        self.ln_1 = LayerNorm(w.ln_1, cfg.layer_norm_epsilon)
        self.attn = Attention(w, cfg)
        self.ln_2 = LayerNorm(w.ln_2, cfg.layer_norm_epsilon)
        self.mlp = MLP(w, cfg)

    def __call__(self, resid, kv: KVCache, past, threads):
        """Update ``resid`` [T, C] in place; this layer's keys/values go into ``kv``."""
        k_cache, v_cache = kv.layer(self.index)
        self.attn(self.ln_1(resid, threads), k_cache, v_cache, past, threads, resid=resid)
        self.mlp(self.ln_2(resid, threads), threads, resid=resid)
        return resid


class CythonBackend:
    """Embedding, blocks, final layer norm and unembedding over loaded weights."""

    name = "cython"

    def __init__(self, cfg: Config, weights: Weights, threads: int):
        self.config = cfg
        self.weights = weights
        self.threads = threads
        self.blocks = [Block(i, w, cfg) for i, w in enumerate(weights.blocks)]
        self.ln_f = LayerNorm(weights.ln_f, cfg.layer_norm_epsilon)

    def new_cache(self, capacity):
        return KVCache(self.config, capacity)

    def embed(self, ids, past, threads):
        """ids [T] -> resid [T, C] = wte[ids] + wpe[past : past + T]."""
        return linalg.embedding(ids, self.weights.wte, self.weights.wpe, pos0=past, threads=threads)

    def unembed(self, x, threads):
        """x [T, C] (after ln_f) -> logits [T, V] = x @ lm_head.T."""
        return linalg.linear_forward(x, self.weights.lm_head, None, w_transposed=True, threads=threads)

    def run(self, ids, kv: KVCache, last_only=False):
        """Feed token ids [T] (already validated) after the kv.length cached
        positions; returns logits [T, V] (or [1, V] with last_only)."""
        threads = self.threads
        past = kv.length
        resid = self.embed(ids, past, threads)
        for block in self.blocks:
            block(resid, kv, past, threads)
        kv.length = past + len(ids)
        if last_only:
            resid = resid[-1:]
        return self.unembed(self.ln_f(resid, threads), threads)
