"""Reading the residual stream in token space: the logit lens and direct logit attribution.

logits = ln_f(resid_final) @ lm_head.T, and resid_final is a sum: the
embeddings plus every attention head's write, every layer's attention bias
and every MLP layer's output.

Logit lens (nostalgebraist, 2020): put the residual stream after each layer
through ln_f and the unembedding as if it were the last, and see which tokens
it already favours.

Direct logit attribution: ln_f(x) = (x - mean(x)) / s * g + b is linear in x
once the scale s = sqrt(var(x) + eps) is frozen at its value in the actual
run (as TransformerLens does).  Centring is linear too, so each component
c contributes

    (c - mean(c)) / s . (g * u_t)        u_t = lm_head[t]

to token t's logit, and the contributions plus b . u_t add up to the logit.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import List

import numpy as np

from .. import _checks
from ..kernels import linalg, norm
from .tokens import as_ids as _as_ids, check_model, display_token, token_labels  # noqa: F401



@dataclass
class LogitLens:
    """Top-k tokens of each layer's residual stream read through the final norm and the unembedding.

    Row 0 of every array reads the embeddings, row i + 1 the stream after
    block i (labels "embed", "L0", ...); the last row is the final stream,
    whose lens is the model's own prediction.  ids [T] the input; top_ids [L+1, T, k]; top_probs
    [L+1, T, k] softmax probabilities; labels: row names; ``tokens[L+1][T][k]``
    the decoded top tokens (ids as text when there is no tokenizer).
    """

    ids: np.ndarray
    input_tokens: List[str]
    labels: List[str]
    top_ids: np.ndarray
    top_probs: np.ndarray
    tokens: List[List[List[str]]]

    def format(self, width=10):
        """A table: one row per layer, one column per position, the top-1 token
        in each cell (cut to ``width`` characters)."""
        width = _checks.integer("LogitLens.format", "width", width)
        texts = self.input_tokens + [t[0] for row in self.tokens for t in row]
        width = max(1, min(width, max(len(display_token(t)) for t in texts)))

        def cell(text):
            text = display_token(text)
            return (text if len(text) <= width else text[:width - 1] + "~").ljust(width)

        head = " " * 8 + " ".join(cell(t) for t in self.input_tokens)
        rows = [head.rstrip(), "-" * len(head.rstrip())]
        for r, label in enumerate(self.labels):
            rows.append((label.ljust(8) + " ".join(cell(self.tokens[r][t][0])
                                                   for t in range(len(self.input_tokens)))).rstrip())
        return "\n".join(rows)


def logit_lens(model, prompt, k=5):
    """The logit lens of one sequence (a str or 1-D ids); returns a LogitLens."""
    ids = _as_ids(model, prompt, "logit_lens")
    cfg = model.config
    k = _checks.integer("logit_lens", "k", k)
    if not 1 <= k <= cfg.vocab_size:
        raise ValueError(f"logit_lens: k must be in [1, {cfg.vocab_size}], got {k}")
    L = cfg.n_layer
    names = [f"blocks.{i}.hook_resid_pre" for i in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    _, cache = model.run_with_cache(ids, names=names)
    T = len(ids)
    top_ids = np.empty((L + 1, T, k), dtype=np.int64)
    top_probs = np.empty((L + 1, T, k), dtype=np.float32)
    ln = model.float_weights.ln_f
    for r, name in enumerate(names):
        x = norm.norm_forward(cfg.norm, cache[name], ln.weight, ln.bias, cfg.norm_eps,
                              threads=model.threads)
        logits = linalg.linear_forward(x, model.weights.lm_head, model.weights.lm_head_bias, w_transposed=True,
                                       threads=model.threads)
        top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(logits, top, axis=1), axis=1, kind="stable")
        top_ids[r] = np.take_along_axis(top, order, axis=1)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=np.float64)
        probs = shifted / shifted.sum(axis=1, keepdims=True)
        top_probs[r] = np.take_along_axis(probs, top_ids[r], axis=1)
    labels = ["embed"] + [f"L{i}" for i in range(L)]
    tokens = [[token_labels(model, top_ids[r, t]) for t in range(T)] for r in range(L + 1)]
    return LogitLens(ids=ids, input_tokens=token_labels(model, ids), labels=labels,
                     top_ids=top_ids, top_probs=top_probs, tokens=tokens)


@dataclass
class LogitAttribution:
    """Direct contributions to one token's logit at one position.

    embed, pos_embed: floats (pos_embed 0 for rotary models); heads [L, H];
    attn_bias [L] (each layer's c_proj bias, 0 where there is none); mlp
    [L]; ln_final_bias: b . u_t (0 for RMSNorm).  ``total()`` adds them all;
    ``logit`` is the model's actual logit, equal to total() up to rounding.
    All float64.  The final norm's scale is frozen at its value in the run;
    layer norm also centres each component (RMSNorm does not).
    """

    token: int
    position: int
    logit: float
    embed: float
    pos_embed: float
    heads: np.ndarray
    attn_bias: np.ndarray
    mlp: np.ndarray
    ln_final_bias: float

    def total(self):
        return (self.embed + self.pos_embed + self.heads.sum() + self.attn_bias.sum()
                + self.mlp.sum() + self.ln_final_bias)

    def items(self):
        """(label, contribution) for every component, in model order."""
        out = [("embed", self.embed), ("pos_embed", self.pos_embed)]
        for i in range(len(self.mlp)):
            out += [(f"L{i}H{h}", float(v)) for h, v in enumerate(self.heads[i])]
            out += [(f"L{i} attn bias", float(self.attn_bias[i])), (f"L{i} mlp", float(self.mlp[i]))]
        return out + [("ln_final bias", self.ln_final_bias)]

    def top(self, n=10):
        """The n components with the largest |contribution|."""
        n = _checks.integer("LogitAttribution.top", "n", n)
        if n < 0:
            raise ValueError(f"LogitAttribution.top: n must be >= 0, got {n}")
        return sorted(self.items(), key=lambda kv: -abs(kv[1]))[:n]


def _check_cache(fn, cache, shapes, embed):
    """The entries of a caller's cache as float arrays of the expected shapes,
    from a run of this prompt (hook_embed must be its token embeddings)."""
    out = {}
    for name, shape in shapes.items():
        try:
            a = np.asarray(cache[name], dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{fn}: cache[{name!r}] is not an array of numbers ({e})") from None
        if a.shape != shape:
            raise ValueError(f"{fn}: cache[{name!r}] has shape {a.shape}, not {shape}: the cache is "
                             "not of this prompt (or has a batch axis)")
        out[name] = a
    if not np.array_equal(out["hook_embed"], embed):
        raise ValueError(f"{fn}: cache is not of this prompt: its hook_embed differs from the "
                         "prompt's token embeddings")
    return out


def direct_logit_attribution(model, prompt, token, position=-1, cache=None):
    """Split token's logit at ``position`` into its direct contributions.

    prompt: a str or 1-D ids; token: a token id (or a str that encodes to one
    token).  ``cache`` may be a run_with_cache cache of this prompt (one
    sequence) holding hook_embed, hook_pos_embed, attn.hook_result,
    hook_mlp_out and ln_final.hook_scale/hook_normalized; otherwise those
    are computed.  A cache whose shapes or token embeddings are not this
    prompt's is refused.
    """
    fn = "direct_logit_attribution"
    ids = _as_ids(model, prompt, fn)
    cfg = model.config
    T, L = len(ids), cfg.n_layer
    if isinstance(token, str):
        enc = model.encode(_checks.text(fn, "token", token))
        if len(enc) != 1:
            raise ValueError(f"{fn}: token {token!r} is {len(enc)} tokens, not one")
        token = enc[0]
    token = _checks.integer(fn, "token", token)
    if not 0 <= token < cfg.vocab_size:
        raise ValueError(f"{fn}: token {token} is outside [0, {cfg.vocab_size})")
    position = _checks.integer(fn, "position", position)
    if not -T <= position < T:
        raise ValueError(f"{fn}: position {position} is outside a sequence of {T}")
    p = position % T
    learned = cfg.position == "learned"
    C, H = cfg.n_embd, cfg.n_head
    shapes = {"hook_embed": (T, C), **({"hook_pos_embed": (T, C)} if learned else {}),
              "ln_final.hook_scale": (T, 1), "ln_final.hook_normalized": (T, C),
              **{f"blocks.{i}.attn.hook_result": (T, H, C) for i in range(L)},
              **{f"blocks.{i}.hook_mlp_out": (T, C) for i in range(L)}}
    if cache is not None and not isinstance(cache, Mapping):
        raise ValueError(f"{fn}: cache must be a run_with_cache cache (a mapping), got {type(cache).__name__}")
    if cache is None or any(n not in cache for n in shapes):
        _, cache = model.run_with_cache(ids, names=list(shapes))
    else:
        cache = _check_cache(fn, cache, shapes, model.float_weights.wte[ids])
    ln = model.float_weights.ln_f
    u = model.float_weights.lm_head[token].astype(np.float64)
    direction = ln.weight.astype(np.float64) * u / float(cache["ln_final.hook_scale"][p, 0])

    centre = cfg.norm == "layer_norm"

    def contrib(v):
        """Components [..., C] at position p (centred by layer norm) . direction."""
        v = np.asarray(v, dtype=np.float64)
        return (v - v.mean(axis=-1, keepdims=True) if centre else v) @ direction

    zero = np.zeros(cfg.n_embd)
    b_O = np.stack([model.float_weights.blocks[i].attn_c_proj.bias if model.float_weights.blocks[i].attn_c_proj.bias
                    is not None else zero for i in range(L)])
    logit = float(cache["ln_final.hook_normalized"][p].astype(np.float64) @ u)
    return LogitAttribution(
        token=token, position=p, logit=logit,
        embed=float(contrib(cache["hook_embed"][p])),
        pos_embed=float(contrib(cache["hook_pos_embed"][p])) if learned else 0.0,
        heads=np.stack([contrib(cache[f"blocks.{i}.attn.hook_result"][p]) for i in range(L)]),
        attn_bias=contrib(b_O),
        mlp=np.array([contrib(cache[f"blocks.{i}.hook_mlp_out"][p]) for i in range(L)]),
        ln_final_bias=float(ln.bias.astype(np.float64) @ u) if ln.bias is not None else 0.0,
    )
