"""Autoregressive generation with a key/value cache.

The prompt runs once through the full (GEMM) path, filling a cache that this
generation owns; every further token is one position through the
matrix-vector path, attending over the cached keys and values.

With ``cache_names`` each of those runs also goes through the named hook
points (cyformer.hooks), and the activations of every step are joined
along the position axis: the decode's own activations, not a re-run.
"""

import time
from typing import NamedTuple

import numpy as np

from . import _checks
from .request import GenerationRequest
from .sampling import Sampler, log_softmax

# Why a generation ended.
LENGTH = "length"    # max_new_tokens reached
EOS = "eos"          # the model produced its end-of-sequence token
STOP = "stop"        # a stop string (or stop token id) appeared
CONTEXT = "context"  # the context window (n_positions) is full


CANCELLED = "cancelled"  # the caller cancelled it (engine streams only)


class TokenLogprob(NamedTuple):
    """A generated token's log-probability and the ``top`` most likely
    tokens at its position as (id, logprob) pairs, most likely first."""

    token: int
    logprob: float
    top: list


class GeneratedText(str):
    """The generated text; also carries ``token_ids``, ``finish_reason``, ``stats``,
    ``cache`` (activations asked for with cache_names, else None) and
    ``logprobs`` (a TokenLogprob per token when asked for, else None)."""

    token_ids: list
    finish_reason: str
    stats: dict
    cache: dict
    logprobs: list


class GeneratedIds(list):
    """The generated token ids; also carries ``finish_reason``, ``stats``, ``cache``
    and ``logprobs``."""

    finish_reason: str
    stats: dict
    cache: dict
    logprobs: list


def _check_stop(stop, has_text, vocab_size):
    """stop (a GenerationRequest's tuple) -> (stop strings, set of stop token ids), or ValueError."""
    strings, ids = [], set()
    for s in stop:
        if isinstance(s, str):
            strings.append(_checks.text("generate", "stop", s))
        else:
            if not 0 <= s < vocab_size:
                raise ValueError(f"stop holds token id {s}, outside [0, {vocab_size})")
            ids.add(int(s))
    if strings and not has_text:
        raise ValueError("stop strings need a tokenizer; pass stop token ids instead")
    return strings, ids


class Finished:
    """``finish_reason`` and ``stats`` of the Generation a stream hands out."""

    generation: "Generation"

    @property
    def finish_reason(self):
        return self.generation.finish_reason

    @property
    def stats(self):
        return self.generation.stats


