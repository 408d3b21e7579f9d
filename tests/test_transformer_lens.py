"""TransformerLens-style analyses, written once, run on cyformer's
TransformerBridge and on TransformerLens 4's with the same random GPT-2
weights.

The analysis functions below take the model and never look at which one it
is: their text is what one would write for TransformerLens.  Both hand them
torch tensors; the results must agree to 1e-4.  Both bridges boot from a
checkpoint directory written here (boot_transformers on a path, offline) and
run in compatibility mode (TransformerLens's weight processing).
"""

import numpy as np
import pytest

import cyformer
from cyformer.errors import TorchRequired
from helpers import make_hf_checkpoint

torch = pytest.importorskip("torch")
tl = pytest.importorskip("transformer_lens")
if not getattr(tl, "__version__", "4").startswith("4"):
    pytest.skip("these tests compare with TransformerLens 4's bridge", allow_module_level=True)
from transformer_lens.model_bridge import TransformerBridge as TheirBridge  # noqa: E402
import transformer_lens.utilities as utils  # noqa: E402

from cyformer.tl import HookedTransformer, TransformerBridge  # noqa: E402

# bos = eos = token 0, the tokenizer's <|endoftext|>, so both bridges put the same bos first
GEOMETRY = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=4096, n_positions=48, n_inner=100,
                bos_token_id=0, eos_token_id=0)
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tl-gpt2"))
    make_hf_checkpoint(path, seed=7, tokenizer_dir=cyformer.loader.default_model_path(), **GEOMETRY)
    return path


@pytest.fixture(scope="module")
def models(checkpoint):
    """(cyformer's bridge, TransformerLens's bridge), both in compatibility mode."""
    torch.set_grad_enabled(False)
    theirs = TheirBridge.boot_transformers(checkpoint, device="cpu")
    theirs.enable_compatibility_mode(disable_warnings=True)
    ours = TransformerBridge.boot_transformers(checkpoint, device="cpu", threads=1)
    ours.enable_compatibility_mode(disable_warnings=True)
    yield ours, theirs
    torch.set_grad_enabled(True)


def numpy(x):
    if isinstance(x, (list, tuple)):
        return np.stack([numpy(v) for v in x])
    return x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)


def both(models, analysis, *args):
    """analysis(model, tokens..., ...) on both models -> (cyformer's, TransformerLens's)."""
    return [analysis(model, *[torch.as_tensor(a) if isinstance(a, np.ndarray) else a for a in args])
            for model in models]


# -- the analyses: TransformerLens code, written once ------------------------

def induction_scores(model, tokens):
    """Mean attention of each head from a token in the repeat to the token
    after its previous occurrence: [n_layers, n_heads]."""
    seq_len = (tokens.shape[-1] - 1) // 2
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("pattern"))
    scores = []
    for layer in range(model.cfg.n_layers):
        pattern = cache["pattern", layer]                      # [batch, head, query, key]
        stripe = pattern.diagonal(1 - seq_len, -2, -1)         # key = query - seq_len + 1
        scores.append(stripe[..., 1:].mean(-1).mean(0))
    return scores


