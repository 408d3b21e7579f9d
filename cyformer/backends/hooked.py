"""The cython backend's second path: the forward pass through named hook
points (cyformer.hooks), for looking inside and intervening.

It computes an activation apart from the fused kernels only when a point
(or one computed from it) is wanted, and it never writes to an array after
handing it to a hook, so a cache can keep the arrays themselves.  Where
hooks only record or look, the logits stay bitwise those of the plain path.
The rest of the pass is computed from what a hook left, whether it edited
the array in place or returned a replacement: most points hand out the very
array (or a view of it) that the next step reads; where the next step reads
something else (a scale, the scores, the pattern, the per-head writes), an
edit is detected against a copy and the next step recomputed from it.
"""

import numpy as np

from ..formats import Packed, dequantize
from ..kernels import activations, attention, linalg


def run_hooked(be, ids, kv, last_only, hooks):
    """Logits [T, V] (or [1, V]) of ids [T] after kv.length cached positions."""
    cfg, w, threads = be.config, be.weights, be.threads
    past, T = kv.length, len(ids)
    if hooks.wants("hook_embed") or hooks.wants("hook_pos_embed"):
        resid = hooks("hook_embed", w.wte.rows(ids) if isinstance(w.wte, Packed)
                      else w.wte[ids])  # a fresh copy either way
        if w.wpe is not None:
            pos = hooks("hook_pos_embed", w.wpe[past:past + T].copy())
            resid = resid + pos  # the embedding kernel's sum, element for element
        else:
            resid = resid.copy()  # the hooked array stays as the hook left it
    else:
        resid = be.embed(ids, past, threads)
    for block in be.blocks:
        resid = _block(block, resid, kv, past, threads, hooks)
    kv.length = past + T
    if hooks.wants("ln_final.hook_scale") or hooks.wants("ln_final.hook_normalized"):
        x = _norm(be.ln_f, resid, threads, hooks, "ln_final.")
        x = x[-1:] if last_only else x
    else:
        x = be.ln_f(resid[-1:] if last_only else resid, threads)
    return be.unembed(np.ascontiguousarray(x), threads)


def _norm(ln, x, threads, hooks, prefix):
    """ln(x) reporting ``{prefix}hook_scale`` [T, 1] and ``{prefix}hook_normalized``."""
    if not hooks.wants(prefix + "hook_scale"):
        return hooks(prefix + "hook_normalized", ln(x, threads))
    scale = np.empty(len(x), dtype=np.float32)
    out = ln(x, threads, scale=scale)
    scale, changed = hooks.changed(prefix + "hook_scale", scale[:, None])
    if changed:  # a frozen or patched scale: normalise by it instead
        w = ln.w
        if ln.kind == "rms_norm":
            out = (x / scale * w.weight).astype(np.float32)
        else:
            centred = x - x.mean(axis=1, keepdims=True, dtype=np.float64)
            out = (centred / scale * w.weight + w.bias).astype(np.float32)
    return hooks(prefix + "hook_normalized", out)


def _hooked_parts(qkv, points, slices, shapes, hooks, prefix):
    """Hand views of qkv's column ranges to their hooks; returns the qkv to
    go on with: a copy holding what the hooks left when any was handed out
    (so the handed-out views are never written again), else qkv itself."""
    left = [(sl, hooks(prefix + point, qkv[:, sl].reshape(shape)))
            for point, sl, shape in zip(points, slices, shapes) if hooks.wants(prefix + point)]
    if not left:
        return qkv
    qkv = qkv.copy()
    for sl, value in left:
        qkv[:, sl] = value.reshape(len(qkv), -1)
    return qkv


