"""Choosing the next token from a row of logits.

All operations are vectorised NumPy over the vocabulary; a seeded
numpy.random.Generator makes sampling reproducible, and because the logits
are bitwise identical at any thread count, so are the samples.

Every finite parameter is honoured, subnormal ones included: the sampled
distribution is softmax(s) with s = penalised logits / temperature, and
when s overflows float64 (temperature or repetition_penalty near 1e-308)
that distribution is a point mass on its largest entry (any other entry is
at least ~1e300 below it), so the exact argmax is taken instead (`_argmax`).
"""

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import numpy as np


def _real(name, value, ok, want, zero_ok=False):
    """A real parameter as a float, or ValueError naming it.  Fractions and
    NumPy scalars are converted once here, so the sampler sees only floats."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    try:
        v = float(value)
    except (OverflowError, ValueError, TypeError):  # e.g. Fraction(10**400)
        raise ValueError(f"{name} must be {want} that fits a float64, got {value!r}") from None
    if not math.isfinite(v) or not ok(value):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    if v == 0 and value != 0 and not zero_ok:
        raise ValueError(f"{name} must be {want}; {value!r} is below the smallest float64")
    return v


def _integer(name, value, minimum):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (or None), got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """The sampler's resolved parameters (cyformer.request.GenerationRequest
    says what each means).  temperature 0 means greedy.  top_k keeps the k
    most likely tokens, top_p the smallest set whose probability reaches p,
    min_p those at least min_p times as likely as the most likely one, and
    repetition_penalty > 1 discourages tokens already in the context (the
    CTRL / Hugging Face rule: positive logits divided, negative multiplied).
    logit_bias ((id, bias) pairs), presence_penalty and frequency_penalty
    are added to the logits first (OpenAI's definitions, over generated
    tokens)."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()

    def __post_init__(self):
        norm = {"temperature": _real("temperature", self.temperature, lambda v: v >= 0,
                                     "a finite number >= 0", zero_ok=True)}
        if self.top_k is not None:
            norm["top_k"] = _integer("top_k", self.top_k, 1)
        if self.top_p is not None:
            norm["top_p"] = _real("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1] (or None)")
        if self.repetition_penalty is not None:
            norm["repetition_penalty"] = _real("repetition_penalty", self.repetition_penalty,
                                               lambda v: v > 0, "a finite number > 0 (or None)")
        if self.seed is not None:
            norm["seed"] = _integer("seed", self.seed, 0)
        if self.min_p is not None:
            norm["min_p"] = _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1] (or None)",
                                  zero_ok=True)
        for name in ("presence_penalty", "frequency_penalty"):
            norm[name] = _real(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]", zero_ok=True)
        norm["logit_bias"] = tuple((int(i), float(b)) for i, b in self.logit_bias)
        for name, value in norm.items():  # frozen: set through object
            object.__setattr__(self, name, value)