class Generation:
    """One generation, iterated token by token.

    Iterating yields ``(token_id, text_piece)``; text pieces are '' while a
    multi-byte character is incomplete or while text might be the start of a
    stop string.  After the loop, ``finish_reason`` says why it ended.

    request: a GenerationRequest (None: the defaults).  add_special_tokens:
    encode a str prompt as transformers does (bos where the tokenizer adds
    one); end_ids: more ids that end it as eos does; text: hand out text
    (default: for a str prompt only).
    """

    def __init__(self, model, prompt, request: GenerationRequest = None, *, cache_names=None,
                 add_special_tokens=True, end_ids=(), text=None):
        cfg = model.config
        req = self.request = request if request is not None else GenerationRequest()
        if not isinstance(req, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(req).__name__}")
        self.model = model
        self.text_mode = isinstance(prompt, str) if text is None else bool(text)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            prompt_ids = model.tokenizer.encode(_checks.text("generate", "prompt", prompt),
                                                add_special_tokens=add_special_tokens)
        else:
            prompt_ids = prompt
        ids = _checks.token_ids("generate", "prompt", prompt_ids, cfg.vocab_size, ndim=1)
        if ids.size == 0:
            raise ValueError("prompt must hold at least one token")
        self.grammar = None  # the llguidance grammar of json_schema / grammar (structured.py)
        if req.json_schema is not None or req.grammar is not None:
            from .structured import grammar_text

            self.grammar = grammar_text(json_schema=req.json_schema, grammar=req.grammar)
        # token healing (healing.py): by default for a str prompt, unless logprobs
        # (they then describe the tokens after the prompt as given) or a constraint
        heal = req.token_healing if req.token_healing is not None else not req.logprobs
        self.heal_text = ""  # the prompt's last token's text, backed up over
        if heal and isinstance(prompt, str) and self.grammar is None:
            from .healing import heal as back_up

            kept, self.heal_text = back_up(model.tokenizer, ids.tolist(), cfg.vocab_size)
            ids = np.asarray(kept, dtype=np.int64)
        self.max_new_tokens = req.max_new_tokens
        self.truncated_tokens = 0
        if req.truncate and ids.size + self.max_new_tokens > cfg.n_positions:
            # keep the end, leaving room for the new tokens (and at least one prompt token)
            keep = max(1, cfg.n_positions - self.max_new_tokens)
            self.truncated_tokens = max(0, int(ids.size) - keep)
            ids = ids[ids.size - min(keep, ids.size):]
        if ids.size > cfg.n_positions:
            raise ValueError(f"prompt has {ids.size} tokens, more than n_positions={cfg.n_positions}; "
                             "truncate=True (cyformer generate --truncate) keeps its end")
        # DEFAULT: the checkpoint's value (generation_config.json)
        self.params = req.sampling(model.generation_config)
        bad = [i for i, _ in self.params.logit_bias if i >= cfg.vocab_size]
        if bad:
            raise ValueError(f"logit_bias holds token id {bad[0]}, outside [0, {cfg.vocab_size})")
        # ignore_eos: neither the checkpoint's eos ids nor a chat template's end of turn ends it
        self.eos_ids = (frozenset() if req.ignore_eos else
                        model.generation_config.eos_ids(cfg) | frozenset(end_ids))
        # the ids a constrained output ends with (llguidance needs them even with ignore_eos)
        self.grammar_eos = model.generation_config.eos_ids(cfg) | frozenset(end_ids)
        # built here, so that a grammar llguidance refuses is the caller's ValueError
        self.constraint = None
        if self.grammar is not None:
            from .structured import Constraint

            self.constraint = Constraint.of(model, self.grammar_eos, self.grammar)
        has_text = self.text_mode or model.tokenizer.available
        self.stop_strings, self.stop_ids = _check_stop(req.stop, has_text, cfg.vocab_size)
        self.top_logprobs = req.top_logprobs
        if self.top_logprobs > cfg.vocab_size:
            raise ValueError(f"top_logprobs must be in [0, {cfg.vocab_size}], got {self.top_logprobs}")
        self.prompt_ids = ids
        self.prompt_tokens = int(ids.size) + bool(self.heal_text)  # the prompt's, healed token included
        self.tokens = []
        self.logprobs = [] if req.logprobs else None  # a TokenLogprob per generated token
        self.finish_reason = None
        self.stats = {}
        self.hooks = None  # HookPoints recording cache_names, when asked
        self.cache = None
        if cache_names is not None:
            from .hooks import HookPoints, select

            if not model.backend.supports_hooks:
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
        decoding = Decoding(self)
        # Owned by this generation, and only as large as it can get: the
        # last new token is never fed back, so prompt + max_new_tokens
        # positions always suffice.  (A cache for the whole context is 75 MB
        # at GPT-2 small, and mapping and clearing it cost more than the
        # prompt's prefill.)
        kv = model.backend.new_cache(min(cfg.n_positions, len(self.prompt_ids) + self.max_new_tokens))
        steps = []  # per-run activation caches, with cache_names
        logits = self._run(self.prompt_ids, kv, steps)
        while True:
            yield from decoding.push(logits)
            if decoding.next_token is None:
                break
            logits = self._run(np.array([decoding.next_token], dtype=np.int64), kv, steps)
        yield from decoding.finish()
        if self.hooks is not None:
            # The last token was sampled but never fed; feed it so that its
            # position has activations too (when the context has room).
            n = len(self.tokens)
            if self.tokens and kv.length < self.prompt_ids.size + n and kv.length < cfg.n_positions:
                self._run(np.array(self.tokens[-1:], dtype=np.int64), kv, steps)
            from .hooks import concat_steps
            self.cache = concat_steps(steps, kv.length)

    def result(self):
        """Run to the end and return GeneratedText or GeneratedIds."""
        for _ in self:
            pass
        return self.output()

    def output(self):
        """The finished generation as GeneratedText or GeneratedIds."""
        if self.text_mode:
            out = GeneratedText(self.text)
            out.token_ids = list(self.tokens)
        else:
            out = GeneratedIds(self.tokens)
        out.finish_reason = self.finish_reason
        out.stats = self.stats
        out.cache = self.cache
        out.logprobs = self.logprobs
        return out