def patch_resid(model, clean, corrupt, answer, wrong):
    """Logit difference after patching the clean residual stream into the
    corrupted run, for every layer and position: [n_layers, pos]."""
    _, clean_cache = model.run_with_cache(clean)
    results = []
    for layer in range(model.cfg.n_layers):
        row = []
        for pos in range(clean.shape[-1]):
            def patch(resid, hook):
                resid[:, pos] = clean_cache[hook.name][:, pos]
                return resid
            logits = model.run_with_hooks(corrupt, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", patch)])
            row.append(float((logits[:, -1, answer] - logits[:, -1, wrong]).mean()))
        results.append(row)
    return results


def patch_heads(model, clean, corrupt, answer, wrong):
    """Logit difference after patching each head's clean output (hook_z) into
    the corrupted run: [n_layers, n_heads]."""
    _, clean_cache = model.run_with_cache(clean)
    results = []
    for layer in range(model.cfg.n_layers):
        row = []
        for head in range(model.cfg.n_heads):
            def patch(z, hook):
                z[:, :, head] = clean_cache[hook.name][:, :, head]
            logits = model.run_with_hooks(corrupt, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", patch)])
            row.append(float((logits[:, -1, answer] - logits[:, -1, wrong]).mean()))
        results.append(row)
    return results


def head_logit_attribution(model, tokens, answer):
    """Direct logit attribution of the answer at the last position, per head."""
    _, cache = model.run_with_cache(tokens)
    per_head, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    return cache.logit_attrs(per_head, answer, pos_slice=-1), labels


def component_logit_attribution(model, tokens, answer, wrong):
    """Logit-difference attribution of embeddings, attention and MLP layers,
    and the decomposition's sum against the final residual stream."""
    _, cache = model.run_with_cache(tokens)
    parts, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    attrs = cache.logit_attrs(parts, answer, incorrect_tokens=wrong, pos_slice=-1)
    gap = (parts.sum(0) - cache["resid_post", -1][:, -1]).abs().max()
    scaled = cache.apply_ln_to_stack(parts, layer=-1, pos_slice=-1)
    return attrs, labels, scaled, gap


def ablate_head(model, tokens, layer, head):
    """Next-token loss with one head zero-ablated through a hook added on the
    module's hook point, and without."""
    def hook(z, hook):
        z[:, :, head] = 0
    model.blocks[layer].attn.hook_z.add_hook(hook)
    try:
        ablated = model(tokens, return_type="loss")
    finally:
        model.reset_hooks()
    return ablated.item(), model(tokens, return_type="loss").item()


def per_token_loss(model, tokens):
    """loss_fn per token of the forward's logits, and the mean loss."""
    logits = model(tokens)
    return model.loss_fn(logits, tokens, per_token=True), model(tokens, return_type="loss").item()


def greedy(model, tokens, n):
    """TransformerLens's generate, greedy: prompt and continuation."""
    kv = {} if isinstance(model, TransformerBridge) else {"use_past_kv_cache": False}
    return model.generate(tokens, max_new_tokens=n, do_sample=False, verbose=False, **kv)


def logit_lens(model, tokens):
    """Accumulated residual stream through the final norm and W_U."""
    _, cache = model.run_with_cache(tokens)
    resid, labels = cache.accumulated_resid(apply_ln=True, pos_slice=-1, return_labels=True)
    return resid @ model.W_U, labels


# -- the comparisons ---------------------------------------------------------

V = GEOMETRY["vocab_size"]


def repeated_tokens(vocab, seq_len, batch, seed):
    rng = np.random.default_rng(seed)
    half = rng.integers(1, vocab, size=(batch, seq_len))
    return np.concatenate([np.zeros((batch, 1), dtype=np.int64), half, half], axis=1)


def test_induction_scores_agree(models):
    ours, theirs = both(models, induction_scores, repeated_tokens(V, 10, 3, 0))
    assert numpy(ours).shape == (GEOMETRY["n_layer"], GEOMETRY["n_head"])
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=TOL)


def prompts():
    rng = np.random.default_rng(1)
    clean = rng.integers(0, V, size=(2, 7))
    corrupt = clean.copy()
    corrupt[:, 2] = (clean[:, 2] + 5) % V
    return clean, corrupt


def test_residual_stream_patching_agrees(models):
    clean, corrupt = prompts()
    ours, theirs = both(models, patch_resid, clean, corrupt, 3, 11)
    np.testing.assert_allclose(ours, theirs, atol=TOL)
    ours = np.array(ours)  # patching the clean stream at the changed position restores the clean run
    assert not np.allclose(ours[:, 2], ours[:, 0])


def test_head_output_patching_agrees(models):
    clean, corrupt = prompts()
    ours, theirs = both(models, patch_heads, clean, corrupt, 3, 11)
    np.testing.assert_allclose(ours, theirs, atol=TOL)


def test_direct_logit_attribution_by_head_agrees(models):
    tokens = np.random.default_rng(2).integers(0, V, size=(2, 9))
    (ours, our_labels), (theirs, their_labels) = both(models, head_logit_attribution, tokens, 5)
    assert our_labels == their_labels
    assert numpy(ours).shape == (GEOMETRY["n_layer"] * GEOMETRY["n_head"], 2)
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=TOL)


