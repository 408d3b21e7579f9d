"""Generation: greedy equality with Hugging Face, sampling, streaming, stops, tokenizer."""

import numpy as np
import pytest
import torch

import cyformer
from cyformer import TokenizerError


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=hf.config.vocab_size - 1)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["odd", "erf"])
def test_greedy_matches_hf(checkpoint, rng, name):
    path, hf = checkpoint(name)
    model = cyformer.load(path)
    cfg = model.config
    prompt = rng.integers(1, cfg.vocab_size, size=5).tolist()
    # 64 new tokens would overrun these small contexts: stop at the edge instead
    n = min(64, cfg.n_positions - len(prompt) + 1)
    # no eos: these random models may produce it, HF is told not to stop either
    object.__setattr__(model.config, "eos_token_id", None)
    got = model.generate(prompt, max_new_tokens=64)
    assert got == hf_greedy(hf, prompt, n)
    assert got.finish_reason == "context" and len(got) == n


@pytest.mark.slow
def test_greedy_matches_hf_gpt2_small(checkpoint, rng):
    path, hf = checkpoint("gpt2-small")
    model = cyformer.load(path)
    object.__setattr__(model.config, "eos_token_id", None)
    prompt = rng.integers(0, 50000, size=16).tolist()
    got = model.generate(prompt, max_new_tokens=64)
    assert len(got) == 64 and got.finish_reason == "length"
    assert got == hf_greedy(hf, prompt, 64)
    # a prompt that runs into n_positions: 1020 tokens + 5 new fills the context
    long_prompt = rng.integers(0, 50000, size=1020).tolist()
    got = model.generate(long_prompt, max_new_tokens=64)
    assert got.finish_reason == "context" and len(got) == 1024 - 1020 + 1
    assert got == hf_greedy(hf, long_prompt, len(got))


def test_decode_with_cache_equals_full_forward(checkpoint, rng):
    """Each greedy token equals the argmax of a full forward over the sequence so far."""
    path, _ = checkpoint("erf")
    model = cyformer.load(path)
    prompt = rng.integers(0, 257, size=7).tolist()
    out = model.generate(prompt, max_new_tokens=20)
    seq = prompt + list(out)
    logits = model.forward(seq)
    np.testing.assert_array_equal(logits[len(prompt) - 1:-1].argmax(-1), out)


def test_sampling_reproducible_across_runs_and_threads(checkpoint, rng):
    path, _ = checkpoint("erf")
    prompt = [3, 1, 4, 1, 5]
    kw = dict(max_new_tokens=30, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=11)
    a = cyformer.load(path, threads=1).generate(prompt, **kw)
    b = cyformer.load(path, threads=2).generate(prompt, **kw)
    c = cyformer.load(path, threads=2).generate(prompt, **kw)
    assert a == b == c
    d = cyformer.load(path, threads=2).generate(prompt, **{**kw, "seed": 12})
    assert d != a  # a different seed gives a different sample (30 tokens from 257)


def test_top_k_one_is_greedy(checkpoint):
    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    prompt = [5, 6, 7]
    assert m.generate(prompt, 15, temperature=2.0, top_k=1, seed=0) == m.generate(prompt, 15)


def test_sampler_top_p_and_penalty():
    from cyformer.sampling import Sampler, SamplingParams

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.6, seed=0))
    draws = {s(logits, []) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.6 so token 1 is needed; 2 and 3 never
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=10.0))
    assert s(np.array([2.0, 1.0, -1.0]), [0]) == 1  # 2.0 / 10 < 1.0


