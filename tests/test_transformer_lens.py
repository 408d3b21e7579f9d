"""TransformerLens-style analyses, written once, run on cyformer and on
TransformerLens's HookedTransformer with the same random GPT-2 weights.

The analysis functions below take the model and never look at which one it
is: their text is what one would write for TransformerLens.  TransformerLens
hands them torch tensors, cyformer NumPy arrays; the results must agree to
1e-4.  The HookedTransformer is built from a config and the weights of a
random Hugging Face checkpoint made here (never from the Hub).
"""

import numpy as np
import pytest

import cyformer
from cyformer.errors import TorchRequired
from helpers import make_hf_checkpoint

torch = pytest.importorskip("torch")
tl = pytest.importorskip("transformer_lens")
from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402
from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights  # noqa: E402

GEOMETRY = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=97, n_positions=48, n_inner=100)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(cyformer model, HookedTransformer) with the same weights."""
    path = str(tmp_path_factory.mktemp("tl-gpt2"))
    hf = make_hf_checkpoint(path, seed=7, **GEOMETRY)
    g = GEOMETRY
    cfg = HookedTransformerConfig(
        n_layers=g["n_layer"], d_model=g["n_embd"], n_heads=g["n_head"], d_head=g["n_embd"] // g["n_head"],
        d_mlp=g["n_inner"], n_ctx=g["n_positions"], d_vocab=g["vocab_size"], act_fn="gelu_new",
        normalization_type="LN", eps=1e-5, positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel", default_prepend_bos=False)
    lens = HookedTransformer(cfg)
    lens.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    lens.eval()
    torch.set_grad_enabled(False)
    yield cyformer.load(path, threads=1), lens
    torch.set_grad_enabled(True)


def tokens_for(model, ids):
    """The token type each model takes (its only difference the analyses see)."""
    return torch.as_tensor(ids) if isinstance(model, HookedTransformer) else np.asarray(ids)


def numpy(x):
    if isinstance(x, (list, tuple)):
        return np.stack([numpy(v) for v in x])
    return x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)


def both(models, analysis, *args):
    """analysis(model, tokens..., ...) on both models -> (cyformer's, TransformerLens's) as NumPy."""
    out = []
    for model in models:
        conv = [tokens_for(model, a) if isinstance(a, np.ndarray) else a for a in args]
        out.append(analysis(model, *conv))
    return out


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
    gap = (parts.sum(0) - cache["resid_post", -1][:, -1]).abs().max() if hasattr(parts, "abs") else None
    scaled = cache.apply_ln_to_stack(parts, layer=-1, pos_slice=-1)
    return attrs, labels, scaled, gap


def ablate_head(model, tokens, layer, head):
    """Next-token loss with one head zero-ablated, and without."""
    def hook(z, hook):
        z[:, :, head] = 0
    ablated = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(f"blocks.{layer}.attn.hook_z", hook)])
    return float(ablated), float(model(tokens, return_type="loss"))


def logit_lens(model, tokens):
    """Accumulated residual stream through the final norm and W_U."""
    _, cache = model.run_with_cache(tokens)
    resid, labels = cache.accumulated_resid(apply_ln=True, pos_slice=-1, return_labels=True)
    return resid @ model.W_U, labels


# -- the comparisons ---------------------------------------------------------

def repeated_tokens(vocab, seq_len, batch, seed):
    rng = np.random.default_rng(seed)
    half = rng.integers(1, vocab, size=(batch, seq_len))
    return np.concatenate([np.zeros((batch, 1), dtype=np.int64), half, half], axis=1)


def test_induction_scores_agree(models):
    ours, theirs = both(models, induction_scores, repeated_tokens(GEOMETRY["vocab_size"], 10, 3, 0))
    assert numpy(ours).shape == (GEOMETRY["n_layer"], GEOMETRY["n_head"])
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=TOL)


def prompts():
    rng = np.random.default_rng(1)
    clean = rng.integers(0, GEOMETRY["vocab_size"], size=(2, 7))
    corrupt = clean.copy()
    corrupt[:, 2] = (clean[:, 2] + 5) % GEOMETRY["vocab_size"]
    return clean, corrupt


def test_residual_stream_patching_agrees(models):
    clean, corrupt = prompts()
    ours, theirs = both(models, patch_resid, clean, corrupt, 3, 11)
    np.testing.assert_allclose(ours, theirs, atol=TOL)
    # patching the whole clean stream at a layer gives the clean answer from there on
    ours = np.array(ours)
    assert not np.allclose(ours[:, 2], ours[:, 0])


def test_head_output_patching_agrees(models):
    clean, corrupt = prompts()
    ours, theirs = both(models, patch_heads, clean, corrupt, 3, 11)
    np.testing.assert_allclose(ours, theirs, atol=TOL)


def test_direct_logit_attribution_by_head_agrees(models):
    tokens = np.random.default_rng(2).integers(0, GEOMETRY["vocab_size"], size=(2, 9))
    (ours, our_labels), (theirs, their_labels) = both(models, head_logit_attribution, tokens, 5)
    assert our_labels == their_labels
    assert numpy(ours).shape == (GEOMETRY["n_layer"] * GEOMETRY["n_head"], 2)
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=TOL)


def test_decompose_resid_attribution_agrees(models):
    tokens = np.random.default_rng(3).integers(0, GEOMETRY["vocab_size"], size=(2, 9))
    ours, theirs = both(models, component_logit_attribution, tokens, 5, 8)
    assert ours[1] == theirs[1]
    np.testing.assert_allclose(numpy(ours[0]), numpy(theirs[0]), atol=TOL)
    np.testing.assert_allclose(numpy(ours[2]), numpy(theirs[2]), atol=TOL)
    _, cache = models[0].run_with_cache(tokens)
    parts = cache.decompose_resid(layer=-1, pos_slice=-1)
    np.testing.assert_allclose(parts.sum(0), cache["resid_post", -1][:, -1], atol=1e-5)


def test_head_ablation_agrees(models):
    tokens = np.random.default_rng(4).integers(0, GEOMETRY["vocab_size"], size=(2, 12))
    ours, theirs = both(models, ablate_head, tokens, 1, 2)
    np.testing.assert_allclose(ours, theirs, atol=TOL)
    assert ours[0] != ours[1]


def test_logit_lens_agrees(models):
    tokens = np.random.default_rng(5).integers(0, GEOMETRY["vocab_size"], size=(1, 8))
    (ours, labels), (theirs, their_labels) = both(models, logit_lens, tokens)
    assert labels == their_labels
    np.testing.assert_allclose(numpy(ours), numpy(theirs), atol=TOL)


def all_flags(model):
    for setter in ("set_use_attn_result", "set_use_split_qkv_input", "set_use_hook_mlp_in"):
        getattr(model, setter)(True)


def test_every_hook_point_agrees(models):
    """Same names in the same order, and the same activations, with
    hook_normalized taken before gain and bias as TransformerLens 3.x does."""
    ours, lens = models
    all_flags(lens)
    ours.set_use_split_qkv_input(True)
    ours.set_use_hook_mlp_in(True)
    ours.set_ln_normalized("before_gain")
    try:
        tokens = np.random.default_rng(6).integers(0, GEOMETRY["vocab_size"], size=(2, 10))
        _, their_cache = lens.run_with_cache(torch.as_tensor(tokens))
        logits, cache = ours.run_with_cache(tokens)
        assert list(cache.keys()) == list(their_cache.keys())
        # TransformerLens's hook_dict also lists hook_attn_in, which it only calls with use_attn_in
        assert list(ours.hook_dict) == list(cache.keys())
        assert set(lens.hook_dict) - set(ours.hook_dict) == {f"blocks.{i}.hook_attn_in" for i in range(3)}
        for name in cache.keys():
            if ".ln1." in name:  # TransformerLens normalises each head's split input: [B, T, H, 1]
                continue
            np.testing.assert_allclose(cache[name], numpy(their_cache[name]), atol=TOL, err_msg=name)
        np.testing.assert_array_equal(logits, ours.forward(tokens))  # recording changes nothing
    finally:
        for setter in ("set_use_split_qkv_input", "set_use_hook_mlp_in"):
            getattr(lens, setter)(False)
            getattr(ours, setter)(False)
        ours.set_ln_normalized("after_gain")


def test_split_inputs_steer_the_pass(models):
    """An edit of one head's query input changes what TransformerLens's does."""
    ours, lens = models
    tokens = np.random.default_rng(8).integers(0, GEOMETRY["vocab_size"], size=(2, 6))

    def edit(x, hook):
        x[:, :, 1, :5] += 1.0  # not a scaling or a shift: the norm would undo those

    out = []
    for model in models:
        model.set_use_split_qkv_input(True)
        model.set_use_attn_in(False)
        try:
            for point in ("hook_q_input", "hook_k_input", "hook_v_input"):
                out.append(numpy(model.run_with_hooks(tokens_for(model, tokens),
                                                      fwd_hooks=[(f"blocks.1.{point}", edit)])))
        finally:
            model.set_use_split_qkv_input(False)
    for a, b in zip(out[:3], out[3:]):
        np.testing.assert_allclose(a, b, atol=TOL)
    assert not np.allclose(out[0], ours.forward(tokens), atol=1e-3)


def test_weights_and_config_match(models):
    ours, lens = models
    for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_out",
                 "b_out", "W_E", "W_pos", "W_U", "b_U"):
        np.testing.assert_allclose(getattr(ours, name), numpy(getattr(lens, name)), atol=1e-7, err_msg=name)
    np.testing.assert_allclose(ours.QK[1, 2].full(), numpy(lens.QK[1, 2].AB), atol=1e-5)
    np.testing.assert_allclose(ours.OV[2, 0].full(), numpy(lens.OV[2, 0].AB), atol=1e-5)
    for field in ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "n_ctx", "d_vocab", "act_fn",
                  "normalization_type", "positional_embedding_type", "eps", "n_key_value_heads"):
        assert getattr(ours.cfg, field) == getattr(lens.cfg, field), field


def test_cache_shorthand_and_batch_axis(models):
    ours, _ = models
    tokens = np.random.default_rng(9).integers(0, GEOMETRY["vocab_size"], size=(1, 5))
    _, cache = ours.run_with_cache(tokens)
    assert cache["pattern", 0] is cache["blocks.0.attn.hook_pattern"]
    assert cache["resid_post", -1] is cache["blocks.2.hook_resid_post"]
    assert cache["k1"] is cache["blocks.1.attn.hook_k"]
    assert cache["scale"] is cache["ln_final.hook_scale"]
    assert cache["normalized", 1, "ln2"] is cache["blocks.1.ln2.hook_normalized"]
    assert cache["pattern", 0].shape == (1, 4, 5, 5)
    cache.remove_batch_dim()
    assert cache["pattern", 0].shape == (4, 5, 5) and not cache.has_batch_dim
    _, cache = ours.run_with_cache(tokens, remove_batch_dim=True)
    assert cache["resid_pre", 0].shape == (5, 64)
    with pytest.raises(ValueError, match="batch holds 2"):
        ours.run_with_cache(np.repeat(tokens, 2, axis=0))[1].remove_batch_dim()


def test_hooks_see_the_batch_and_the_hook_point(models):
    ours, _ = models
    tokens = np.random.default_rng(10).integers(0, GEOMETRY["vocab_size"], size=(3, 6))
    seen = []

    def tl_style(x, hook):
        seen.append((hook.name, hook.layer(), x.shape))
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1

    def native(x, name):
        seen.append((name, x.shape))

    ours.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", tl_style), ("blocks.1.attn.hook_z", native)])
    assert seen == [("blocks.1.attn.hook_z", 1, (3, 6, 4, 16))] + [("blocks.1.attn.hook_z", (6, 4, 16))] * 3
    # the native and batched protocols give one answer
    ablate_tl = ours.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z * 0)])
    ablate_native = ours.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, name: z * 0)])
    np.testing.assert_array_equal(ablate_tl, ablate_native)


def test_add_hook_reset_hooks_and_context(models):
    ours, _ = models
    tokens = np.random.default_rng(11).integers(0, GEOMETRY["vocab_size"], size=(2, 6))
    plain = ours.forward(tokens)

    def zero(z, hook):
        z[:] = 0

    ours.add_hook("blocks.0.attn.hook_z", zero)
    try:
        hooked = ours(tokens)
        assert not np.allclose(hooked, plain)
    finally:
        ours.reset_hooks()
    np.testing.assert_array_equal(ours(tokens), plain)
    with ours.hooks(fwd_hooks=[("blocks.0.attn.hook_z", zero)]):
        np.testing.assert_array_equal(ours.forward(tokens), hooked)
    np.testing.assert_array_equal(ours.forward(tokens), plain)
    ours.add_hook(lambda name: name.endswith("hook_z"), zero, is_permanent=True)
    ours.reset_hooks()
    assert not np.allclose(ours.forward(tokens), plain)
    ours.reset_hooks(including_permanent=True)
    np.testing.assert_array_equal(ours.forward(tokens), plain)


def test_recording_the_optional_points_changes_nothing(models):
    ours, _ = models
    tokens = np.random.default_rng(12).integers(0, GEOMETRY["vocab_size"], size=(2, 7))
    plain = ours.forward(tokens)
    ours.set_use_attn_in(True)
    ours.set_use_hook_mlp_in(True)
    try:
        logits, cache = ours.run_with_cache(tokens)
        np.testing.assert_array_equal(logits, plain)
        assert cache["blocks.0.hook_attn_in"].shape == (2, 7, 4, 64)
        np.testing.assert_array_equal(cache["unembed.hook_out"], plain)
        np.testing.assert_array_equal(cache["unembed.hook_in"], cache["ln_final.hook_normalized"])
        def edit(x, hook):
            x[..., :5] += 1.0
        edited = ours.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mlp_in", edit)])
        assert not np.allclose(edited, plain, atol=1e-3)
    finally:
        ours.set_use_attn_in(False)
        ours.set_use_hook_mlp_in(False)
    with pytest.raises(ValueError, match="use_hook_mlp_in"):
        ours.run_with_cache(tokens, names_filter=["blocks.0.hook_mlp_in"])


def test_torch_only_features_say_so(models):
    ours, _ = models
    tokens = np.zeros((1, 3), dtype=np.int64)
    with pytest.raises(TorchRequired, match="gradients"):
        ours.run_with_cache(tokens, incl_bwd=True)
    with pytest.raises(TorchRequired, match="backward"):
        ours.add_hook("hook_embed", lambda x, hook: None, dir="bwd")
    with pytest.raises(TorchRequired, match="CPU"):
        ours.to("cuda")
    with pytest.raises(TorchRequired):
        ours.run_with_cache(tokens)[1].to("cuda")


# -- weight processing (fold_ln, center_writing_weights, center_unembed, fold_value_biases) --
PROCESSING = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
WEIGHT_NAMES = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_out", "b_out",
                "W_E", "W_pos", "W_U", "b_U")


def processed_lens(path, **flags):
    """HookedTransformer with the same weights, processed by TransformerLens."""
    from transformers import GPT2LMHeadModel

    g = GEOMETRY
    cfg = HookedTransformerConfig(
        n_layers=g["n_layer"], d_model=g["n_embd"], n_heads=g["n_head"], d_head=g["n_embd"] // g["n_head"],
        d_mlp=g["n_inner"], n_ctx=g["n_positions"], d_vocab=g["vocab_size"], act_fn="gelu_new",
        normalization_type="LNPre" if flags["fold_ln"] else "LN", eps=1e-5, positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel", default_prepend_bos=False)
    lens = HookedTransformer(cfg)
    lens.load_and_process_state_dict(convert_gpt2_weights(GPT2LMHeadModel.from_pretrained(path), cfg),
                                     refactor_factored_attn_matrices=False, **flags)
    return lens.eval()


@pytest.mark.parametrize("bits", range(16))
def test_weight_processing_equals_transformer_lens(models, bits):
    """Every combination of the four options: the processed weights are
    TransformerLens's, the logits agree with its processed model, and the
    log-probabilities are the unprocessed model's."""
    flags = {name: bool(bits >> i & 1) for i, name in enumerate(PROCESSING)}
    plain = models[0]
    ours = cyformer.load(plain.path, threads=1, **flags)
    lens = processed_lens(plain.path, **flags)
    assert ours.processing == flags
    for name in WEIGHT_NAMES:
        np.testing.assert_allclose(getattr(ours, name), numpy(getattr(lens, name)), atol=1e-6, err_msg=name)
    ids = np.random.default_rng(bits).integers(0, GEOMETRY["vocab_size"], 24)
    logits = ours.forward(ids)
    np.testing.assert_allclose(logits, numpy(lens(torch.as_tensor(ids)[None])[0]), atol=TOL)

    def log_probs(x):
        x = x.astype(np.float64)
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_probs(logits), log_probs(plain.forward(ids)), atol=1e-5)


