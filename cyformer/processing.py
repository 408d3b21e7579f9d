"""Weight processing (TransformerLens's): the same model, rewritten for reading.

Each option changes the weights so that analyses read more cleanly and the
model's log-probabilities stay what they were (up to float32 rounding):

    fold_ln                 a norm's gain (and LayerNorm's bias) moves into the
                            weights that read its output (W_Q/W_K/W_V, W_in,
                            W_U and new biases b_Q/b_K/b_V, b_in, b_U); each
                            read vector is centred, since LayerNorm's output
                            has zero mean.  The norm is left as x / scale
                            (gain 1, bias 0).  RMSNorm: the gain only.
    center_writing_weights  every vector written into the residual stream (W_E,
                            W_pos, W_O, b_O, W_out, b_out) loses its mean over
                            d_model, which the next LayerNorm removes anyway.
                            LayerNorm models only.
    center_unembed          W_U and b_U lose their mean over the vocabulary: the
                            logits shift by a constant per position, the
                            log-probabilities do not change.
    fold_value_biases       b_V always adds b_V @ W_O to a head's output (a
                            pattern sums to 1), so it moves into b_O.
    refactor_factored_attn_matrices
                            each head's W_Q W_K^T (with b_Q, b_K as an extra
                            input row) and W_V W_O are refactored from their
                            SVD U S V^T: W_Q = U S^1/2, W_K = V S^1/2 and
                            W_V = U S, W_O = V^T; b_V moves into b_O first.
                            Learned positions (no rotary) and one key/value
                            head per query head only.  Off by default, as in
                            TransformerLens.

The order and the arithmetic are TransformerLens's (``process_weights`` of
HookedTransformer 3.x, the bridge's enable_compatibility_mode in 4.x); tests compare the
result with what TransformerLens computes.
The processed matrices are float32; norms, biases and the KV cache are
float32 as always.
"""

import dataclasses

import numpy as np

from .weights import LinearWeights, NormWeights

F32 = np.float32
OPTIONS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases",
           "refactor_factored_attn_matrices")


def _f32(a):
    return np.ascontiguousarray(a, dtype=F32)


def _fold(norm, lin, *, bias, center):
    """A norm (gain g, bias b) folded into the linear layer that reads it:
    W' = g[:, None] W, b' = b_lin + b @ W, columns centred over the input."""
    W = lin.weight.astype(np.float64)
    b_lin = np.zeros(W.shape[1]) if lin.bias is None else lin.bias.astype(np.float64)
    if bias and norm.bias is not None:
        b_lin = b_lin + norm.bias.astype(np.float64) @ W
    W = W * norm.weight.astype(np.float64)[:, None]
    if center:
        W = W - W.mean(axis=0, keepdims=True)
    new_bias = _f32(b_lin) if (lin.bias is not None or (bias and norm.bias is not None)) else None
    return LinearWeights(_f32(W), new_bias)


def _identity(norm):
    return NormWeights(np.ones_like(norm.weight), None if norm.bias is None else np.zeros_like(norm.bias))


def _centred_rows(a):
    """Each row (a vector written into the residual stream) minus its mean."""
    return _f32(a - a.mean(axis=-1, keepdims=True, dtype=np.float64))


