"""Looking inside: activation cache, hooks, parts, circuits, logit lens, attribution, export, CLI."""

import math
import subprocess
import sys
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import cyformer
from cyformer.interp import FactoredMatrix, direct_logit_attribution, logit_lens

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def erf(checkpoint):
    """(model, hf eager model, path) for the 3-layer, 4-head exact-GELU geometry.

    One thread: results do not depend on it, and tiny models gain nothing from more.
    """
    from transformers import GPT2LMHeadModel

    path, _ = checkpoint("erf")
    hf = GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager").eval()
    return cyformer.load(path, threads=1), hf, path


@pytest.fixture(scope="module")
def odd(checkpoint):
    path, _ = checkpoint("odd")
    return cyformer.load(path, threads=1)


def ids_for(model, T, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, size=T)


# -- a NumPy reference for the pieces the hand computations need -------------

def np_ln(x, ln, eps):
    x = x.astype(np.float64)
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * ln.weight + ln.bias


def np_gelu(x, kind):
    if kind == "gelu":
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def np_attn(x, w, H):
    """Causal attention of x [T, C] with one block's weights -> (update, z [T, H, D])."""
    T, C = x.shape
    D = C // H
    qkv = x @ w.c_attn.weight + w.c_attn.bias
    q, k, v = (qkv[:, j * C:(j + 1) * C].reshape(T, H, D).transpose(1, 0, 2) for j in range(3))
    s = q @ k.transpose(0, 2, 1) / math.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    z = (p @ v).transpose(1, 0, 2)
    return z.reshape(T, C) @ w.attn_c_proj.weight + w.attn_c_proj.bias, z


def np_mlp(x, w, kind):
    return np_gelu(x @ w.c_fc.weight + w.c_fc.bias, kind) @ w.mlp_c_proj.weight + w.mlp_c_proj.bias


def np_logits(model, resid):
    return np_ln(resid, model.weights.ln_f, model.config.layer_norm_epsilon) @ model.weights.lm_head.T


# -- the cache -----------------------------------------------------------------

def test_cache_matches_hugging_face(erf):
    """Residual streams equal HF's hidden states and patterns its attentions."""
    model, hf, _ = erf
    L = model.config.n_layer
    ids = ids_for(model, 19)
    logits, cache = model.run_with_cache(ids)
    seen = {}

    def grab_input(module, inputs, output):  # returns None: observe, do not replace
        seen["x"] = inputs[0]

    handle = hf.transformer.ln_f.register_forward_hook(grab_input)
    try:
        with torch.no_grad():
            out = hf(torch.as_tensor(ids[None]), output_hidden_states=True, output_attentions=True)
    finally:
        handle.remove()
    hidden = [h[0].numpy() for h in out.hidden_states]  # embeddings, after each block, ln_f output
    for i in range(L):
        np.testing.assert_allclose(cache[f"blocks.{i}.hook_resid_pre"], hidden[i], **TOL)
        np.testing.assert_allclose(cache[f"blocks.{i}.attn.hook_pattern"], out.attentions[i][0].numpy(), **TOL)
    for i in range(L - 1):
        np.testing.assert_allclose(cache[f"blocks.{i}.hook_resid_post"], hidden[i + 1], **TOL)
    np.testing.assert_allclose(cache[f"blocks.{L - 1}.hook_resid_post"], seen["x"][0].numpy(), **TOL)
    np.testing.assert_allclose(cache["ln_final.hook_normalized"], hidden[L], **TOL)
    np.testing.assert_allclose(logits, out.logits[0].numpy(), **TOL)
    np.testing.assert_array_equal(logits, model.forward(ids))


