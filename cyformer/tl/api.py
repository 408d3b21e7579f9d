"""TransformerLens's HookedTransformer / TransformerBridge surface, wrapping a Model.

``HookedTransformer(model)`` holds a cyformer Model and speaks
TransformerLens's dialect over it: config fields, stacked weights, hook
points with TransformerLens's and the bridge's names, ActivationCache,
tokens with TransformerLens's BOS rules, loss, generation.  It computes
nothing itself: every pass is the Model's hooked pass (Model.run_hooked),
every weight a view or a one-time stacked copy of the Model's.  With
``tensors="torch"`` (cyformer.tl.TransformerBridge) it hands out and takes
torch tensors, which are views of the same NumPy buffers (cyformer.tl.arrays).

Dimension letters: L layers, H query heads, G key/value heads, C = d_model,
D = d_head, F = d_mlp, V = d_vocab, P = n_ctx, B batch, T positions.
Stacked weights are float32 copies made on first use, laid out as
TransformerLens lays them out; under grouped-query attention W_K, W_V, b_K,
b_V repeat each key/value head for the query heads that share it ([L, H, ...]).
"""

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .. import _checks
from ..errors import TorchRequired
from ..hooks import HookOptions, HookPoint, HookPoints, hook_names, pick
from .arrays import Arrays, check_kind
from .names import INPUT_POINTS, aliases

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
    dtype: object = "float32"
    n_devices: int = 1
    tokenizer_prepends_bos: bool = False
    eos_token_id: Optional[int] = None

    @property
    def attn_scale(self):
        return float(np.sqrt(self.d_head))


class HookPointLens(HookPoint):
    """A hook point of the wrapper: hooks added to it are converted to the
    wrapper's array kind (they receive torch tensors on the torch surface)."""

    def __init__(self, name, arrays):
        super().__init__(name)
        self._arrays = arrays

    def add_hook(self, hook, dir="fwd", is_permanent=False, level=None, prepend=False):
        if dir == "fwd" and not callable(hook):
            raise ValueError(f"the hook for {self.name!r} is not callable")
        wrapped = self._arrays.hook(hook) if dir == "fwd" else hook
        super().add_hook(wrapped, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)