def processed_weights(cfg, w, *, fold_ln=False, center_writing_weights=False, center_unembed=False,
                      fold_value_biases=False, refactor_factored_attn_matrices=False, fn="process_weights"):
    """Weights -> processed Weights (new arrays; ``w`` is not modified)."""
    layer_norm = cfg.norm == "layer_norm"
    if refactor_factored_attn_matrices:
        check_refactor(cfg, fn)
    if center_writing_weights and not layer_norm:
        raise ValueError(f"{fn}: center_writing_weights needs LayerNorm (the next norm must remove the mean); "
                         f"this model uses {cfg.norm}")
    blocks = list(w.blocks)
    ln_f = w.ln_f
    lm_head = w.lm_head.astype(np.float64)          # [V, C]; untied from here on
    b_U = None if w.lm_head_bias is None else w.lm_head_bias.astype(np.float64)
    if fold_ln:
        for i, blk in enumerate(blocks):
            blocks[i] = dataclasses.replace(
                blk, c_attn=_fold(blk.ln_1, blk.c_attn, bias=layer_norm, center=layer_norm),
                c_fc=_fold(blk.ln_2, blk.c_fc, bias=layer_norm, center=layer_norm),
                ln_1=_identity(blk.ln_1), ln_2=_identity(blk.ln_2))
        if layer_norm and ln_f.bias is not None:
            b_U = (0.0 if b_U is None else b_U) + lm_head @ ln_f.bias.astype(np.float64)
        lm_head = lm_head * ln_f.weight.astype(np.float64)[None, :]
        if layer_norm:
            lm_head = lm_head - lm_head.mean(axis=1, keepdims=True)
        ln_f = _identity(ln_f)
    wte, wpe = w.wte, w.wpe
    if center_writing_weights:
        wte = _centred_rows(wte)
        wpe = None if wpe is None else _centred_rows(wpe)
        for i, blk in enumerate(blocks):
            o, m = blk.attn_c_proj, blk.mlp_c_proj
            blocks[i] = dataclasses.replace(
                blk, attn_c_proj=LinearWeights(_centred_rows(o.weight), None if o.bias is None else _centred_rows(o.bias)),
                mlp_c_proj=LinearWeights(_centred_rows(m.weight), None if m.bias is None else _centred_rows(m.bias)))
    if center_unembed:
        lm_head = lm_head - lm_head.mean(axis=0, keepdims=True)
        if b_U is not None:
            b_U = b_U - b_U.mean()
    if fold_value_biases:
        blocks = [_fold_value_bias(cfg, blk, center_writing_weights, fn) for blk in blocks]
    if refactor_factored_attn_matrices:
        blocks = [_refactor_attn(cfg, blk) for blk in blocks]
    return dataclasses.replace(w, wte=wte, wpe=wpe, blocks=tuple(blocks), ln_f=ln_f, lm_head=_f32(lm_head),
                               lm_head_bias=None if b_U is None else _f32(b_U))


def _fold_value_bias(cfg, blk, centre, fn):
    attn = blk.c_attn
    if attn.bias is None:
        return blk                                   # no b_V: nothing to fold
    H, G, D = cfg.n_head, cfg.n_kv_head, cfg.d_head
    v0 = (H + G) * D
    b_V = attn.bias[v0:v0 + G * D].astype(np.float64).reshape(G, D)
    if not b_V.any():
        return blk
    o = blk.attn_c_proj
    if o.bias is None:
        raise ValueError(f"{fn}: fold_value_biases needs an attention output bias (b_O), "
                         f"which this model's family does not have")
    W_O = o.weight.astype(np.float64).reshape(H, D, -1)            # [H, D, C]
    per_head = np.repeat(b_V, H // G, axis=0)                      # head h reads kv group h // (H / G)
    b_O = o.bias.astype(np.float64) + np.einsum("hd,hdc->c", per_head, W_O)
    if centre:
        b_O = b_O - b_O.mean()
    bias = attn.bias.copy()
    bias[v0:v0 + G * D] = 0
    return dataclasses.replace(blk, c_attn=LinearWeights(attn.weight, bias),
                               attn_c_proj=LinearWeights(o.weight, _f32(b_O)))


def check_refactor(cfg, fn):
    """A clear error where refactor_factored_attn_matrices cannot apply."""
    if cfg.position != "learned":
        raise ValueError(f"{fn}: refactor_factored_attn_matrices needs learned positions: with {cfg.position} "
                         f"embeddings W_Q W_K^T depends on the query's and key's positions")
    if cfg.n_kv_head != cfg.n_head:
        raise ValueError(f"{fn}: refactor_factored_attn_matrices needs one key/value head per query head; "
                         f"this model has {cfg.n_head} query heads sharing {cfg.n_kv_head} key/value heads")
    if not (cfg.qkv_bias and cfg.attn_out_bias):
        raise ValueError(f"{fn}: refactor_factored_attn_matrices needs attention biases (b_Q, b_K, b_V, b_O), "
                         f"which this model does not have")


def _factored_svd(A, B):
    """SVD of A @ B per head without forming it, TransformerLens's FactoredMatrix
    arithmetic (float32, as it runs): A [H, m, k], B [H, k, n] ->
    U [H, m, k], S [H, k], V [H, n, k] with U diag(S) V^T = A B."""
    Ua, Sa, Vha = np.linalg.svd(A, full_matrices=False)
    Ub, Sb, Vhb = np.linalg.svd(B, full_matrices=False)
    middle = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]
    Um, Sm, Vhm = np.linalg.svd(middle, full_matrices=False)
    return Ua @ Um, Sm, Vhb.swapaxes(-1, -2) @ Vhm.swapaxes(-1, -2)


