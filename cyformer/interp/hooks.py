"""Named hook points: the activations a forward pass can report or have replaced.

The names are TransformerLens's, so an analysis written against it reads the
same here.  Shapes for one sequence of T new positions after ``past`` cached
ones (S = past + T key positions); C = d_model, H heads, D = d_head,
M = d_mlp.  A 2-D input adds a leading batch axis to every cached array.

    hook_embed, hook_pos_embed             [T, C]     wte[ids], wpe[positions]
    blocks.{i}.hook_resid_pre              [T, C]     residual stream entering block i
    blocks.{i}.ln1.hook_scale              [T, 1]     sqrt(var + eps) of each row
    blocks.{i}.ln1.hook_normalized         [T, C]     ln_1 output (gain and bias applied)
    blocks.{i}.attn.hook_q / _k / _v       [T, H, D]
    blocks.{i}.attn.hook_attn_scores       [H, T, S]  q.k / sqrt(D); -inf where masked
    blocks.{i}.attn.hook_pattern           [H, T, S]  softmax of the scores; 0 where masked
    blocks.{i}.attn.hook_z                 [T, H, D]  each head's pattern-weighted values
    blocks.{i}.attn.hook_result            [T, H, C]  each head's write: z_h @ W_O[h] (no bias)
    blocks.{i}.hook_attn_out               [T, C]     sum of the writes + c_proj bias
    blocks.{i}.hook_resid_mid              [T, C]     resid_pre + attn_out
    blocks.{i}.ln2.hook_scale / _normalized
    blocks.{i}.mlp.hook_pre                [T, M]     x @ W_in + b_in, one value per neuron
    blocks.{i}.mlp.hook_post               [T, M]     gelu(pre)
    blocks.{i}.hook_mlp_out                [T, C]     post @ W_out + b_out
    blocks.{i}.hook_resid_post             [T, C]     resid_mid + mlp_out
    ln_final.hook_scale / _normalized      [T, 1] / [T, C]

The final residual stream is ``blocks.{L-1}.hook_resid_post``.

A hook is ``fn(activation, name)``: it gets the activation as a NumPy array
and returns either None (keep it) or a replacement of the same shape.
"""

import numpy as np

from ..config import Config

# Per-block points in the order a forward pass reaches them.
BLOCK_POINTS = (
    "hook_resid_pre",
    "ln1.hook_scale", "ln1.hook_normalized",
    "attn.hook_q", "attn.hook_k", "attn.hook_v",
    "attn.hook_attn_scores", "attn.hook_pattern",
    "attn.hook_z", "attn.hook_result",
    "hook_attn_out", "hook_resid_mid",
    "ln2.hook_scale", "ln2.hook_normalized",
    "mlp.hook_pre", "mlp.hook_post",
    "hook_mlp_out", "hook_resid_post",
)
FINAL_POINTS = ("ln_final.hook_scale", "ln_final.hook_normalized")

# Attention scores and patterns put positions on axis 1 ([H, query, key]);
# every other activation has them on axis 0.
_KEY_AXIS_POINTS = ("attn.hook_attn_scores", "attn.hook_pattern")


def hook_names(cfg):
    """Every hook point of a model with this config, in forward order."""
    if not isinstance(cfg, Config):
        raise TypeError(f"hook_names: cfg must be a cyformer.Config (model.config), got {type(cfg).__name__}")
    names = ["hook_embed", "hook_pos_embed"]
    for i in range(cfg.n_layer):
        names += [f"blocks.{i}.{p}" for p in BLOCK_POINTS]
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
            raise ValueError(f"{fn}: no hook point named {n!r}; " + _hint(n, cfg))
    return frozenset(wanted)


def _hint(name, cfg):
    tail = name.rsplit(".", 1)[-1]
    similar = [n for n in hook_names(cfg) if tail in n]
    if similar:
        return f"e.g. {similar[0]!r} (layers 0..{cfg.n_layer - 1})"
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
        try:
            items = None if isinstance(fwd_hooks, (str, bytes)) else list(fwd_hooks or ())
        except (TypeError, ValueError):  # not iterable (an ndarray's truth value is a ValueError)
            items = None
        if items is None:
            raise ValueError(f"run_with_hooks: fwd_hooks must be a list of (name, fn) pairs, "
                             f"got {type(fwd_hooks).__name__}")
        for item in items:
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
    """name -> activation array, in the order the forward pass produced them."""

    def __missing__(self, name):
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