def test_decompose_resid_attribution_agrees(models):
    tokens = np.random.default_rng(3).integers(0, V, size=(2, 9))
    ours, theirs = both(models, component_logit_attribution, tokens, 5, 8)
    assert ours[1] == theirs[1]
    np.testing.assert_allclose(numpy(ours[0]), numpy(theirs[0]), atol=TOL)
    np.testing.assert_allclose(numpy(ours[2]), numpy(theirs[2]), atol=TOL)
    assert float(ours[3]) < 1e-5  # the parts sum to the stream


def test_head_ablation_through_a_module_hook_agrees(models):
    tokens = np.random.default_rng(4).integers(0, V, size=(2, 12))
    ours, theirs = both(models, ablate_head, tokens, 1, 2)
    np.testing.assert_allclose(ours, theirs, atol=TOL)
    assert ours[0] != ours[1]


def test_loss_agrees(models):
    tokens = np.random.default_rng(13).integers(0, V, size=(3, 10))
    (ours, our_mean), (theirs, their_mean) = both(models, per_token_loss, tokens)
    assert isinstance(ours, torch.Tensor) and ours.shape == (3, 9)
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=TOL)
    assert abs(our_mean - their_mean) < TOL
    text = "def add(a, b):\n    return a + b"
    ours, theirs = (m(text, return_type="loss") for m in models)
    assert isinstance(ours, torch.Tensor) and ours.ndim == 0 and abs(ours.item() - theirs.item()) < TOL


def test_logit_lens_agrees(models):
    tokens = np.random.default_rng(5).integers(0, V, size=(1, 8))
    (ours, labels), (theirs, their_labels) = both(models, logit_lens, tokens)
    assert labels == their_labels
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=TOL)


def test_greedy_generation_agrees(models):
    """generate returns prompt and continuation: ids with the bos, or text
    without it.  TransformerLens 4.3's KV-cached loop drifts from its own
    forward pass, so its reference here is the loop without the cache."""
    ours, theirs = models
    tokens = ours.to_tokens("def f(x):")
    out, want = both(models, greedy, numpy(tokens), 6)
    assert out.shape == (1, tokens.shape[1] + 6)
    np.testing.assert_array_equal(numpy(out), numpy(want))
    text = ours.generate("def f(x):", max_new_tokens=6, do_sample=False, verbose=False)
    assert text == ours.to_string(out[0, 1:]) and text.startswith("def f(x):")


def test_tokens_follow_transformer_lens(models):
    ours, theirs = models
    for text in ("def add(a, b):", ["x = 1", "for i in range(10): pass"]):
        for bos in (None, True, False):
            np.testing.assert_array_equal(numpy(ours.to_tokens(text, prepend_bos=bos)),
                                          numpy(theirs.to_tokens(text, prepend_bos=bos)))
            assert ours.to_str_tokens(text, prepend_bos=bos) == theirs.to_str_tokens(text, prepend_bos=bos)
    tokens = theirs.to_tokens("import os")
    assert ours.to_string(tokens[0]) == theirs.to_string(tokens[0]) and ours.to_string(7) == theirs.to_string(7)
    assert ours.to_str_tokens(tokens) == theirs.to_str_tokens(tokens)
    assert ours.to_single_token(" add") == theirs.to_single_token(" add")
    for options in ({}, dict(mode="last", prepend_bos=False)):
        assert (ours.get_token_position(" add", "def add(a): add", **options)
                == theirs.get_token_position(" add", "def add(a): add", **options))


def test_every_hook_point_agrees(models):
    """Every name the bridge caches, its aliases (hook_in/hook_out, q.hook_out,
    ...) included, holds the bridge's activation; hook_normalized is taken
    before gain and bias as TransformerLens 3.9 and 4.x do."""
    ours, theirs = models
    tokens = torch.as_tensor(np.random.default_rng(6).integers(0, V, size=(2, 10)))
    _, their_cache = theirs.run_with_cache(tokens)
    logits, cache = ours.run_with_cache(tokens)
    missing = set(their_cache.keys()) - set(cache.keys())
    assert missing <= {f"blocks.{i}.attn.qkv.hook_{e}" for i in range(3) for e in ("in", "out")}, missing
    for name in their_cache.keys():
        if name in cache:
            np.testing.assert_allclose(numpy(cache[name]), numpy(their_cache[name]), atol=TOL, err_msg=name)
    np.testing.assert_array_equal(numpy(logits), numpy(ours(tokens)))  # recording changes nothing


