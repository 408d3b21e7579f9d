"""TransformerLens's shorthand for hook names (its utils.get_act_name)."""

import re

_LAYER_TYPES = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}
_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
            "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_ATTN = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores")
_MLP = ("pre", "post", "mid", "pre_linear")


def get_act_name(name, layer=None, layer_type=None):
    """A full hook name from shorthand: ("pattern", 0) -> "blocks.0.attn.hook_pattern",
    ("resid_post", 5) -> "blocks.5.hook_resid_post", ("scale", 2, "ln1") ->
    "blocks.2.ln1.hook_scale", "k6" -> "blocks.6.attn.hook_k", ("scale",) ->
    "ln_final.hook_scale".  A name that is already full comes back as is."""
    if not isinstance(name, str):
        raise ValueError(f"get_act_name: the name must be a str, got {name!r}")
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = re.match(r"([a-z_]+?)(\d+)([a-z]?.*)$", name)
    if match is not None:
        name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3) or None
    name = _ALIASES.get(name, name)
    if name in _ATTN:
        layer_type = "attn"
    elif name in _MLP:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPES:
        layer_type = _LAYER_TYPES[layer_type]
    full = f"blocks.{layer}." if layer is not None else ""
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in ("scale", "normalized") and layer is None:
        full = "ln_final." + full
    return full


# TransformerLens 4's bridge names each component's input and output
# (``blocks.3.hook_in``, ``attn.o.hook_in``, ...) beside the HookedTransformer
# names; each is the same activation as one cyformer point: bridge name -> ours.
BLOCK_ALIASES = {
    "hook_in": "hook_resid_pre", "hook_out": "hook_resid_post",
    "ln1.hook_in": "hook_resid_pre", "ln2.hook_in": "hook_resid_mid",
    "attn.q.hook_out": "attn.hook_q", "attn.k.hook_out": "attn.hook_k", "attn.v.hook_out": "attn.hook_v",
    "attn.o.hook_in": "attn.hook_z", "attn.o.hook_out": "hook_attn_out", "attn.hook_out": "hook_attn_out",
    "attn.hook_hidden_states": "hook_attn_out",
    "mlp.out.hook_in": "mlp.hook_post", "mlp.out.hook_out": "hook_mlp_out", "mlp.hook_out": "hook_mlp_out",
}
# The norms' outputs (after gain and bias): hook_normalized only when that is
# what it holds (weights processed by fold_ln, or ln_normalized="after_gain")
NORM_OUT_ALIASES = {
    "ln1.hook_out": "ln1.hook_normalized", "attn.hook_in": "ln1.hook_normalized",
    "attn.q.hook_in": "ln1.hook_normalized", "attn.k.hook_in": "ln1.hook_normalized",
    "attn.v.hook_in": "ln1.hook_normalized",
    "ln2.hook_out": "ln2.hook_normalized", "mlp.hook_in": "ln2.hook_normalized",
    "mlp.in.hook_in": "ln2.hook_normalized",
}
FINAL_ALIASES = {"embed.hook_out": "hook_embed", "pos_embed.hook_out": "hook_pos_embed",
                 "ln_final.hook_out": "unembed.hook_in", "hook_unembed": "unembed.hook_out"}
# Inputs, not activations: the token ids [B, T] and the positions [1, T] (int64)
INPUT_POINTS = ("embed.hook_in", "pos_embed.hook_in")


def aliases(cfg, norm_out_is_normalized):
    """bridge name -> cyformer hook name for a model with this config."""
    block = dict(BLOCK_ALIASES)
    if cfg.gated:  # SwiGLU: "in" is the up product, "gate" the gated one
        block.update({"mlp.in.hook_out": "mlp.hook_pre_linear", "mlp.gate.hook_out": "mlp.hook_pre"})
    else:
        block["mlp.in.hook_out"] = "mlp.hook_pre"
    if norm_out_is_normalized:
        block.update(NORM_OUT_ALIASES)
        if cfg.gated:
            block["mlp.gate.hook_in"] = "ln2.hook_normalized"
    out = {}
    for i in range(cfg.n_layer):
        out.update({f"blocks.{i}.{a}": f"blocks.{i}.{n}" for a, n in block.items()})
    out.update(FINAL_ALIASES)
    out["ln_final.hook_in"] = f"blocks.{cfg.n_layer - 1}.hook_resid_post"
    if cfg.position != "learned":
        del out["pos_embed.hook_out"]
    return out