def test_cache_is_self_consistent(erf):
    """Every cached activation follows from the ones before it by the model's own arithmetic."""
    model, _, _ = erf
    cfg = model.config
    H, D, eps = cfg.n_head, cfg.d_head, cfg.layer_norm_epsilon
    ids = ids_for(model, 13, seed=1)
    T = len(ids)
    _, c = model.run_with_cache(ids)
    assert list(c) == model.hook_names()
    w = model.weights
    np.testing.assert_array_equal(c["hook_embed"], w.wte[ids])
    np.testing.assert_array_equal(c["hook_pos_embed"], w.wpe[:T])
    np.testing.assert_array_equal(c["blocks.0.hook_resid_pre"], c["hook_embed"] + c["hook_pos_embed"])
    mask = np.tril(np.ones((T, T), bool))
    for i, bw in enumerate(w.blocks):
        p = f"blocks.{i}."
        resid = c[p + "hook_resid_pre"]
        assert c[p + "ln1.hook_scale"].shape == (T, 1)
        np.testing.assert_allclose(c[p + "ln1.hook_scale"][:, 0],
                                   np.sqrt(resid.astype(np.float64).var(-1) + eps), **TOL)
        np.testing.assert_allclose(c[p + "ln1.hook_normalized"], np_ln(resid, bw.ln_1, eps), **TOL)
        x = c[p + "ln1.hook_normalized"]
        qkv = x.astype(np.float64) @ bw.c_attn.weight + bw.c_attn.bias
        for j, name in enumerate("qkv"):
            got = c[p + f"attn.hook_{name}"]
            assert got.shape == (T, H, D)
            np.testing.assert_allclose(got, qkv[:, j * H * D:(j + 1) * H * D].reshape(T, H, D), **TOL)
        q, k, v = (c[p + f"attn.hook_{n}"].transpose(1, 0, 2).astype(np.float64) for n in "qkv")
        scores = c[p + "attn.hook_attn_scores"]
        assert scores.shape == (H, T, T) and np.isneginf(scores[:, ~mask]).all()
        np.testing.assert_allclose(scores[:, mask], (q @ k.transpose(0, 2, 1) / math.sqrt(D))[:, mask], **TOL)
        pattern = c[p + "attn.hook_pattern"]
        assert (pattern[:, ~mask] == 0).all()
        np.testing.assert_allclose(pattern.sum(-1), 1.0, **TOL)
        np.testing.assert_allclose(c[p + "attn.hook_z"], (pattern @ v).transpose(1, 0, 2), **TOL)
        # each head's write, and their sum plus the c_proj bias is the attention output
        z = c[p + "attn.hook_z"].astype(np.float64)
        W_O = bw.attn_c_proj.weight.reshape(H, D, -1)
        result = c[p + "attn.hook_result"]
        assert result.shape == (T, H, cfg.n_embd)
        np.testing.assert_allclose(result, np.einsum("thd,hdc->thc", z, W_O), **TOL)
        np.testing.assert_allclose(result.sum(1) + bw.attn_c_proj.bias, c[p + "hook_attn_out"], **TOL)
        np.testing.assert_allclose(c[p + "hook_resid_mid"], resid + c[p + "hook_attn_out"], **TOL)
        mid = c[p + "hook_resid_mid"]
        np.testing.assert_allclose(c[p + "ln2.hook_normalized"], np_ln(mid, bw.ln_2, eps), **TOL)
        pre = c[p + "mlp.hook_pre"]
        assert pre.shape == (T, cfg.d_mlp)
        x2 = c[p + "ln2.hook_normalized"].astype(np.float64)
        np.testing.assert_allclose(pre, x2 @ bw.c_fc.weight + bw.c_fc.bias, **TOL)
        np.testing.assert_allclose(c[p + "mlp.hook_post"], np_gelu(pre.astype(np.float64), cfg.gelu), **TOL)
        post = c[p + "mlp.hook_post"].astype(np.float64)
        np.testing.assert_allclose(c[p + "hook_mlp_out"], post @ bw.mlp_c_proj.weight + bw.mlp_c_proj.bias, **TOL)
        np.testing.assert_allclose(c[p + "hook_resid_post"], mid + c[p + "hook_mlp_out"], **TOL)


def test_names_select_what_is_kept(odd):
    ids = ids_for(odd, 9)
    plain = odd.forward(ids)
    logits, cache = odd.run_with_cache(ids, names=["blocks.1.attn.hook_pattern", "hook_embed"])
    assert list(cache) == ["hook_embed", "blocks.1.attn.hook_pattern"]
    np.testing.assert_array_equal(logits, plain)
    _, cache = odd.run_with_cache(ids, names=lambda n: n.endswith("hook_z"))
    assert list(cache) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    _, cache = odd.run_with_cache(ids, names="ln_final.hook_scale")
    assert list(cache) == ["ln_final.hook_scale"]
    _, cache = odd.run_with_cache(ids, names=[])
    assert cache == {}
    with pytest.raises(ValueError, match="no hook point named 'blocks.7.hook_resid_pre'"):
        odd.run_with_cache(ids, names=["blocks.7.hook_resid_pre"])
    with pytest.raises(ValueError, match="hook_pattern"):
        odd.run_with_cache(ids, names=["pattern"])
    with pytest.raises(KeyError, match="not in this cache"):
        cache["hook_embed"]


