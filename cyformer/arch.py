"""Architectures as data: what differs between model families, in one place.

Every family cyformer runs is the same residual stream,

    resid = embed(ids) (+ wpe[positions] for learned positions)
    for each block:
        resid += attn(norm_1(resid))      # heads read and write the stream
        resid += mlp(norm_2(resid))       # neurons read and write the stream
    logits = norm_f(resid) @ lm_head.T

and differs only in the choices recorded by a ``Family``: which norm
(layer norm or RMSNorm), how positions enter (a learned table added to the
stream, or rotary embeddings turning queries and keys), which MLP (a GELU
between two products, or SwiGLU's gated pair), which biases exist, how many
key/value heads serve the query heads, and how the checkpoint names its
tensors.  The loader, the three backends, the fused decode step, the hook
names and the interpretability views all read these; none has a per-family
copy of the model.

Parameters are stored in one kernel layout whatever the checkpoint: GPT-2's
names and its Conv1D [in, out] matrices.  ``attn.c_attn`` holds the query,
key and value products side by side ([C, (H + 2G) D]), ``mlp.c_fc`` the gate
and up products side by side for SwiGLU ([C, 2F]), so each is read in one
pass.  A family's ``sources`` says which checkpoint tensors fill each
parameter and whether they are transposed (``nn.Linear`` stores [out, in]).

Adding a family: write its ``read_config`` (config.json keys -> Config
fields) and ``sources`` (parameter -> checkpoint tensors), and register it in
FAMILIES.  A new kind of norm, position or MLP also needs its kernel.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

# One block's parameters, kernel layout (absent ones have shape None).
LAYER_PARAMS = (
    "ln_1.weight", "ln_1.bias",
    "attn.c_attn.weight", "attn.c_attn.bias",   # [C, (H + 2G) D]: q | k | v
    "attn.c_proj.weight", "attn.c_proj.bias",   # [H D, C]: the heads' writes
    "ln_2.weight", "ln_2.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias",         # [C, F], or [C, 2F]: gate | up
    "mlp.c_proj.weight", "mlp.c_proj.bias",     # [F, C]
)
GLOBAL_PARAMS = ("wte", "wpe", "ln_f.weight", "ln_f.bias", "lm_head")


def layer_shapes(cfg) -> Dict[str, Optional[Tuple[int, ...]]]:
    """Each block parameter's shape for this config (None: the model has none)."""
    C, H, G, D, F = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.d_head, cfg.d_mlp
    nq = (H + 2 * G) * D
    f_in = 2 * F if cfg.gated else F
    ln_b = (C,) if cfg.norm == "layer_norm" else None
    return {
        "ln_1.weight": (C,), "ln_1.bias": ln_b,
        "attn.c_attn.weight": (C, nq), "attn.c_attn.bias": (nq,) if cfg.qkv_bias else None,
        "attn.c_proj.weight": (H * D, C), "attn.c_proj.bias": (C,) if cfg.attn_out_bias else None,
        "ln_2.weight": (C,), "ln_2.bias": ln_b,
        "mlp.c_fc.weight": (C, f_in), "mlp.c_fc.bias": (f_in,) if cfg.mlp_bias else None,
        "mlp.c_proj.weight": (F, C), "mlp.c_proj.bias": (C,) if cfg.mlp_bias else None,
    }


def global_shapes(cfg) -> Dict[str, Optional[Tuple[int, ...]]]:
    V, C = cfg.vocab_size, cfg.n_embd
    return {"wte": (V, C),
            "wpe": (cfg.n_positions, C) if cfg.position == "learned" else None,
            "ln_f.weight": (C,), "ln_f.bias": (C,) if cfg.norm == "layer_norm" else None,
            "lm_head": (V, C)}


def n_params(cfg) -> int:
    """Parameters counted once (a tied unembedding is wte)."""
    def count(shapes):
        return sum(math.prod(s) for s in shapes.values() if s is not None)
    g = global_shapes(cfg)
    if cfg.tie_word_embeddings:
        g = {k: v for k, v in g.items() if k != "lm_head"}
    return count(g) + cfg.n_layer * count(layer_shapes(cfg))


