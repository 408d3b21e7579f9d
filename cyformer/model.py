"""The GPT-2 forward pass, wired from the compiled kernels.

The model is a residual stream that every layer reads from and adds into:

    resid  = wte[ids] + wpe[positions]                 # embed
    for each block:
        resid += attn(ln_1(resid))                     # move information between positions
        resid += mlp(ln_2(resid))                      # compute on each position
    logits = ln_f(resid) @ wte.T                       # unembed

Shapes: T positions, C = d_model, H heads, D = d_head, V vocabulary.
All numeric work happens in the kernels; this module only allocates and calls.
"""

import numpy as np

from . import _checks
from .config import Config
from .kernels import activations, attention, linalg, mlp, norm
from .generate import Generation, Stream
from .kv_cache import KVCache
from .tokenizer import NoTokenizer
from .weights import BlockWeights, LayerNormWeights, Weights


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


class Model:
    """A loaded GPT-2: embedding, blocks, final layer norm and unembedding.

    Build one with ``cyformer.load(path)``.  ``threads`` is the OpenMP team
    size every kernel call uses; results do not depend on it.
    """

    def __init__(self, cfg: Config, weights: Weights, threads=None, path=None, tokenizer=None):
        self.config = cfg
        self.weights = weights
        self.path = path
        self.tokenizer = tokenizer if tokenizer is not None else NoTokenizer(path)
        self.threads = _checks.threads("load", threads)
        self.blocks = [Block(i, w, cfg) for i, w in enumerate(weights.blocks)]
        self.ln_f = LayerNorm(weights.ln_f, cfg.layer_norm_epsilon)

    def __repr__(self):
        c = self.config
        return (f"<cyformer.Model {c.n_layer} layers, d_model {c.n_embd}, {c.n_head} heads, "
                f"vocab {c.vocab_size}, context {c.n_positions}, threads {self.threads}>")

    def forward(self, ids):
        """Logits for every position: ids [T] -> [T, V], or [B, T] -> [B, T, V] (float32).

        Each sequence runs from position 0 with its own cache; positions only
        see earlier ones (causal).
        """
        batch, batched = check_ids(ids, self.config)
        logits = np.empty((*batch.shape, self.config.vocab_size), dtype=np.float32)
        for b, seq in enumerate(batch):
            kv = KVCache(self.config, capacity=len(seq))
            logits[b] = self.run(seq, kv, self.threads)
        return logits if batched else logits[0]

    __call__ = forward

    # -- text -------------------------------------------------------------

    def encode(self, text):
        """str -> list of token ids (needs the checkpoint's tokenizer.json)."""
        return self.tokenizer.encode(text)

    def decode(self, ids):
        """token ids -> str (needs the checkpoint's tokenizer.json)."""
        return self.tokenizer.decode(_checks.token_ids("decode", "ids", ids, self.config.vocab_size, ndim=1))

    # -- generation -------------------------------------------------------

    def generate(self, prompt, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
                 repetition_penalty=None, stop=None, seed=None):
        """Continue ``prompt`` (a str, or a sequence of token ids).

        Returns the new text (a str with ``.token_ids``, ``.finish_reason`` and
        ``.stats``) for a str prompt, or the new token ids (a list with
        ``.finish_reason`` and ``.stats``) for an ids prompt.
        temperature 0 is greedy; ``seed`` makes sampling reproducible.  It stops
        at max_new_tokens ("length"), the eos token ("eos"), a stop string or
        stop token id ("stop"; a stop string is cut from the text), or when the
        n_positions context is full ("context").
        """
        return Generation(self, prompt, max_new_tokens, temperature, top_k, top_p,
                          repetition_penalty, stop, seed).result()

    def stream(self, prompt, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
               repetition_penalty=None, stop=None, seed=None):
        """Like generate(), but yields pieces as they are produced: str pieces
        (never splitting a UTF-8 character) for a str prompt, int ids for an
        ids prompt.  The returned iterator has ``finish_reason`` once exhausted."""
        return Stream(Generation(self, prompt, max_new_tokens, temperature, top_k, top_p,
                                 repetition_penalty, stop, seed))

    def embed(self, ids, past, threads):
        """ids [T] -> resid [T, C] = wte[ids] + wpe[past : past + T]."""
        return linalg.embedding(ids, self.weights.wte, self.weights.wpe, pos0=past, threads=threads)

    def unembed(self, x, threads):
        """x [T, C] (after ln_f) -> logits [T, V] = x @ lm_head.T."""
        return linalg.linear_forward(x, self.weights.lm_head, None, w_transposed=True, threads=threads)

    def run(self, ids, kv: KVCache, threads, last_only=False):
        """Feed token ids [T] (already validated) after the kv.length cached
        positions; returns logits [T, V] (or [1, V] with last_only)."""
        past = kv.length
        resid = self.embed(ids, past, threads)
        for block in self.blocks:
            block(resid, kv, past, threads)
        kv.length = past + len(ids)
        if last_only:
            resid = resid[-1:]
        return self.unembed(self.ln_f(resid, threads), threads)


def check_ids(ids, cfg: Config, fn="forward"):
    """Token ids -> (int64 array [B, T], had_batch_axis), validated against cfg."""
    arr = _checks.token_ids(fn, "ids", ids, cfg.vocab_size)
    if arr.ndim not in (1, 2):
        raise ValueError(f"{fn}: ids must be 1-D [T] or 2-D [B, T], got shape {arr.shape}")
    batched = arr.ndim == 2
    arr = arr.reshape(-1, arr.shape[-1]) if batched else arr[None, :]
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{fn}: ids must hold at least one token, got shape {arr.shape}")
    if arr.shape[1] > cfg.n_positions:
        raise ValueError(f"{fn}: {arr.shape[1]} tokens exceed the model's context of "
                         f"n_positions={cfg.n_positions}")
    return arr, batched