def test_backends_without_hook_points_say_so(checkpoint):
    model = cyformer.load(checkpoint("odd")[0], backend="numpy")
    with pytest.raises(ValueError, match="no hook points"):
        model.run_with_cache([1, 2, 3])
    with pytest.raises(ValueError, match="hook points"):
        model.generate([1, 2, 3], max_new_tokens=2, cache_names=["hook_embed"])


def test_batched_input_adds_a_batch_axis(odd):
    ids = np.stack([ids_for(odd, 7, seed=s) for s in range(3)])
    logits, cache = odd.run_with_cache(ids, names=lambda n: n.startswith("blocks.1."))
    np.testing.assert_array_equal(logits, odd.forward(ids))
    assert cache["blocks.1.attn.hook_pattern"].shape == (3, 3, 7, 7)
    assert cache["blocks.1.attn.hook_q"].shape == (3, 7, 3, 16)
    for b in range(3):
        _, one = odd.run_with_cache(ids[b], names=["blocks.1.hook_resid_post"])
        np.testing.assert_array_equal(cache["blocks.1.hook_resid_post"][b], one["blocks.1.hook_resid_post"])


# -- interventions ---------------------------------------------------------------

def test_hooks_returning_none_change_no_bit(odd, erf):
    seen = []

    def look(act, name):
        seen.append(name)
        assert isinstance(act, np.ndarray)

    for model in (odd, erf[0]):
        for T in (1, 3, 11):  # the matrix-vector and the GEMM paths
            ids = ids_for(model, T, seed=T)
            seen.clear()
            got = model.run_with_hooks(ids, fwd_hooks=[(lambda n: True, look)])
            np.testing.assert_array_equal(got, model.forward(ids))
            assert seen == model.hook_names()


def test_head_ablation_matches_a_hand_computation(erf):
    """Zeroing one head's z in layer 0 equals removing its write there and running
    the rest of the model in NumPy from the cached stream."""
    model, _, _ = erf
    cfg, w = model.config, model.weights
    ids = ids_for(model, 12, seed=3)
    _, cache = model.run_with_cache(ids)
    layer, head = 0, 2

    def ablate(z, name):
        z = z.copy()
        z[:, head, :] = 0.0
        return z

    got = model.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate)])
    resid = (cache[f"blocks.{layer}.hook_resid_mid"].astype(np.float64)
             - cache[f"blocks.{layer}.attn.hook_result"][:, head])
    resid = resid + np_mlp(np_ln(resid, w.blocks[layer].ln_2, cfg.layer_norm_epsilon), w.blocks[layer], cfg.gelu)
    for bw in w.blocks[layer + 1:]:
        resid = resid + np_attn(np_ln(resid, bw.ln_1, cfg.layer_norm_epsilon), bw, cfg.n_head)[0]
        resid = resid + np_mlp(np_ln(resid, bw.ln_2, cfg.layer_norm_epsilon), bw, cfg.gelu)
    np.testing.assert_allclose(got, np_logits(model, resid), **TOL)
    assert np.abs(got - model.forward(ids)).max() > 1e-3  # the ablation did something
    # the same ablation through the head's write, and through its pattern's effect on z
    zero_write = model.run_with_hooks(ids, fwd_hooks=[(
        f"blocks.{layer}.attn.hook_result", lambda r, n: np.where(np.arange(cfg.n_head)[None, :, None] == head, 0, r))])
    np.testing.assert_allclose(zero_write, got, **TOL)