def test_split_inputs_steer_the_pass(models):
    """An edit of one head's query input changes what TransformerLens's does."""
    ours, _ = models
    tokens = np.random.default_rng(8).integers(0, V, size=(2, 6))

    def edit(x, hook):
        x[:, :, 1, :5] += 1.0  # not a scaling or a shift: the norm would undo those

    out = []
    for model in models:
        model.set_use_split_qkv_input(True)
        try:
            for point in ("hook_q_input", "hook_k_input", "hook_v_input"):
                out.append(numpy(model.run_with_hooks(torch.as_tensor(tokens),
                                                      fwd_hooks=[(f"blocks.1.{point}", edit)])))
        finally:
            model.set_use_split_qkv_input(False)
    for a, b in zip(out[:3], out[3:]):
        np.testing.assert_allclose(a, b, atol=TOL)
    assert not np.allclose(out[0], numpy(ours(torch.as_tensor(tokens))), atol=1e-3)


def test_weights_circuits_and_config_match(models):
    ours, theirs = models
    for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_out",
                 "b_out", "W_E", "W_pos", "W_U", "b_U"):
        np.testing.assert_allclose(numpy(getattr(ours, name)), numpy(getattr(theirs, name)), atol=1e-6,
                                   err_msg=name)
    np.testing.assert_allclose(numpy(ours.blocks[1].attn.W_Q), numpy(theirs.blocks[1].attn.W_Q), atol=1e-6)
    np.testing.assert_allclose(numpy(ours.unembed.b_U), numpy(theirs.unembed.b_U), atol=1e-6)
    for circuit in ("QK", "OV"):
        a, b = getattr(ours, circuit), getattr(theirs, circuit)
        assert tuple(a.shape) == tuple(b.shape) == (3, 4, 64, 64)
        np.testing.assert_allclose(numpy(a[1, 2].AB), numpy(b[1, 2].AB), atol=1e-5)
        ev_a, ev_b = numpy(a.eigenvalues), numpy(b.eigenvalues)  # [L, H, d_head], complex
        key = lambda e: np.sort_complex(np.round(e, 4))  # noqa: E731  eig's order is its own
        np.testing.assert_allclose(np.apply_along_axis(key, -1, ev_a), np.apply_along_axis(key, -1, ev_b), atol=2e-4)
        np.testing.assert_allclose(numpy(a.S), numpy(b.S), atol=1e-4)
        np.testing.assert_allclose(numpy(a.norm()), numpy(b.norm()), atol=1e-4)
        U, S, Vm = a[0, 0].svd()
        np.testing.assert_allclose(numpy(U @ torch.diag(S) @ Vm.T), numpy(a[0, 0].AB), atol=1e-5)
    full = ours.embed.W_E @ ours.OV @ ours.unembed.W_U  # the Main Demo's full OV circuit
    np.testing.assert_allclose(numpy(full.eigenvalues.abs().sum(-1)),
                               numpy((theirs.embed.W_E @ theirs.OV @ theirs.unembed.W_U).eigenvalues.abs().sum(-1)),
                               rtol=1e-3)
    for field in ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "n_ctx", "d_vocab", "act_fn",
                  "positional_embedding_type", "eps", "n_key_value_heads", "default_prepend_bos"):
        assert getattr(ours.cfg, field) == getattr(theirs.cfg, field), field


def test_transformer_lens_utilities_run_on_cyformer(models, capsys):
    """TransformerLens's own helpers, called on cyformer's bridge."""
    ours, theirs = models
    assert utils.get_act_name("in", 1) == "blocks.1.hook_in" and "blocks.1.hook_in" in ours.hook_dict
    printed = []
    for model in models:
        utils.test_prompt("def add(a, b):\n    return", " a", model, prepend_bos=True)
        printed.append(capsys.readouterr().out)
    assert "Top 0th token" in printed[0] and printed[0] == printed[1]
    assert utils.to_numpy(ours.W_E).shape == (V, 64)


