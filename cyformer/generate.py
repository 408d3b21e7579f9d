"""Autoregressive generation with a key/value cache.

The prompt runs once through the full (GEMM) path, filling a cache that this
generation owns; every further token is one position through the
matrix-vector path, attending over the cached keys and values.

With ``cache_names`` each of those runs also goes through the named hook
points (cyformer.interp.hooks), and the activations of every step are joined
along the position axis: the decode's own activations, not a re-run.
"""

import numbers
import time

import numpy as np

from . import _checks
from .sampling import Sampler, SamplingParams

# Why a generation ended.
LENGTH = "length"    # max_new_tokens reached
EOS = "eos"          # the model produced its end-of-sequence token
STOP = "stop"        # a stop string (or stop token id) appeared
CONTEXT = "context"  # the context window (n_positions) is full


class GeneratedText(str):
    """The generated text; also carries ``token_ids``, ``finish_reason``, ``stats``
    and ``cache`` (activations asked for with cache_names, else None)."""

    token_ids: list
    finish_reason: str
    stats: dict
    cache: dict


class GeneratedIds(list):
    """The generated token ids; also carries ``finish_reason``, ``stats`` and ``cache``."""

    finish_reason: str
    stats: dict
    cache: dict


def _check_stop(stop, has_text, vocab_size):
    """stop -> (stop strings, set of stop token ids), or ValueError."""
    if stop is None:
        return [], set()
    if isinstance(stop, (str, numbers.Integral)):
        items = [stop]
    elif isinstance(stop, (list, tuple, set, frozenset)):
        items = list(stop)
    else:
        raise ValueError(f"stop must be a string, a token id or a list of them, got {stop!r}")
    strings, ids = [], set()
    for s in items:
        if isinstance(s, str):
            if not s:
                raise ValueError("stop strings must be non-empty")
            strings.append(_checks.text("generate", "stop", s))
        elif isinstance(s, numbers.Integral) and not isinstance(s, bool):
            if not 0 <= s < vocab_size:
                raise ValueError(f"stop holds token id {s}, outside [0, {vocab_size})")
            ids.add(int(s))
        else:
            raise ValueError(f"stop must hold strings or token ids, got {s!r}")
    if strings and not has_text:
        raise ValueError("stop strings need a tokenizer; pass stop token ids instead")
    return strings, ids