def test_pattern_and_score_replacements_reach_z(odd):
    ids = ids_for(odd, 8, seed=4)
    T = len(ids)
    uniform = np.tril(np.ones((T, T), np.float32)) / np.arange(1, T + 1, dtype=np.float32)[:, None]
    logits, cache = odd.run_with_cache(
        ids, names=lambda n: n.startswith("blocks.1.attn."),
        fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, n: np.broadcast_to(uniform, p.shape))])
    v = cache["blocks.1.attn.hook_v"].transpose(1, 0, 2)
    np.testing.assert_allclose(cache["blocks.1.attn.hook_z"], (uniform @ v).transpose(1, 0, 2), **TOL)
    np.testing.assert_array_equal(cache["blocks.1.attn.hook_pattern"][0], uniform)
    # scores all equal (where visible) give the same uniform pattern
    flat = odd.run_with_hooks(ids, fwd_hooks=[(
        "blocks.1.attn.hook_attn_scores", lambda s, n: np.where(np.isneginf(s), s, 0.0))])
    np.testing.assert_allclose(flat, logits, **TOL)


def test_a_replaced_layer_norm_scale_is_used(odd):
    ids = ids_for(odd, 6, seed=11)
    same = odd.run_with_hooks(ids, fwd_hooks=[("blocks.1.ln2.hook_scale", lambda s, n: s.copy())])
    np.testing.assert_allclose(same, odd.forward(ids), **TOL)
    # doubling the final scale halves the normalised stream before the bias
    _, cache = odd.run_with_cache(ids, names=["ln_final.hook_normalized"],
                                  fwd_hooks=[("ln_final.hook_scale", lambda s, n: 2 * s)])
    _, plain = odd.run_with_cache(ids, names=["ln_final.hook_normalized"])
    b = odd.weights.ln_f.bias
    halved = (plain["ln_final.hook_normalized"] - b) / 2
    np.testing.assert_allclose(cache["ln_final.hook_normalized"] - b, halved, **TOL)


def test_activation_patching(odd):
    clean, corrupt = ids_for(odd, 10, seed=5), ids_for(odd, 10, seed=6)
    _, clean_cache = odd.run_with_cache(clean)
    name = "blocks.0.hook_resid_pre"
    # patching the whole stream in gives the clean run, bit for bit
    got = odd.run_with_hooks(corrupt, fwd_hooks=[(name, lambda r, n: clean_cache[name])])
    np.testing.assert_array_equal(got, odd.forward(clean))
    # patching one position of a later stream leaves earlier positions alone
    pos, name = 6, "blocks.1.hook_resid_pre"

    def patch(r, n):
        r = r.copy()
        r[pos] = clean_cache[name][pos]
        return r

    got = odd.run_with_hooks(corrupt, fwd_hooks=[(name, patch)])
    base = odd.forward(corrupt)
    np.testing.assert_array_equal(got[:pos], base[:pos])
    assert np.abs(got[pos] - base[pos]).max() > 1e-4
    with pytest.raises(ValueError, match="shape"):
        odd.run_with_hooks(corrupt, fwd_hooks=[(name, lambda r, n: r[:3])])


# -- generation ----------------------------------------------------------------

def test_generate_cache_equals_run_with_cache(erf):
    model, _, _ = erf
    object.__setattr__(model.config, "eos_token_id", None)
    prompt = ids_for(model, 6, seed=7).tolist()
    out = model.generate(prompt, max_new_tokens=9, cache_names=lambda n: True)
    seq = prompt + list(out)
    assert len(out) == 9
    _, full = model.run_with_cache(seq)
    assert list(out.cache) == list(full)
    for name, arr in full.items():
        assert out.cache[name].shape == arr.shape, name
        np.testing.assert_allclose(out.cache[name], arr, err_msg=name, **TOL)
    assert model.generate(prompt, max_new_tokens=3).cache is None


def test_generate_cache_at_the_context_edge(odd):
    object.__setattr__(odd.config, "eos_token_id", None)
    prompt = ids_for(odd, 35, seed=8).tolist()
    out = odd.generate(prompt, max_new_tokens=20, cache_names=["blocks.1.attn.hook_pattern", "hook_embed"])
    assert out.finish_reason == "context" and len(out) == 6  # 40 positions, the last token never fed
    seq = (prompt + list(out))[:40]
    _, full = odd.run_with_cache(seq, names=["blocks.1.attn.hook_pattern", "hook_embed"])
    for name in full:
        np.testing.assert_allclose(out.cache[name], full[name], **TOL)


