"""cyformer.jobs: score, generate and collect over corpora; shards, resume, Ray."""

import filecmp
import json
import os
import signal

import numpy as np
import pytest

import cyformer
from cyformer import jobs
from cyformer.jobs.scoring import log_softmax_at, windows

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def model():
    return cyformer.load(threads=1)


def _doc(i, repeat):
    return f"def f{i}(x):\n    y = x * {i}\n    return y + {i % 7}\n" * repeat


def write_jsonl(path, texts, extra=None):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, **((extra or {}).get(i, {}))}) + "\n")
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    """13 documents, two of them longer than the bundled model's context."""
    texts = [_doc(i, 1 + i % 4) for i in range(13)]
    texts[4] = _doc(4, 70)
    texts[9] = _doc(9, 110)
    return write_jsonl(tmp_path / "c.jsonl", texts)


def same_tree(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        pa_, pb = os.path.join(a, n), os.path.join(b, n)
        if os.path.isdir(pa_):
            same_tree(pa_, pb)
        else:
            assert filecmp.cmp(pa_, pb, shallow=False), n


def ref_logprobs(model, ids):
    """ln p of ids[1:] from one forward pass, log-softmax by the definition."""
    x = model.forward(ids).astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    return x[np.arange(len(ids) - 1), ids[1:]] - lse[:-1]


# -- score ---------------------------------------------------------------------

def test_log_softmax_at_is_float64_exact():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((70, 33)) * 30).astype(np.float32)
    t = rng.integers(0, 33, 70)
    x = logits.astype(np.float64)
    want = x[np.arange(70), t] - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) - x.max(1)
    np.testing.assert_allclose(log_softmax_at(logits, t), want, rtol=0, atol=1e-12)


def test_windows_score_every_token_once():
    for n, ctx, stride in [(1, 8, 4), (8, 8, 4), (9, 8, 4), (30, 8, 3), (30, 8, 8), (30, 8, 1), (17, 8, 7)]:
        seen = np.zeros(n, int)
        for begin, end, first in windows(n, ctx, stride):
            assert end - begin <= ctx and begin < first <= end or first == end
            seen[first:end] += 1
        if stride < ctx:
            assert seen[0] == 0 and (seen[1:] == 1).all(), (n, ctx, stride)
        else:  # non-overlapping windows: window starts have no context
            assert (seen <= 1).all() and seen[0] == 0


def test_score_matches_forward(model, tmp_path, corpus):
    s = jobs.score(corpus, tmp_path / "o", model, per_token=True, shard_rows=4, progress=False)
    assert s.documents == 13 and not s.skipped and s.shards_written == 4
    out = jobs.open(tmp_path / "o")
    assert out.complete and list(out["row"]) == list(range(13))
    texts = [json.loads(line)["text"] for line in open(corpus)]
    for r in (0, 3, 12):
        ids = np.array(model.encode(texts[r]))
        want = ref_logprobs(model, ids)
        got = out["token_logprobs"][r]
        assert np.isnan(got[0]) and list(out["token_ids"][r]) == list(ids)
        np.testing.assert_allclose(got[1:], want, rtol=0, atol=1e-9)
        assert out["n_tokens"][r] == len(ids) - 1
        assert out["logprob"][r] == pytest.approx(want.sum(), abs=1e-9)
        assert out["perplexity"][r] == pytest.approx(np.exp(-want.mean()), rel=1e-12)


