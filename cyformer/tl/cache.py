"""The activation cache with TransformerLens's methods.

A cache maps hook names to float32 arrays (cyformer.hooks for names and
shapes); with ``has_batch_dim`` every array starts with the batch axis B.
Below, N is a number of components in a stack and ``...`` the batch and
position axes the arrays carry ([B, T], [T], or fewer after a pos_slice).

The stacks are what TransformerLens returns:

    accumulated_resid   [N, ..., C]  the stream before each layer (and after the last)
    decompose_resid     [N, ..., C]  embed, pos_embed, each layer's attn_out and mlp_out
    stack_head_results  [N, ..., C]  each head's write (attn.hook_result), L0H0, L0H1, ...
    apply_ln_to_stack   a stack divided by the frozen norm scale of the layer it feeds
                        (centred first under layer norm): no gain, no bias, as in
                        TransformerLens, so use it with weights processed by fold_ln
                        or with directions that include the gain
    logit_attrs         (apply_ln_to_stack(stack) * W_U[:, token]).sum(-1)

The arrays are kept as NumPy; what the cache hands out (entries, stacks) is
in the wrapper's kind (cyformer.tl.arrays): torch tensors viewing the same
buffers on the torch surface.
"""

import functools
import inspect

import numpy as np

from ..errors import IndexOutOfRange
from ..hooks import ActivationCache as _NameCache
from .names import get_act_name