@dataclass(frozen=True)
class Source:
    """Where a parameter comes from: checkpoint tensors with their shapes,
    concatenated along the output axis; ``transpose``: stored [out, in]."""

    parts: Tuple[Tuple[str, Tuple[int, ...]], ...]
    transpose: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    model_types: Tuple[str, ...]
    norm: str        # "layer_norm" | "rms_norm"
    position: str    # "learned" | "rotary"
    mlp: str         # "gelu" | "swiglu"
    read_config: Callable   # (raw config.json dict, source) -> Config keyword arguments
    sources: Callable       # (cfg, prefix) -> {parameter: Source}, globals and blocks.{i}.*
    prefixes: Tuple[str, ...]  # prefixes a checkpoint may put before every name


# -- GPT-2 ------------------------------------------------------------------

def _gpt2_config(raw, source):
    keys = {"vocab_size": "vocab_size", "n_positions": "n_positions", "n_embd": "n_embd",
            "n_layer": "n_layer", "n_head": "n_head", "n_inner": "n_inner",
            "activation_function": "activation_function",
            "layer_norm_epsilon": "layer_norm_epsilon", "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id"}
    aliases = {"n_positions": "max_position_embeddings", "n_embd": "hidden_size",
               "n_layer": "num_hidden_layers", "n_head": "num_attention_heads"}
    out = {field: raw[key] for key, field in keys.items() if key in raw}
    for field, alias in aliases.items():
        if field not in out and alias in raw:
            out[field] = raw[alias]
    # Options of GPT2Config that change the arithmetic and that the kernels
    # do not implement: refuse rather than compute something else.
    if flag(raw, "scale_attn_by_inverse_layer_idx", False, source):
        raise _unsupported(source, "scale_attn_by_inverse_layer_idx=true")
    if not flag(raw, "scale_attn_weights", True, source):
        raise _unsupported(source, "scale_attn_weights=false")
    flag(raw, "tie_word_embeddings", True, source)  # checked only: GPT-2 ties by the checkpoint's names
    if flag(raw, "add_cross_attention", False, source):
        raise _unsupported(source, "add_cross_attention=true (an encoder-decoder model)")
    return out


def _gpt2_sources(cfg, prefix=""):
    # GPT-2's own names are the parameters' names; only the prefix differs.
    out = {"wte": Source(((prefix + "wte.weight", (cfg.vocab_size, cfg.n_embd)),)),
           "wpe": Source(((prefix + "wpe.weight", (cfg.n_positions, cfg.n_embd)),)),
           "ln_f.weight": Source(((prefix + "ln_f.weight", (cfg.n_embd,)),)),
           "ln_f.bias": Source(((prefix + "ln_f.bias", (cfg.n_embd,)),)),
           "lm_head": Source((("lm_head.weight", (cfg.vocab_size, cfg.n_embd)),))}
    shapes = layer_shapes(cfg)
    for i in range(cfg.n_layer):
        for name, shape in shapes.items():
            out[f"blocks.{i}.{name}"] = Source(((f"{prefix}h.{i}.{name}", shape),))
    return out


# -- the Llama family (Llama, Mistral, Qwen2, SmolLM) -------------------------

ROPE_TYPES = ("default", "linear", "llama3")


def _llama_config(raw, source):
    model_type = raw.get("model_type")
    if "intermediate_size" not in raw:
        from .errors import ModelLoadError
        raise ModelLoadError(f"{source}: missing key 'intermediate_size'")
    out = {}
    keys = {"vocab_size": "vocab_size", "max_position_embeddings": "n_positions",
            "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
            "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
            "head_dim": "head_dim", "intermediate_size": "n_inner",
            "rms_norm_eps": "layer_norm_epsilon", "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id"}
    for key, field in keys.items():
        if raw.get(key) is not None:
            out[field] = raw[key]
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported(source, f"hidden_act={act!r} (the Llama family's SwiGLU uses silu)")
    out["tie_word_embeddings"] = flag(raw, "tie_word_embeddings", False, source)
    if model_type == "qwen2":  # Qwen2 biases its q, k, v products (not o)
        out["qkv_bias"], out["attn_out_bias"] = True, False
        if flag(raw, "use_sliding_window", False, source):
            raise _unsupported(source, "use_sliding_window=true")
    else:
        biased = flag(raw, "attention_bias", False, source)
        out["qkv_bias"] = out["attn_out_bias"] = biased
    out["mlp_bias"] = flag(raw, "mlp_bias", False, source)
    window = raw.get("sliding_window")
    if (window is not None and model_type != "qwen2" and isinstance(window, int)
            and not isinstance(window, bool) and 0 < window < raw.get("max_position_embeddings", 0)):
        # Within the window, sliding-window attention is full attention:
        # the context is the window, and nothing else changes.
        out["n_positions"] = window
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(source, f"partial_rotary_factor={raw['partial_rotary_factor']!r}")
    # transformers 5 groups the rotary settings in rope_parameters; older
    # configs have rope_theta and rope_scaling at the top level.
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise _unsupported(source, f"rope_parameters={_clip(rope)}")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    out["rope_theta"] = theta
    scaling = raw.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise _unsupported(source, f"rope_scaling={_clip(scaling)}")
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise _unsupported(source, f"rope scaling type {_clip(kind)} (supported: "
                               f"{', '.join(ROPE_TYPES)})")
        if kind != "default":
            out["rope_scaling"] = RopeScaling.from_dict(kind, scaling, source)
    if raw.get("num_local_experts") or raw.get("num_experts"):
        raise _unsupported(source, "mixture-of-experts layers")
    return out


