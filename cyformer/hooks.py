"""Named hook points: the activations a forward pass can report or have replaced.

The names are TransformerLens's, so an analysis written against it reads the
same here.  Shapes for one sequence of T new positions after ``past`` cached
ones (S = past + T key positions); C = d_model, H query heads, G key/value
heads (H unless the model groups them), D = d_head, F = d_mlp.  A 2-D input
adds a leading batch axis to every cached array.

    hook_embed                             [T, C]     wte[ids]
    hook_pos_embed                         [T, C]     wpe[positions] (learned positions only)
    blocks.{i}.hook_resid_pre              [T, C]     residual stream entering block i
    blocks.{i}.ln1.hook_scale              [T, 1]     sqrt(var + eps) (RMSNorm: sqrt(mean(x^2) + eps))
    blocks.{i}.ln1.hook_normalized         [T, C]     the norm's output (gain and bias applied)
    blocks.{i}.attn.hook_q                 [T, H, D]
    blocks.{i}.attn.hook_k / _v            [T, G, D]
    blocks.{i}.attn.hook_rot_q / _rot_k    [T, H, D] / [T, G, D]  after the rotary embedding (rotary models)
    blocks.{i}.attn.hook_attn_scores       [H, T, S]  q.k / sqrt(D); -inf where masked
    blocks.{i}.attn.hook_pattern           [H, T, S]  softmax of the scores; 0 where masked
    blocks.{i}.attn.hook_z                 [T, H, D]  each head's pattern-weighted values
    blocks.{i}.attn.hook_result            [T, H, C]  each head's write: z_h @ W_O[h] (no bias)
    blocks.{i}.hook_attn_out               [T, C]     sum of the writes + c_proj bias
    blocks.{i}.hook_resid_mid              [T, C]     resid_pre + attn_out
    blocks.{i}.ln2.hook_scale / _normalized
    blocks.{i}.mlp.hook_pre                [T, F]     x @ W_in + b_in (SwiGLU: the gate, x @ W_gate)
    blocks.{i}.mlp.hook_pre_linear         [T, F]     SwiGLU only: x @ W_in, the "up" product
    blocks.{i}.mlp.hook_post               [T, F]     gelu(pre) (SwiGLU: silu(pre) * pre_linear)
    blocks.{i}.hook_mlp_out                [T, C]     post @ W_out + b_out
    blocks.{i}.hook_resid_post             [T, C]     resid_mid + mlp_out
    ln_final.hook_scale / _normalized      [T, 1] / [T, C]

The final residual stream is ``blocks.{L-1}.hook_resid_post``.

A hook is ``fn(activation, name)``: it gets the activation as a NumPy array
and returns either None (keep it, with whatever it changed in place) or a
replacement of the same shape.  Either way the forward pass continues from
what the hook left; a hook that changes nothing leaves the logits bitwise
those of a plain forward.
"""

import difflib
import re

import numpy as np

# Per-block points in the order a forward pass reaches them; the rotary and
# gated ones exist only in models that have those parts.
BLOCK_POINTS = (
    "hook_resid_pre",
    "ln1.hook_scale", "ln1.hook_normalized",
    "attn.hook_q", "attn.hook_k", "attn.hook_v",
    "attn.hook_rot_q", "attn.hook_rot_k",
    "attn.hook_attn_scores", "attn.hook_pattern",
    "attn.hook_z", "attn.hook_result",
    "hook_attn_out", "hook_resid_mid",
    "ln2.hook_scale", "ln2.hook_normalized",
    "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post",
    "hook_mlp_out", "hook_resid_post",
)
ROTARY_POINTS = ("attn.hook_rot_q", "attn.hook_rot_k")
GATED_POINTS = ("mlp.hook_pre_linear",)
FINAL_POINTS = ("ln_final.hook_scale", "ln_final.hook_normalized")

# Attention scores and patterns put positions on axis 1 ([H, query, key]);
# every other activation has them on axis 0.
_KEY_AXIS_POINTS = ("attn.hook_attn_scores", "attn.hook_pattern")


def block_points(cfg):
    """The per-block point names of a model with this config."""
    skip = set()
    if cfg.position != "rotary":
        skip.update(ROTARY_POINTS)
    if not cfg.gated:
        skip.update(GATED_POINTS)
    return tuple(p for p in BLOCK_POINTS if p not in skip)


def hook_names(cfg):
    """Every hook point of a model with this config, in forward order."""
    names = ["hook_embed"] + (["hook_pos_embed"] if cfg.position == "learned" else [])
    points = block_points(cfg)
    for i in range(cfg.n_layer):
        names += [f"blocks.{i}.{p}" for p in points]
    return names + list(FINAL_POINTS)


def position_axis(name):
    """The axis of an (unbatched) activation that runs over query positions."""
    return 1 if name.endswith(_KEY_AXIS_POINTS) else 0


def select(cfg, names, fn="run_with_cache"):
    """The set of hook names that ``names`` picks out.

    names: None (all of them), one name, a list of names, or a predicate
    name -> bool.  Unknown names are an error rather than an empty cache.
    """
    every = hook_names(cfg)
    if names is None:
        return frozenset(every)
    if callable(names):
        return frozenset(n for n in every if names(n))
    if isinstance(names, str):
        names = [names]
    try:
        wanted = list(names)
    except TypeError:
        raise ValueError(f"{fn}: names must be a hook name, a list of hook names or a predicate, "
                         f"got {type(names).__name__}") from None
    known = set(every)
    for n in wanted:
        if not isinstance(n, str):
            raise ValueError(f"{fn}: hook names must be strings, got {n!r}")
        if n not in known:
            raise ValueError(f"{fn}: no hook point named {n!r}; " + unknown_name_hint(n, every))
    return frozenset(wanted)