def test_processed_model_on_every_path(models, tmp_path):
    """b_U and the folded norms reach the fused decode step, the numpy and
    naive backends, the hooked path and the logit lens; pickling keeps the
    processing; saving refuses it."""
    import pickle

    from cyformer.errors import CyformerError
    from cyformer.interp import logit_lens

    path = models[0].path
    ours = cyformer.load(path, threads=2, fold_ln=True, center_writing_weights=True, center_unembed=True,
                         fold_value_biases=True)
    assert np.abs(ours.b_U).max() > 0  # fold_ln made an unembedding bias
    ids = np.random.default_rng(5).integers(0, GEOMETRY["vocab_size"], 12)
    want = ours.forward(ids)
    for backend in ("numpy", "naive"):
        other = cyformer.load(path, backend=backend, fold_ln=True, center_writing_weights=True,
                              center_unembed=True, fold_value_biases=True)
        np.testing.assert_allclose(other.forward(ids[:6] if backend == "naive" else ids),
                                   want[:6] if backend == "naive" else want, atol=TOL)
    logits, cache = ours.run_with_cache(ids)
    np.testing.assert_allclose(logits, want, atol=1e-5)
    np.testing.assert_allclose(cache["ln_final.hook_normalized"] @ ours.W_U + ours.b_U, want, atol=1e-4)
    # greedy decoding (the fused step, with b_U) follows the forward's argmax
    gen = ours.generate(list(ids[:5]), max_new_tokens=6, temperature=0)
    seq = list(ids[:5])
    for _ in range(6):
        seq.append(int(np.argmax(ours.forward(np.array(seq))[-1])))
    assert list(gen) == seq[5:]
    lens = logit_lens(ours, ids)
    assert lens.top_ids[-1, -1, 0] == int(np.argmax(want[-1]))
    again = pickle.loads(pickle.dumps(ours))
    assert again.processing == ours.processing
    np.testing.assert_array_equal(again.forward(ids), want)
    with pytest.raises(CyformerError, match="processed for analysis"):
        ours.save(tmp_path / "processed")


def test_weight_processing_refuses_what_it_cannot_do(models, tmp_path):
    from cyformer.tl.process import process_weights
    from helpers import make_hf_llama

    path = models[0].path
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
    plain, folded = cyformer.load(lpath), cyformer.load(lpath, fold_ln=True, fold_value_biases=True)
    ids = np.arange(1, 20)
    np.testing.assert_allclose(folded.forward(ids), plain.forward(ids), atol=1e-4)
    assert np.all(folded.weights.ln_f.weight == 1) and folded.weights.lm_head_bias is None
