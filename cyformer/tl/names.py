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