class Decoding:
    """The per-token decisions of one generation, apart from running the model.

    ``push(logits)`` takes the logits of the last fed position, samples the
    next token, applies eos, stop ids, stop strings, the context and
    max_new_tokens, and returns the (token_id, text_piece) pairs to hand out;
    ``next_token`` is then the token to feed next, or None when the
    generation has ended.  ``finish()`` returns the last text held back and
    fills the Generation's text, finish_reason and stats.  Generation feeds
    it one sequence's logits; the engine feeds it rows of a batched step, so
    both make the same choices.  Text pieces are '' while a multi-byte
    character is incomplete or while text might be the start of a stop string.
    """

    def __init__(self, generation: Generation):
        g = self.g = generation
        self.sampler = Sampler(g.params)
        self.context = list(g.prompt_ids)
        self.decoder = (g.model.tokenizer.stream(skip_special_tokens=g.request.skip_special_tokens)
                        if (g.text_mode or g.stop_strings or g.heal_text) else None)
        # generated text so far (starting with the healed text, which is not
        # handed out again), and how much of it was handed out
        self.base = len(g.heal_text)
        self.text, self.emitted = "", self.base
        self.constraint, self.healing = g.constraint, None
        if g.heal_text:
            from .healing import Healing, token_texts

            self.healing = Healing(token_texts(g.model.tokenizer, g.model.config.vocab_size), g.heal_text)
        self.hold = max((len(s) for s in g.stop_strings), default=1) - 1
        # ids that may not be sampled before min_tokens: those that would end it
        self.enders = np.array(sorted(g.eos_ids | g.stop_ids), dtype=np.int64)
        self.next_token = None
        self.reason = None
        self.t0 = time.perf_counter()
        self.t_first = None  # when the first new token was chosen

    def _logprob(self, logits, tok):
        if self.g.request.logprobs_mode == "raw":
            lp = log_softmax(logits)
        else:
            lp = self.sampler.logprobs(logits, self.context, self.g.tokens)
        k = self.g.top_logprobs
        top = []
        if k:
            best = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
            best = best[np.lexsort((best, -lp[best]))]  # most likely first, ties by id
            top = [(int(i), float(lp[i])) for i in best]
        return TokenLogprob(int(tok), float(lp[tok]), top)

    def push(self, logits):
        g = self.g
        self.next_token = None
        if len(g.tokens) >= g.max_new_tokens:
            self.reason = LENGTH
            return []
        early = len(g.tokens) < g.request.min_tokens
        scores = logits
        if early and self.enders.size:
            scores = np.array(logits, dtype=np.float32)
            scores[self.enders] = -np.inf
        if self.healing is not None and self.healing.active:
            scores = self.healing.mask(scores)
        if self.constraint is not None:
            scores = self.constraint.mask(scores)
        tok = self.sampler(scores, self.context, g.tokens)
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if tok in g.eos_ids:
            self.reason = EOS
            return []
        if tok in g.stop_ids:
            self.reason = STOP
            return []
        if g.logprobs is not None:
            g.logprobs.append(self._logprob(logits, tok))
        g.tokens.append(tok)
        self.context.append(tok)
        if self.healing is not None and self.healing.active:
            self.healing.advance(tok)
        if self.constraint is not None:
            self.constraint.advance(tok)
            if self.constraint.done:  # the output is complete: end as eos would
                self.reason = EOS
                if self.decoder is not None:
                    self.text += self.decoder.push(tok)
                return [(tok, "")]
        piece = ""
        if self.decoder is not None:
            # a stop string ends in the new text (never in the healed text, the
            # prompt's): search from hold characters before it
            start = max(self.base, len(self.text) - self.hold)
            self.text += self.decoder.push(tok)
            text = self.text
            stops = g.stop_strings if len(g.tokens) >= g.request.min_tokens else ()
            cut = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                self.text = text[:cut]
                self.reason = STOP
                piece, self.emitted = self.text[self.emitted:], len(self.text)
                return [(tok, piece)]
            # keep back a tail that could still grow into a stop string
            safe = len(text) - self.hold if g.stop_strings else len(text)
            piece, self.emitted = text[self.emitted:max(safe, self.emitted)], max(safe, self.emitted)
        # positions filled once this token is fed: prompt + every token but this one
        if g.prompt_ids.size + len(g.tokens) - 1 >= g.model.config.n_positions:
            self.reason = CONTEXT if len(g.tokens) < g.max_new_tokens else LENGTH
        elif len(g.tokens) >= g.max_new_tokens:
            self.reason = LENGTH
        else:
            self.next_token = tok
        return [(tok, piece)]

    def finish(self, reason=None):
        """The text still held back, as (None, piece) pairs; reason: why it
        ended when push() did not say (CANCELLED)."""
        g = self.g
        self.reason = reason or self.reason or LENGTH
        out = []
        if self.decoder is not None and self.reason != STOP:
            self.text += self.decoder.flush()
            if self.emitted < len(self.text):
                out.append((None, self.text[self.emitted:]))
                self.emitted = len(self.text)
        g.text = self.text[self.base:]
        g.finish_reason = self.reason
        t_end = time.perf_counter()
        t_first = self.t_first if self.t_first is not None else t_end
        n = len(g.tokens)
        g.stats = {
            "prompt_tokens": g.prompt_tokens,
            "truncated_tokens": g.truncated_tokens,
            "new_tokens": n,
            "time_to_first_token_s": t_first - self.t0,
            "total_s": t_end - self.t0,
            "decode_tokens_per_s": (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else None,
            "finish_reason": self.reason,
        }
        return out


class Stream(Finished):
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
