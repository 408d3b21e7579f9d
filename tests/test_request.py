"""The generation request: one object from every entry point to the sampler,
and the options OpenAI and vLLM clients send (penalties, logit_bias, min_p,
min_tokens, ignore_eos, skip_special_tokens), each checked against its
definition."""

import numpy as np
import pytest

import cyformer
from cyformer.engine import Engine
from cyformer.request import GenerationRequest
from cyformer.sampling import Sampler, SamplingParams, log_softmax


@pytest.fixture(scope="module")
def model():
    return cyformer.load()


def test_request_object_and_keywords_agree(model):
    kw = dict(temperature=0.8, top_k=40, seed=3, stop=[5], presence_penalty=0.5)
    req = GenerationRequest(max_new_tokens=10, **kw)
    want = model.generate([1, 2, 3], 10, **kw)
    assert model.generate([1, 2, 3], request=req) == want
    assert list(model.stream([1, 2, 3], request=req)) == want
    assert model.generate([1, 2, 3], request=req.replace(seed=4)) == model.generate([1, 2, 3], 10, **dict(kw, seed=4))
    assert model.generate([1, 2, 3], request=req, seed=4) == model.generate([1, 2, 3], 10, **dict(kw, seed=4))
    with Engine(model, max_batch=2) as engine:
        assert engine.generate([1, 2, 3], request=req).result(timeout=60) == want
    assert model.generate([[1, 2, 3], [1, 2, 3]], request=req) == [want, want]


def test_unknown_option_is_named(model):
    with pytest.raises(TypeError, match="colour"):
        model.generate([1, 2], colour=3)
    with pytest.raises(TypeError, match="colour"):
        model.stream([1, 2], colour=3)


def test_penalties_and_bias_are_openai_definitions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32)
    output = [3, 3, 7, 3, 9]
    s = Sampler(SamplingParams(temperature=1.0, presence_penalty=0.4, frequency_penalty=-0.3,
                               logit_bias=((7, 5.0), (11, -100.0))))
    want = logits.astype(np.float64)
    counts = np.bincount(output, minlength=50)
    want = want - counts * -0.3 - (counts > 0) * 0.4
    want[7] += 5.0
    want[11] -= 100.0
    got = s.penalised(logits, [1, 2] + output, output)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # the prompt does not count for the OpenAI penalties
    np.testing.assert_array_equal(Sampler(SamplingParams(presence_penalty=2.0)).penalised(logits, [3, 4], []),
                                  logits.astype(np.float64))


def test_min_p_keeps_tokens_near_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float64)).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=0))
    got = {s(logits, []) for _ in range(200)}
    assert got == {0, 1}  # 0.15 < 0.5 * 0.5
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=0))
    assert {s(logits, []) for _ in range(400)} == {0, 1, 2}


def test_logit_bias_forces_a_token(model):
    out = model.generate([1, 2, 3], 6, logit_bias={17: 100}, ignore_eos=True)
    assert list(out) == [17] * 6
    assert model.generate([1, 2, 3], 6, logit_bias={"17": 100}, ignore_eos=True) == out  # JSON's str keys
    with pytest.raises(ValueError, match="logit_bias"):
        model.generate([1, 2, 3], logit_bias={17: 101})
    with pytest.raises(ValueError, match="logit_bias holds token id 4096"):
        model.generate([1, 2, 3], logit_bias={4096: 1})


def test_min_tokens_and_ignore_eos(model):
    eos = min(model.generation_config.eos_ids(model.config))
    forced = dict(logit_bias={eos: 100})
    out = model.generate([1, 2, 3], 8, **forced)
    assert list(out) == [] and out.finish_reason == "eos"
    out = model.generate([1, 2, 3], 8, min_tokens=3, **forced)
    assert len(out) == 3 and eos not in out and out.finish_reason == "eos"
    out = model.generate([1, 2, 3], 4, ignore_eos=True, **forced)
    assert list(out) == [eos] * 4 and out.finish_reason == "length"
    # stop ids wait for min_tokens too
    out = model.generate([1, 2, 3], 8, min_tokens=2, stop=[17], logit_bias={17: 100})
    assert len(out) == 2 and 17 not in out and out.finish_reason == "stop"


def test_min_tokens_holds_stop_strings(model):
    free = model.generate("def f(x):", 24, ignore_eos=True, temperature=0)
    stop = free[2:4]  # text that appears early in the continuation
    early = model.generate("def f(x):", 24, ignore_eos=True, stop=stop, temperature=0)
    assert early.finish_reason == "stop" and len(early.token_ids) < 24
    n = len(early.token_ids) + 2
    late = model.generate("def f(x):", 24, ignore_eos=True, stop=stop, min_tokens=n, temperature=0)
    assert len(late.token_ids) >= n
    # as vLLM: from the min_tokens-th token on, a stop string that ends in the new text cuts it there
    start = max(0, len(model.decode(free.token_ids[:n - 1])) - len(stop) + 1)
    cut = free.find(stop, start)
    assert late == (free[:cut] if cut >= 0 else free)
    assert late.finish_reason == ("stop" if cut >= 0 else "length")


def test_skip_special_tokens(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    m = cyformer.load(path)
    # without healing: its first token would have to re-spell the prompt's last one
    kept = m.generate("def", 3, ignore_eos=True, logit_bias={0: 100}, skip_special_tokens=False,
                      token_healing=False)
    assert kept == "<|endoftext|>" * 3
    assert m.generate("def", 3, ignore_eos=True, logit_bias={0: 100}, token_healing=False) == ""


def test_processed_logprobs_follow_the_sampled_scores(model):
    out = model.generate([1, 2, 3], 5, logprobs=True, logprobs_mode="processed", frequency_penalty=1.5,
                         temperature=0.5, seed=1, logit_bias={9: 2.0}, repetition_penalty=None)
    raw = model.generate([1, 2, 3], 5, logprobs=True, frequency_penalty=1.5, temperature=0.5, seed=1,
                         repetition_penalty=None,
                         logit_bias={9: 2.0})
    assert list(out) == list(raw)
    ids = [1, 2, 3] + list(out)
    logits = model.forward(ids)[2:-1]
    for i, (p, r) in enumerate(zip(out.logprobs, raw.logprobs)):
        # decode steps and one prefill of the same ids round differently (~1e-6)
        assert r.logprob == pytest.approx(log_softmax(logits[i])[r.token], abs=1e-5)
        x = logits[i].astype(np.float64)
        x[9] += 2.0
        gen = list(out)[:i]
        for t in set(gen):
            x[t] -= 1.5 * gen.count(t)
        assert p.logprob == pytest.approx(log_softmax(x / 0.5)[p.token], abs=1e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_tokens=-1), "min_tokens"), (dict(ignore_eos=1), "ignore_eos"),
    (dict(logprobs_mode="final"), "logprobs_mode"), (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
])
def test_bad_options_are_named(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.generate([1, 2], **kw)
