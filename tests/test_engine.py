"""The batched engine: every result equals generating from that prompt alone.

Covers Model.generate with a list of prompts (greedy and seeded sampling,
ragged prompts, per-prompt arguments), the threaded Engine (chunked prefill,
cancellation, the bounded queue, shutdown), the prefix cache (equal results,
fewer prefilled positions, its memory bound), logprobs and Model.score
against transformers' log_softmax.
"""

import threading

import numpy as np
import pytest

import cyformer
from cyformer.engine import Engine, EngineBusy, EngineClosed, Scheduler
from cyformer.prefix_cache import PrefixCache
from helpers import hf_logits, make_hf_llama

PROMPTS = ["def fib(n):", "import numpy as np\n", "class Foo:\n    def __init__(self, x):\n",
           "x = [1, 2, 3]\nfor i in x:\n    print(i", "#"]


@pytest.fixture(scope="module")
def gpt2():
    # greedy unless a test asks otherwise: the bundled model's
    # generation_config.json samples by default, and these tests compare runs
    from cyformer.model_files import GenerationConfig

    m = cyformer.load()
    m.generation_config = GenerationConfig(eos_token_ids=m.generation_config.eos_ids(m.config))
    return m


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama-engine"))
    make_hf_llama(path, "llama", seed=3, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, vocab_size=97,
                  max_position_embeddings=96, tie_word_embeddings=False)
    return cyformer.load(path)


def ragged_ids(rng, vocab, lengths):
    return [rng.integers(1, vocab - 1, n).tolist() for n in lengths]


def test_batched_greedy_equals_single(gpt2):
    alone = [gpt2.generate(p, max_new_tokens=12) for p in PROMPTS]
    together = gpt2.generate(PROMPTS, max_new_tokens=12)
    assert len(together) == len(PROMPTS)
    for a, b in zip(alone, together):
        assert isinstance(b, str) and b == a and b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason


def test_batched_seeded_sampling_per_prompt_arguments(gpt2):
    temps, seeds, lengths = [0.7, 1.0, 1.3, 0.0, 0.9], [1, 2, 3, 4, 5], [3, 9, 1, 14, 0]
    alone = [gpt2.generate(p, max_new_tokens=n, temperature=t, top_k=40, seed=s)
             for p, n, t, s in zip(PROMPTS, lengths, temps, seeds)]
    together = gpt2.generate(PROMPTS, max_new_tokens=lengths, temperature=temps, top_k=40, seed=seeds)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [len(r.token_ids) <= n for r, n in zip(together, lengths)] == [True] * 5


def test_prompt_dicts_and_stop(gpt2):
    first = gpt2.generate(PROMPTS[0], max_new_tokens=12)
    stop = first[3:6]  # a piece of what greedy decoding writes
    together = gpt2.generate([{"prompt": PROMPTS[0], "stop": [stop]}, PROMPTS[1]], max_new_tokens=12)
    assert together[0] == gpt2.generate(PROMPTS[0], max_new_tokens=12, stop=[stop])
    assert together[0].finish_reason == "stop"
    assert together[1] == gpt2.generate(PROMPTS[1], max_new_tokens=12)


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=[1, 2]), "max_new_tokens has 2 values for 3 prompts"),
    (dict(seed=[1, 2, 3, 4]), "seed has 4 values"),
    (dict(temperature=[0, -1, 0]), "prompt 1: temperature"),
])
def test_per_prompt_argument_errors(gpt2, bad, match):
    with pytest.raises(ValueError, match=match):
        gpt2.generate(PROMPTS[:3], **bad)
    with pytest.raises(ValueError, match="unknown: colour"):
        gpt2.generate([{"prompt": "x", "colour": 1}])
    with pytest.raises(ValueError, match="cache_names takes one prompt"):
        gpt2.generate(PROMPTS[:2], cache_names=["blocks.0.hook_resid_pre"])


def test_ragged_ids_on_llama_with_chunked_prefill(llama):
    rng = np.random.default_rng(0)
    prompts = ragged_ids(rng, llama.config.vocab_size, [1, 2, 3, 5, 17, 40, 61])
    alone = [llama.generate(p, max_new_tokens=16) for p in prompts]
    sampled = [llama.generate(p, max_new_tokens=16, temperature=0.9, seed=i) for i, p in enumerate(prompts)]
    with Engine(llama, max_batch=3, prefill_chunk=7, prefix_cache_mb=0) as engine:
        greedy = [engine.generate(p, max_new_tokens=16) for p in prompts]
        seeded = [engine.generate(p, max_new_tokens=16, temperature=0.9, seed=i) for i, p in enumerate(prompts)]
        assert [list(s.result(timeout=60)) for s in greedy] == [list(a) for a in alone]
        assert [list(s.result(timeout=60)) for s in seeded] == [list(a) for a in sampled]
        stats = engine.stats()
    assert stats["finished"] == 2 * len(prompts) and stats["active"] == 0 and stats["queue_depth"] == 0
    # fills the context: the same "context" ending as alone
    long = ragged_ids(rng, llama.config.vocab_size, [90])[0]
    assert llama.generate([long], max_new_tokens=20)[0] == llama.generate(long, max_new_tokens=20)


