"""Prompts to ids and ids to labels, shared by the analyses and the exports."""

from .. import _checks

_VISIBLE = {" ": "\u00b7", "\n": "\u21b5", "\t": "\u2192"}


def check_model(fn, model):
    """model must be a cyformer.Model (the interp functions take one first)."""
    from ..model import Model

    if not isinstance(model, Model):
        raise TypeError(f"{fn}: model must be a cyformer.Model (from cyformer.load), got {type(model).__name__}")
    return model


def token_labels(model, ids):
    """One printable label per token: its text when there is a tokenizer, else its id."""
    check_model("token_labels", model)
    ids = _checks.token_ids("token_labels", "ids", ids, model.config.vocab_size, ndim=1).tolist()
    if not model.tokenizer.available:
        return [str(i) for i in ids]
    return [model.tokenizer.decode([i]) for i in ids]


def display_token(text):
    """A token's text made visible: spaces as '\u00b7', newlines as '\u21b5', tabs as '\u2192',
    other control characters escaped, the empty string as '\u2205'."""
    out = "".join(_VISIBLE.get(ch, ch if ch.isprintable() else repr(ch)[1:-1]) for ch in text)
    return out if out else "\u2205"


def as_ids(model, prompt, fn):
    """One sequence's ids [T] from a str or 1-D ids, validated."""
    check_model(fn, model)
    if isinstance(prompt, str):
        prompt = model.encode(_checks.text(fn, "prompt", prompt))
    ids, batched = _checks.check_ids(prompt, model.config, fn)
    if batched:
        raise ValueError(f"{fn}: takes one sequence (1-D ids or a str), got shape {ids.shape}")
    return ids[0]
