"""Choosing the next token from a row of logits.

All operations are vectorised NumPy over the vocabulary; a seeded
numpy.random.Generator makes sampling reproducible, and because the logits
are bitwise identical at any thread count, so are the samples.
"""

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy.  top_k keeps the k most likely tokens,
    top_p the smallest set whose probability reaches p, and
    repetition_penalty > 1 discourages tokens already in the context
    (the CTRL / Hugging Face rule: positive logits divided, negative multiplied)."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (or None), got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Real)
                              or not math.isfinite(p) or not 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (or None), got {p!r}")
        r = self.repetition_penalty
        if r is not None and (isinstance(r, bool) or not isinstance(r, numbers.Real)
                              or not math.isfinite(r) or r <= 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (or None), got {r!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0):
            raise ValueError(f"seed must be a non-negative integer (or None), got {s!r}")


def log_softmax(x):
    """float64 log_softmax over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def penalised(self, logits, context_ids):
        """logits [V] -> float64 [V] after the repetition penalty."""
        p = self.params
        x = np.asarray(logits, dtype=np.float64)
        if p.repetition_penalty is not None and p.repetition_penalty != 1.0 and len(context_ids):
            seen = np.unique(np.asarray(context_ids, dtype=np.int64))
            v = x[seen]
            x = x.copy()
            x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        return x

    def logprobs(self, logits, context_ids):
        """float64 [V] log-probabilities of the next token as OpenAI reports
        them: log_softmax of the logits after the repetition penalty and the
        temperature (1 when greedy), before top-k and top-p filtering."""
        x = self.penalised(logits, context_ids)
        if self.params.temperature > 0:
            x = x / self.params.temperature
        return log_softmax(x)

    def __call__(self, logits, context_ids):
        """logits [V] float32 for the next position; context_ids: the tokens so far."""
        p = self.params
        x = self.penalised(logits, context_ids)
        if p.temperature == 0.0:
            return int(np.argmax(x))
        x = x / p.temperature
        if p.top_k is not None and p.top_k < x.size:
            kth = np.partition(x, x.size - p.top_k)[x.size - p.top_k]
            x = np.where(x >= kth, x, -np.inf)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if p.top_p is not None and p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep tokens until the mass before them reaches top_p (at least one)
            keep = order[: int(np.searchsorted(cum, p.top_p, side="left")) + 1]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), x.size - 1))