def test_numpy_backend_batches_too(tmp_path):
    m = cyformer.load(backend="numpy")
    alone = [m.generate(p, max_new_tokens=5, temperature=0) for p in PROMPTS[:3]]
    assert m.generate(PROMPTS[:3], max_new_tokens=5, temperature=0) == alone


def test_stream_events_and_text(gpt2):
    with Engine(gpt2) as engine:
        stream = engine.generate(PROMPTS[2], max_new_tokens=10, logprobs=True, top_logprobs=2)
        events = list(stream)
        out = stream.result()
    # logprobs: the prompt is not healed (token_healing's default), in both
    assert "".join(e.text for e in events) == out == gpt2.generate(PROMPTS[2], max_new_tokens=10,
                                                                    logprobs=True)
    assert [e.token for e in events if e.token is not None] == out.token_ids
    assert [e.logprob for e in events if e.token is not None] == out.logprobs
    assert stream.finish_reason == "length" and stream.stats["new_tokens"] == 10


def test_cancel_frees_the_slot(gpt2):
    with Engine(gpt2, max_batch=1) as engine:
        long = engine.generate(PROMPTS[0], max_new_tokens=200)
        waiting = engine.generate(PROMPTS[1], max_new_tokens=4)
        next(iter(long))  # running: the one slot is taken
        assert engine.active == 1
        long.cancel()
        assert waiting.result(timeout=60) == gpt2.generate(PROMPTS[1], max_new_tokens=4)
        assert long.result(timeout=60).finish_reason == "cancelled"
        assert len(long.result().token_ids) < 200
        assert engine.active == 0 and engine.stats()["cancelled"] == 1


def test_bounded_queue_and_close(gpt2):
    engine = Engine(gpt2, max_batch=1, max_queue=2)
    try:
        streams = [engine.generate(PROMPTS[0], max_new_tokens=30)]
        next(iter(streams[0]))  # admitted: the queue is empty again
        streams += [engine.generate(p, max_new_tokens=3) for p in PROMPTS[1:3]]
        with pytest.raises(EngineBusy, match="queue is full"):
            engine.generate(PROMPTS[3], max_new_tokens=3)
    finally:
        assert engine.close(timeout=120)  # finishes what it had
    assert [s.result(timeout=0).finish_reason for s in streams] == ["length"] * 3
    with pytest.raises(EngineClosed):
        engine.generate(PROMPTS[0])
    # close(cancel=True) ends running requests early
    engine = Engine(gpt2)
    s = engine.generate(PROMPTS[0], max_new_tokens=200)
    next(iter(s))
    assert engine.close(cancel=True, timeout=60) and not engine.running
    assert s.result(timeout=0).finish_reason == "cancelled"


def test_requests_from_many_threads(gpt2):
    expected = {p: gpt2.generate(p, max_new_tokens=6) for p in PROMPTS}
    got, errors = [], []
    with Engine(gpt2, max_batch=4) as engine:
        def client(i):
            try:
                for p in PROMPTS[i % 2::2]:
                    got.append((p, engine.generate(p, max_new_tokens=6).result(timeout=60)))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors
    assert len(got) == 3 * len(PROMPTS[0::2]) + 3 * len(PROMPTS[1::2])
    assert all(out == expected[p] for p, out in got)


# -- the prefix cache --

def test_prefix_cache_reuses_a_shared_prefix(llama):
    rng = np.random.default_rng(1)
    system = ragged_ids(rng, llama.config.vocab_size, [40])[0]
    turns = [system + t for t in ragged_ids(rng, llama.config.vocab_size, [9, 2, 25])]
    alone = [llama.generate(p, max_new_tokens=8) for p in turns]
    with Engine(llama, prefix_cache_mb=4) as engine:
        first = engine.generate(turns[0], max_new_tokens=8).result(timeout=60)
        before = engine.stats()["prefilled_tokens"]
        rest = [engine.generate(p, max_new_tokens=8).result(timeout=60) for p in turns[1:]]
        stats = engine.stats()
    assert [first] + rest == alone
    pc = stats["prefix_cache"]
    assert pc["hits"] == 2 and pc["hit_tokens"] >= 40 + 36
    # each later prompt prefilled only past the shared part (at least 4 positions: exact pieces)
    assert stats["prefilled_tokens"] - before == sum(len(p) for p in turns[1:]) - pc["hit_tokens"]
    # the cache holds the two longest prompts: the 42-token one extends nothing stored
    # later but the 40-token system prefix was never stored on its own


def test_prefix_cache_chat_turns(llama):
    rng = np.random.default_rng(2)
    turn1 = ragged_ids(rng, llama.config.vocab_size, [30])[0]
    with Engine(llama, prefix_cache_mb=4) as engine:
        reply = engine.generate(turn1, max_new_tokens=10).result(timeout=60)
        turn2 = turn1 + list(reply) + ragged_ids(rng, llama.config.vocab_size, [6])[0]
        out = engine.generate(turn2, max_new_tokens=10).result(timeout=60)
        assert engine.stats()["prefix_cache"]["hit_tokens"] == 30  # turn 1's prompt
    assert out == llama.generate(turn2, max_new_tokens=10)