def test_tensors_are_views_and_hooks_steer_in_place(models):
    ours, _ = models
    tokens = torch.as_tensor(np.random.default_rng(9).integers(0, V, size=(1, 5)))
    logits, cache = ours.run_with_cache(tokens)
    assert isinstance(logits, torch.Tensor) and isinstance(cache["pattern", 0], torch.Tensor)
    z = cache["z", 1]
    assert z.data_ptr() == cache["blocks.1.attn.hook_z"].data_ptr()  # one buffer, no copy per access
    seen = []

    def edit(x, hook):
        seen.append(type(x))
        x[:, :, 0] = 0.0  # in place, returns nothing

    def replace(x, hook):
        y = x.clone()
        y[:, :, 0] = 0.0
        return y

    a = ours.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", edit)])
    b = ours.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", replace)])
    assert seen == [torch.Tensor]
    np.testing.assert_array_equal(numpy(a), numpy(b))
    assert not np.allclose(numpy(a), numpy(logits))
    with pytest.raises(TorchRequired, match="requires grad"):
        with torch.enable_grad():
            ours.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z",
                                                    lambda x, hook: x.clone().requires_grad_())])


def test_numpy_surface_gives_the_same_numbers(models):
    """HookedTransformer(model) hands out NumPy arrays over the same pass."""
    ours, _ = models
    lens = HookedTransformer(ours.model)
    tokens = repeated_tokens(V, 8, 2, 3)
    a, b = induction_scores(lens, tokens), induction_scores(ours, torch.as_tensor(tokens))
    assert isinstance(a[0], np.ndarray)
    np.testing.assert_allclose(numpy(a), numpy(b), atol=1e-6)
    logits, cache = lens.run_with_cache(tokens)
    assert isinstance(logits, np.ndarray) and isinstance(cache["blocks.0.hook_in"], np.ndarray)


def test_hook_normalized_options(models):
    """Before gain and bias by default; set_ln_normalized("after_gain") gives 2.x's."""
    ours, theirs = models
    plain = HookedTransformer(cyformer.load(ours.model.path, threads=1), tensors="torch")
    tokens = torch.as_tensor(np.random.default_rng(14).integers(0, V, size=(1, 6)))
    _, before = plain.run_with_cache(tokens)
    plain.set_ln_normalized("after_gain")
    _, after = plain.run_with_cache(tokens)
    w = plain.model.weights.blocks[0].ln_1
    x = numpy(before["blocks.0.ln1.hook_normalized"])
    np.testing.assert_allclose(numpy(after["blocks.0.ln1.hook_normalized"]), x * w.weight + w.bias, atol=1e-5)
    assert "blocks.0.ln1.hook_out" in after and "blocks.0.ln1.hook_out" not in before


def test_cache_shorthand_and_batch_axis(models):
    ours, _ = models
    tokens = torch.as_tensor(np.random.default_rng(9).integers(0, V, size=(1, 5)))
    _, cache = ours.run_with_cache(tokens)
    for short, full in ((("pattern", 0), "blocks.0.attn.hook_pattern"), (("resid_post", -1), "blocks.2.hook_resid_post"),
                        ("k1", "blocks.1.attn.hook_k"), ("scale", "ln_final.hook_scale"),
                        (("normalized", 1, "ln2"), "blocks.1.ln2.hook_normalized")):
        assert cache[short].data_ptr() == cache[full].data_ptr()
    assert cache["pattern", 0].shape == (1, 4, 5, 5)
    cache.remove_batch_dim()
    assert cache["pattern", 0].shape == (4, 5, 5) and not cache.has_batch_dim
    _, cache = ours.run_with_cache(tokens, remove_batch_dim=True, stop_at_layer=1,
                                   names_filter=["blocks.0.attn.hook_pattern"])
    assert list(cache.keys()) == ["blocks.0.attn.hook_pattern"] and cache["pattern", 0].shape == (4, 5, 5)
    with pytest.raises(ValueError, match="batch holds 2"):
        ours.run_with_cache(tokens.repeat(2, 1))[1].remove_batch_dim()