def test_max_new_tokens_zero_and_eos(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    m = cyformer.load(path)
    out = m.generate("def", max_new_tokens=0)
    assert out == "" and out.finish_reason == "length"
    # make eos the greedy choice: generation ends at once, eos not included
    logits = m.forward(m.encode("def"))[-1]
    object.__setattr__(m.config, "eos_token_id", int(logits.argmax()))
    out = m.generate("def", max_new_tokens=10, token_healing=False)  # the logits of the prompt as given
    assert out.finish_reason == "eos" and out.token_ids == []


def test_text_round_trip_and_stream(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    m = cyformer.load(path)
    text = "Grüße 日本語 🙂 def fib(n):"
    ids = m.encode(text)
    assert m.decode(ids) == text
    out = m.generate("def fib(n):", max_new_tokens=40, temperature=1.0, seed=5)
    assert isinstance(out, str) and out.finish_reason in ("length", "eos")
    stream = m.stream("def fib(n):", max_new_tokens=40, temperature=1.0, seed=5)
    pieces = list(stream)
    assert "".join(pieces) == out and stream.finish_reason == out.finish_reason
    assert all(isinstance(p, str) and p for p in pieces)


def test_stream_never_splits_utf8(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    m = cyformer.load(path)
    text = "🙂🚀 日本語 Köln"
    ids = m.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    dec = m.tokenizer.stream()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    m = cyformer.load(path)
    full = m.generate("def", max_new_tokens=30, temperature=1.0, seed=3)
    assert len(full) > 6
    stop = full[3:6]
    out = m.generate("def", max_new_tokens=30, temperature=1.0, seed=3, stop=[stop])
    assert out.finish_reason == "stop" and out == full[: full.index(stop)]
    stream = m.stream("def", max_new_tokens=30, temperature=1.0, seed=3, stop=stop)
    assert "".join(stream) == out and stream.finish_reason == "stop"


def test_stop_token_ids(checkpoint):
    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    full = m.generate([1, 2, 3], max_new_tokens=10)
    out = m.generate([1, 2, 3], max_new_tokens=10, stop=[full[4]])
    assert out == full[: full.index(full[4])] and out.finish_reason == "stop"


def test_no_tokenizer(checkpoint):
    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        m.generate("hello")
    with pytest.raises(TokenizerError):
        m.decode([1, 2])
    with pytest.raises(ValueError, match="tokenizer"):
        m.generate([1, 2], stop="x")


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=-3), "seed"), (dict(max_new_tokens=2.5), "max_new_tokens"),
])
def test_bad_generation_arguments(checkpoint, kw, match):
    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    with pytest.raises(ValueError, match=match):
        m.generate([1, 2, 3], **kw)


def test_bad_prompts(checkpoint):
    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    for bad, match in [([], "at least one"), ([500], "500"), (list(range(41)), "n_positions"),
                       (np.ones((1, 1, 2), dtype=np.int64), "1-D")]:
        with pytest.raises(ValueError, match=match):
            m.generate(bad)
    # a list of id lists is several prompts (cyformer.engine), one result each
    assert m.generate([[1, 2]], max_new_tokens=3) == [m.generate([1, 2], max_new_tokens=3)]


def test_generations_do_not_share_state(checkpoint):
    """Interleaving two streams on one model gives what each gives alone."""
    path, _ = checkpoint("erf")
    m = cyformer.load(path)
    a_alone = m.generate([1, 2, 3], 12)
    b_alone = m.generate([9, 8], 12)
    sa, sb = m.stream([1, 2, 3], 12), m.stream([9, 8], 12)
    a, b = [], []
    for x, y in zip(sa, sb):
        a.append(x)
        b.append(y)
    assert a == a_alone and b == b_alone


@pytest.mark.parametrize("n_prompt,n_new", [(5, 8), (3, 0), (30, 20)])
def test_cache_holds_prompt_plus_new_tokens(checkpoint, rng, n_prompt, n_new):
    """A generation's KV cache is sized for what it can reach, never more than
    the context, and the tokens are those of a cache for the whole context."""
    path, _ = checkpoint("odd")
    m = cyformer.load(path, threads=2)
    object.__setattr__(m.config, "eos_token_id", None)
    prompt = rng.integers(0, 101, size=n_prompt).tolist()
    made = []
    new_cache = m.backend.new_cache
    m.backend.new_cache = lambda capacity, reuse=False: made.append(capacity) or new_cache(capacity, reuse)
    out = m.generate(prompt, max_new_tokens=n_new)
    assert made == [min(m.config.n_positions, n_prompt + n_new)]
    m.backend.new_cache = lambda capacity, reuse=False: new_cache(m.config.n_positions, reuse)
    assert m.generate(prompt, max_new_tokens=n_new) == out
    # the context fills up: its last position still gives one more token
    assert len(out) == min(n_new, m.config.n_positions - n_prompt + 1)