def _llama_sources(cfg, prefix=""):
    C, H, G, D, F, V = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.d_head, cfg.d_mlp, cfg.vocab_size
    out = {"wte": Source(((prefix + "embed_tokens.weight", (V, C)),)),
           "ln_f.weight": Source(((prefix + "norm.weight", (C,)),)),
           "lm_head": Source((("lm_head.weight", (V, C)),))}
    for i in range(cfg.n_layer):
        p, b = f"{prefix}layers.{i}.", f"blocks.{i}."
        out.update({
            b + "ln_1.weight": Source(((p + "input_layernorm.weight", (C,)),)),
            b + "attn.c_attn.weight": Source(((p + "self_attn.q_proj.weight", (H * D, C)),
                                              (p + "self_attn.k_proj.weight", (G * D, C)),
                                              (p + "self_attn.v_proj.weight", (G * D, C))), True),
            b + "attn.c_attn.bias": Source(((p + "self_attn.q_proj.bias", (H * D,)),
                                            (p + "self_attn.k_proj.bias", (G * D,)),
                                            (p + "self_attn.v_proj.bias", (G * D,)))),
            b + "attn.c_proj.weight": Source(((p + "self_attn.o_proj.weight", (C, H * D)),), True),
            b + "attn.c_proj.bias": Source(((p + "self_attn.o_proj.bias", (C,)),)),
            b + "ln_2.weight": Source(((p + "post_attention_layernorm.weight", (C,)),)),
            b + "mlp.c_fc.weight": Source(((p + "mlp.gate_proj.weight", (F, C)),
                                           (p + "mlp.up_proj.weight", (F, C))), True),
            b + "mlp.c_fc.bias": Source(((p + "mlp.gate_proj.bias", (F,)), (p + "mlp.up_proj.bias", (F,)))),
            b + "mlp.c_proj.weight": Source(((p + "mlp.down_proj.weight", (C, F)),), True),
            b + "mlp.c_proj.bias": Source(((p + "mlp.down_proj.bias", (C,)),)),
        })
    return out


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "linear" divides every frequency by factor;
    "llama3" divides the low frequencies only, blending in between."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, kind, d, source):
        def number(key, default=None):
            v = d.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise _unsupported(source, f"rope scaling {key}={_clip(v)} (must be a positive number)")
            return v
        if kind == "linear":
            return cls(kind, float(number("factor")))
        lo, hi = number("low_freq_factor"), number("high_freq_factor")
        if hi <= lo:
            raise _unsupported(source, f"rope scaling high_freq_factor={hi} <= low_freq_factor={lo}")
        return cls(kind, float(number("factor")), float(lo), float(hi),
                   int(number("original_max_position_embeddings")))


GPT2 = Family("gpt2", ("gpt2",), "layer_norm", "learned", "gelu", _gpt2_config, _gpt2_sources,
              ("transformer.", ""))
LLAMA = Family("llama", ("llama", "mistral", "qwen2"), "rms_norm", "rotary", "swiglu",
               _llama_config, _llama_sources, ("model.", ""))
FAMILIES = {t: f for f in (GPT2, LLAMA) for t in f.model_types}


def flag(raw, key, default, source):
    """config.json's boolean ``key`` (absent or null: ``default``).  Strictly
    a JSON true/false: a string "false" is truthy to Python's bool() and
    would silently mean the opposite, so anything else is refused."""
    v = raw.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        from .errors import ModelLoadError
        raise ModelLoadError(f"{source}: {key} must be true or false, got {_clip(v)}")
    return v


def _clip(v, n=60):
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _unsupported(source, what):
    from .errors import ModelLoadError
    return ModelLoadError(f"{source}: {what} is not supported")