def test_add_hook_reset_hooks_and_context(models):
    ours, _ = models
    tokens = torch.as_tensor(np.random.default_rng(11).integers(0, V, size=(2, 6)))
    plain = numpy(ours(tokens)).copy()

    def zero(z, hook):
        z[:] = 0

    ours.add_hook("blocks.0.attn.hook_z", zero)
    try:
        hooked = numpy(ours(tokens)).copy()
        assert not np.allclose(hooked, plain)
    finally:
        ours.reset_hooks()
    np.testing.assert_array_equal(numpy(ours(tokens)), plain)
    with ours.hooks(fwd_hooks=[("blocks.0.attn.o.hook_in", zero)]):  # the bridge's name of hook_z
        np.testing.assert_array_equal(numpy(ours(tokens)), hooked)
    np.testing.assert_array_equal(numpy(ours(tokens)), plain)
    ours.add_hook(lambda name: name.endswith("hook_z"), zero, is_permanent=True)
    ours.reset_hooks()
    assert not np.allclose(numpy(ours(tokens)), plain)
    ours.reset_hooks(including_permanent=True)
    np.testing.assert_array_equal(numpy(ours(tokens)), plain)


def test_torch_only_features_say_so(models):
    ours, _ = models
    tokens = torch.zeros((1, 3), dtype=torch.int64)
    with pytest.raises(TorchRequired, match="gradients"):
        ours.run_with_cache(tokens, incl_bwd=True)
    with pytest.raises(TorchRequired, match="backward"):
        ours.add_hook("hook_embed", lambda x, hook: None, dir="bwd")
    with pytest.raises(TorchRequired, match="CPU"):
        ours.to("cuda")


def test_the_model_keeps_its_own_surface(models):
    ours, _ = models
    model = ours.model
    assert not isinstance(model, HookedTransformer)
    with pytest.raises(AttributeError, match=r"cyformer\.tl\.HookedTransformer\(model\)"):
        model.to_tokens("x")
    with pytest.raises(TypeError, match="return_type"):
        model([1, 2, 3], return_type="loss")


# -- weight processing (fold_ln, center_writing_weights, center_unembed, fold_value_biases) --
PROCESSING = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
WEIGHT_NAMES = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_out", "b_out",
                "W_E", "W_pos", "W_U", "b_U")


@pytest.mark.parametrize("flags", [dict.fromkeys(PROCESSING, True), dict(fold_ln=True),
                                   dict(center_writing_weights=True, center_unembed=True),
                                   dict(fold_value_biases=True, center_unembed=True)],
                         ids=["all", "fold_ln", "centring", "value-biases"])
def test_weight_processing_equals_transformer_lens(checkpoint, flags):
    """The processed weights are those of TransformerLens's bridge in
    compatibility mode with the same options, the logits agree with its, and
    the log-probabilities are the unprocessed model's."""
    flags = {name: flags.get(name, False) for name in PROCESSING}
    torch.set_grad_enabled(False)
    try:
        theirs = TheirBridge.boot_transformers(checkpoint, device="cpu")
        theirs.enable_compatibility_mode(disable_warnings=True, **flags)
        plain = cyformer.load(checkpoint, threads=1)
        ours = HookedTransformer(cyformer.load(checkpoint, threads=1, **flags), tensors="torch")
        assert ours.model.processing == dict(flags, refactor_factored_attn_matrices=False)
        for name in WEIGHT_NAMES:
            np.testing.assert_allclose(numpy(getattr(ours, name)), numpy(getattr(theirs, name)), atol=1e-6,
                                       err_msg=name)
        ids = np.random.default_rng(0).integers(0, V, (1, 24))
        logits = numpy(ours(torch.as_tensor(ids)))[0]
        np.testing.assert_allclose(logits, numpy(theirs(torch.as_tensor(ids)))[0], atol=TOL)
    finally:
        torch.set_grad_enabled(True)

    def log_probs(x):
        x = x.astype(np.float64)
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_probs(logits), log_probs(plain.forward(ids[0])), atol=1e-5)