def _apply_slice(x, sl, axis):
    """TransformerLens's Slice: None keeps all, an int takes one index (dropping
    the axis), a (start, stop[, step]) tuple or a slice takes a range, a list
    or array takes those indices.  Anything else, or an index out of range,
    is a clear TypeError or IndexError naming the slice."""
    if sl is None:
        return x
    n = x.shape[axis]

    def is_int(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if is_int(sl):
        if not -n <= int(sl) < n:
            raise IndexOutOfRange(f"slice index {int(sl)} is out of range for an axis of {n}")
        return np.take(x, int(sl), axis=axis)
    if isinstance(sl, tuple):
        if not 1 <= len(sl) <= 3 or not all(v is None or is_int(v) for v in sl):
            raise TypeError(f"a slice tuple is (start, stop[, step]) of integers or None, got {sl!r:.80}")
        sl = slice(*sl)
    if isinstance(sl, slice):
        if not all(v is None or is_int(v) for v in (sl.start, sl.stop, sl.step)) or sl.step == 0:
            raise TypeError(f"a slice takes integers or None and a non-zero step, got {sl!r:.80}")
        index = sl
    else:
        if isinstance(sl, (str, bytes, dict, float, bool, np.bool_)):
            raise TypeError(f"a slice is None, an int, a (start, stop[, step]) tuple, a slice or a list "
                            f"of ints, got {type(sl).__name__} {sl!r:.40}")
        if isinstance(sl, range) and len(sl) and (min(sl[0], sl[-1]) < -n or max(sl[0], sl[-1]) >= n):
            raise IndexOutOfRange(f"slice {sl!r:.60} is out of range for an axis of {n}")
        try:
            index = np.asarray(sl)
        except ValueError:
            raise TypeError(f"a slice's list of indices must be flat, got {sl!r:.60}") from None
        if index.dtype.kind == "b":
            if index.shape != (n,):
                raise IndexOutOfRange(f"a boolean slice needs {n} entries, got shape {index.shape}")
        elif index.dtype.kind not in "iu" and index.size:
            raise TypeError(f"a slice's indices must be integers, got {index.dtype}")
        else:
            index = index.astype(np.int64)
            if index.size and (index.min() < -n or index.max() >= n):
                raise IndexOutOfRange(f"slice indices {index.min()}..{index.max()} out of range for an axis of {n}")
    full = [slice(None)] * x.ndim
    full[axis] = index
    return x[tuple(full)]


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _layer_arg(layer, n_layers, what="layer", end=True):
    """A layer argument as an index in [0, n_layers] (end: a stack up to the
    final stream, where None and -1 mean n_layers) or [0, n_layers)
    (a layer's own activation, where -1 is the last layer, as cache keys
    count).  A wrong type is a TypeError, a layer out of range an
    IndexError, each naming ``what``."""
    if end and layer is None:
        return n_layers
    if not _is_int(layer):
        raise TypeError(f"{what} must be an int{' or None' if end else ''}, got "
                        f"{type(layer).__name__} {layer!r:.40}")
    layer = int(layer)
    if end:
        if layer == -1:
            return n_layers
        if not 0 <= layer <= n_layers:
            raise IndexOutOfRange(f"{what} must be in [0, {n_layers}] or -1, got {layer}")
        return layer
    if not -n_layers <= layer < n_layers:
        raise IndexOutOfRange(f"{what} must be in [{-n_layers}, {n_layers}), got {layer}")
    return layer % n_layers


def _stack_arg(stack, d_model, what="residual_stack"):
    """A stack [N, ..., C] of real numbers with C = d_model, as NumPy."""
    stack = np.asarray(stack)
    if stack.dtype.kind not in "fiu":
        raise TypeError(f"{what} must hold real numbers, got dtype {stack.dtype}")
    if stack.ndim < 2 or stack.shape[-1] != d_model:
        raise ValueError(f"{what} must be [N, ..., {d_model}], got shape {stack.shape}")
    return stack


def _kinds(method):
    """A method that computes in NumPy and hands out the wrapper's kind:
    array arguments (tensors too) in as NumPy, the array result out."""
    flags = [n for n, p in inspect.signature(method).parameters.items() if isinstance(p.default, bool)]

    @functools.wraps(method)
    def wrapper(self, *args, **options):
        bound = inspect.signature(method).bind(self, *args, **options).arguments
        for name in flags:
            if name in bound and not isinstance(bound[name], (bool, np.bool_)):
                raise TypeError(f"{method.__name__}: {name} must be True or False, got {bound[name]!r:.40}")
        args = [self._np(a) if hasattr(a, "shape") else a for a in args]
        options = {k: self._np(v) if hasattr(v, "shape") else v for k, v in options.items()}
        out = method(self, *args, **options)
        if isinstance(out, tuple):
            return (self._out(out[0]),) + out[1:]
        return self._out(out)
    return wrapper


class ActivationCache(_NameCache):
    """name -> activation, with TransformerLens's shorthand keys and methods.

    ``cache["pattern", 0]``, ``cache["resid_post", -1]`` and ``cache["k6"]``
    resolve through get_act_name.  ``model`` is the cyformer.tl wrapper
    (HookedTransformer / TransformerBridge) that produced it; ``has_batch_dim``
    whether the arrays start with a batch axis.
    """

    def __init__(self, cache_dict=(), model=None, has_batch_dim=True):
        super().__init__(cache_dict)
        self.model = model
        self.has_batch_dim = has_batch_dim

    @property
    def cache_dict(self):
        return {k: self[k] for k in self}

    def __repr__(self):
        return f"ActivationCache with keys {list(self.keys())}"

    def _out(self, x):
        return x if self.model is None else self.model.arrays.out(x)

    def _np(self, x):
        return np.asarray(x) if self.model is None else self.model.arrays.numpy(x, "ActivationCache")

    def _cfg(self):
        return self.model.model.config

    def values(self):
        return [self[k] for k in self]

    def items(self):
        return [(k, self[k]) for k in self]

    def get(self, key, default=None):
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"cache keys are hook names or (name, layer[, layer_type]) tuples, "
                            f"got {type(key).__name__}") from None
        return self[key] if key in self else default

    def __getitem__(self, key):
        return self._out(self._get(key))

    def _get(self, key):
        """The NumPy array behind a key."""
        if isinstance(key, str):
            if dict.__contains__(self, key):
                return dict.__getitem__(self, key)
            return super().__getitem__(get_act_name(key))
        if isinstance(key, tuple):
            key = list(key)
            if len(key) > 1 and key[1] is not None and key[1] < 0:
                key[1] += self._n_layers()
            return super().__getitem__(get_act_name(*key))
        raise KeyError(f"cache keys are hook names or (name, layer[, layer_type]) tuples, got {key!r}")

    def _n_layers(self):
        if self.model is None:
            raise ValueError("this cache has no model, so layer counts are unknown")
        return self._cfg().n_layer

    def to(self, device):
        """Only the CPU exists here: ``to("cpu")`` returns the cache itself."""
        from ..errors import TorchRequired
        if str(device) != "cpu":
            raise TorchRequired(f"ActivationCache.to({device!r}): cyformer's arrays are NumPy "
                                "arrays on the CPU; there are no devices to move them to")
        return self

    def toggle_autodiff(self, mode=False):
        from ..errors import TorchRequired
        raise TorchRequired("toggle_autodiff: cyformer computes no gradients")

    def remove_batch_dim(self):
        """Drop the batch axis of a batch of one, in place; returns the cache."""
        if not self.has_batch_dim:
            return self
        sizes = {v.shape[0] for v in dict.values(self)}
        if sizes - {1}:
            raise ValueError(f"remove_batch_dim: the batch holds {max(sizes)} sequences, not one")
        for name in list(self.keys()):
            dict.__setitem__(self, name, dict.__getitem__(self, name)[0])
        self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice):
        """A new cache holding a slice of the batch (an int drops the batch axis)."""
        if not self.has_batch_dim:
            raise ValueError("apply_slice_to_batch_dim: this cache has no batch axis")
        keep = not isinstance(batch_slice, (int, np.integer))
        return ActivationCache({n: _apply_slice(v, batch_slice, 0) for n, v in dict.items(self)},
                               self.model, has_batch_dim=keep)

    # -- stacks of the residual stream ----------------------------------

    def _last_layer(self, layer):
        return _layer_arg(layer, self._n_layers())

    @_kinds
    def accumulated_resid(self, layer=None, incl_mid=False, apply_ln=False, pos_slice=None,
                          mlp_input=False, return_labels=False):
        """The residual stream entering each layer up to ``layer`` (None/-1: all,
        then the final stream): [N, ..., C], labels "0_pre", "0_mid", ...,
        "final_post".  apply_ln: through the norm that reads it (the final
        norm, recomputed per component, when layer is the last)."""
        L = self._n_layers()
        layer = self._last_layer(layer)
        parts, labels = [], []
        for i in range(layer + 1):
            if i == L:
                parts.append(self._get(("resid_post", L - 1)))
                labels.append("final_post")
                continue
            parts.append(self._get(("resid_pre", i)))
            labels.append(f"{i}_pre")
            if (incl_mid and i < layer) or (mlp_input and i == layer):
                parts.append(self._get(("resid_mid", i)))
                labels.append(f"{i}_mid")
        stack = np.stack([_apply_slice(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self._np(self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice, mlp_input=mlp_input,
                                                    has_batch_dim=self.has_batch_dim, recompute_ln=layer == L))
        return (stack, labels) if return_labels else stack

    @_kinds
    def decompose_resid(self, layer=None, mlp_input=False, mode="all", apply_ln=False, pos_slice=None,
                        incl_embeds=True, return_labels=False):
        """The residual stream entering ``layer`` split into what wrote it:
        embed, pos_embed, then each earlier layer's attn_out and mlp_out
        (mode "attn"/"mlp" keeps one kind) -> [N, ..., C]; the parts sum to
        the stream."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"decompose_resid: mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        layer = self._last_layer(layer)
        parts, labels = [], []
        if incl_embeds:
            for name, label in (("hook_embed", "embed"), ("hook_pos_embed", "pos_embed")):
                if name in self:
                    parts.append(self._get((name)))
                    labels.append(label)
        for i in range(layer):
            if mode != "mlp":
                parts.append(self._get(("attn_out", i)))
                labels.append(f"{i}_attn_out")
            if mode != "attn":
                parts.append(self._get(("mlp_out", i)))
                labels.append(f"{i}_mlp_out")
        if mlp_input and mode != "mlp":
            parts.append(self._get(("attn_out", layer)))
            labels.append(f"{layer}_attn_out")
        stack = np.stack([_apply_slice(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self._np(self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice, mlp_input=mlp_input))
        return (stack, labels) if return_labels else stack

    def compute_head_results(self):
        """Fill ``blocks.{i}.attn.hook_result`` [..., H, C] from hook_z and W_O
        where the cache lacks it."""
        W_O = None
        for i in range(self._n_layers()):
            name = f"blocks.{i}.attn.hook_result"
            if name in self:
                continue
            if W_O is None:
                W_O = self._np(self.model.W_O)
            z = self._get(("z", i))  # [..., H, D]
            dict.__setitem__(self, name, np.einsum("...hd,hdc->...hc", z, W_O[i]).astype(np.float32))

    @_kinds
    def stack_head_results(self, layer=-1, return_labels=False, incl_remainder=False, pos_slice=None,
                           apply_ln=False):
        """Every head's write into the stream, heads of layers before ``layer``:
        [N, ..., C] with N = layers x heads, labels "L0H0", "L0H1", ...;
        incl_remainder adds the rest of the stream (its last layer's
        resid_post minus the heads)."""
        layer = self._last_layer(layer)
        H = self._cfg().n_head
        parts, labels = [], []
        if layer > 0:
            self.compute_head_results()
        for i in range(layer):
            r = _apply_slice(self._get(("result", i, "attn")), pos_slice, -3)  # [..., H, C]
            parts.append(np.moveaxis(r, -2, 0))
            labels += [f"L{i}H{h}" for h in range(H)]
        if parts:
            stack = np.concatenate(parts)
        else:
            like = _apply_slice(self._get(("hook_embed")), pos_slice, -2)
            stack = np.zeros((0,) + like.shape, dtype=np.float32)
        if incl_remainder:
            rest = _apply_slice(self._get(("resid_post", layer - 1)), pos_slice, -2) - stack.sum(axis=0)
            stack = np.concatenate([stack, rest[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self._np(self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice))
        return (stack, labels) if return_labels else stack

    @_kinds
    def stack_activation(self, activation_name, layer=-1, sublayer_type=None):
        """One activation of each layer before ``layer``, stacked: [layers, ...]."""
        layer = self._last_layer(layer)
        if not isinstance(activation_name, str):
            raise TypeError(f"stack_activation: activation_name must be a str, got {type(activation_name).__name__}")
        if sublayer_type is not None and not isinstance(sublayer_type, str):
            raise TypeError(f"stack_activation: sublayer_type must be a str or None, got {sublayer_type!r:.40}")
        if layer == 0:
            raise ValueError("stack_activation: layer 0 stacks no layers; give a layer in [1, n_layers] or -1")
        try:
            parts = [self._get((activation_name, i, sublayer_type)) for i in range(layer)]
        except KeyError as e:
            raise ValueError(f"stack_activation: {e.args[0] if e.args else e}") from None
        return np.stack(parts)

    @_kinds
    def get_neuron_results(self, layer, neuron_slice=None, pos_slice=None):
        """Each neuron's write at ``layer``: post * W_out[n] -> [..., F, C]."""
        layer = _layer_arg(layer, self._n_layers(), end=False)
        post = _apply_slice(self._get(("post", layer)), pos_slice, -2)
        W_out = self._np(self.model.W_out)[layer]
        if neuron_slice is not None:
            post, W_out = _apply_slice(post, neuron_slice, -1), _apply_slice(W_out, neuron_slice, 0)
        return post[..., None] * W_out

    @_kinds
    def stack_neuron_results(self, layer, pos_slice=None, neuron_slice=None, return_labels=False,
                             incl_remainder=False, apply_ln=False):
        """Every neuron's write for layers before ``layer``: [N, ..., C]."""
        layer = self._last_layer(layer)
        parts, labels = [], []
        F = self._cfg().d_mlp
        for i in range(layer):
            parts.append(np.moveaxis(self.get_neuron_results(i, neuron_slice, pos_slice), -2, 0))
            idx = range(F) if neuron_slice is None else _apply_slice(np.arange(F), neuron_slice, 0)
            labels += [f"L{i}N{n}" for n in np.atleast_1d(idx)]
        stack = np.concatenate(parts) if parts else np.zeros(
            (0,) + _apply_slice(self._get(("hook_embed")), pos_slice, -2).shape, dtype=np.float32)
        if incl_remainder:
            rest = _apply_slice(self._get(("resid_post", layer - 1)), pos_slice, -2) - stack.sum(axis=0)
            stack = np.concatenate([stack, rest[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self._np(self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice))
        return (stack, labels) if return_labels else stack

    # -- through the norms and the unembedding --------------------------

    @_kinds
    def apply_ln_to_stack(self, residual_stack, layer=None, mlp_input=False, pos_slice=None,
                          batch_slice=None, has_batch_dim=True, recompute_ln=False):
        """A stack [N, ..., C] as the input of a norm: centred (layer norm) and
        divided by that norm's scale frozen at the run (``ln1``/``ln2`` of
        ``layer``, ``ln_final`` for layer None/-1/n_layers).  No gain or bias,
        as TransformerLens does.  recompute_ln (final norm only): each
        component through the whole final norm with its own statistics, gain
        and bias, for the logit lens."""
        L = self._n_layers()
        layer = self._last_layer(layer)
        cfg = self._cfg()
        stack = _stack_arg(residual_stack, cfg.n_embd)
        if has_batch_dim and self.has_batch_dim:
            if stack.ndim < 3:
                raise ValueError(f"apply_ln_to_stack: a stack with a batch axis is [N, B, ..., C], "
                                 f"got shape {stack.shape}")
            stack = _apply_slice(stack, batch_slice, 1)
        if recompute_ln and layer == L:
            from ..kernels import norm
            ln = self.model.model.weights.ln_f
            flat = np.ascontiguousarray(stack.reshape(-1, stack.shape[-1]), dtype=np.float32)
            out = norm.norm_forward(cfg.norm, flat, ln.weight, ln.bias, cfg.norm_eps)
            return out.reshape(stack.shape)
        if cfg.norm == "layer_norm":
            stack = stack - stack.mean(axis=-1, keepdims=True)
        key = "ln_final.hook_scale" if layer == L else f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale"
        if key not in self:
            raise KeyError(f"apply_ln_to_stack needs {key!r} in the cache; run_with_cache it")
        scale = _apply_slice(self._get((key)), pos_slice, -2)
        if self.has_batch_dim:
            scale = _apply_slice(scale, batch_slice, 0)
        try:
            np.broadcast_shapes(stack.shape, scale.shape)
        except ValueError:
            raise ValueError(f"apply_ln_to_stack: a stack of shape {stack.shape} does not match the "
                             f"norm scale's {scale.shape} (after pos_slice/batch_slice)") from None
        return stack / scale

    @_kinds
    def logit_attrs(self, residual_stack, tokens, incorrect_tokens=None, pos_slice=None, batch_slice=None,
                    has_batch_dim=True):
        """How much each component of a stack [N, ..., C] adds to the logits of
        ``tokens`` (minus those of ``incorrect_tokens``): apply_ln_to_stack
        through the final norm, then the dot product with W_U's columns.
        tokens: a str (one token), an int, or an array of ids matching the
        stack's batch/position axes.  -> [N, ...]"""
        model = self.model
        directions = self._np(model.tokens_to_residual_directions(tokens))
        if incorrect_tokens is not None:
            wrong = self._np(model.tokens_to_residual_directions(incorrect_tokens))
            if np.shape(wrong) != np.shape(directions):
                raise ValueError(f"logit_attrs: tokens and incorrect_tokens must have one shape, got "
                                 f"{np.shape(directions)[:-1]} and {np.shape(wrong)[:-1]}")
            directions = directions - wrong
        scaled = self._np(self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim))
        try:
            np.broadcast_shapes(scaled.shape, np.shape(directions))
        except ValueError:
            raise ValueError(f"logit_attrs: tokens' shape {np.shape(directions)[:-1]} does not match the "
                             f"stack's {scaled.shape[1:-1]}") from None
        return (scaled * directions).sum(axis=-1)