# -- parts and circuits ------------------------------------------------------------

def test_parts_are_read_only_views(erf):
    model, hf, _ = erf
    cfg, w = model.config, model.weights
    C, D = cfg.n_embd, cfg.d_head
    head = model.blocks[1].attn.heads[2]
    bw = w.blocks[1]
    for arr, src in ((head.W_Q, bw.c_attn.weight), (head.W_K, bw.c_attn.weight), (head.W_V, bw.c_attn.weight),
                     (head.W_O, bw.attn_c_proj.weight), (head.b_Q, bw.c_attn.bias), (head.b_V, bw.c_attn.bias)):
        assert np.shares_memory(arr, src) and not arr.flags.writeable
    assert head.W_Q.shape == (C, D) and head.W_O.shape == (D, C) and head.b_K.shape == (D,)
    hf_attn = hf.transformer.h[1].attn.c_attn.weight.detach().numpy()
    np.testing.assert_array_equal(head.W_K, hf_attn[:, C + 2 * D:C + 3 * D])
    np.testing.assert_array_equal(head.W_O, w.blocks[1].attn_c_proj.weight[2 * D:3 * D])
    neuron = model.blocks[2].mlp.neurons[17]
    assert len(model.blocks[2].mlp.neurons) == cfg.d_mlp
    np.testing.assert_array_equal(neuron.read, w.blocks[2].c_fc.weight[:, 17])
    np.testing.assert_array_equal(neuron.write, w.blocks[2].mlp_c_proj.weight[17])
    assert float(neuron.bias) == float(w.blocks[2].c_fc.bias[17])
    for arr in (neuron.read, neuron.write, neuron.bias):
        assert np.shares_memory(arr, w.blocks[2].c_fc.weight) or np.shares_memory(
            arr, w.blocks[2].mlp_c_proj.weight) or np.shares_memory(arr, w.blocks[2].c_fc.bias)
    u = model.unembed[42]
    assert np.shares_memory(u, w.lm_head) and not u.flags.writeable
    np.testing.assert_array_equal(u, w.lm_head[42])
    with pytest.raises(IndexError):
        model.blocks[0].mlp.neurons[cfg.d_mlp]