def test_score_sliding_window_contexts(model, tmp_path, corpus):
    stride = 100
    jobs.score(corpus, tmp_path / "o", model, per_token=True, stride=stride, progress=False)
    out = jobs.open(tmp_path / "o")
    ids = np.asarray(out["token_ids"][9], dtype=np.int64)
    lp = out["token_logprobs"][9]
    ctx = model.config.n_positions
    assert len(ids) > 2 * ctx and np.isnan(lp[0]) and not np.isnan(lp[1:]).any()
    assert out["n_tokens"][9] == len(ids) - 1
    # token t is scored in the window that starts at the largest multiple of
    # stride whose window (ctx long) reaches past the previous window's end
    wins = windows(len(ids), ctx, stride)
    for t in (ctx - 1, ctx, ctx + 37, len(ids) - 1):
        begin = next(b for b, e, f in wins if f <= t < e)
        x = model.forward(ids[begin:t + 1])[-2].astype(np.float64)
        want = x[ids[t]] - (np.log(np.exp(x - x.max()).sum()) + x.max())
        assert lp[t] == pytest.approx(want, abs=1e-9), t


# -- determinism, resume, refusal -------------------------------------------------

def test_same_bytes_at_any_thread_count_and_after_interruption(tmp_path, corpus):
    a, b, c = (str(tmp_path / n) for n in "abc")
    jobs.score(corpus, a, cyformer.load(threads=1), per_token=True, shard_rows=3, progress=False)
    jobs.score(corpus, b, cyformer.load(threads=2), per_token=True, shard_rows=3, progress=False)
    same_tree(a, b)

    def stop_after_two(record):
        if record["index"] == 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        jobs.score(corpus, c, per_token=True, shard_rows=3, progress=False, on_shard=stop_after_two,
                   threads=1)
    m = json.load(open(os.path.join(c, "_manifest.json")))
    assert not m["complete"] and [r["index"] for r in m["shards"]] == [0, 1]
    assert not jobs.open(c).complete
    # what a crash leaves behind: a partial temporary file, and a shard renamed
    # in place whose manifest entry was never written
    open(os.path.join(c, "scores-00002.parquet.tmp"), "wb").write(b"partial")
    open(os.path.join(c, "scores-00003.parquet"), "wb").write(b"not a shard")
    s = jobs.score(corpus, c, per_token=True, shard_rows=3, progress=False, threads=1)
    assert s.shards_reused == 2 and s.shards_written == 3
    same_tree(a, c)
    s = jobs.score(corpus, c, per_token=True, shard_rows=3, progress=False, threads=1)
    assert s.shards_written == 0 and s.documents == 0 and s.shards_reused == 5


def test_other_job_in_the_same_directory_is_refused(model, tmp_path, corpus):
    jobs.score(corpus, tmp_path / "o", model, shard_rows=5, progress=False)
    with pytest.raises(jobs.JobOutputError, match="differs in: params"):
        jobs.score(corpus, tmp_path / "o", model, shard_rows=5, stride=7, progress=False)
    with pytest.raises(jobs.JobOutputError, match="shard_rows"):
        jobs.score(corpus, tmp_path / "o", model, shard_rows=4, progress=False)
    s = jobs.score(corpus, tmp_path / "o", model, shard_rows=4, progress=False, overwrite=True)
    assert s.shards_written == 4 and len(os.listdir(tmp_path / "o")) == 5


# -- malformed corpora --------------------------------------------------------------

def test_malformed_jsonl_rows_are_reported_by_line(model, tmp_path):
    good = json.dumps({"text": "x = 1\n"})
    lines = [good.encode(), b"{not json", json.dumps({"body": "x"}).encode(), json.dumps({"text": ""}).encode(),
             json.dumps({"text": 5}).encode(), b'{"text": "caf\xe9"}', b"", b"[1, 2]",
             json.dumps({"text": "\ud800"}).encode(), good.encode()]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines))  # no newline after the last row
    s = jobs.score(str(path), tmp_path / "o", model, shard_rows=4, progress=False)
    assert s.documents == 2 and s.rows == 10
    where = [(r, w) for r, w, _ in s.skipped]
    assert where == [(1, "line 2"), (2, "line 3"), (3, "line 4"), (4, "line 5"), (5, "line 6"),
                     (6, "line 7"), (7, "line 8"), (8, "line 9")]
    reasons = [why for _, _, why in s.skipped]
    for want, got in zip(["not JSON", "no field 'text'", "is empty", "not a string", "not UTF-8",
                          "empty line", "not a JSON object", "lone surrogate"], reasons):
        assert want in got
    assert "8 rows skipped" in s.line() and "line 2: not JSON" in s.line()
    assert jobs.open(tmp_path / "o").skipped == s.skipped
    assert list(jobs.open(tmp_path / "o")["row"]) == [0, 9]


