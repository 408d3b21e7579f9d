"""Named hook points: the activations a forward pass can report or have replaced.

The names are TransformerLens's, so an analysis written against it reads the
same here.  Shapes for one sequence of T new positions after ``past`` cached
ones (S = past + T key positions); C = d_model, H query heads, G key/value
heads (H unless the model groups them), D = d_head, F = d_mlp, V = d_vocab.
A 2-D input adds a leading batch axis to every cached array.

    hook_embed                             [T, C]     wte[ids]
    hook_pos_embed                         [T, C]     wpe[positions] (learned positions only)
    blocks.{i}.hook_resid_pre              [T, C]     residual stream entering block i
    blocks.{i}.hook_attn_in                [T, H, C]  resid_pre, one copy per head (option use_attn_in)
    blocks.{i}.hook_q_input                [T, H, C]  each query head's input   (option use_split_qkv_input)
    blocks.{i}.hook_k_input / _v_input     [T, G, C]  each key/value head's input (same option)
    blocks.{i}.ln1.hook_scale              [T, 1]     sqrt(var + eps) (RMSNorm: sqrt(mean(x^2) + eps))
    blocks.{i}.ln1.hook_normalized         [T, C]     after gain and bias (default), or before them
                                                      (option ln_normalized="before_gain")
    blocks.{i}.attn.hook_q                 [T, H, D]
    blocks.{i}.attn.hook_k / _v            [T, G, D]
    blocks.{i}.attn.hook_rot_q / _rot_k    [T, H, D] / [T, G, D]  after the rotary embedding (rotary models)
    blocks.{i}.attn.hook_attn_scores       [H, T, S]  q.k / sqrt(D); -inf where masked
    blocks.{i}.attn.hook_pattern           [H, T, S]  softmax of the scores; 0 where masked
    blocks.{i}.attn.hook_z                 [T, H, D]  each head's pattern-weighted values
    blocks.{i}.attn.hook_result            [T, H, C]  each head's write: z_h @ W_O[h] (no bias)
    blocks.{i}.hook_attn_out               [T, C]     sum of the writes + c_proj bias
    blocks.{i}.hook_resid_mid              [T, C]     resid_pre + attn_out
    blocks.{i}.hook_mlp_in                 [T, C]     a copy of resid_mid the MLP reads (option use_hook_mlp_in)
    blocks.{i}.ln2.hook_scale / _normalized
    blocks.{i}.mlp.hook_pre                [T, F]     x @ W_in + b_in (SwiGLU: the gate, x @ W_gate)
    blocks.{i}.mlp.hook_pre_linear         [T, F]     SwiGLU only: x @ W_in, the "up" product
    blocks.{i}.mlp.hook_post               [T, F]     gelu(pre) (SwiGLU: silu(pre) * pre_linear)
    blocks.{i}.hook_mlp_out                [T, C]     post @ W_out + b_out
    blocks.{i}.hook_resid_post             [T, C]     resid_mid + mlp_out
    ln_final.hook_scale / _normalized      [T, 1] / [T, C]
    unembed.hook_in                        [T, C]     what the unembedding reads (ln_final's output)
    unembed.hook_out                       [T, V]     the logits

The final residual stream is ``blocks.{L-1}.hook_resid_post``.  The optional
points (and ``ln_normalized``) are TransformerLens's config flags, held in a
``HookOptions``; the split inputs and ``attn_in`` are copies of resid_pre, so
edits to them change what those heads read and nothing else.

A hook is either cyformer's ``fn(activation, name)``, called once per
sequence without a batch axis, or TransformerLens's ``fn(activation, hook)``
(a parameter named ``hook``), called once per batch with the batch axis
first and ``hook`` the point's ``HookPoint`` (``.name``, ``.layer()``,
``.ctx``).  It returns None (keep the activation, with whatever it changed in
place) or a replacement of the same shape.  Either way the forward pass
continues from what the hook left; a hook that changes nothing leaves the
logits bitwise those of a plain forward.

The hooked forward pass (cyformer.backends.hooked) is a generator per
sequence that yields ``(name, activation)`` at each wanted point and is sent
``(activation, changed)`` back; ``HookPoints.run`` drives the sequences of a
batch in lockstep, so a batched hook sees all of them at once.
"""