def _attention(attn, x, k_cache, v_cache, past, threads, hooks, prefix):
    """z [T, H D] from x [T, C], reporting q, k, v (rotated q, k), scores,
    pattern and z."""
    H, G, D = attn.n_head, attn.n_kv_head, attn.d_head
    T = len(x)
    q_sl, k_sl, v_sl = slice(0, H * D), slice(H * D, (H + G) * D), slice((H + G) * D, (H + 2 * G) * D)
    qkv = attn.qkv(x, threads)
    qkv = _hooked_parts(qkv, ("hook_q", "hook_k", "hook_v"), (q_sl, k_sl, v_sl),
                        ((T, H, D), (T, G, D), (T, G, D)), hooks, prefix)
    if attn.rope is not None:
        attn.rotate(qkv, past, threads)
        qkv = _hooked_parts(qkv, ("hook_rot_q", "hook_rot_k"), (q_sl, k_sl),
                            ((T, H, D), (T, G, D)), hooks, prefix)
    S = past + T
    want_scores = hooks.wants(prefix + "hook_attn_scores")
    want_pattern = hooks.wants(prefix + "hook_pattern")
    scores = np.empty((H, T, S), dtype=np.float32) if want_scores else None
    pattern = np.empty((H, T, S), dtype=np.float32) if want_pattern else None
    z = attn.mix(qkv, k_cache, v_cache, past, threads, scores=scores, pattern=pattern)
    changed = False
    if want_scores:
        scores, changed = hooks.changed(prefix + "hook_attn_scores", scores)
        if changed:
            pattern = activations.softmax_inplace(scores.copy(), threads=threads)
    if want_pattern:
        pattern, edited = hooks.changed(prefix + "hook_pattern", pattern)
        changed = changed or edited
    if changed:  # z = pattern @ v, each query head reading its key/value head
        values = v_cache[:, :S, :][np.arange(H) // (H // G)]      # [H, S, D]
        z = np.ascontiguousarray(np.matmul(pattern, values).transpose(1, 0, 2)).reshape(T, H * D)
    zv = z.reshape(T, H, D)
    return hooks(prefix + "hook_z", zv).reshape(T, H * D)


def head_writes(attn, z, threads):
    """z [T, H D] -> [H, T, C]: head h's write z_h @ W_O[h], one product per head.

    W_O[h] is the h-th block of D rows of c_proj's weight, already
    contiguous; z_h is gathered into [H, T, D] once.  The writes sum over
    heads (plus the bias) to the attention update.
    """
    H, D = attn.n_head, attn.d_head
    T = z.shape[0]
    W = dequantize(attn.c_proj.weight)  # (the float32 array itself when not packed)
    z_heads = np.ascontiguousarray(z.reshape(T, H, D).transpose(1, 0, 2))
    out = np.empty((H, T, W.shape[1]), dtype=np.float32)
    for h in range(H):
        linalg.linear_forward(z_heads[h], W[h * D:(h + 1) * D], None, out=out[h], threads=threads)
    return out


def _mlp(m, x, threads, hooks, prefix):
    """The MLP update [T, C], reporting ``mlp.hook_pre`` (``mlp.hook_pre_linear``),
    ``mlp.hook_post`` and ``hook_mlp_out`` on the way; None when none of them
    is wanted (the caller then adds the update with the fused kernel)."""
    points = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")
    if any(hooks.wants(prefix + p) for p in points):
        c_fc = m.c_fc
        if m.act == "swiglu":
            F = c_fc.weight.shape[1] // 2
            h = linalg.linear_forward(x, c_fc.weight, c_fc.bias, threads=threads)  # [T, 2F]
            gate = hooks(prefix + "mlp.hook_pre", np.ascontiguousarray(h[:, :F]))
            up = hooks(prefix + "mlp.hook_pre_linear", np.ascontiguousarray(h[:, F:]))
            post = activations.swiglu_forward(np.concatenate([gate, up], axis=1), threads=threads)
        elif hooks.wants(prefix + "mlp.hook_pre"):
            pre = hooks(prefix + "mlp.hook_pre",
                        linalg.linear_forward(x, c_fc.weight, c_fc.bias, threads=threads))
            post = activations.gelu_inplace(pre.copy(), kind=m.act, threads=threads)
        else:
            post = linalg.linear_forward(x, c_fc.weight, c_fc.bias, activation=m.act, threads=threads)
        post = hooks(prefix + "mlp.hook_post", post)
        out = linalg.linear_forward(post, m.c_proj.weight, m.c_proj.bias, threads=threads)
    elif hooks.wants(prefix + "hook_mlp_out"):
        out = m(x, threads)
    else:
        return None
    return hooks(prefix + "hook_mlp_out", out)


def _block(block, resid, kv, past, threads, hooks):
    """One block through its hook points; returns a new resid.

    An update is computed on its own only when it (or a part of it) is
    wanted, and then added with one float32 add per element: bitwise what
    the kernels' accumulate (out += x @ W + b) gives, so hooks that only
    record change nothing.
    """
    p = block.prefix
    attn = block.attn
    k_cache, v_cache = kv.layer(block.index)
    resid = hooks(p + "hook_resid_pre", resid)
    z = _attention(attn, _norm(block.ln_1, resid, threads, hooks, p + "ln1."),
                   k_cache, v_cache, past, threads, hooks, p + "attn.")
    attn_out = None
    if hooks.wants(p + "attn.hook_result"):
        writes, changed = hooks.changed(p + "attn.hook_result",
                                        head_writes(attn, z, threads).transpose(1, 0, 2))
        if changed:  # edited writes: the update is their sum
            attn_out = writes.sum(axis=1, dtype=np.float32)
            if attn.c_proj.bias is not None:
                attn_out += attn.c_proj.bias
    if attn_out is None and hooks.wants(p + "hook_attn_out"):
        attn_out = attn.out(z, threads)
    if attn_out is None:
        resid = resid.copy()
        attn.out(z, threads, resid=resid)
    else:
        resid = resid + hooks(p + "hook_attn_out", attn_out)
    resid = hooks(p + "hook_resid_mid", resid)
    x = _norm(block.ln_2, resid, threads, hooks, p + "ln2.")
    mlp_out = _mlp(block.mlp, x, threads, hooks, p)
    if mlp_out is None:
        resid = resid.copy()
        block.mlp(x, threads, resid=resid)
    else:
        resid = resid + mlp_out
    return hooks(p + "hook_resid_post", resid)