def _refactor_attn(cfg, blk):
    """One block's heads refactored (see the module docstring); the fused
    c_attn [C, 3 H D] (q | k | v, head-major within each) keeps its layout."""
    H, D = cfg.n_head, cfg.d_head
    attn, o = blk.c_attn, blk.attn_c_proj
    C = attn.weight.shape[0]
    W = attn.weight.astype(F32).reshape(C, 3, H, D).transpose(1, 2, 0, 3)     # [3, H, C, D]
    b = attn.bias.astype(F32).reshape(3, H, 1, D)
    q_eff = np.concatenate([W[0], b[0]], axis=1)                              # [H, C + 1, D]
    k_eff = np.concatenate([W[1], b[1]], axis=1)
    U, S, V = _factored_svd(q_eff, k_eff.swapaxes(-1, -2))
    root = np.sqrt(S)[:, None, :]
    q_eff, k_eff = U * root, V * root                                         # [H, C + 1, D] each
    W_O = o.weight.astype(F32).reshape(H, D, C)
    b_O = o.bias.astype(F32) + (b[2].reshape(H, D, 1) * W_O).sum(1).sum(0)
    U, S, V = _factored_svd(W[2], W_O)
    W_V, W_O = U * S[:, None, :], V.swapaxes(-1, -2)                          # [H, C, D], [H, D, C]
    W_new = np.stack([q_eff[:, :-1], k_eff[:, :-1], W_V])                     # [3, H, C, D]
    b_new = np.stack([q_eff[:, -1], k_eff[:, -1], np.zeros((H, D), F32)])     # [3, H, D]
    return dataclasses.replace(
        blk, c_attn=LinearWeights(_f32(W_new.transpose(2, 0, 1, 3).reshape(C, 3 * H * D)),
                                  _f32(b_new.reshape(3 * H * D))),
        attn_c_proj=LinearWeights(_f32(W_O.reshape(H * D, C)), _f32(b_O)))


def check_options(fn, options):
    """The processing flags as bools; a clear error for anything else."""
    out = {}
    for name in OPTIONS:
        v = options.get(name, False)
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{fn}: {name} must be True or False, got {v!r}")
        out[name] = bool(v)
    return out


def process_weights(model, fold_ln=True, center_writing_weights=True, center_unembed=True,
                    fold_value_biases=True, refactor_factored_attn_matrices=False):
    """A new Model with TransformerLens's weight processing applied (its
    ``from_pretrained`` defaults: the first four on, the refactor off).  ``model`` is not changed.
    The model's weights must be float32 (``cyformer.load(..., dtype="float32")``)."""
    fn = "process_weights"
    flags = check_options(fn, dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                                   center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                                   refactor_factored_attn_matrices=refactor_factored_attn_matrices))
    if model.dtype != "float32":
        raise ValueError(f"{fn}: weight processing rewrites the matrices in float32; this model's are "
                         f"{model.dtype} (load it with dtype='float32')")
    done = dict(getattr(model, "processing", None) or {})
    if any(done.values()):
        raise ValueError(f"{fn}: the model's weights are already processed ({_describe(done)}); "
                         f"process the unprocessed model once with every option wanted")
    weights = processed_weights(model.config, model.weights, fn=fn, **flags)
    new = type(model)(model.config, weights, threads=model.threads, path=model.path, tokenizer=model.tokenizer,
                      backend=model.backend.name, generation_config=model.generation_config,
                      reload=model._reload)
    new.processing = flags
    return new


def _describe(flags):
    return ", ".join(k for k, v in flags.items() if v) or "none"