class HookedTransformer:
    """TransformerLens's HookedTransformer over a cyformer Model.

    ``HookedTransformer(model)`` hands out NumPy arrays (no torch needed);
    ``HookedTransformer(model, tensors="torch")``, or cyformer.tl.TransformerBridge,
    hands out torch tensors.  ``model`` stays usable on its own; this object
    adds no state to it.
    """

    def __init__(self, model, tensors="numpy"):
        if not hasattr(model, "run_hooked") or not hasattr(model, "config"):
            raise TypeError(f"HookedTransformer: wraps a cyformer.Model (cyformer.load(path)), "
                            f"got {type(model).__name__}")
        self.model = model
        self.arrays = Arrays(check_kind("HookedTransformer", tensors))
        self.tensors = tensors
        # TransformerLens 3.9 and 4.x record hook_normalized before gain and bias
        self.hook_options = HookOptions(ln_normalized="before_gain")
        self.compatibility_mode = False
        self._points = None
        self._modules = None
        self._memo = {}
        self._hook_level = 0

    @classmethod
    def from_pretrained(cls, path=None, fold_ln=True, center_writing_weights=True, center_unembed=True,
                        fold_value_biases=True, refactor_factored_attn_matrices=False, device=None, dtype=None,
                        tensors="numpy", threads=None, **load_options):
        """Load ``path`` (a checkpoint directory, or a Hub name cyformer.load
        finds) with TransformerLens's weight processing (as its
        from_pretrained: the refactor off, the others on) and wrap it."""
        _check_device("from_pretrained", device)
        _check_dtype("from_pretrained", dtype)
        import cyformer
        model = cyformer.load(path, threads=threads, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                              center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                              refactor_factored_attn_matrices=refactor_factored_attn_matrices, **load_options)
        return cls(model, tensors=tensors)

    @classmethod
    def from_pretrained_no_processing(cls, path=None, **options):
        return cls.from_pretrained(path, fold_ln=False, center_writing_weights=False, center_unembed=False,
                                   fold_value_biases=False, **options)

    def __repr__(self):
        return f"<cyformer.tl.{type(self).__name__} ({self.tensors}) over {self.model!r}>"

    # -- config ---------------------------------------------------------

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def cfg(self):
        """TransformerLens's config fields (LensConfig)."""
        c, o = self.model.config, self.hook_options
        folded = self.model.processing.get("fold_ln", False)
        norm = {"layer_norm": "LN", "rms_norm": "RMS"}[c.norm] + ("Pre" if folded else "")
        rotary = c.position == "rotary"
        torch = self.arrays.torch
        return LensConfig(
            n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.d_head, d_mlp=c.d_mlp,
            n_ctx=c.n_positions, d_vocab=c.vocab_size, d_vocab_out=c.vocab_size,
            n_key_value_heads=c.n_kv_head if c.n_kv_head != c.n_head else None,
            act_fn=_ACT_FN[c.mlp_activation], normalization_type=norm,
            positional_embedding_type="rotary" if rotary else "standard", eps=c.norm_eps,
            gated_mlp=c.gated, original_architecture=_ARCHITECTURE.get(c.model_type, c.model_type),
            model_name=str(self.model.path or c.model_type), rotary_dim=c.d_head if rotary else None,
            rotary_base=c.rope_theta, use_attn_result=True, use_attn_in=o.use_attn_in,
            use_split_qkv_input=o.use_split_qkv_input, use_hook_mlp_in=o.use_hook_mlp_in,
            final_rms=c.norm == "rms_norm", dtype=torch.float32 if torch else "float32",
            tokenizer_prepends_bos=getattr(self.tokenizer, "bos_id", None) is not None,
            eos_token_id=c.eos_token_id)

    def _set_option(self, **change):
        self.hook_options = replace(self.hook_options, **change)
        self._points = None  # the set of points changed

    def set_use_attn_in(self, use_attn_in: bool):
        """Add (or remove) ``blocks.{i}.hook_attn_in`` [B, T, H, C]."""
        self._set_option(use_attn_in=use_attn_in)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool):
        """Add (or remove) ``hook_q_input`` [B, T, H, C], ``hook_k_input``/``hook_v_input`` [B, T, G, C]."""
        self._set_option(use_split_qkv_input=use_split_qkv_input)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool):
        """Add (or remove) ``blocks.{i}.hook_mlp_in`` [B, T, C]."""
        self._set_option(use_hook_mlp_in=use_hook_mlp_in)

    def set_use_attn_result(self, use_attn_result: bool):
        """``attn.hook_result`` always exists here (computed only when asked for):
        nothing to switch either way, an unasked point costs nothing."""
        _flag("set_use_attn_result", "use_attn_result", use_attn_result)

    def set_ln_normalized(self, mode: str):
        """What ``ln*.hook_normalized`` holds: "before_gain" (the normalised input
        before gain and bias, TransformerLens 3.9 and 4.x; the default) or
        "after_gain" (the norm's output, TransformerLens 2.x)."""
        self._set_option(ln_normalized=mode)

    # -- hook points ----------------------------------------------------

    def _aliases(self):
        folded = self.model.processing.get("fold_ln", False)
        key = ("aliases", folded, self.hook_options)
        if key not in self._memo:
            self._memo[key] = aliases(self.model.config, folded or self.hook_options.ln_normalized == "after_gain")
        return self._memo[key]

    def _canonical(self):
        return hook_names(self.model.config, self.hook_options)

    @property
    def hook_dict(self):
        """name -> HookPoint for every hook point (cyformer's names in forward
        order, then the bridge's names of the same points, then the inputs)."""
        names = self._canonical()
        if self._points is None or list(self._points)[:len(names)] != names:
            old = self._points or {}
            points = {n: old.get(n) or HookPointLens(n, self.arrays) for n in names}
            for alias, name in self._aliases().items():
                points[alias] = points[name]
            for name in self._input_points():
                points[name] = old.get(name) or HookPointLens(name, self.arrays)
            self._points = points
        return self._points

    def _input_points(self):
        return INPUT_POINTS if self.model.config.position == "learned" else INPUT_POINTS[:1]

    @property
    def mod_dict(self):
        """TransformerLens's module dict; here the hook points (cyformer has no torch modules)."""
        return self.hook_dict

    def hook_points(self):
        return list({id(p): p for p in self.hook_dict.values()}.values())

    def _select(self, names, fn):
        """A name, a list of names or a predicate -> the names it picks (any of hook_dict's)."""
        return pick(names, list(self.hook_dict), fn, self.hook_options)

    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False):
        """Attach ``hook`` to a point (or every point a predicate accepts) until
        reset_hooks(); it then runs in every forward pass."""
        for point in self._points_of(self._select(name, "add_hook")):
            point.add_hook(hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def _points_of(self, names):
        """Each distinct point once, whatever names reach it."""
        points = self.hook_dict
        return list({id(points[n]): points[n] for n in names}.values())

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
        for point in self.hook_points():
            if clear_contexts:
                point.clear_context()
            point.remove_hooks(including_permanent=including_permanent, level=level)

    def clear_contexts(self):
        for point in self.hook_points():
            point.clear_context()

    def remove_all_hook_fns(self, direction="both", including_permanent=False, level=None):
        self.reset_hooks(False, direction, including_permanent, level)

    def _has_added_hooks(self):
        return self._points is not None and any(p.fwd_hooks for p in self._points.values())

    @contextlib.contextmanager
    def hooks(self, fwd_hooks=(), bwd_hooks=(), reset_hooks_end=True, clear_contexts=False):
        """Within the block, the model runs with these hooks added."""
        if bwd_hooks:
            raise TorchRequired("hooks(bwd_hooks=...): backward hooks need gradients, which cyformer "
                                "does not compute")
        self._hook_level = level = self._hook_level + 1
        try:
            for name, hook in fwd_hooks:
                for point in self._points_of(self._select(name, "hooks")):
                    point.add_hook(hook, level=level)
            yield self
        finally:
            if reset_hooks_end:
                self.reset_hooks(clear_contexts, level=level)
            self._hook_level = level - 1

    # -- modules --------------------------------------------------------

    def __getattr__(self, name):
        if name.startswith("_") or name in ("model", "arrays"):
            raise AttributeError(name)
        if name in ("blocks", "embed", "pos_embed", "ln_final", "unembed"):
            if self._modules is None:
                from .modules import tree
                self._modules = tree(self)
            if name == "pos_embed" and self.model.config.position != "learned":
                raise AttributeError("pos_embed: this model has rotary positions, no position embedding")
            return self._modules[name]
        if name.startswith("hook_") and name in self.hook_dict:
            return self.hook_dict[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def tl_named_parameters(self):
        """(name, weight) pairs in TransformerLens's names: blocks.{i}.attn.W_Q [H, C, D], ..."""
        out = [("embed.W_E", self.W_E)]
        if self.model.config.position == "learned":
            out.append(("pos_embed.W_pos", self.W_pos))
        for i in range(self.model.config.n_layer):
            for part, names in (("attn", ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")),
                                ("mlp", ("W_in", "b_in", "W_gate", "W_out", "b_out"))):
                for n in names:
                    w = getattr(self, n)
                    if w is not None:
                        out.append((f"blocks.{i}.{part}.{n}", w[i]))
        out += [("unembed.W_U", self.W_U), ("unembed.b_U", self.b_U)]
        return out

    # -- weights --------------------------------------------------------

    def _stacked(self, key, make):
        key = ("w", key, id(self.model.weights))
        if key not in self._memo:
            arr = make()
            if arr is not None:
                arr = np.array(arr, dtype=np.float32, order="C")  # our own copy: torch may view it
                if self.arrays.torch is None:
                    arr.flags.writeable = False
            self._memo[key] = arr
        return self.arrays.out(self._memo[key])

    def _heads(self, part):
        """[L, H, C, D] (W_Q/W_K/W_V) or [L, H, D] (b_*) of every block's heads."""
        def make():
            out = []
            for block in self.model.blocks:
                rows = [getattr(h, part) for h in block.attn.heads]
                if rows[0] is None:
                    rows = [np.zeros(self.model.config.d_head, np.float32)] * len(rows)
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
            rows = [getattr(getattr(b, part), attr) for b in self.model.blocks]
            if rows[0] is None:
                if width is None:
                    return None
                rows = [np.zeros(width, np.float32)] * len(rows)
            return np.stack(rows)
        return self._stacked(part + attr, make)

    b_O = property(lambda self: self._layers("attn", "b_O", self.model.config.n_embd), doc="[L, C]")
    W_in = property(lambda self: self._layers("mlp", "W_in", None), doc="[L, C, F] (SwiGLU: the up read)")
    b_in = property(lambda self: self._layers("mlp", "b_in", self.model.config.d_mlp), doc="[L, F]")
    W_gate = property(lambda self: self._layers("mlp", "W_gate", None), doc="[L, C, F] or None")
    W_out = property(lambda self: self._layers("mlp", "W_out", None), doc="[L, F, C]")
    b_out = property(lambda self: self._layers("mlp", "b_out", self.model.config.n_embd), doc="[L, C]")

    def _norms(self, which, attr):
        w = self.model.weights
        def make():
            if which == "ln_f":
                v = getattr(w.ln_f, attr)
                return v
            rows = [getattr(getattr(b, which), attr) for b in w.blocks]
            return None if rows[0] is None else np.stack(rows)
        return self._stacked(which + attr, make)

    ln1_w = property(lambda self: self._norms("ln_1", "weight"), doc="[L, C] ln1 gain")
    ln1_b = property(lambda self: self._norms("ln_1", "bias"), doc="[L, C] ln1 bias (None: RMSNorm)")
    ln2_w = property(lambda self: self._norms("ln_2", "weight"), doc="[L, C]")
    ln2_b = property(lambda self: self._norms("ln_2", "bias"), doc="[L, C]")
    ln_final_w = property(lambda self: self._norms("ln_f", "weight"), doc="[C]")
    ln_final_b = property(lambda self: self._norms("ln_f", "bias"), doc="[C]")

    @property
    def W_E(self):
        """[V, C] token embedding."""
        return self._stacked("W_E", lambda: self.model.weights.wte)

    @property
    def W_pos(self):
        """[P, C] learned position embedding."""
        if self.model.weights.wpe is None:
            raise AttributeError("W_pos: this model has rotary positions, no position embedding table")
        return self._stacked("W_pos", lambda: self.model.weights.wpe)

    @property
    def W_E_pos(self):
        """[V + P, C]: W_E and W_pos stacked."""
        return self.arrays.out(np.concatenate([self.arrays.numpy(self.W_E), self.arrays.numpy(self.W_pos)]))

    @property
    def W_U(self):
        """[C, V] unembedding."""
        return self._stacked("W_U", lambda: self.model.float_weights.lm_head.T)

    @property
    def b_U(self):
        """[V] unembedding bias (zeros unless weight processing folded one in)."""
        b = getattr(self.model.weights, "lm_head_bias", None)
        V = self.model.config.vocab_size
        return self._stacked("b_U", lambda: np.zeros(V, np.float32) if b is None else b)

    @property
    def QK(self):
        """W_Q @ W_K^T per head, factored: FactoredMatrix [L, H, C, C]
        (``model.QK[layer, head]`` one head's; ``.eigenvalues``, ``.svd()``)."""
        from .factored import FactoredMatrix
        return FactoredMatrix(self.W_Q, self.W_K.swapaxes(-1, -2))

    @property
    def OV(self):
        """W_V @ W_O per head, factored: FactoredMatrix [L, H, C, C]."""
        from .factored import FactoredMatrix
        return FactoredMatrix(self.W_V, self.W_O)

    def tokens_to_residual_directions(self, tokens):
        """The unembedding directions W_U[:, token] -> [C] for one token (int or
        one-token str), [..., C] for ids of any shape."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        arr = _as_int_array(self.arrays.numpy(tokens), "tokens_to_residual_directions",
                            self.model.config.vocab_size)
        return self.arrays.out(np.ascontiguousarray(self.arrays.numpy(self.W_U).T[arr]))

    def accumulated_bias(self, layer, mlp_input=False, include_mlp_biases=True):
        """The biases written into the stream before ``layer``: b_O (and b_out) summed -> [C]."""
        fn = "accumulated_bias"
        L = self.model.config.n_layer
        layer = _checks.integer(fn, "layer", layer)
        mlp_input = _flag(fn, "mlp_input", mlp_input)
        include_mlp_biases = _flag(fn, "include_mlp_biases", include_mlp_biases)
        if not 0 <= layer <= (L - 1 if mlp_input else L):
            raise ValueError(f"{fn}: layer must be in [0, {L - 1 if mlp_input else L}]"
                             f"{' with mlp_input' if mlp_input else ''}, got {layer}")
        b_O, b_out = self.arrays.numpy(self.b_O), self.arrays.numpy(self.b_out)
        out = np.zeros(self.model.config.n_embd, np.float32)
        for i in range(layer):
            out += b_O[i]
            if include_mlp_biases:
                out += b_out[i]
        if mlp_input:
            out += b_O[layer]
        return self.arrays.out(out)

    def all_head_labels(self):
        return [f"L{i}H{h}" for i in range(self.model.config.n_layer) for h in range(self.model.config.n_head)]

    # -- weight processing ----------------------------------------------

    def enable_compatibility_mode(self, disable_warnings=False, no_processing=False, fold_ln=True,
                                  center_writing_weights=True, center_unembed=True, fold_value_biases=True,
                                  refactor_factored_attn_matrices=False):
        """TransformerLens's weight processing on the wrapped model (the
        bridge's defaults: fold_ln and the centring on), once; the wrapper
        then reads a processed copy (cyformer.processing.process_weights)."""
        from ..processing import process_weights
        if self.compatibility_mode:
            raise ValueError("enable_compatibility_mode: already enabled; weight processing is applied once")
        flags = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                     center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                     refactor_factored_attn_matrices=refactor_factored_attn_matrices)
        if not no_processing and any(flags.values()):
            if self.model.config.norm != "layer_norm":
                flags["center_writing_weights"] = False  # as TransformerLens: only LayerNorm models centre
            self.model = process_weights(self.model, **flags)
            self._memo.clear()
            self._points = None
            self._modules = None
        self.compatibility_mode = True

    # -- tokens ---------------------------------------------------------

    def _bos(self):
        cfg = self.model.config
        bos = getattr(self.tokenizer, "bos_id", None)
        if bos is None:
            bos = cfg.bos_token_id if cfg.bos_token_id is not None else cfg.eos_token_id
        return bos

    def to_tokens(self, input, prepend_bos=None, padding_side=None, move_to_device=True, truncate=True):
        """str or list of str -> int64 ids [B, T] (a list pads with eos on
        ``padding_side``, default right), the bos token first when prepend_bos
        (default True, TransformerLens's default_prepend_bos), cut to n_ctx
        when truncate."""
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
        prepend_bos = True if prepend_bos is None else _flag("to_tokens", "prepend_bos", prepend_bos)
        truncate = _flag("to_tokens", "truncate", truncate)
        padding_side = "right" if padding_side is None else padding_side
        if not isinstance(padding_side, str) or padding_side not in ("left", "right"):
            raise ValueError(f"to_tokens: padding_side must be 'left' or 'right', got {padding_side!r}")
        cfg = self.model.config
        bos = self._bos()
        if prepend_bos and bos is None:
            raise ValueError("to_tokens: prepend_bos needs a bos (or eos) token id in config.json")
        rows = [([bos] if prepend_bos else []) + self.tokenizer.encode(t) for t in texts]
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
        return self.arrays.out(out)

    def to_string(self, tokens):
        """ids [T] (or one id) -> str, [B, T] -> list of str; special tokens kept."""
        arr = _as_int_array(self.arrays.numpy(tokens), "to_string", self.model.config.vocab_size)
        if arr.ndim == 2:
            return [self._decode(row) for row in arr]
        if arr.ndim > 2:
            raise ValueError(f"to_string: ids must be 0-, 1- or 2-D, got shape {arr.shape}")
        return self._decode(np.atleast_1d(arr))

    def _decode(self, ids, skip_special=False):
        tok = getattr(self.tokenizer, "_tok", None)
        ids = [int(i) for i in ids]
        if tok is not None:
            return tok.decode(ids, skip_special_tokens=skip_special)
        return self.tokenizer.decode(ids)

    def to_str_tokens(self, input, prepend_bos=None, padding_side=None):
        """Each token's text: a str (tokenized as to_tokens does), a list of
        them (a list per text), or ids [T] / [1, T]."""
        if isinstance(input, (list, tuple)) and input and isinstance(input[0], str):
            return [self.to_str_tokens(x, prepend_bos, padding_side) for x in input]
        if isinstance(input, str):
            ids = self.arrays.numpy(self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side))[0]
        else:
            ids = np.atleast_1d(_as_int_array(self.arrays.numpy(input), "to_str_tokens",
                                              self.model.config.vocab_size).squeeze())
            if ids.ndim != 1:
                raise ValueError(f"to_str_tokens: ids must be [T] or [1, T], got shape {ids.shape}")
        return [self._decode([i]) for i in ids]

    def to_single_token(self, string):
        """The id of a str that is exactly one token."""
        ids = self.arrays.numpy(self.to_tokens(string, prepend_bos=False))[0]
        if len(ids) != 1:
            raise ValueError(f"to_single_token: {string!r} is {len(ids)} tokens, not one")
        return int(ids[0])

    def to_single_str_token(self, int_token):
        token = _checks.integer("to_single_str_token", "int_token", int_token)
        return self.to_str_tokens(np.array([token]))[0]

    def get_token_position(self, single_token, input, mode="first", prepend_bos=None, padding_side=None):
        """The position of ``single_token`` (a one-token str or an id) in
        ``input`` (a str, tokenized as to_tokens does, or ids [T] / [1, T]):
        its first or last occurrence."""
        if isinstance(input, str):
            tokens = self.arrays.numpy(self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side))
        else:
            tokens = self.arrays.numpy(input)
        tokens = np.atleast_2d(tokens)
        if tokens.shape[0] != 1:
            raise ValueError(f"get_token_position: one sequence only, got a batch of {tokens.shape[0]}")
        token = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        where = np.flatnonzero(tokens[0] == token)
        if where.size == 0:
            raise ValueError(f"get_token_position: token {single_token!r} does not occur in the input")
        if mode not in ("first", "last"):
            raise ValueError(f"get_token_position: mode must be 'first' or 'last', got {mode!r}")
        return int(where[0] if mode == "first" else where[-1])

    # -- running --------------------------------------------------------

    def _ids(self, input, prepend_bos, padding_side, fn):
        """A str / list of str (tokenized as to_tokens does) or ids -> int64 [B, T]."""
        if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
            return self.arrays.numpy(self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side))
        ids = self.arrays.numpy(input, fn)
        return ids[None] if ids.ndim == 1 else ids

    def __call__(self, input, return_type="logits", **options):
        return self.forward(input, return_type=return_type, **options)

    def forward(self, input, return_type="logits", loss_per_token=False, prepend_bos=None, padding_side=None,
                stop_at_layer=None, attention_mask=None, **options):
        """Logits [B, T, V] of a str, a list of str or ids [T] / [B, T]
        (return_type "logits"), the next-token loss ("loss"), both, or None;
        hooks added with add_hook run."""
        return self._run("forward", input, None, (), return_type=return_type, loss_per_token=loss_per_token,
                         prepend_bos=prepend_bos, padding_side=padding_side, stop_at_layer=stop_at_layer,
                         attention_mask=attention_mask, **options)[0]

    def run_with_cache(self, input, names_filter=None, return_type="logits", remove_batch_dim=False,
                       return_cache_object=True, **options):
        """(output, ActivationCache): output as forward's; the cache maps the
        selected names (None: every point, with the bridge's names too) to
        activations [B, ...] (remove_batch_dim: one sequence, no batch axis)."""
        fwd_hooks = options.pop("fwd_hooks", ())
        names = self._select(names_filter, "run_with_cache")
        return self._run("run_with_cache", input, names, fwd_hooks, return_type=return_type,
                         remove_batch_dim=remove_batch_dim, return_cache_object=return_cache_object, **options)

    def run_with_hooks(self, input, fwd_hooks=(), bwd_hooks=(), reset_hooks_end=True, clear_contexts=False,
                       return_type="logits", **options):
        """forward's output with ``fwd_hooks`` (pairs (name or predicate, fn))
        running; ``fn(activation, hook)`` may edit the activation in place or
        return a replacement."""
        if bwd_hooks:
            raise TorchRequired("run_with_hooks(bwd_hooks=...): backward hooks need gradients, which "
                                "cyformer does not compute")
        if not reset_hooks_end:
            for name, fn in fwd_hooks:
                self.add_hook(name, fn)
            fwd_hooks = ()
        return self._run("run_with_hooks", input, None, fwd_hooks, return_type=return_type, **options)[0]

    def _run(self, fn, input, record, fwd_hooks, return_type="logits", loss_per_token=False,
             prepend_bos=None, padding_side=None, remove_batch_dim=False, return_cache_object=True,
             stop_at_layer=None, attention_mask=None, device=None, incl_bwd=False, pos_slice=None,
             start_at_layer=None, tokens=None):
        """The pass behind forward / run_with_cache / run_with_hooks -> (output, cache or None).
        record: the names to cache (None: no cache)."""
        _check_device(fn, device)
        if incl_bwd:
            raise TorchRequired(f"{fn}(incl_bwd=True): cyformer computes no gradients")
        if pos_slice is not None:
            raise ValueError(f"{fn}: pos_slice is not supported; slice the cached arrays instead")
        if start_at_layer is not None or tokens is not None:
            raise ValueError(f"{fn}: start_at_layer is not supported; run from the tokens")
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"{fn}: return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        ids = self._ids(input, prepend_bos, padding_side, fn)
        if attention_mask is not None and not bool(np.all(self.arrays.numpy(attention_mask))):
            raise ValueError(f"{fn}: padded batches (an attention_mask with zeros) are not supported")
        cfg = self.model.config
        L = cfg.n_layer
        if stop_at_layer is not None:
            stop_at_layer = _checks.integer(fn, "stop_at_layer", stop_at_layer)
            stop_at_layer = stop_at_layer + L if stop_at_layer < 0 else stop_at_layer
            if not 0 <= stop_at_layer <= L:
                raise ValueError(f"{fn}: stop_at_layer must be in [-{L}, {L}], got {stop_at_layer}")

        aliases = self._aliases()
        points = self.hook_dict
        hooks = []  # (cyformer name, fn taking NumPy)
        for target, hook in fwd_hooks:
            if not callable(hook):
                raise ValueError(f"{fn}: the hook for {target!r} is not callable")
            for p in self._points_of(self._select(target, fn)):
                hooks.append((p.name, self.arrays.hook(hook)))
        ids = self._input_hooks(ids, hooks, fn)
        record = None if record is None else list(record)
        wanted = set() if record is None else {aliases.get(n, n) for n in record if n not in INPUT_POINTS}
        stop_name = None
        if stop_at_layer is not None and stop_at_layer < L:
            stop_name = f"blocks.{stop_at_layer}.hook_resid_pre"
            wanted.add(stop_name)
        inner = [(n, h) for n, h in hooks if n not in INPUT_POINTS]
        if not wanted and not inner and not self._has_added_hooks() and stop_name is None:
            logits = self.model.forward(ids)  # the fused pass: nothing to look at
            cache_np = {}
        else:
            lens_points = {n: p for n, p in points.items() if n == p.name and n not in INPUT_POINTS}
            run = HookPoints(cfg, frozenset(wanted), inner, options=self.hook_options, points=lens_points, fn=fn)
            logits = self.model.run_hooked(ids, run, fn)
            cache_np = run.cache

        cache = None
        if record is not None:
            from .cache import ActivationCache
            inputs = {"embed.hook_in": ids, "pos_embed.hook_in": np.arange(ids.shape[1], dtype=np.int64)[None]}
            entries = {}
            for n in record:
                if stop_at_layer is not None and _after(n, aliases.get(n, n), stop_at_layer, L):
                    continue
                entries[n] = inputs[n] if n in INPUT_POINTS else cache_np[aliases.get(n, n)]
            cache = ActivationCache(entries, self, has_batch_dim=True)
            cache.hook_names = list(points)
            if remove_batch_dim:
                cache.remove_batch_dim()
            if not return_cache_object:
                cache = {k: cache[k] for k in cache}
        if stop_name is not None:
            return self.arrays.out(cache_np[stop_name]), cache
        if return_type is None:
            return None, cache
        if return_type == "logits":
            return self.arrays.out(logits), cache
        loss = _lm_loss(logits, ids, loss_per_token)
        loss = self.arrays.out(loss) if loss_per_token else self.arrays.scalar(loss)
        return (loss if return_type == "loss" else (self.arrays.out(logits), loss)), cache

    def _input_hooks(self, ids, hooks, fn):
        """Hooks on embed.hook_in may replace the token ids; those on
        pos_embed.hook_in see the positions and may not change them."""
        added = [(n, h) for p in (self._points or {}).values() if p.name in INPUT_POINTS
                 for n, h in [(p.name, f) for f, _, _ in p.fwd_hooks]]
        for name, hook in added + [(n, h) for n, h in hooks if n in INPUT_POINTS]:
            point = self.hook_dict[name]
            value = ids if name == "embed.hook_in" else np.arange(ids.shape[1], dtype=np.int64)[None]
            new = hook(value.copy(), point) if _takes_hook(hook) else hook(value.copy(), name)
            if new is None:
                continue
            new = np.asarray(new)
            if name == "pos_embed.hook_in":
                if not np.array_equal(new, value):
                    raise ValueError(f"{fn}: a hook on pos_embed.hook_in cannot change the positions")
                continue
            ids = _checks.check_ids(new.astype(np.int64), self.model.config, fn)[0]
        return ids

    def loss_fn(self, logits, tokens, attention_mask=None, per_token=False):
        """Next-token cross-entropy of logits [B, T, V] on tokens [B, T]: the
        mean, or [B, T - 1] per token."""
        if attention_mask is not None and not bool(np.all(self.arrays.numpy(attention_mask))):
            raise ValueError("loss_fn: attention masks with zeros are not supported")
        x = self.arrays.numpy(logits, "loss_fn")
        ids = self.arrays.numpy(tokens, "loss_fn").astype(np.int64)
        if x.ndim == 2:
            x, ids = x[None], ids.reshape(1, -1)
        loss = _lm_loss(x, ids, per_token)
        return self.arrays.out(loss) if per_token else self.arrays.scalar(loss)

    def generate(self, input="", max_new_tokens=10, stop_at_eos=True, eos_token_id=None, do_sample=True,
                 top_k=None, top_p=None, temperature=1.0, freq_penalty=0.0, repetition_penalty=1.0,
                 use_past_kv_cache=True, prepend_bos=None, padding_side=None, return_type="input",
                 verbose=True, seed=None):
        """TransformerLens's generate: the prompt and its continuation, as a
        str for str input (special tokens dropped), as ids [B, T + n] for ids
        (bos included where to_tokens put it).  do_sample=False is greedy;
        sampling uses cyformer's sampler (``seed`` makes it reproducible),
        so sampled tokens differ from TransformerLens's for one seed."""
        fn = "generate"
        if freq_penalty:
            raise ValueError(f"{fn}: freq_penalty is not supported; repetition_penalty is")
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"{fn}: return_type must be 'input', 'str' or 'tokens', got {return_type!r}")
        text_input = isinstance(input, str) or (isinstance(input, (list, tuple)) and input
                                                and isinstance(input[0], str))
        ids = self._ids(input, prepend_bos, padding_side, fn)
        if self._has_added_hooks():
            raise ValueError(f"{fn}: hooks added with add_hook do not run in cyformer's KV-cached decode; "
                             "reset_hooks() first")
        eos = self.model.config.eos_token_ids if eos_token_id is None else (
            tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (int(eos_token_id),))
        stop = list(eos) if stop_at_eos else None
        rows = []
        for row in ids:
            out = self.model.generate(
                [int(i) for i in row], max_new_tokens=max_new_tokens, stop=stop,
                temperature=(temperature if do_sample else 0.0), top_k=top_k if do_sample else None,
                top_p=top_p if do_sample else None,
                repetition_penalty=None if repetition_penalty in (None, 1.0) else repetition_penalty, seed=seed)
            new = [int(t) for t in out]
            if stop_at_eos and getattr(out, "finish_reason", None) in ("eos", "stop") and (not new or new[-1] not in eos):
                new.append(int(eos[0]))  # TransformerLens keeps the eos it stopped at
            rows.append(list(row) + new)
        width = max(len(r) for r in rows)
        pad = eos[0] if eos else 0
        tokens = np.full((len(rows), width), pad, dtype=np.int64)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        if return_type == "tokens" or (return_type == "input" and not text_input):
            return self.arrays.out(tokens)
        texts = [self._decode(r, skip_special=True) for r in tokens]
        return texts[0] if isinstance(input, str) or len(texts) == 1 else texts

    # -- what needs torch's autograd or devices --------------------------

    def to(self, device_or_dtype, print_details=True):
        if str(device_or_dtype) in ("cpu", "float32", "torch.float32"):
            return self
        raise TorchRequired(f"to({device_or_dtype!r}): cyformer runs float32 on the CPU; "
                            "there are no devices or other dtypes to move to")

    def cpu(self):
        return self

    def cuda(self, device=None):
        raise TorchRequired("cuda(): cyformer runs on the CPU")

    def eval(self):
        return self

    def parameters(self):
        raise TorchRequired("parameters(): cyformer's weights are not torch parameters; there is nothing "
                            "to train (tl_named_parameters() lists the weights)")

    def backward(self, *_):
        raise TorchRequired("backward: cyformer computes no gradients")


class TransformerBridge(HookedTransformer):
    """TransformerLens 4's entry point over cyformer, with torch tensors:

        bridge = TransformerBridge.boot_transformers("path/to/checkpoint")
        bridge.enable_compatibility_mode()

    Tensors are views of cyformer's buffers (cyformer.tl.arrays); needs torch.
    """

    def __init__(self, model, tensors="torch"):
        super().__init__(model, tensors=tensors)

    @classmethod
    def boot_transformers(cls, model_name, device="cpu", dtype=None, tokenizer=None, threads=None,
                          tensors="torch", **load_options):
        """Load a checkpoint directory (or a Hub name cyformer.load finds, no
        network unless it is not cached) without weight processing, as the
        bridge boots; ``enable_compatibility_mode()`` then processes."""
        _check_device("boot_transformers", device)
        _check_dtype("boot_transformers", dtype)
        if tokenizer is not None:
            raise ValueError("boot_transformers: cyformer reads the checkpoint's own tokenizer.json; "
                             "tokenizer= is not supported")
        import cyformer
        return cls(cyformer.load(model_name, threads=threads, **load_options), tensors=tensors)


def _after(name, canonical, stop, L):
    """True for a cached name computed at or after block ``stop`` (stop_at_layer)."""
    for n in (name, canonical):
        if n.startswith("blocks."):
            return int(n.split(".")[1]) >= stop
    return (name.startswith(("ln_final", "unembed", "hook_unembed"))) and stop < L


def _takes_hook(fn):
    from ..hooks import takes_hook_point
    return takes_hook_point(fn)


def _check_device(fn, device):
    if device is not None and str(device) != "cpu":
        raise TorchRequired(f"{fn}(device={device!r}): cyformer runs on the CPU")


def _check_dtype(fn, dtype):
    if dtype is not None and str(dtype) not in ("float32", "torch.float32"):
        raise ValueError(f"{fn}: dtype={dtype!r}: the TransformerLens surface computes in float32 "
                         "(cyformer.load(path, dtype=...) for packed formats)")


def _lm_loss(logits, ids, per_token=False):
    """Next-token cross-entropy of logits [B, T, V] on ids [B, T]: the mean, or
    [B, T - 1] per token (float64 arithmetic, float32 out)."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return nll.astype(np.float32) if per_token else float(nll.mean())


def _as_int_array(tokens, fn, vocab_size):
    """Token ids of any shape as int64, each in [0, vocab_size)."""
    if isinstance(tokens, (str, bytes)):
        raise ValueError(f"{fn}: expected token ids, got {type(tokens).__name__}")
    return _checks.token_ids(fn, "tokens", tokens, vocab_size)


def _flag(fn, name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{fn}: {name} must be True or False, got {value!r}")
    return bool(value)