def test_parquet_text_and_empty_corpora(model, tmp_path):
    texts = ["a = 1\n", None, "", "b = 2\n"]
    pq.write_table(pa.table({"body": texts, "id": [1, 2, 3, 4]}), tmp_path / "c.parquet")
    s = jobs.score(str(tmp_path / "c.parquet"), tmp_path / "p", model, field="body", progress=False)
    assert [(r, w) for r, w, _ in s.skipped] == [(1, "row 1"), (2, "row 2")] and s.documents == 2
    with pytest.raises(jobs.CorpusError, match="no column 'text'"):
        jobs.score(str(tmp_path / "c.parquet"), tmp_path / "p2", model, progress=False)

    d = tmp_path / "txt"
    d.mkdir()
    (d / "a.txt").write_text("import os\n")
    (d / "b.txt").write_bytes(b"\xff\xfe")
    (d / "c.txt").write_text("")
    (d / "d.txt").write_text("print(1)\n")
    s = jobs.score(str(d), tmp_path / "t", model, progress=False)
    assert [(r, w) for r, w, _ in s.skipped] == [(1, "b.txt"), (2, "c.txt")] and s.documents == 2
    assert "not UTF-8" in s.skipped[0][2]

    (tmp_path / "none.jsonl").write_text("{}\n{}\n")
    s = jobs.collect(str(tmp_path / "none.jsonl"), tmp_path / "n", model, hooks="blocks.0.hook_resid_post",
                     progress=False)
    out = jobs.open(tmp_path / "n")
    assert s.documents == 0 and len(s.skipped) == 2 and out.complete
    assert out["blocks.0.hook_resid_post"].shape == (0, model.config.n_embd)