def test_circuits_in_factored_form(erf):
    model, _, _ = erf
    head = model.blocks[0].attn.heads[1]
    rng = np.random.default_rng(9)
    for circuit, (A, B) in ((head.qk_circuit(), (head.W_Q, head.W_K.T)), (head.ov_circuit(), (head.W_V, head.W_O))):
        full = A.astype(np.float64) @ B.astype(np.float64)
        assert circuit.shape == full.shape and np.shares_memory(circuit.A, A)
        np.testing.assert_allclose(circuit.full(), full, rtol=1e-12, atol=1e-12)
        x, X = rng.standard_normal(full.shape[1]), rng.standard_normal((full.shape[1], 5))
        np.testing.assert_allclose(circuit @ x, full @ x, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(circuit @ X, full @ X, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(x @ circuit, x @ full, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(circuit.singular_values(), np.linalg.svd(full, compute_uv=False), atol=1e-9)
        ev = circuit.eigenvalues()
        ref = np.linalg.eigvals(full)
        ref = ref[np.argsort(-np.abs(ref), kind="stable")]
        k = circuit.rank_bound
        np.testing.assert_allclose(np.sort_complex(ev[:k]), np.sort_complex(ref[:k]), atol=1e-8)
        assert np.abs(ref[k:]).max() < 1e-8 and (ev[k:] == 0).all()
    # composition stays factored: the OV circuit of one head feeding the QK circuit of a later one
    later = model.blocks[1].attn.heads[0].qk_circuit()
    comp = head.ov_circuit() @ later
    assert comp.A.shape[1] == model.config.d_head
    np.testing.assert_allclose(comp.full(), head.ov_circuit().full() @ later.full(), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError):
        FactoredMatrix(np.ones((3, 2)), np.ones((3, 3)))


# -- analyses -------------------------------------------------------------------

def test_logit_lens(tokenized_checkpoint):
    path, _ = tokenized_checkpoint
    model = cyformer.load(path, threads=1)
    lens = logit_lens(model, "def fib(n):", k=3)
    T, L = len(model.encode("def fib(n):")), model.config.n_layer
    assert lens.top_ids.shape == (L + 1, T, 3) and lens.labels == ["embed"] + [f"L{i}" for i in range(L)]
    # the last row is the model's own prediction
    logits = model.forward(model.encode("def fib(n):"))
    np.testing.assert_array_equal(lens.top_ids[-1], np.argsort(-logits, axis=1, kind="stable")[:, :3])
    assert lens.tokens[-1][0][0] == model.decode([lens.top_ids[-1, 0, 0]])
    assert (np.diff(lens.top_probs, axis=-1) <= 0).all()
    table = lens.format()
    assert len(table.splitlines()) == L + 3


@pytest.mark.parametrize("position", [-1, 4])
def test_direct_logit_attribution_sums_to_the_logit(erf, position):
    model, _, _ = erf
    ids = ids_for(model, 9, seed=10)
    token = 77
    dla = direct_logit_attribution(model, ids, token, position=position)
    logit = model.forward(ids)[position, token]
    assert dla.heads.shape == (model.config.n_layer, model.config.n_head)
    assert math.isclose(dla.logit, logit, rel_tol=1e-5, abs_tol=1e-4)
    assert math.isclose(dla.total(), logit, rel_tol=1e-5, abs_tol=1e-4)
    assert math.isclose(sum(v for _, v in dla.items()), logit, rel_tol=1e-5, abs_tol=1e-4)
    # one head's share is its centred write . (g * u) / scale
    _, cache = model.run_with_cache(ids)
    g, u = model.weights.ln_f.weight, model.unembed[token]
    r = cache["blocks.2.attn.hook_result"][position, 1].astype(np.float64)
    scale = cache["ln_final.hook_scale"][position, 0]
    # the reference in float64 throughout, as the attribution is computed
    direction = g.astype(np.float64) * u.astype(np.float64) / float(scale)
    assert math.isclose(dla.heads[2, 1], (r - r.mean()) @ direction, rel_tol=1e-9, abs_tol=1e-9)
    assert len(dla.top(4)) == 4


# -- export and the command line -------------------------------------------------------

class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.external = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.external += [v for k, v in attrs if k in ("src", "href")]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cyformer", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_inspect_writes_png_and_html(tokenized_checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = tokenized_checkpoint
    png, page = tmp_path / "attn.png", tmp_path / "attn.html"
    r = run_cli("inspect", "def add(a, b): return a + b", "--model", path, "--png", str(png),
                "--html", str(page), "--logit-lens", "--layer", "1", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "next token:" in r.stdout and "L1 H0" in r.stdout and "logit lens" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = page.read_text(encoding="utf-8")
    parser = _Tags()
    parser.feed(html)
    assert parser.external == [] and "script" not in parser.tags
    assert html.count('class="panel"') == 2 and "return" in html


@pytest.mark.parametrize("args,needle", [
    (["--layer", "9"], "--layer 9"),
    (["--head", "5"], "--head 5"),
])
def test_cli_inspect_errors_are_one_line(tokenized_checkpoint, args, needle):
    r = run_cli("inspect", "x = 1", "--model", tokenized_checkpoint[0], *args)
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_inspect_help():
    r = run_cli("inspect", "--help")
    assert r.returncode == 0
    for opt in ("--layer", "--head", "--logit-lens", "--html", "--png", "--threads", "--model"):
        assert opt in r.stdout


def test_png_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    from cyformer.interp import PlotUnavailable, save_png

    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes the import fail
    with pytest.raises(PlotUnavailable, match=r"pip install 'cyformer\[plot\]'"):
        save_png(str(tmp_path / "x.png"), ["a"], {(0, 0): np.ones((1, 1), np.float32)})
    assert isinstance(PlotUnavailable("x"), cyformer.CyformerError)  # one line from the CLI


@pytest.mark.slow
def test_caching_everything_costs_at_most_1_5x_a_forward():
    """GPT-2-small geometry, 128 tokens, one thread; the fastest runs' CPU times
    are what other load on a shared machine disturbs least."""
    from cyformer.interp.cost import cache_overhead, random_model

    r = cache_overhead(random_model(threads=1), tokens=128, repeats=5)
    assert r["best_cpu_ratio"] <= 1.5, r
