"""Sampling is right for every parameter it accepts, the extreme ones included.

A temperature or repetition penalty near the bottom of float64's range (1e-310,
5e-324) makes logits / temperature overflow; the distribution is then a point
mass on the largest score, and the sampler must return that token, not the
last id (what NaN probabilities gave).  Exact fractions and NumPy scalars are
the numbers they stand for; stop token ids are checked like any other id.
"""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cyformer
from cyformer.sampling import Sampler, SamplingParams

TINY = [5e-324, 1e-320, 1e-310, 2.2e-308, 1e-300, 1e-200]


def sample(logits, context=(), n=20, **params):
    s = Sampler(SamplingParams(**params))
    return {s(np.asarray(logits, dtype=np.float32), list(context)) for _ in range(n)}


@pytest.mark.parametrize("t", TINY)
@pytest.mark.parametrize("logits", [
    [1.0, 3.0, 2.0, -1.0], [-4.0, -3.0, -9.0, -3.5], [3e38, -3e38, 3.1e38, 0.0],
    [1e-30, 2e-30, 0.0, -1e-30], [0.0, 0.0, 1e-45, 0.0],
])
def test_tiny_temperature_is_greedy(t, logits):
    best = int(np.argmax(np.asarray(logits, np.float32)))
    assert sample(logits, temperature=t, seed=0) == {best}
    assert sample(logits, temperature=t, top_k=2, top_p=0.5, seed=1) == {best}


@pytest.mark.parametrize("r", [5e-324, 1e-310, 1e-300])
@pytest.mark.parametrize("t", [0.0, 1.0, 1e-310])
def test_tiny_repetition_penalty_favours_the_largest_seen_logit(r, t):
    # seen positive logits are divided by r: 2.0 / r is the largest score, and
    # 1.0 / r (also overflowing) is far below it
    logits = [5.0, 1.0, 2.0, -3.0, 4.0]
    assert sample(logits, context=[1, 2, 3], repetition_penalty=r, temperature=t, seed=0) == {2}
    # nothing seen is positive: seen logits are multiplied by r, unseen ones
    # decide (at t = 1 all four are possible)
    if t != 1.0:
            assert sample([-1.0, -2.0, 0.5, 0.25], context=[0, 1], repetition_penalty=r,
                      temperature=t, seed=0) == {2}


@pytest.mark.parametrize("t", [0.0, 1.0, 1e-300])
def test_huge_repetition_penalty_keeps_the_order_of_overflowing_negative_scores(t):
    # every token seen, every logit negative: x * 1e308 overflows to -inf for all
    assert sample([-5.0, -2.0, -3.0], context=[0, 1, 2], repetition_penalty=1e308,
                  temperature=t, seed=0) == {1}
    # a positive seen logit divided by 1e308 is still above every negative one
    assert sample([-5.0, 1e-30, -3.0], context=[0, 1, 2], repetition_penalty=1e308,
                  temperature=t, seed=0) == {1}


def test_nan_logits_are_never_chosen():
    assert sample([np.nan, 1.0, 2.0, np.nan], temperature=0.0) == {2}
    assert sample([np.nan, 1.0, 2.0, np.nan], temperature=1e-310, seed=0) == {2}


finite_logits = st.lists(st.floats(-1e4, 1e4, width=32), min_size=2, max_size=12)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(logits=finite_logits, t=st.floats(5e-324, 1e3), r=st.none() | st.floats(5e-324, 1e3),
       context=st.lists(st.integers(0, 11), max_size=5), seed=st.integers(0, 2**32))
def test_sample_is_drawn_from_the_exact_distribution_support(logits, t, r, context, seed):
    """The token drawn has a probability that is not vanishingly small in the
    exact distribution softmax(penalised / t), computed with Fractions."""
    context = [c for c in context if c < len(logits)]
    x = np.asarray(logits, dtype=np.float32)
    tok = Sampler(SamplingParams(temperature=t, repetition_penalty=r, seed=seed))(x, context)
    assert 0 <= tok < len(logits)
    m = [Fraction(1)] * len(logits)
    if r is not None:
        for c in set(context):
            m[c] = 1 / Fraction(r) if x[c] > 0 else Fraction(r)
    scores = [Fraction(float(v)) * mi / Fraction(t) for v, mi in zip(x, m)]
    gap = max(scores) - scores[tok]  # exact: p(tok) / p(best) = exp(-gap)
    assert gap < 60, (tok, float(gap))


def test_ordinary_values_sample_as_before():
    """The overflow guard changes nothing for ordinary values: a seeded run is
    the plain formula's inverse-CDF draw."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(50).astype(np.float32)
    s = Sampler(SamplingParams(temperature=0.7, seed=11))
    draw = np.random.default_rng(11)
    for _ in range(50):
        x = logits.astype(np.float64) / 0.7
        p = np.exp(x - x.max())
        cdf = np.cumsum(p / p.sum())
        want = int(min(np.searchsorted(cdf, draw.random() * cdf[-1], side="right"), 49))
        assert s(logits, []) == want


@pytest.fixture(scope="module")
def model():
    return cyformer.load()


def test_fractions_and_numpy_scalars_are_the_numbers_they_stand_for(model):
    kw = dict(max_new_tokens=12, seed=4)
    want = model.generate([1, 2, 3], temperature=0.5, top_p=0.9, repetition_penalty=1.2, **kw)
    for t, p, r in [(Fraction(1, 2), Fraction(9, 10), Fraction(6, 5)),
                    (np.float32(0.5), np.float64(0.9), np.float64(1.2)),
                    (np.float64(0.5), Fraction(9, 10), np.float64(1.2))]:
        got = model.generate([1, 2, 3], temperature=t, top_p=p, repetition_penalty=r, **kw)
        assert got == want
    assert model.generate([1, 2, 3], temperature=Fraction(1, 10**400), max_new_tokens=8) \
        == model.generate([1, 2, 3], max_new_tokens=8, temperature=0)  # below float64: greedy, its limit


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=Fraction(10**400)), "temperature"),
    (dict(temperature=-Fraction(1, 10**400)), "temperature"),
    (dict(repetition_penalty=Fraction(1, 10**400)), "repetition_penalty"),
    (dict(repetition_penalty=Fraction(10**400)), "repetition_penalty"),
    (dict(top_p=Fraction(0)), "top_p"),
    (dict(top_p=Fraction(1, 10**400)), "top_p"),
    (dict(top_k=np.int64(0)), "top_k"),
    (dict(seed=np.int64(-1)), "seed"),
    (dict(temperature=np.bool_(True)), "temperature"),
    (dict(temperature=np.float64("nan")), "temperature"),
])
def test_unrepresentable_parameters_are_refused(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.generate([1, 2], **kw)


@pytest.mark.parametrize("stop", [4096, [4096], [1, -1], 2**70, np.int64(10**6), (np.int32(-5),)])
def test_out_of_range_stop_ids_are_refused(model, stop):
    with pytest.raises(ValueError, match=r"stop .*token id .*outside \[0, 4096\)"):
        model.generate([1, 2], stop=stop)


def test_stop_ids_in_range_still_stop(model):
    first = model.generate([1, 2, 3], max_new_tokens=1, temperature=0)[0]
    out = model.generate([1, 2, 3], max_new_tokens=10, stop=np.int64(first), temperature=0)
    assert out == [] and out.finish_reason == "stop"