def test_datasets_on_disk(model, tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = ["x = 1\n", "", "y = [2, 3]\n"]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    s = jobs.score(str(tmp_path / "ds"), tmp_path / "o", model, progress=False)
    assert s.documents == 2 and s.skipped[0][:2] == (1, "row 1")
    jobs.score(write_jsonl(tmp_path / "same.jsonl", texts), tmp_path / "j", model, progress=False)
    np.testing.assert_array_equal(jobs.open(tmp_path / "o")["logprob"], jobs.open(tmp_path / "j")["logprob"])


# -- collect ----------------------------------------------------------------------

def test_collect_matches_run_with_cache(model, tmp_path, corpus):
    hooks = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_z"]
    s = jobs.collect(corpus, tmp_path / "o", model, hooks=hooks, shard_rows=5, max_tokens=200, progress=False)
    out = jobs.open(tmp_path / "o")
    texts = [json.loads(line)["text"] for line in open(corpus)]
    man = out.manifest
    assert [r["truncated"] for r in man["shards"]] == [[4], [9], []]
    assert man["identity"]["arrays"]["blocks.0.attn.hook_z"]["shape"] == [4, 64]
    doc, pos, tok = out["doc"], out["pos"], out["token_ids"]
    assert s.tokens == len(doc) == out.tokens
    for r in (0, 4, 12):
        ids = model.encode(texts[r])[:200]
        sel = doc == r
        assert list(pos[sel]) == list(range(len(ids))) and list(tok[sel]) == ids
        _, cache = model.run_with_cache(ids, names=hooks)
        for h in hooks:
            np.testing.assert_array_equal(out[h][sel], cache[h])
    view = jobs.open(tmp_path / "o", mmap=True)["blocks.1.hook_resid_post"]
    full = out["blocks.1.hook_resid_post"]
    assert view.shape == full.shape
    np.testing.assert_array_equal(np.asarray(view), full)
    np.testing.assert_array_equal(view[37:900], full[37:900])
    np.testing.assert_array_equal(view[-1], full[-1])
    np.testing.assert_array_equal(view[[5, 700, 3]], full[[5, 700, 3]])


def test_collect_float16_and_npy(model, tmp_path, corpus):
    h = "blocks.2.mlp.hook_post"
    jobs.collect(corpus, tmp_path / "a", model, hooks=[h], shard_rows=4, progress=False)
    jobs.collect(corpus, tmp_path / "b", model, hooks=[h], shard_rows=4, dtype="float16", save_as="npy",
                 progress=False)
    a, b = jobs.open(tmp_path / "a")[h], jobs.open(tmp_path / "b", mmap=True)
    assert b[h].dtype == np.float16 and os.path.isdir(tmp_path / "b" / "activations-00000")
    np.testing.assert_array_equal(np.asarray(b[h]), a.astype(np.float16))
    np.testing.assert_array_equal(b["doc"][:], jobs.open(tmp_path / "a")["doc"])


def test_collect_refuses_what_it_cannot_store(model, tmp_path, corpus):
    with pytest.raises(ValueError, match="key axis"):
        jobs.collect(corpus, tmp_path / "o", model, hooks=["blocks.0.attn.hook_pattern"], progress=False)
    with pytest.raises(ValueError, match="no hook point named"):
        jobs.collect(corpus, tmp_path / "o", model, hooks=["blocks.99.hook_resid_post"], progress=False)
    with pytest.raises(ValueError, match="dtype"):
        jobs.collect(corpus, tmp_path / "o", model, hooks=["hook_embed"], dtype="int8", progress=False)


# -- generate ------------------------------------------------------------------------

def test_generate_with_per_row_parameters(model, tmp_path):
    prompts = ["def add(a, b):", "import ", "class A:", "x = ", "y = " * 1500, "for i in"]
    extra = {1: {"temperature": 0.9, "top_k": 20, "seed": 5}, 2: {"max_new_tokens": 3},
             3: {"temperature": -1}, 5: {"temperature": 0.7}}
    path = str(tmp_path / "p.jsonl")
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p, **extra.get(i, {})}) + "\n")
    s = jobs.generate(path, tmp_path / "o", model, max_new_tokens=6, seed=100, shard_rows=4, progress=False)
    assert [r for r, _, _ in s.skipped] == [3, 4]
    assert "temperature" in s.skipped[0][2] and "n_positions" in s.skipped[1][2]
    rows = jobs.open(tmp_path / "o").table().to_pylist()
    assert [r["row"] for r in rows] == [0, 1, 2, 5]
    want = [model.generate(prompts[0], max_new_tokens=6, seed=100),
            model.generate(prompts[1], max_new_tokens=6, temperature=0.9, top_k=20, seed=5),
            model.generate(prompts[2], max_new_tokens=3, seed=102),
            model.generate(prompts[5], max_new_tokens=6, temperature=0.7, seed=105)]
    for got, w in zip(rows, want):
        assert got["completion"] == str(w) and got["token_ids"] == w.token_ids
        assert got["finish_reason"] == w.finish_reason
    assert [r["seed"] for r in rows] == [100, 5, 102, 105]


# -- command line ----------------------------------------------------------------------