def unknown_name_hint(name, every):
    """What to say about a name that is no hook point of a model whose points
    are ``every``: a layer it does not have, or the nearest valid names."""
    layers = sorted({int(m.group(1)) for m in map(re.compile(r"blocks\.(\d+)\.").match, every) if m})
    asked = re.match(r"blocks\.(\d+)\.(.*)", name)
    if asked and layers and int(asked.group(1)) not in layers:
        near = difflib.get_close_matches(f"blocks.{layers[-1]}.{asked.group(2)}", every, n=1)
        return (f"this model has layers 0..{layers[-1]}"
                + (f" (the last one's is {near[0]!r})" if near else "") + "; model.hook_names() lists them")
    near = difflib.get_close_matches(name, every, n=3, cutoff=0.6)
    if not near:  # a bare point name ("pattern", "hook_z"): the points that end with it
        tail = name.rsplit(".", 1)[-1]
        near = [n for n in every if tail and n.endswith(tail)][:3]
    if near:
        return "did you mean " + " or ".join(repr(n) for n in near) + "?"
    return "model.hook_names() lists them"


class HookPoints:
    """What a hooked forward pass does at each named point.

    ``wants(name)`` tells the backend whether a point is observed or may be
    changed, so it computes that activation explicitly (unfused) only then;
    ``hp(name, value)`` runs the hooks on it, records it when asked, and
    returns the value the forward pass continues with.

    record: set of names to keep in ``self.cache`` (after the hooks ran, so
    the cache holds what the model actually used).  fwd_hooks: pairs
    (name or predicate, fn) as in TransformerLens.
    """

    def __init__(self, cfg, record=frozenset(), fwd_hooks=()):
        self.record = frozenset(record)
        self.hooks = {}
        for item in fwd_hooks or ():
            try:
                target, fn = item
            except (TypeError, ValueError):
                raise ValueError("run_with_hooks: fwd_hooks must be pairs (name, fn)") from None
            if not callable(fn):
                raise ValueError(f"run_with_hooks: the hook for {target!r} is not callable")
            for name in select(cfg, target, "run_with_hooks"):
                self.hooks.setdefault(name, []).append(fn)
        self.active = self.record | frozenset(self.hooks)
        self.cache = {}

    def wants(self, name):
        return name in self.active

    def changed(self, name, value):
        """Run the hooks at ``name`` like __call__; returns (value, changed),
        changed True when a hook replaced the array or edited it in place
        (found by comparing with a copy taken before, so only where a hook
        function is attached)."""
        if name not in self.hooks:
            return self(name, value), False
        before = value.copy()
        new = self(name, value)
        return new, new is not value or before.tobytes() != new.tobytes()

    def __call__(self, name, value):
        if name not in self.active:
            return value
        for fn in self.hooks.get(name, ()):
            new = fn(value, name)
            if new is not None:
                value = _replacement(name, value, new)
        if name in self.record:
            self.cache[name] = value
        return value

    def fresh(self):
        """A HookPoints with the same hooks and an empty cache (one per sequence)."""
        other = object.__new__(HookPoints)
        other.record, other.hooks, other.active = self.record, self.hooks, self.active
        other.cache = {}
        return other


def _replacement(name, old, new):
    if new is old:
        return old
    try:
        arr = np.ascontiguousarray(new, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"hook on {name}: the replacement is not a float array ({e})") from None
    if arr.shape != old.shape:
        raise ValueError(f"hook on {name}: the replacement has shape {arr.shape}, "
                         f"the activation has shape {old.shape}")
    if arr is new and not arr.flags.writeable:
        arr = arr.copy()
    return arr


class ActivationCache(dict):
    """name -> activation array, in the order the forward pass produced them.

    ``hook_names``: every hook point of the model that filled it (set by
    run_with_cache), so a missing key is told apart from a misspelt one."""

    hook_names = None

    def __missing__(self, name):
        if self.hook_names is not None and name not in self.hook_names:
            raise KeyError(f"no hook point named {name!r}; " + unknown_name_hint(name, self.hook_names))
        if self.hook_names is None and isinstance(name, str) and name not in self:
            near = difflib.get_close_matches(name, list(self), n=3, cutoff=0.8)
            if near:
                raise KeyError(f"{name!r} is not in this cache; did you mean "
                               + " or ".join(repr(n) for n in near) + "?")
        some = ", ".join(list(self)[:3])
        raise KeyError(f"{name!r} is not in this cache ({len(self)} names"
                       f"{': ' + some + ', ...' if some else ''}); ask run_with_cache for it "
                       "with names=")


def stack_batch(caches):
    """Per-sequence caches -> one cache with a leading batch axis."""
    return ActivationCache((name, np.stack([c[name] for c in caches])) for name in caches[0])


def concat_steps(steps, length):
    """Caches of consecutive runs over one sequence (a prefill, then one
    decode step per token) -> one cache covering all ``length`` positions.

    Attention scores and patterns of earlier steps have a shorter key axis;
    they are padded to ``length`` keys with what the mask puts there: -inf
    for scores, 0 for patterns.
    """
    out = ActivationCache()
    if not steps:
        return out
    for name in steps[0]:
        parts = [s[name] for s in steps]
        if position_axis(name) == 1:
            fill = -np.inf if name.endswith("hook_attn_scores") else 0.0
            padded = []
            for p in parts:
                q = np.full(p.shape[:2] + (length,), fill, dtype=p.dtype)
                q[:, :, :p.shape[2]] = p
                padded.append(q)
            out[name] = np.concatenate(padded, axis=1)
        else:
            out[name] = np.concatenate(parts, axis=0)
    return out