def log_softmax(x):
    """float64 log_softmax over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            self.bias_ids = np.array([i for i, _ in params.logit_bias], dtype=np.int64)
            self.bias_values = np.array([b for _, b in params.logit_bias], dtype=np.float64)

    def _added(self, logits, output_ids):
        """float64 [V]: logits plus logit_bias, less the presence and frequency
        penalties of the generated tokens (OpenAI's definitions)."""
        p = self.params
        x = np.asarray(logits, dtype=np.float64)
        if not (self.bias_ids is not None or (len(output_ids) and (p.presence_penalty or p.frequency_penalty))):
            return x
        x = x.copy()
        if self.bias_ids is not None:
            x[self.bias_ids] += self.bias_values
        if len(output_ids) and (p.presence_penalty or p.frequency_penalty):
            ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
            x[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return x

    def _penalised(self, logits, context_ids, output_ids=()):
        """logits [V] -> (float64 [V] after bias and penalties, the float64
        logits before the repetition penalty, the ids that penalty touched)."""
        p = self.params
        x = base = self._added(logits, output_ids)
        r = p.repetition_penalty
        seen = None
        if r is not None and r != 1.0 and len(context_ids):
            seen = np.unique(np.asarray(context_ids, dtype=np.int64))
            v = x[seen]
            x = x.copy()
            with np.errstate(over="ignore"):  # v / r may overflow: _argmax settles that case
                x[seen] = np.where(v > 0, v / r, v * r)
        return x, base, seen

    def penalised(self, logits, context_ids, output_ids=()):
        """logits [V] -> float64 [V] after logit_bias and the penalties."""
        return self._penalised(logits, context_ids, output_ids)[0]

    def logprobs(self, logits, context_ids, output_ids=()):
        """float64 [V] log-probabilities of the scores sampled from: log_softmax
        of the logits after logit_bias, the penalties and the temperature (1
        when greedy), before top-k, top-p and min-p."""
        x, base, seen = self._penalised(logits, context_ids, output_ids)
        if self.params.temperature > 0:
            with np.errstate(over="ignore"):
                x = x / self.params.temperature
        if not np.isfinite(x).all():
            # overflowed scores (a subnormal temperature or penalty): the
            # distribution is the point mass __call__ samples from, not the
            # NaN that inf - inf gives in log_softmax
            out = np.full(x.shape, -np.inf)
            out[_argmax(x, base, seen, self.params.repetition_penalty)] = 0.0
            return out
        return log_softmax(x)

    def __call__(self, logits, context_ids, output_ids=()):
        """logits [V] float32 for the next position; context_ids: the tokens so
        far (prompt and generated); output_ids: the generated ones."""
        p = self.params
        r = p.repetition_penalty
        x, base, seen = self._penalised(logits, context_ids, output_ids)
        if p.temperature == 0.0:
            return _argmax(x, base, seen, r)
        with np.errstate(over="ignore"):
            x = x / p.temperature
        top = x.max()
        if not math.isfinite(top):
            # +inf: some score overflowed, and the largest is ~1e300 above the
            # rest; -inf: every score overflowed downwards.  Either way the
            # distribution is a point mass (NaN logits fall through to here too).
            return _argmax(x, base, seen, r)
        if p.top_k is not None and p.top_k < x.size:
            kth = np.partition(x, x.size - p.top_k)[x.size - p.top_k]
            x = np.where(x >= kth, x, -np.inf)
        with np.errstate(over="ignore"):  # x - top below -1.8e308 is -inf: probability 0
            probs = np.exp(x - top)
        probs /= probs.sum()
        if p.top_p is not None and p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep tokens until the mass before them reaches top_p (at least one)
            keep = order[: int(np.searchsorted(cum, p.top_p, side="left")) + 1]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        if p.min_p:  # relative to the most likely token (vLLM's order: after top-k and top-p)
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
            probs /= probs.sum()
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), x.size - 1))


def _argmax(scores, logits, seen, r):
    """The token with the largest score, scores being the (penalised,
    possibly temperature-scaled) logits; the first one among exact ties.

    When the largest score overflowed (+inf, or -inf for all of them), the
    tied ones are compared exactly: each is logit * m / temperature with
    m = 1/r for seen positive logits, r for other seen ones and 1 for unseen
    ones, and within one m the order is the logits' order.  NaN never wins.
    """
    best = int(np.argmax(scores))  # a NaN anywhere is returned here
    if math.isfinite(scores[best]):
        return best
    scores = np.where(np.isnan(scores), -np.inf, scores)
    best = int(np.argmax(scores))
    x = np.asarray(logits, dtype=np.float64)
    if math.isfinite(scores[best]):
        return best
    if np.isposinf(x).any():  # an infinite logit outranks every finite one
        return int(np.argmax(x == np.inf))
    tied = np.flatnonzero((scores == scores[best]) & np.isfinite(x))
    if tied.size == 0:
        return best
    x = x[tied]
    in_seen = np.isin(tied, seen) if seen is not None else np.zeros(tied.size, dtype=bool)
    exact = []  # (exact logit * m, -token) for the best of each multiplier
    for group, m in ((in_seen & (x > 0), 1 / Fraction(r or 1)), (in_seen & (x <= 0), Fraction(r or 1)),
                     (~in_seen, Fraction(1))):
        if group.any():
            i = int(np.argmax(np.where(group, x, -np.inf)))
            exact.append((Fraction(float(x[i])) * m, -int(tied[i])))
    return -max(exact)[1]