def _same_up_to_signs(ours, theirs, left, right, name):
    """Per head, ours[left] and ours[right] are theirs' with each singular
    component's sign flipped in both factors or in neither: SVD leaves that
    sign free, and numpy's LAPACK and torch's choose differently.
    left [L, H, m, k] (its columns are the components), right W_K [L, H, n, k]
    or W_O [L, H, k, n].  Returns the signs [L, H, 1, k]."""
    a, b = numpy(getattr(ours, left)), numpy(getattr(theirs, left))
    sign = np.where((a * b).sum(-2, keepdims=True) < 0, -1.0, 1.0)          # [L, H, 1, k]
    np.testing.assert_allclose(a * sign, b, atol=TOL, err_msg=f"{name}: {left}")
    np.testing.assert_allclose(numpy(getattr(ours, right)) * (sign if right == "W_K" else sign.swapaxes(-1, -2)),
                               numpy(getattr(theirs, right)),
                               atol=TOL, err_msg=f"{name}: {right}")
    return sign


@pytest.mark.parametrize("entry", ["bridge", "load"])
def test_refactor_factored_attn_matrices_equals_transformer_lens(checkpoint, entry):
    """W_Q W_K^T and W_V W_O refactored as TransformerLens's bridge does (after
    the default processing through cyformer's bridge; alone through
    cyformer.load, where b_V moves into b_O): the same weights and biases up
    to SVD's signs, the same logits, and the logits of the model without
    the refactor (it is an identity of the function)."""
    flags = dict.fromkeys(PROCESSING, entry == "bridge")
    torch.set_grad_enabled(False)
    try:
        theirs = TheirBridge.boot_transformers(checkpoint, device="cpu")
        theirs.enable_compatibility_mode(disable_warnings=True, refactor_factored_attn_matrices=True, **flags)
        if entry == "bridge":
            ours = TransformerBridge.boot_transformers(checkpoint, device="cpu", threads=1)
            ours.enable_compatibility_mode(disable_warnings=True, refactor_factored_attn_matrices=True)
        else:
            ours = HookedTransformer(cyformer.load(checkpoint, threads=1, refactor_factored_attn_matrices=True),
                                     tensors="torch")
        assert ours.model.processing == dict(flags, refactor_factored_attn_matrices=True)
        before = HookedTransformer(cyformer.load(checkpoint, threads=1, **flags), tensors="torch")
        assert np.abs(numpy(before.b_V)).max() > 0 or entry == "bridge"
        b_sign = _same_up_to_signs(ours, theirs, "W_Q", "W_K", entry)[:, :, 0]      # [L, H, k]
        np.testing.assert_allclose(numpy(ours.b_Q) * b_sign, numpy(theirs.b_Q), atol=TOL, err_msg="b_Q")
        np.testing.assert_allclose(numpy(ours.b_K) * b_sign, numpy(theirs.b_K), atol=TOL, err_msg="b_K")
        _same_up_to_signs(ours, theirs, "W_V", "W_O", entry)
        for name in ("b_V", "b_O"):
            np.testing.assert_allclose(numpy(getattr(ours, name)), numpy(getattr(theirs, name)), atol=TOL,
                                       err_msg=name)
        assert not numpy(ours.b_V).any()
        # the factorisations are "even": W_O's rows orthonormal, W_Q and W_K columns of equal norms
        W_O = numpy(ours.W_O)
        np.testing.assert_allclose(W_O @ W_O.swapaxes(-1, -2) - np.eye(W_O.shape[-2]), 0, atol=1e-5)
        q = np.concatenate([numpy(ours.W_Q), numpy(ours.b_Q)[:, :, None]], axis=2)
        k = np.concatenate([numpy(ours.W_K), numpy(ours.b_K)[:, :, None]], axis=2)
        np.testing.assert_allclose((q * q).sum(2), (k * k).sum(2), rtol=1e-4)
        assert np.abs(numpy(ours.W_Q) - numpy(before.W_Q)).max() > 0.1      # it did rewrite them
        ids = torch.as_tensor(np.random.default_rng(0).integers(0, V, (1, 24)))
        logits = numpy(ours(ids))
        np.testing.assert_allclose(logits, numpy(theirs(ids)), atol=TOL)
        np.testing.assert_allclose(logits, numpy(before(ids)), atol=1e-5)
    finally:
        torch.set_grad_enabled(True)


