"""TransformerLens's HookedTransformer surface, as a mixin of cyformer's Model.

Everything here reads the Model's config, weights and hook machinery; no
array is computed twice for the two APIs.  Dimension letters: L layers, H
query heads, G key/value heads, C = d_model, D = d_head, F = d_mlp, V =
d_vocab, P = n_ctx.  Stacked weights are float32 copies made on first use
(read-only), laid out as TransformerLens lays them out; under grouped-query
attention W_K, W_V, b_K, b_V repeat each key/value head for the query heads
that share it ([L, H, ...]), as TransformerLens's properties do.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import _checks
from ..errors import TorchRequired
from ..hooks import HookOptions, HookPoint, HookPoints, hook_names, select

_ACT_FN = {"gelu_new": "gelu_new", "gelu": "gelu", "swiglu": "silu"}
_ARCHITECTURE = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class LensConfig:
    """A HookedTransformerConfig's fields for this model (read-only; change
    the hook flags with model.set_use_attn_in(...) and friends)."""

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    n_ctx: int
    d_vocab: int
    d_vocab_out: int
    n_key_value_heads: Optional[int]
    act_fn: str
    normalization_type: str
    positional_embedding_type: str
    eps: float
    gated_mlp: bool
    original_architecture: str
    model_name: str
    rotary_dim: Optional[int]
    rotary_base: float
    use_attn_result: bool
    use_attn_in: bool
    use_split_qkv_input: bool
    use_hook_mlp_in: bool
    default_prepend_bos: bool = True
    attn_only: bool = False
    parallel_attn_mlp: bool = False
    final_rms: bool = False
    use_hook_tokens: bool = False
    ungroup_grouped_query_attention: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    n_devices: int = 1
    tokenizer_prepends_bos: bool = False

    @property
    def attn_scale(self):
        return float(np.sqrt(self.d_head))


class LensAPI:
    """HookedTransformer's attributes and methods on a Model (see cyformer.tl)."""

    # -- config ---------------------------------------------------------

    @property
    def cfg(self):
        """TransformerLens's config fields (LensConfig)."""
        c, o = self.config, self.hook_options
        processed = getattr(self.weights, "processing", frozenset())
        norm = {"layer_norm": "LN", "rms_norm": "RMS"}[c.norm] + ("Pre" if "fold_ln" in processed else "")
        rotary = c.position == "rotary"
        return LensConfig(
            n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.d_head, d_mlp=c.d_mlp,
            n_ctx=c.n_positions, d_vocab=c.vocab_size, d_vocab_out=c.vocab_size,
            n_key_value_heads=c.n_kv_head if c.n_kv_head != c.n_head else None,
            act_fn=_ACT_FN[c.mlp_activation], normalization_type=norm,
            positional_embedding_type="rotary" if rotary else "standard", eps=c.norm_eps,
            gated_mlp=c.gated, original_architecture=_ARCHITECTURE.get(c.model_type, c.model_type),
            model_name=str(self.path or c.model_type), rotary_dim=c.d_head if rotary else None,
            rotary_base=c.rope_theta, use_attn_result=True, use_attn_in=o.use_attn_in,
            use_split_qkv_input=o.use_split_qkv_input, use_hook_mlp_in=o.use_hook_mlp_in,
            final_rms=c.norm == "rms_norm",
            tokenizer_prepends_bos=bool(getattr(self.tokenizer, "bos_id", None) is not None))

    def _set_option(self, **change):
        from dataclasses import replace
        self.hook_options = replace(self.hook_options, **change)
        self._hook_points = None  # the set of points changed

    def set_use_attn_in(self, use_attn_in: bool):
        """Add (or remove) ``blocks.{i}.hook_attn_in`` [T, H, C]."""
        self._set_option(use_attn_in=use_attn_in)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool):
        """Add (or remove) ``hook_q_input`` [T, H, C], ``hook_k_input``/``hook_v_input`` [T, G, C]."""
        self._set_option(use_split_qkv_input=use_split_qkv_input)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool):
        """Add (or remove) ``blocks.{i}.hook_mlp_in`` [T, C]."""
        self._set_option(use_hook_mlp_in=use_hook_mlp_in)

    def set_use_attn_result(self, use_attn_result: bool):
        """``attn.hook_result`` always exists here (computed only when asked for):
        nothing to switch either way, an unasked point costs nothing."""
        _flag("set_use_attn_result", "use_attn_result", use_attn_result)

    def set_ln_normalized(self, mode: str):
        """What ``ln*.hook_normalized`` holds: "after_gain" (the norm's output,
        TransformerLens 2.x; the default) or "before_gain" (TransformerLens 3.x)."""
        self._set_option(ln_normalized=mode)

    # -- hook points ----------------------------------------------------

    @property
    def hook_dict(self):
        """name -> HookPoint for every hook point, in forward order."""
        points = getattr(self, "_hook_points", None)
        names = hook_names(self.config, self.hook_options)
        if points is None or list(points) != names:
            old = points or {}
            points = {n: old.get(n) or HookPoint(n) for n in names}
            self._hook_points = points
        return points

    @property
    def mod_dict(self):
        """TransformerLens's module dict; here the hook points (cyformer has no torch modules)."""
        return self.hook_dict

    def hook_points(self):
        return self.hook_dict.values()

    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False):
        """Attach ``hook`` to a point (or every point a predicate accepts) until
        reset_hooks(); it then runs in every forward pass, plain ones included."""
        for n in select(self.config, name, "add_hook", self.hook_options):
            self.hook_dict[n].add_hook(hook, dir=dir, is_permanent=is_permanent, level=level,
                                       prepend=prepend)

    def add_perma_hook(self, name, hook, dir="fwd"):
        self.add_hook(name, hook, dir=dir, is_permanent=True)

    def reset_hooks(self, clear_contexts=True, direction="both", including_permanent=False, level=None):
        """Remove the hooks added with add_hook (not permanent ones unless asked)."""
        clear_contexts = _flag("reset_hooks", "clear_contexts", clear_contexts)
        including_permanent = _flag("reset_hooks", "including_permanent", including_permanent)
        if not isinstance(direction, str) or direction not in ("fwd", "bwd", "both"):
            raise ValueError(f"reset_hooks: direction must be 'fwd', 'bwd' or 'both', got {direction!r}")
        if level is not None:
            level = _checks.integer("reset_hooks", "level", level)
        for point in self.hook_dict.values():
            if clear_contexts:
                point.clear_context()
            point.remove_hooks(including_permanent=including_permanent, level=level)

    def clear_contexts(self):
        for point in self.hook_dict.values():
            point.clear_context()

    def remove_all_hook_fns(self, direction="both", including_permanent=False, level=None):
        self.reset_hooks(False, direction, including_permanent, level)

    def _has_added_hooks(self):
        points = getattr(self, "_hook_points", None)
        return points is not None and any(p.fwd_hooks for p in points.values())

    @contextlib.contextmanager
    def hooks(self, fwd_hooks=(), bwd_hooks=(), reset_hooks_end=True, clear_contexts=False):
        """Within the block, the model runs with these hooks added."""
        if bwd_hooks:
            raise TorchRequired("hooks(bwd_hooks=...): backward hooks need gradients, which cyformer "
                                "does not compute")
        self._hook_level = level = getattr(self, "_hook_level", 0) + 1
        try:
            for name, hook in fwd_hooks:
                for n in select(self.config, name, "hooks", self.hook_options):
                    self.hook_dict[n].add_hook(hook, level=level)
            yield self
        finally:
            if reset_hooks_end:
                self.reset_hooks(clear_contexts, level=level)
            self._hook_level = level - 1

    # -- weights --------------------------------------------------------

    def _stacked(self, key, make):
        memo = self.__dict__.setdefault("_lens_weights", {})
        if key not in memo:
            arr = make()
            if arr is not None:
                arr = np.ascontiguousarray(arr, dtype=np.float32)
                arr.flags.writeable = False
            memo[key] = arr
        return memo[key]

    def _heads(self, part):
        """[L, H, C, D] (W_Q/W_K/W_V) or [L, H, D] (b_*) of every block's heads."""
        def make():
            out = []
            for block in self.blocks:
                rows = [getattr(h, part) for h in block.attn.heads]
                if rows[0] is None:
                    D = self.config.d_head
                    rows = [np.zeros(D, np.float32)] * len(rows)
                out.append(np.stack(rows))
            return np.stack(out)
        return self._stacked(part, make)

    W_Q = property(lambda self: self._heads("W_Q"), doc="[L, H, C, D] query weights")
    W_K = property(lambda self: self._heads("W_K"), doc="[L, H, C, D] key weights (GQA: repeated per query head)")
    W_V = property(lambda self: self._heads("W_V"), doc="[L, H, C, D] value weights (GQA: repeated)")
    W_O = property(lambda self: self._heads("W_O"), doc="[L, H, D, C] output weights")
    b_Q = property(lambda self: self._heads("b_Q"), doc="[L, H, D] (zeros where the model has none)")
    b_K = property(lambda self: self._heads("b_K"), doc="[L, H, D]")
    b_V = property(lambda self: self._heads("b_V"), doc="[L, H, D]")

    def _layers(self, part, attr, width):
        def make():
            rows = [getattr(getattr(b, part), attr) for b in self.blocks]
            if rows[0] is None:
                if width is None:
                    return None
                rows = [np.zeros(width, np.float32)] * len(rows)
            return np.stack(rows)
        return self._stacked(part + attr, make)

    b_O = property(lambda self: self._layers("attn", "b_O", self.config.n_embd), doc="[L, C]")
    W_in = property(lambda self: self._layers("mlp", "W_in", None), doc="[L, C, F] (SwiGLU: the up read)")
    b_in = property(lambda self: self._layers("mlp", "b_in", self.config.d_mlp), doc="[L, F]")
    W_gate = property(lambda self: self._layers("mlp", "W_gate", None), doc="[L, C, F] or None")
    W_out = property(lambda self: self._layers("mlp", "W_out", None), doc="[L, F, C]")
    b_out = property(lambda self: self._layers("mlp", "b_out", self.config.n_embd), doc="[L, C]")

    @property
    def W_E(self):
        """[V, C] token embedding."""
        return self._stacked("W_E", lambda: self.weights.wte)

    @property
    def W_pos(self):
        """[P, C] learned position embedding."""
        if self.weights.wpe is None:
            raise AttributeError("W_pos: this model has rotary positions, no position embedding table")
        return self._stacked("W_pos", lambda: self.weights.wpe)

    @property
    def W_E_pos(self):
        """[V + P, C]: W_E and W_pos stacked."""
        return np.concatenate([self.W_E, self.W_pos])

    @property
    def W_U(self):
        """[C, V] unembedding."""
        return self._stacked("W_U", lambda: self.weights.lm_head.T)

    @property
    def b_U(self):
        """[V] unembedding bias (zeros unless weight processing folded one in)."""
        b = getattr(self.weights, "lm_head_bias", None)
        return self._stacked("b_U", lambda: np.zeros(self.config.vocab_size, np.float32) if b is None else b)

    @property
    def QK(self):
        """W_Q @ W_K^T per head, factored: ``model.QK[layer, head]`` is a
        FactoredMatrix [C, C]; ``.A`` [L, H, C, D] and ``.B`` [L, H, D, C]."""
        return StackedFactored(self.W_Q, np.swapaxes(self.W_K, -1, -2))

    @property
    def OV(self):
        """W_V @ W_O per head, factored: ``model.OV[layer, head]`` [C, C]."""
        return StackedFactored(self.W_V, self.W_O)

    def tokens_to_residual_directions(self, tokens):
        """The unembedding directions W_U[:, token] -> [C] for one token (int or
        one-token str), [..., C] for an array of ids."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        arr = _as_int_array(tokens, "tokens_to_residual_directions", self.config.vocab_size)
        return self.W_U.T[arr]

    def accumulated_bias(self, layer, mlp_input=False, include_mlp_biases=True):
        """The biases written into the stream before ``layer``: b_O (and b_out) summed -> [C]."""
        fn = "accumulated_bias"
        L = self.config.n_layer
        layer = _checks.integer(fn, "layer", layer)
        mlp_input = _flag(fn, "mlp_input", mlp_input)
        include_mlp_biases = _flag(fn, "include_mlp_biases", include_mlp_biases)
        if not 0 <= layer <= (L - 1 if mlp_input else L):
            raise ValueError(f"{fn}: layer must be in [0, {L - 1 if mlp_input else L}]"
                             f"{' with mlp_input' if mlp_input else ''}, got {layer}")
        out = np.zeros(self.config.n_embd, np.float32)
        for i in range(layer):
            out += self.b_O[i]
            if include_mlp_biases:
                out += self.b_out[i]
        if mlp_input:
            out += self.b_O[layer]
        return out

    def all_head_labels(self):
        return [f"L{i}H{h}" for i in range(self.config.n_layer) for h in range(self.config.n_head)]

    # -- tokens ---------------------------------------------------------

    def to_tokens(self, input, prepend_bos=True, padding_side="right", move_to_device=True, truncate=True):
        """str or list of str -> int64 ids [B, T] (a list pads with eos on
        ``padding_side``), with the bos token first when prepend_bos (as
        TransformerLens's default_prepend_bos), cut to n_ctx when truncate."""
        if isinstance(input, str):
            texts = [input]
        elif isinstance(input, (list, tuple)):
            texts = list(input)
        else:
            raise ValueError(f"to_tokens: input must be a str or a list of str, got {type(input).__name__}")
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("to_tokens: input must be a str or a non-empty list of str")
        for t in texts:
            _checks.text("to_tokens", "input", t)
        prepend_bos = _flag("to_tokens", "prepend_bos", prepend_bos)
        truncate = _flag("to_tokens", "truncate", truncate)
        if not isinstance(padding_side, str) or padding_side not in ("left", "right"):
            raise ValueError(f"to_tokens: padding_side must be 'left' or 'right', got {padding_side!r}")
        cfg = self.config
        bos = cfg.bos_token_id if cfg.bos_token_id is not None else cfg.eos_token_id
        if prepend_bos and bos is None:
            raise ValueError("to_tokens: prepend_bos needs a bos (or eos) token id in config.json")
        rows = []
        for t in texts:
            ids = self.tokenizer.encode(t)
            rows.append(([bos] if prepend_bos else []) + ids)
        if truncate:
            rows = [r[:cfg.n_positions] for r in rows]
        width = max(len(r) for r in rows)
        pad = cfg.eos_token_id if cfg.eos_token_id is not None else 0
        out = np.full((len(rows), width), pad, dtype=np.int64)
        for i, r in enumerate(rows):
            if padding_side == "left":
                out[i, width - len(r):] = r
            else:
                out[i, :len(r)] = r
        return out

    def to_string(self, tokens):
        """ids [T] -> str, [B, T] -> list of str."""
        arr = _as_int_array(tokens, "to_string", self.config.vocab_size)
        if arr.ndim == 2:
            return [self.tokenizer.decode(row) for row in arr]
        if arr.ndim > 2:
            raise ValueError(f"to_string: ids must be 0-, 1- or 2-D, got shape {arr.shape}")
        return self.tokenizer.decode(np.atleast_1d(arr))

    def to_str_tokens(self, input, prepend_bos=True, padding_side="right"):
        """Each token's text: a str (tokenized as to_tokens does) or ids [T] / [1, T]."""
        if isinstance(input, list) and input and not isinstance(input[0], (int, np.integer)):
            return [self.to_str_tokens(x, prepend_bos, padding_side) for x in input]
        if isinstance(input, str):
            ids = self.to_tokens(input, prepend_bos=prepend_bos)[0]
        else:
            ids = np.atleast_1d(_as_int_array(input, "to_str_tokens", self.config.vocab_size).squeeze())
            if ids.ndim != 1:
                raise ValueError(f"to_str_tokens: ids must be [T] or [1, T], got shape {ids.shape}")
        return [self.tokenizer._tok.decode([int(i)], skip_special_tokens=False)
                if hasattr(self.tokenizer, "_tok") else self.tokenizer.decode([int(i)]) for i in ids]

    def to_single_token(self, string):
        """The id of a str that is exactly one token."""
        ids = self.to_tokens(string, prepend_bos=False)[0]
        if len(ids) != 1:
            raise ValueError(f"to_single_token: {string!r} is {len(ids)} tokens, not one")
        return int(ids[0])

    def to_single_str_token(self, int_token):
        token = _checks.integer("to_single_str_token", "int_token", int_token)
        return self.to_str_tokens(np.array([token]))[0]

    # -- what needs torch -----------------------------------------------

    def to(self, device_or_dtype, print_details=True):
        if str(device_or_dtype) in ("cpu", "float32", "torch.float32"):
            return self
        raise TorchRequired(f"to({device_or_dtype!r}): cyformer runs float32 on the CPU with NumPy; "
                            "there are no devices or other dtypes to move to")

    def cpu(self):
        return self

    def cuda(self, device=None):
        raise TorchRequired("cuda(): cyformer runs on the CPU")

    def parameters(self):
        raise TorchRequired("parameters(): cyformer's weights are NumPy arrays (model.weights), "
                            "not torch parameters; there is nothing to train")

    def backward(self, *_):
        raise TorchRequired("backward: cyformer computes no gradients")


class StackedFactored:
    """Per-layer, per-head factored matrices A @ B: A [L, H, m, k], B [L, H, k, n]."""

    def __init__(self, A, B):
        self.A, self.B = A, B

    @property
    def shape(self):
        return self.A.shape[:-1] + self.B.shape[-1:]

    def __getitem__(self, index):
        from ..parts import FactoredMatrix
        A, B = self.A[index], self.B[index]
        if A.ndim != 2:
            raise IndexError("StackedFactored: index one layer and one head, e.g. model.QK[3, 5]")
        return FactoredMatrix(A, B)

    def full(self):
        return np.matmul(self.A.astype(np.float64), self.B.astype(np.float64))


def _as_int_array(tokens, fn, vocab_size):
    """Token ids of any shape as int64, each in [0, vocab_size)."""
    if isinstance(tokens, (str, bytes)):
        raise ValueError(f"{fn}: expected token ids, got {type(tokens).__name__}")
    return _checks.token_ids(fn, "tokens", tokens, vocab_size)


def _flag(fn, name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{fn}: {name} must be True or False, got {value!r}")
    return bool(value)


# -- running --------------------------------------------------------------

def as_ids(model, input, fn, prepend_bos=True):
    """A str / list of str (tokenized with bos, as TransformerLens does), or ids."""
    if isinstance(input, str) or (isinstance(input, list) and input and isinstance(input[0], str)):
        return model.to_tokens(input, prepend_bos=prepend_bos)
    if hasattr(input, "detach") and hasattr(input, "cpu"):  # a torch tensor of ids
        input = input.detach().cpu().numpy()
    return input


def _check_torch_options(fn, device=None, incl_bwd=False, bwd_hooks=(), pos_slice=None):
    if incl_bwd:
        raise TorchRequired(f"{fn}(incl_bwd=True): cyformer computes no gradients")
    if bwd_hooks:
        raise TorchRequired(f"{fn}(bwd_hooks=...): backward hooks need gradients, which cyformer "
                            "does not compute")
    if device is not None and str(device) != "cpu":
        raise TorchRequired(f"{fn}(device={device!r}): cyformer's arrays live on the CPU")
    if pos_slice is not None:
        raise ValueError(f"{fn}: pos_slice is not supported; slice the cached arrays instead")


def run(model, fn, input, record, fwd_hooks, return_type="logits", loss_per_token=False,
        prepend_bos=True, remove_batch_dim=False, return_cache_object=True, padding_side=None,
        **torch_options):
    """The hooked forward pass behind run_with_cache / run_with_hooks / forward
    with TransformerLens's arguments -> (output, cache or None)."""
    from .cache import ActivationCache
    _check_torch_options(fn, **torch_options)
    if not model.backend.supports_hooks:
        raise ValueError(f"{fn}: the {model.backend.name!r} backend has no hook points; "
                         "load the model with backend='cython'")
    if return_type not in ("logits", "loss", "both", None):
        raise ValueError(f"{fn}: return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
    ids = as_ids(model, input, fn, prepend_bos)
    cfg = model.config
    hooks = HookPoints(cfg, record or frozenset(), fwd_hooks, options=model.hook_options,
                       points=getattr(model, "_hook_points", None), fn=fn)
    batch, batched = _checks.check_ids(ids, cfg, fn)
    logits = np.stack(model.backend.run_hooked_batch(batch, hooks))
    cache = None
    if record is not None:
        cache = ActivationCache(hooks.cache, model, has_batch_dim=True)
        if not batched or remove_batch_dim:
            cache.remove_batch_dim()
        if not return_cache_object:
            cache = dict(cache)
    out = logits if batched else logits[0]
    if return_type == "logits":
        return out, cache
    loss = lm_loss(logits, batch, loss_per_token)
    if not batched and loss_per_token:
        loss = loss[0]
    return (None if return_type is None else loss if return_type == "loss" else (out, loss)), cache


def lm_loss(logits, ids, per_token=False):
    """Next-token cross-entropy of logits [B, T, V] on ids [B, T]: the mean, or
    [B, T - 1] per token (float64)."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return nll if per_token else float(nll.mean())
