"""The public Model: one interface over interchangeable backends.

A backend computes logits for new positions given a per-sequence cache
(``new_cache(capacity)``, ``run(ids, cache, last_only)``); the Model adds
input checking, batching, text and generation on top, identically for all.

For looking inside, a backend with ``supports_hooks`` also takes
``run(..., hooks=HookPoints)``; ``run_with_cache`` and ``run_with_hooks``
go through it, and ``blocks``/``unembed`` are read-only views of the weights
(cyformer.interp).
"""

import os

import numpy as np

from . import _checks
from .backends import make_backend
from .config import Config
from .generate import Generation, Stream
from .tokenizer import NoTokenizer
from .weights import Weights


class Model:
    """A loaded GPT-2: embedding, blocks, final layer norm and unembedding.

    Build one with ``cyformer.load(path)``.  ``threads`` is the OpenMP team
    size every kernel call uses; results do not depend on it.
    """

    def __init__(self, cfg: Config, weights: Weights, threads=None, path=None, tokenizer=None,
                 backend="cython"):
        self.config = cfg
        self.weights = weights
        self.path = path
        self.tokenizer = tokenizer if tokenizer is not None else NoTokenizer(path)
        self.threads = _checks.threads("load", threads)
        self.backend = make_backend(backend, cfg, weights, self.threads)
        self._parts = None

    def __repr__(self):
        c = self.config
        return (f"<cyformer.Model ({self.backend.name}) {c.n_layer} layers, d_model {c.n_embd}, {c.n_head} heads, "
                f"vocab {c.vocab_size}, context {c.n_positions}, threads {self.threads}>")

    def __reduce__(self):
        # pickle, copy and deepcopy load the directory again: the weights are
        # memory-mapped and the compiled kernels hold pointers into them
        if self.path is None:
            raise TypeError("a Model built from weights in memory cannot be pickled or copied: "
                            "only one loaded with cyformer.load(path) can (it is loaded again)")
        from .loader import reload
        return reload, (os.path.abspath(self.path), self.threads, self.backend.name)

    def forward(self, ids):
        """Logits for every position: ids [T] -> [T, V], or [B, T] -> [B, T, V] (float32).

        Each sequence runs from position 0 with its own cache; positions only
        see earlier ones (causal).
        """
        batch, batched = check_ids(ids, self.config)
        backend = self.backend

        def run(seq):
            return backend.run(seq, backend.new_cache(len(seq), reuse=True))

        if not batched:  # the backend's array as is (a [512, 50257] copy costs a layer norm pass)
            return run(batch[0])
        logits = np.empty((*batch.shape, self.config.vocab_size), dtype=np.float32)
        for b, seq in enumerate(batch):  # each run's array is dropped before the next one
            logits[b] = run(seq)
        return logits

    __call__ = forward

    # -- looking inside ---------------------------------------------------

    @property
    def blocks(self):
        """The blocks as objects to read: ``blocks[i].attn.heads[h]`` (W_Q, W_K,
        W_V, W_O, biases, qk_circuit(), ov_circuit()) and
        ``blocks[i].mlp.neurons[n]`` (read, bias, write); views of the weights."""
        if self._parts is None:
            from .interp.parts import model_blocks
            self._parts = model_blocks(self.config, self.weights)
        return self._parts

    @property
    def unembed(self):
        """``unembed[token]`` -> that token's logit direction [C] (a row of lm_head, read-only)."""
        from .interp.parts import Unembed
        return Unembed(self.weights.lm_head)

    def hook_names(self):
        """Every hook point's name, in the order the forward pass reaches them."""
        from .interp.hooks import hook_names
        return hook_names(self.config)

    def run_with_cache(self, ids, names=None, fwd_hooks=()):
        """Logits plus the activations at the hook points: -> (logits, cache).

        ids [T] or [B, T] as for forward().  names selects what is kept: None
        (everything), a list of hook names, or a predicate name -> bool; see
        ``hook_names()`` and cyformer.interp.hooks for names and shapes.  The
        cache is a dict name -> float32 array, with a leading batch axis for
        2-D ids.  Only the requested points are computed apart from the
        fused kernels.  fwd_hooks as in run_with_hooks() run first, so the
        cache shows what the model used.
        """
        from .interp.hooks import ActivationCache, HookPoints, select, stack_batch

        hooks = HookPoints(self.config, select(self.config, names), fwd_hooks)
        logits, caches, batched = self._run_hooked("run_with_cache", ids, hooks)
        return logits, stack_batch(caches) if batched else ActivationCache(caches[0])

    def run_with_hooks(self, ids, fwd_hooks=()):
        """Logits of a forward pass whose activations the hooks may change.

        fwd_hooks: pairs (name, fn), name a hook name or a predicate name ->
        bool.  ``fn(activation, name)`` gets the activation as a NumPy array
        and returns None (keep it; the logits stay bitwise those of forward())
        or a replacement of the same shape.  Several hooks on one point run in
        order.  With 2-D ids each sequence runs on its own, and the hooks are
        called once per sequence with its activations (no batch axis).
        """
        from .interp.hooks import HookPoints

        return self._run_hooked("run_with_hooks", ids, HookPoints(self.config, (), fwd_hooks))[0]

    def _run_hooked(self, fn, ids, hooks):
        backend = self.backend
        if not getattr(backend, "supports_hooks", False):
            raise ValueError(f"{fn}: the {backend.name!r} backend has no hook points; "
                             "load the model with backend='cython'")
        batch, batched = check_ids(ids, self.config, fn)
        logits = np.empty((*batch.shape, self.config.vocab_size), dtype=np.float32)
        caches = []
        for b, seq in enumerate(batch):
            hp = hooks.fresh()
            logits[b] = backend.run(seq, backend.new_cache(len(seq)), hooks=hp)
            caches.append(hp.cache)
        return (logits if batched else logits[0]), caches, batched

    # -- text -------------------------------------------------------------

    def encode(self, text):
        """str -> list of token ids (needs the checkpoint's tokenizer.json)."""
        return self.tokenizer.encode(text)

    def decode(self, ids):
        """token ids -> str (needs the checkpoint's tokenizer.json)."""
        return self.tokenizer.decode(_checks.token_ids("decode", "ids", ids, self.config.vocab_size, ndim=1))

    # -- generation -------------------------------------------------------

    def generate(self, prompt, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
                 repetition_penalty=None, stop=None, seed=None, cache_names=None):
        """Continue ``prompt`` (a str, or a sequence of token ids).

        Returns the new text (a str with ``.token_ids``, ``.finish_reason`` and
        ``.stats``) for a str prompt, or the new token ids (a list with
        ``.finish_reason`` and ``.stats``) for an ids prompt.
        temperature 0 is greedy; ``seed`` makes sampling reproducible.  It stops
        at max_new_tokens ("length"), the eos token ("eos"), a stop string or
        stop token id ("stop"; a stop string is cut from the text), or when the
        n_positions context is full ("context").

        cache_names (a list of hook names or a predicate, as run_with_cache's
        names) also records those activations for every position of the
        prompt and of each generated token, from the cached decode itself;
        the result's ``.cache`` maps name -> array with all positions
        concatenated (attention scores and patterns [H, positions, positions],
        earlier steps' key axes padded with -inf and 0: the causal mask).  The
        last generated token is fed once more to fill its position, unless the
        context is full.  Without cache_names ``.cache`` is None.
        """
        return Generation(self, prompt, max_new_tokens, temperature, top_k, top_p,
                          repetition_penalty, stop, seed, cache_names).result()

    def stream(self, prompt, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
               repetition_penalty=None, stop=None, seed=None):
        """Like generate(), but yields pieces as they are produced: str pieces
        (never splitting a UTF-8 character) for a str prompt, int ids for an
        ids prompt.  The returned iterator has ``finish_reason`` once exhausted."""
        return Stream(Generation(self, prompt, max_new_tokens, temperature, top_k, top_p,
                                 repetition_penalty, stop, seed))

def check_ids(ids, cfg: Config, fn="forward"):
    """Token ids -> (int64 array [B, T], had_batch_axis), validated against cfg."""
    arr = _checks.token_ids(fn, "ids", ids, cfg.vocab_size)
    if arr.ndim not in (1, 2):
        raise ValueError(f"{fn}: ids must be 1-D [T] or 2-D [B, T], got shape {arr.shape}")
    batched = arr.ndim == 2
    if arr.size == 0:
        raise ValueError(f"{fn}: ids must hold at least one token, got shape {arr.shape}")
    arr = arr.reshape(-1, arr.shape[-1]) if batched else arr[None, :]
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{fn}: ids must hold at least one token, got shape {arr.shape}")
    if arr.shape[1] > cfg.n_positions:
        raise ValueError(f"{fn}: {arr.shape[1]} tokens exceed the model's context of "
                         f"n_positions={cfg.n_positions}")
    return arr, batched