def test_cli_commands(tmp_path, corpus, capsys):
    from cyformer import cli

    assert cli.main(["score", corpus, "--out", str(tmp_path / "s"), "--threads", "1", "--no-progress",
                     "--shard-rows", "5"]) == 0
    err = capsys.readouterr().err
    assert "score: 13 documents" in err and "tokens/s" in err and "0 rows skipped" in err
    assert cli.main(["collect", corpus, "--out", str(tmp_path / "c"), "--hooks",
                     "blocks.0.hook_resid_post, hook_embed", "--save-dtype", "float16", "--no-progress",
                     "--threads", "1"]) == 0
    assert jobs.open(tmp_path / "c")["hook_embed"].dtype == np.float16
    assert cli.main(["collect", corpus, "--out", str(tmp_path / "x"), "--hooks", "blocks.9.nothing",
                     "--no-progress"]) == 1
    assert "no hook point named" in capsys.readouterr().err
    assert cli.main(["score", corpus, "--out", str(tmp_path / "y"), "--workers", "2"]) == 1
    with pytest.raises(SystemExit):
        cli.main(["generate-corpus", "--help"])
    assert "override" in capsys.readouterr().out


# -- Ray --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    from cyformer.jobs.ray_engine import init_local_ray

    init_local_ray(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_local_ray_listens_on_loopback_only(ray_cluster):
    psutil = pytest.importorskip("psutil")
    import ipaddress

    ray_cluster.get(ray_cluster.remote(lambda: 1).remote())  # a worker is up as well
    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 3  # GCS, raylet, the driver's and the worker's core workers
    for c in listening:
        ip = ipaddress.ip_address(c.laddr.ip)
        ip = getattr(ip, "ipv4_mapped", None) or ip
        assert ip.is_loopback, f"pid {c.pid} listens on {c.laddr.ip}:{c.laddr.port}"


@pytest.mark.slow
def test_ray_gives_the_local_bytes(ray_cluster, tmp_path, corpus):
    local = cyformer.load(threads=2)
    jobs.score(corpus, tmp_path / "sl", local, per_token=True, shard_rows=4, progress=False)
    jobs.score(corpus, tmp_path / "sr", per_token=True, shard_rows=4, progress=False, engine="ray",
               workers=2, threads=1)
    same_tree(tmp_path / "sl", tmp_path / "sr")
    hooks = ["blocks.3.hook_resid_post"]
    jobs.collect(corpus, tmp_path / "cl", local, hooks=hooks, shard_rows=4, progress=False)
    jobs.collect(corpus, tmp_path / "cr", hooks=hooks, shard_rows=4, progress=False, engine="ray",
                 workers=1, threads=2)
    same_tree(tmp_path / "cl", tmp_path / "cr")
    prompts = write_jsonl(tmp_path / "p.jsonl", ["def f():", "x", "", "import os"],
                          extra={1: {"temperature": 0.8}})
    jobs.generate(prompts, tmp_path / "gl", local, field="text", max_new_tokens=5, progress=False)
    s = jobs.generate(prompts, tmp_path / "gr", field="text", max_new_tokens=5, progress=False, engine="ray")
    assert s.skipped[0][:2] == (2, "line 3")
    same_tree(tmp_path / "gl", tmp_path / "gr")


@pytest.mark.slow
def test_ray_survives_a_killed_worker(ray_cluster, tmp_path):
    psutil = pytest.importorskip("psutil")
    texts = [_doc(i, 6 + i % 5) for i in range(40)]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    jobs.score(corpus, tmp_path / "local", cyformer.load(threads=2), shard_rows=2, progress=False)
    killed = []

    def workers():
        return [p for p in psutil.process_iter(["cmdline"])
                if "_JobWorker" in " ".join(p.info["cmdline"] or [])]

    def kill_one(record):
        if not killed:
            victims = workers()
            assert victims, "no Ray worker process found"
            victims[0].send_signal(signal.SIGKILL)
            killed.append(victims[0].pid)

    s = jobs.score(corpus, tmp_path / "ray", shard_rows=2, progress=False, engine="ray", workers=2,
                   threads=1, on_shard=kill_one, batch_docs=1)
    assert killed and s.documents == 40
    rows = jobs.open(tmp_path / "ray")["row"]
    assert sorted(rows) == list(range(40)) and len(set(rows)) == 40
    same_tree(tmp_path / "local", tmp_path / "ray")