import difflib
import inspect
import re
from dataclasses import dataclass

import numpy as np

# Per-block points in the order a forward pass reaches them; the rotary and
# gated ones exist only in models that have those parts, the optional ones
# only when their HookOptions flag is on.
BLOCK_POINTS = (
    "hook_resid_pre",
    "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input",
    "ln1.hook_scale", "ln1.hook_normalized",
    "attn.hook_q", "attn.hook_k", "attn.hook_v",
    "attn.hook_rot_q", "attn.hook_rot_k",
    "attn.hook_attn_scores", "attn.hook_pattern",
    "attn.hook_z", "attn.hook_result",
    "hook_attn_out", "hook_resid_mid",
    "hook_mlp_in",
    "ln2.hook_scale", "ln2.hook_normalized",
    "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post",
    "hook_mlp_out", "hook_resid_post",
)
ROTARY_POINTS = ("attn.hook_rot_q", "attn.hook_rot_k")
GATED_POINTS = ("mlp.hook_pre_linear",)
ATTN_IN_POINTS = ("hook_attn_in",)
SPLIT_QKV_POINTS = ("hook_q_input", "hook_k_input", "hook_v_input")
MLP_IN_POINTS = ("hook_mlp_in",)
FINAL_POINTS = ("ln_final.hook_scale", "ln_final.hook_normalized", "unembed.hook_in", "unembed.hook_out")

# Attention scores and patterns put positions on axis 1 ([H, query, key]);
# every other activation has them on axis 0.
_KEY_AXIS_POINTS = ("attn.hook_attn_scores", "attn.hook_pattern")

LN_NORMALIZED = ("after_gain", "before_gain")