def test_processed_model_on_every_path(checkpoint, tmp_path):
    """b_U and the folded norms reach the fused decode step, the numpy and
    naive backends, the hooked path and the logit lens; pickling keeps the
    processing; saving refuses it."""
    import pickle

    from cyformer.errors import CyformerError
    from cyformer.interp import logit_lens

    path = checkpoint
    ours = cyformer.load(path, threads=2, fold_ln=True, center_writing_weights=True, center_unembed=True,
                         fold_value_biases=True)
    lens = HookedTransformer(ours)
    assert np.abs(lens.b_U).max() > 0  # fold_ln made an unembedding bias
    ids = np.random.default_rng(5).integers(0, V, 12)
    want = ours.forward(ids)
    for backend in ("numpy", "naive"):
        other = cyformer.load(path, backend=backend, fold_ln=True, center_writing_weights=True,
                              center_unembed=True, fold_value_biases=True)
        np.testing.assert_allclose(other.forward(ids[:6] if backend == "naive" else ids),
                                   want[:6] if backend == "naive" else want, atol=TOL)
    logits, cache = ours.run_with_cache(ids)
    np.testing.assert_allclose(logits, want, atol=1e-5)
    np.testing.assert_allclose(cache["ln_final.hook_normalized"] @ lens.W_U + lens.b_U, want, atol=1e-4)
    # greedy decoding (the fused step, with b_U) follows the forward's argmax
    gen = ours.generate(list(ids[:5]), max_new_tokens=6, temperature=0)
    seq = list(ids[:5])
    for _ in range(6):
        seq.append(int(np.argmax(ours.forward(np.array(seq))[-1])))
    assert list(gen) == seq[5:]
    lens_view = logit_lens(ours, ids)
    assert lens_view.top_ids[-1, -1, 0] == int(np.argmax(want[-1]))
    again = pickle.loads(pickle.dumps(ours))
    assert again.processing == ours.processing
    np.testing.assert_array_equal(again.forward(ids), want)
    with pytest.raises(CyformerError, match="processed for analysis"):
        ours.save(tmp_path / "processed")


def test_weight_processing_refuses_what_it_cannot_do(checkpoint, tmp_path):
    import dataclasses

    from cyformer.processing import check_refactor, process_weights
    from helpers import make_hf_llama

    path = checkpoint
    with pytest.raises(TypeError, match="fold_ln must be True or False"):
        cyformer.load(path, fold_ln="yes")
    with pytest.raises(ValueError, match="dtype='int8'"):
        cyformer.load(path, dtype="int8", fold_ln=True)
    with pytest.raises(ValueError, match="float32"):
        process_weights(cyformer.load(path, dtype="bfloat16"))
    with pytest.raises(ValueError, match="already processed"):
        process_weights(cyformer.load(path, fold_ln=True))
    # RMSNorm: the gain folds, nothing is centred
    lpath = str(tmp_path / "llama")
    make_hf_llama(lpath, "llama", seed=1, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=61, max_position_embeddings=32)
    with pytest.raises(ValueError, match="center_writing_weights needs LayerNorm"):
        cyformer.load(lpath, center_writing_weights=True)
    # the refactor: learned positions and one key/value head per query head only
    with pytest.raises(ValueError, match="refactor_factored_attn_matrices needs learned positions"):
        cyformer.load(lpath, refactor_factored_attn_matrices=True)
    with pytest.raises(ValueError, match="refactor_factored_attn_matrices needs learned positions"):
        TransformerBridge(cyformer.load(lpath)).enable_compatibility_mode(fold_ln=False,
                                                                          refactor_factored_attn_matrices=True)
    gpt2 = cyformer.load(path).config
    with pytest.raises(ValueError, match="4 query heads sharing 2 key/value heads"):
        check_refactor(dataclasses.replace(gpt2, n_kv_head=2), "process_weights")
    with pytest.raises(ValueError, match="needs attention biases"):
        check_refactor(dataclasses.replace(gpt2, qkv_bias=False), "process_weights")
    with pytest.raises(TypeError, match="refactor_factored_attn_matrices must be True or False"):
        cyformer.load(path, refactor_factored_attn_matrices=1)
    plain, folded = cyformer.load(lpath), cyformer.load(lpath, fold_ln=True, fold_value_biases=True)
    ids = np.arange(1, 20)
    np.testing.assert_allclose(folded.forward(ids), plain.forward(ids), atol=1e-4)
    assert np.all(folded.weights.ln_f.weight == 1) and folded.weights.lm_head_bias is None
