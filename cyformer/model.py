"""The public Model: one interface over interchangeable backends.

A backend computes logits for new positions given a per-sequence cache
(``new_cache(capacity)``, ``run(ids, cache, last_only)``); the Model adds
input checking, batching, text and generation on top, identically for all.
"""

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

    def __repr__(self):
        c = self.config
        return (f"<cyformer.Model ({self.backend.name}) {c.n_layer} layers, d_model {c.n_embd}, {c.n_head} heads, "
                f"vocab {c.vocab_size}, context {c.n_positions}, threads {self.threads}>")

    def forward(self, ids):
        """Logits for every position: ids [T] -> [T, V], or [B, T] -> [B, T, V] (float32).

        Each sequence runs from position 0 with its own cache; positions only
        see earlier ones (causal).
        """
        batch, batched = check_ids(ids, self.config)
        logits = np.empty((*batch.shape, self.config.vocab_size), dtype=np.float32)
        for b, seq in enumerate(batch):
            logits[b] = self.backend.run(seq, self.backend.new_cache(len(seq)))
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