class Generation:
    """One generation, iterated token by token.

    Iterating yields ``(token_id, text_piece)``; text pieces are '' while a
    multi-byte character is incomplete or while text might be the start of a
    stop string.  After the loop, ``finish_reason`` says why it ended.
    """

    def __init__(self, model, prompt, max_new_tokens=64, temperature=0.0, top_k=None,
                 top_p=None, repetition_penalty=None, stop=None, seed=None, cache_names=None):
        cfg = model.config
        self.model = model
        self.text_mode = isinstance(prompt, str)
        if self.text_mode:
            if not prompt:
                raise ValueError("prompt must not be empty")
            prompt_ids = model.tokenizer.encode(_checks.text("generate", "prompt", prompt))
        else:
            prompt_ids = prompt
        ids = _checks.token_ids("generate", "prompt", prompt_ids, cfg.vocab_size, ndim=1)
        if ids.size == 0:
            raise ValueError("prompt must hold at least one token")
        if ids.size > cfg.n_positions:
            raise ValueError(f"prompt has {ids.size} tokens, more than n_positions={cfg.n_positions}")
        self.max_new_tokens = _checks.integer("generate", "max_new_tokens", max_new_tokens)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.params = SamplingParams(temperature, top_k, top_p, repetition_penalty, seed)
        has_text = self.text_mode or model.tokenizer.available
        self.stop_strings, self.stop_ids = _check_stop(stop, has_text, cfg.vocab_size)
        self.prompt_ids = ids
        self.tokens = []
        self.finish_reason = None
        self.stats = {}
        self.hooks = None  # HookPoints recording cache_names, when asked
        self.cache = None
        if cache_names is not None:
            from .interp.hooks import HookPoints, select

            if not getattr(model.backend, "supports_hooks", False):
                raise ValueError(f"generate: cache_names needs a backend with hook points; "
                                 f"the {model.backend.name!r} backend has none")
            self.hooks = HookPoints(cfg, select(cfg, cache_names, "generate"))

    def _run(self, ids, kv, steps):
        """Logits of the last of ``ids`` fed after the cached positions."""
        if self.hooks is None:
            return self.model.backend.run(ids, kv, last_only=True)[-1]
        hooks = self.hooks.fresh()
        logits = self.model.backend.run(ids, kv, last_only=True, hooks=hooks)[-1]
        steps.append(hooks.cache)
        return logits

    def __iter__(self):
        model, cfg = self.model, self.model.config
        sampler = Sampler(self.params)
        context = list(self.prompt_ids)
        decoder = model.tokenizer.stream() if (self.text_mode or self.stop_strings) else None
        text, emitted = "", 0  # generated text so far, and how much of it was yielded
        hold = max((len(s) for s in self.stop_strings), default=1) - 1
        t0 = time.perf_counter()
        # Owned by this generation, and only as large as it can get: the
        # last new token is never fed back, so prompt + max_new_tokens
        # positions always suffice.  (A cache for the whole context is 75 MB
        # at GPT-2 small, and mapping and clearing it cost more than the
        # prompt's prefill.)
        kv = model.backend.new_cache(min(cfg.n_positions, len(self.prompt_ids) + self.max_new_tokens))
        steps = []  # per-run activation caches, with cache_names
        logits = self._run(self.prompt_ids, kv, steps)
        t_first = None  # when the first new token was chosen
        reason = LENGTH
        while len(self.tokens) < self.max_new_tokens:
            tok = sampler(logits, context)
            if t_first is None:
                t_first = time.perf_counter()
            if tok == cfg.eos_token_id:
                reason = EOS
                break
            if tok in self.stop_ids:
                reason = STOP
                break
            self.tokens.append(tok)
            context.append(tok)
            piece = ""
            if decoder is not None:
                text += decoder.push(tok)
                cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=-1)
                if cut >= 0:
                    text = text[:cut]
                    reason = STOP
                    yield tok, text[emitted:]
                    emitted = len(text)
                    break
                # keep back a tail that could still grow into a stop string
                safe = len(text) - hold if self.stop_strings else len(text)
                piece, emitted = text[emitted:max(safe, emitted)], max(safe, emitted)
            yield tok, piece
            if kv.length >= cfg.n_positions:
                reason = CONTEXT if len(self.tokens) < self.max_new_tokens else LENGTH
                break
            if len(self.tokens) >= self.max_new_tokens:
                break
            logits = self._run(np.array([tok], dtype=np.int64), kv, steps)
        if decoder is not None and reason != STOP:
            text += decoder.flush()
            if emitted < len(text):
                yield None, text[emitted:]
                emitted = len(text)
        self.text = text
        self.finish_reason = reason
        t_end = time.perf_counter()
        if t_first is None:
            t_first = t_end
        n = len(self.tokens)
        self.stats = {
            "prompt_tokens": int(self.prompt_ids.size),
            "new_tokens": n,
            "time_to_first_token_s": t_first - t0,
            "total_s": t_end - t0,
            "decode_tokens_per_s": (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else None,
            "finish_reason": reason,
        }
        if self.hooks is not None:
            # The last token was sampled but never fed; feed it so that its
            # position has activations too (when the context has room).
            if self.tokens and kv.length < self.prompt_ids.size + n and kv.length < cfg.n_positions:
                self._run(np.array(self.tokens[-1:], dtype=np.int64), kv, steps)
            from .interp.hooks import concat_steps
            self.cache = concat_steps(steps, kv.length)

    def result(self):
        """Run to the end and return GeneratedText or GeneratedIds."""
        for _ in self:
            pass
        if self.text_mode:
            out = GeneratedText(self.text)
            out.token_ids = list(self.tokens)
        else:
            out = GeneratedIds(self.tokens)
        out.finish_reason = self.finish_reason
        out.stats = self.stats
        out.cache = self.cache
        return out


class Stream:
    """Iterator over generated pieces: str for a text prompt, int ids for an
    ids prompt.  ``finish_reason`` and ``stats`` are set once it is exhausted."""

    def __init__(self, generation: Generation):
        self.generation = generation
        self._it = iter(generation)

    def __iter__(self):
        return self

    def __next__(self):
        g = self.generation
        while True:
            tok, piece = next(self._it)
            if g.text_mode:
                if piece:
                    return piece
            elif tok is not None:
                return tok

    @property
    def finish_reason(self):
        return self.generation.finish_reason

    @property
    def stats(self):
        return self.generation.stats