def test_prefix_cache_memory_bound(gpt2):
    cfg = gpt2.config
    per_position = 2 * cfg.n_layer * cfg.n_kv_head * cfg.d_head * 4
    cache = PrefixCache(max_mb=50 * per_position / 2**20)  # room for 50 positions
    rng = np.random.default_rng(3)
    for n in (20, 20, 20, 60, 15):
        ids = rng.integers(1, cfg.vocab_size, n)
        kv = gpt2.backend.new_cache(n)
        gpt2.backend.run(ids, kv)
        stored = cache.store(ids, kv)
        assert stored == (n <= 50)
        assert cache.nbytes <= cache.max_bytes
    # 20 + 20 fit, the third 20 evicted the oldest; 60 never fits; 15 evicted one more
    st = cache.stats()
    assert st["entries"] == 2 and st["evictions"] == 2 and st["bytes"] == 35 * per_position
    with pytest.raises(ValueError, match="MB >= 0"):
        PrefixCache(-1)


def test_prefix_cache_lookup_copies_rows(gpt2):
    rng = np.random.default_rng(4)
    ids = rng.integers(1, gpt2.config.vocab_size, 30)
    kv = gpt2.backend.new_cache(30)
    gpt2.backend.run(ids, kv)
    cache = PrefixCache(1)
    cache.store(ids[:20], kv)
    other = np.concatenate([ids[:12], rng.integers(1, 100, 10)])
    fresh = gpt2.backend.new_cache(22)
    assert cache.lookup(other, fresh, keep=4) == 12
    assert np.array_equal(fresh.k[..., :12], kv.k[..., :12]) and np.array_equal(fresh.v[:, :, :12], kv.v[:, :, :12])
    # a prompt that is the stored one: all but `keep` positions come from the cache
    assert cache.lookup(ids[:20], gpt2.backend.new_cache(20), keep=4) == 16


# -- logprobs and score against transformers --

def test_logprobs_match_transformers(tokenized_checkpoint):
    """Default ("raw"): log_softmax of the model's logits whatever the sampling
    options; "processed": of the scores sampled from (here logits / temperature)."""
    path, hf = tokenized_checkpoint
    m = cyformer.load(path)
    prompt = m.encode("def fib(n):")
    for temperature, seed, mode in ((0.0, None, "raw"), (0.7, 5, "raw"), (0.7, 5, "processed"),
                                    (0.0, None, "processed")):
        out = m.generate(prompt, max_new_tokens=8, temperature=temperature, seed=seed, logprobs=True,
                         top_logprobs=5, logprobs_mode=mode, repetition_penalty=None)
        ids = prompt + list(out)
        ref = hf_logits(hf, ids)[0].astype(np.float64)[len(prompt) - 1:len(ids) - 1]
        if mode == "processed":
            ref = ref / (temperature or 1.0)
        ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
        assert len(out.logprobs) == len(out) > 0
        for row, tl, tok in zip(ref, out.logprobs, out):
            assert tl.token == tok and abs(tl.logprob - row[tok]) <= 1e-4
            assert len(tl.top) == 5
            assert [lp for _, lp in tl.top] == sorted((lp for _, lp in tl.top), reverse=True)
            for t, lp in tl.top:
                assert abs(lp - row[t]) <= 1e-4
            assert abs(tl.top[0][1] - row.max()) <= 1e-4
    assert m.generate(prompt, max_new_tokens=2).logprobs is None
    with pytest.raises(ValueError, match="top_logprobs needs logprobs=True"):
        m.generate(prompt, top_logprobs=2)
    # the checkpoint's repetition penalty changes the choice, never the reported value
    pen = m.generate(prompt, max_new_tokens=4, repetition_penalty=5.0, logprobs=True)
    ref = hf_logits(hf, prompt + list(pen))[0].astype(np.float64)[len(prompt) - 1:-1]
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    assert [t.logprob for t in pen.logprobs] == pytest.approx([r[t] for r, t in zip(ref, pen)], abs=1e-4)


def test_score_matches_transformers(tokenized_checkpoint):
    path, hf = tokenized_checkpoint
    m = cyformer.load(path)
    text = "def fib(n):\n    return n"
    ids = m.encode(text)
    got = m.score(text)
    ref = hf_logits(hf, ids)[0].astype(np.float64)
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    expected = ref[np.arange(len(ids) - 1), ids[1:]]
    assert got.dtype == np.float64 and got.shape == (len(ids) - 1,)
    assert np.abs(got - expected).max() <= 1e-4
    assert np.array_equal(m.score(ids), got)
    with pytest.raises(ValueError, match="no tokens"):
        m.score([])


def test_scheduler_prefill_pieces_are_exact(gpt2):
    sched = Scheduler(gpt2, prefill_chunk=10)
    assert sched.exact == 4
    # never a piece under 4 positions, nor a tail under 4 left behind
    assert sched._piece(3, 10) == 3 and sched._piece(12, 10) == 12 and sched._piece(15, 10) == 10
    assert sched._piece(30, 2) == 4 and sched._piece(6, 2) == 6
