"""The public Model: one interface over interchangeable backends.

A backend computes logits for new positions given a per-sequence cache
(``new_cache(capacity)``, ``run(ids, cache, last_only)``); the Model adds
input checking, batching, text and generation on top, identically for all.

For looking inside, a backend with ``supports_hooks`` also takes
``run(..., hooks=HookPoints)``; ``run_with_cache`` and ``run_with_hooks``
go through it, and ``blocks``/``unembed`` are read-only views of the weights
(cyformer.interp).
"""

import numpy as np

from . import _checks
from .backends import make_backend
from .config import Config
from .generate import Generation, Stream
from .model_files import DEFAULT, GenerationConfig
from .tokenizer import NoTokenizer
from .weights import Weights


class Model:
    """A loaded model: embedding, blocks, final norm and unembedding.

    Build one with ``cyformer.load(path)``.  ``threads`` is the OpenMP team
    size every kernel call uses; results do not depend on it.
    """

    def __init__(self, cfg: Config, weights: Weights, threads=None, path=None, tokenizer=None,
                 backend="cython", generation_config: GenerationConfig = None):
        self.config = cfg
        # eos ids and default sampling values (generation_config.json)
        self.generation_config = generation_config if generation_config is not None else GenerationConfig()
        self.weights = weights
        self.path = path
        self.tokenizer = tokenizer if tokenizer is not None else NoTokenizer(path)
        self.threads = _checks.threads("load", threads)
        self.backend = make_backend(backend, cfg, weights, self.threads)
        self._parts = None

    def __repr__(self):
        c = self.config
        kv = f" ({c.n_kv_head} key/value)" if c.n_kv_head != c.n_head else ""
        return (f"<cyformer.Model {c.model_type} ({self.backend.name}) {c.n_layer} layers, d_model {c.n_embd}, "
                f"{c.n_head} heads{kv}, vocab {c.vocab_size}, context {c.n_positions}, threads {self.threads}>")

    def forward(self, ids):
        """Logits for every position: ids [T] -> [T, V], or [B, T] -> [B, T, V] (float32).

        Each sequence runs from position 0 with its own cache; positions only
        see earlier ones (causal).
        """
        batch, batched = _checks.check_ids(ids, self.config)
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
            from .parts import model_blocks
            self._parts = model_blocks(self.config, self.weights)
        return self._parts

    @property
    def unembed(self):
        """``unembed[token]`` -> that token's logit direction [C] (a row of lm_head, read-only)."""
        from .parts import Unembed
        return Unembed(self.weights.lm_head)

    def hook_names(self):
        """Every hook point's name, in the order the forward pass reaches them."""
        from .hooks import hook_names
        return hook_names(self.config)

    def run_with_cache(self, ids, names=None, fwd_hooks=()):
        """Logits plus the activations at the hook points: -> (logits, cache).

        ids [T] or [B, T] as for forward().  names selects what is kept: None
        (everything), a list of hook names, or a predicate name -> bool; see
        ``hook_names()`` and cyformer.hooks for names and shapes.  The
        cache is a dict name -> float32 array, with a leading batch axis for
        2-D ids.  Only the requested points are computed apart from the
        fused kernels.  fwd_hooks as in run_with_hooks() run first, so the
        cache shows what the model used.
        """
        from .hooks import ActivationCache, HookPoints, select, stack_batch

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
        from .hooks import HookPoints

        return self._run_hooked("run_with_hooks", ids, HookPoints(self.config, (), fwd_hooks))[0]

    def _run_hooked(self, fn, ids, hooks):
        backend = self.backend
        if not getattr(backend, "supports_hooks", False):
            raise ValueError(f"{fn}: the {backend.name!r} backend has no hook points; "
                             "load the model with backend='cython'")
        batch, batched = _checks.check_ids(ids, self.config, fn)
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

    def generate(self, prompt, max_new_tokens=64, temperature=DEFAULT, top_k=DEFAULT, top_p=DEFAULT,
                 repetition_penalty=DEFAULT, stop=None, seed=None, cache_names=None, logprobs=False,
                 top_logprobs=0):
        """Continue ``prompt`` (a str, or a sequence of token ids).

        Returns the new text (a str with ``.token_ids``, ``.finish_reason`` and
        ``.stats``) for a str prompt, or the new token ids (a list with
        ``.finish_reason`` and ``.stats``) for an ids prompt.
        temperature 0 is greedy; ``seed`` makes sampling reproducible.  A
        sampling argument not given takes the checkpoint's value from
        generation_config.json (``generation_config.sampling()``); without that
        file, greedy with no filters; None switches a filter off.  A str prompt
        is encoded as transformers does (with bos where the tokenizer adds one).
        It stops at max_new_tokens ("length"), an eos token ("eos": config.json's
        eos_token_id, or generation_config.json's list), a stop string or
        stop token id ("stop"; a stop string is cut from the text), or when the
        n_positions context is full ("context").

        Several prompts (a list of str or of id lists, a 2-D id array) run
        together through the batched engine (cyformer.engine) and give a list
        of results, each equal to generating from that prompt alone.
        max_new_tokens, temperature, top_k, top_p, repetition_penalty and seed
        may then be lists with one value per prompt, and a prompt may be a
        dict {"prompt": ..., "stop": ..., any other argument} of its own.

        logprobs=True gives the result ``.logprobs``: per generated token a
        TokenLogprob (token, logprob, top), where top holds the
        ``top_logprobs`` most likely tokens as (id, logprob) pairs; log
        probabilities of the distribution after the repetition penalty and
        the temperature (1 when greedy), before top-k/top-p, as OpenAI gives them.

        cache_names (a list of hook names or a predicate, as run_with_cache's
        names) also records those activations for every position of the
        prompt and of each generated token, from the cached decode itself;
        the result's ``.cache`` maps name -> array with all positions
        concatenated (attention scores and patterns [H, positions, positions],
        earlier steps' key axes padded with -inf and 0: the causal mask).  The
        last generated token is fed once more to fill its position, unless the
        context is full.  Without cache_names ``.cache`` is None.
        """
        from .engine import batch_generations, is_batch, run_batch

        if is_batch(prompt):
            if cache_names is not None:
                raise ValueError("generate: cache_names takes one prompt, not a list of them")
            return run_batch(self, batch_generations(
                self, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                top_p=top_p, repetition_penalty=repetition_penalty, stop=stop, seed=seed,
                logprobs=logprobs, top_logprobs=top_logprobs))
        return Generation(self, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
                          stop, seed, cache_names, logprobs=logprobs, top_logprobs=top_logprobs).result()

    def score(self, text):
        """Per-token log-likelihoods of a given text (a str, encoded as a
        prompt, or token ids [T]): float64 [T - 1], entry i the log-probability
        of token i + 1 after tokens 0..i (log_softmax in float64).  The first
        token has no prediction; ``model.encode`` shows the ids of a str."""
        ids = self.tokenizer.encode(text, add_special_tokens=True) if isinstance(text, str) else text
        ids = _checks.token_ids("score", "text", ids, self.config.vocab_size, ndim=1)
        if ids.size == 0:
            raise ValueError("score: the text holds no tokens")
        from .sampling import log_softmax

        logits = self.forward(ids)
        out = np.empty(ids.size - 1, dtype=np.float64)
        for t0 in range(0, ids.size - 1, 64):  # float64 rows in blocks: [T, V] of them can be GBs
            t1 = min(t0 + 64, ids.size - 1)
            out[t0:t1] = log_softmax(logits[t0:t1])[np.arange(t1 - t0), ids[t0 + 1:t1 + 1]]
        return out

    def stream(self, prompt, max_new_tokens=64, temperature=DEFAULT, top_k=DEFAULT, top_p=DEFAULT,
               repetition_penalty=DEFAULT, stop=None, seed=None):
        """Like generate(), but yields pieces as they are produced: str pieces
        (never splitting a UTF-8 character) for a str prompt, int ids for an
        ids prompt.  The returned iterator has ``finish_reason`` once exhausted."""
        return Stream(Generation(self, prompt, max_new_tokens, temperature, top_k, top_p,
                                 repetition_penalty, stop, seed))

    def chat(self, messages, max_new_tokens=256, temperature=DEFAULT, top_k=DEFAULT, top_p=DEFAULT,
             repetition_penalty=DEFAULT, stop=None, seed=None, template_vars=None):
        """The assistant's reply to ``messages`` ([{"role": ..., "content": ...}, ...]),
        rendered with the checkpoint's chat template (cyformer.chat) and ended
        at its end-of-turn token.  Sampling arguments as for generate(); returns
        its result type for a str prompt."""
        from .chat import chat_generation
        return chat_generation(self, messages, max_new_tokens, temperature, top_k, top_p,
                               repetition_penalty, stop, seed, template_vars).result()

    def chat_stream(self, messages, max_new_tokens=256, temperature=DEFAULT, top_k=DEFAULT,
                    top_p=DEFAULT, repetition_penalty=DEFAULT, stop=None, seed=None, template_vars=None):
        """Like chat(), but yields the reply's str pieces as stream() does."""
        from .chat import chat_generation
        return Stream(chat_generation(self, messages, max_new_tokens, temperature, top_k, top_p,
                                      repetition_penalty, stop, seed, template_vars))