@dataclass(frozen=True)
class HookOptions:
    """TransformerLens's hook flags: which optional points exist, and what
    ``ln*.hook_normalized`` holds.

    use_attn_in: ``blocks.{i}.hook_attn_in``; use_split_qkv_input:
    ``hook_q_input``/``hook_k_input``/``hook_v_input``; use_hook_mlp_in:
    ``hook_mlp_in``.  ln_normalized: "after_gain" (the norm's output, as
    TransformerLens 2.x records it) or "before_gain" (the normalised input
    before gain and bias, as 3.x does).  With TransformerLens's fold_ln the
    two coincide.
    """

    use_attn_in: bool = False
    use_split_qkv_input: bool = False
    use_hook_mlp_in: bool = False
    ln_normalized: str = "after_gain"

    def __post_init__(self):
        for name in ("use_attn_in", "use_split_qkv_input", "use_hook_mlp_in"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HookOptions: {name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.ln_normalized, str) or self.ln_normalized not in LN_NORMALIZED:
            raise ValueError(f"HookOptions: ln_normalized must be one of {LN_NORMALIZED}, "
                             f"got {self.ln_normalized!r}")


DEFAULT_OPTIONS = HookOptions()


def block_points(cfg, options=DEFAULT_OPTIONS):
    """The per-block point names of a model with this config and these options."""
    skip = set()
    if cfg.position != "rotary":
        skip.update(ROTARY_POINTS)
    if not cfg.gated:
        skip.update(GATED_POINTS)
    if not options.use_attn_in:
        skip.update(ATTN_IN_POINTS)
    if not options.use_split_qkv_input:
        skip.update(SPLIT_QKV_POINTS)
    if not options.use_hook_mlp_in:
        skip.update(MLP_IN_POINTS)
    return tuple(p for p in BLOCK_POINTS if p not in skip)


def hook_names(cfg, options=DEFAULT_OPTIONS):
    """Every hook point of a model with this config, in forward order."""
    from .config import Config

    if not isinstance(cfg, Config):
        raise TypeError(f"hook_names: cfg must be a cyformer.Config (model.config), got {type(cfg).__name__}")
    if not isinstance(options, HookOptions):
        raise TypeError(f"hook_names: options must be a cyformer.hooks.HookOptions, got {type(options).__name__}")
    names = ["hook_embed"] + (["hook_pos_embed"] if cfg.position == "learned" else [])
    points = block_points(cfg, options)
    for i in range(cfg.n_layer):
        names += [f"blocks.{i}.{p}" for p in points]
    return names + list(FINAL_POINTS)


def position_axis(name):
    """The axis of an (unbatched) activation that runs over query positions."""
    return 1 if name.endswith(_KEY_AXIS_POINTS) else 0


def select(cfg, names, fn="run_with_cache", options=DEFAULT_OPTIONS):
    """The set of hook names that ``names`` picks out.

    names: None (all of them), one name, a list of names, or a predicate
    name -> bool.  Unknown names are an error rather than an empty cache.
    """
    return frozenset(pick(names, hook_names(cfg, options), fn, options))


def pick(names, every, fn, options=DEFAULT_OPTIONS):
    """The names of ``every`` that ``names`` picks, as a list in the order asked.

    names: None (all of ``every``), one name, a list of names, or a predicate
    name -> bool; a name not in ``every`` is a ValueError with a hint.
    """
    if names is None:
        return list(every)
    if callable(names):
        return [n for n in every if names(n)]
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
            raise ValueError(f"{fn}: no hook point named {n!r}; " + _hint(n, options, list(every)))
    return wanted


FLAGS = {"hook_attn_in": "use_attn_in", "hook_q_input": "use_split_qkv_input",
         "hook_k_input": "use_split_qkv_input", "hook_v_input": "use_split_qkv_input",
         "hook_mlp_in": "use_hook_mlp_in"}


def _hint(name, options, every):
    tail = name.rsplit(".", 1)[-1]
    if tail in FLAGS and not getattr(options, FLAGS[tail]):
        return (f"it exists with the hook option {FLAGS[tail]}=True (a Model's hook_options; "
                f"cyformer.tl's set_{FLAGS[tail]}(True))")
    return unknown_name_hint(name, every)


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


class HookPoint:
    """One named point, as TransformerLens hands it to a hook: ``name``,
    ``layer()`` and ``ctx`` (a dict that lives as long as the model, for
    hooks to keep state in; cyformer.tl's ``reset_hooks()`` clears it).
    Hooks added with cyformer.tl's ``add_hook`` sit in ``fwd_hooks``."""

    def __init__(self, name):
        self.name = name
        self.ctx = {}
        self.fwd_hooks = []  # [(fn, permanent, level)]

    def __repr__(self):
        n = len(self.fwd_hooks)
        return f"HookPoint(name={self.name!r}" + (f", {n} fwd)" if n else ")")

    def layer(self):
        """The block index of a ``blocks.{i}....`` point."""
        parts = self.name.split(".")
        if len(parts) < 2 or parts[0] != "blocks":
            raise ValueError(f"HookPoint.layer: {self.name!r} is not inside a block")
        return int(parts[1])

    def clear_context(self):
        self.ctx = {}

    def add_hook(self, hook, dir="fwd", is_permanent=False, level=None, prepend=False):
        if dir != "fwd":
            from .errors import TorchRequired
            raise TorchRequired("add_hook(dir='bwd'): backward hooks need gradients, which "
                                "cyformer (NumPy, inference only) does not compute")
        _check_hook(self.name, hook)
        entry = (hook, is_permanent, level)
        self.fwd_hooks.insert(0, entry) if prepend else self.fwd_hooks.append(entry)

    def remove_hooks(self, dir="fwd", including_permanent=False, level=None):
        self.fwd_hooks = [(f, perm, lv) for f, perm, lv in self.fwd_hooks
                          if (perm and not including_permanent) or (level is not None and lv != level)]


def _check_hook(name, fn):
    if not callable(fn):
        raise ValueError(f"the hook for {name!r} is not callable")


def takes_hook_point(fn):
    """True for a TransformerLens-style hook ``fn(activation, hook)``: one
    with a parameter named ``hook``."""
    try:
        return "hook" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


class HookPoints:
    """What a hooked forward pass does at each named point.

    ``wants(name)`` tells the backend whether a point is observed or may be
    changed, so it computes that activation explicitly (unfused) only then;
    ``run(forwards)`` drives the backend's per-sequence forward generators,
    runs the hooks on what they yield and records what is asked.

    record: set of names to keep in ``self.cache`` (after the hooks ran, so
    the cache holds what the model actually used).  fwd_hooks: pairs
    (name or predicate, fn) as in TransformerLens.  points: name ->
    HookPoint (the model's, carrying hooks added with add_hook and the ctx
    dicts); None makes fresh ones.  options: HookOptions.
    """

    def __init__(self, cfg, record=frozenset(), fwd_hooks=(), options=DEFAULT_OPTIONS, points=None,
                 fn="run_with_hooks"):
        self.options = options
        self.record = frozenset(record)
        self.points = points if points is not None else {}
        self.hooks = {}
        for point in self.points.values():
            for hook, _, _ in point.fwd_hooks:
                self.hooks.setdefault(point.name, []).append(hook)
        try:
            items = None if isinstance(fwd_hooks, (str, bytes)) else list(fwd_hooks or ())
        except (TypeError, ValueError):  # not iterable (an ndarray's truth value is a ValueError)
            items = None
        if items is None:
            raise ValueError(f"{fn}: fwd_hooks must be a list of (name, fn) pairs, "
                             f"got {type(fwd_hooks).__name__}")
        for item in items:
            try:
                target, hook = item
            except (TypeError, ValueError):
                raise ValueError(f"{fn}: fwd_hooks must be pairs (name, fn)") from None
            _check_hook(target, hook)
            for name in select(cfg, target, fn, options):
                self.hooks.setdefault(name, []).append(hook)
        self.batched = {id(h): takes_hook_point(h) for hs in self.hooks.values() for h in hs}
        self.active = self.record | frozenset(self.hooks)
        self.cache = {}

    def wants(self, name):
        return name in self.active

    def fresh(self):
        """A HookPoints with the same hooks and an empty cache (one per run)."""
        other = object.__new__(HookPoints)
        other.__dict__.update(self.__dict__)
        other.cache = {}
        return other

    def run(self, forwards):
        """Drive the forward generators of a batch in lockstep; returns their
        results.  Records the wanted points with a leading batch axis in
        ``self.cache``."""
        replies = [None] * len(forwards)
        while True:
            msgs, results = [], []
            for g, r in zip(forwards, replies):
                try:
                    msgs.append(g.send(r))
                except StopIteration as stop:
                    results.append(stop.value)
            if results:
                if len(results) != len(forwards):
                    raise RuntimeError("hooked forward passes out of step at the end")
                return results
            name = msgs[0][0]
            if any(m[0] != name for m in msgs):  # all sequences have one length: cannot happen
                raise RuntimeError(f"hooked forward passes out of step at {name!r}")
            batch, changed = self._visit(name, [m[1] for m in msgs])
            replies = [(batch[b], changed[b]) for b in range(len(forwards))]

    def _visit(self, name, values):
        """Hooks at ``name`` over the batch's values -> (batch array, changed per sequence)."""
        B = len(values)
        batch = values[0][None] if B == 1 else np.stack(values)  # one sequence: a view, no copy
        hooks = self.hooks.get(name, ())
        changed = [False] * B
        if hooks:
            before = batch.copy()
            owned = B > 1  # batch is our own stack, not an array a hook handed back
            for fn in hooks:
                if self.batched[id(fn)]:
                    point = self.points.get(name) or HookPoint(name)
                    new = fn(batch, hook=point)
                    if new is not None and new is not batch:
                        batch, owned = _replacement(name, batch, new), False
                    continue
                for b in range(B):
                    new = fn(batch[b], name)
                    if new is None or new is batch[b]:
                        continue
                    new = _replacement(name, batch[b], new)
                    if B == 1:
                        batch = new[None]
                    else:
                        if not owned:
                            batch, owned = batch.copy(), True
                        batch[b] = new
            changed = [before[b].tobytes() != batch[b].tobytes() for b in range(B)]
        if name in self.record:
            self.cache[name] = batch
        return batch, changed


def _replacement(name, old, new):
    if new is old:
        return old
    try:
        raw = np.asarray(new)
        # checked before the cast: float32() of a complex array silently drops its imaginary part
        if raw.dtype.kind not in "biuf":
            raise TypeError(f"its dtype is {raw.dtype}, not a real number type")
        arr = np.ascontiguousarray(raw, dtype=np.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"hook on {name}: the replacement is not a real float array ({e})") from None
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
