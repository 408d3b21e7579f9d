"""Attention patterns as pictures: a PNG heatmap (matplotlib) or a self-contained HTML page.

Each panel is one head's pattern [query, key]: row q shows how the token at
position q spreads its attention over positions 0..q.  Cells above the
diagonal are masked (a position never sees later ones) and drawn blank.

The PNG needs matplotlib (``pip install cyformer[plot]``); the HTML needs
nothing: inline CSS, no scripts, no external files.
"""

import html
import os
from collections.abc import Mapping

import numpy as np

from .. import _checks
from ..errors import CyformerError
from .tokens import as_ids, check_model, display_token, token_labels  # noqa: F401 (display_token re-exported)


class PlotUnavailable(CyformerError, ImportError):
    """matplotlib is needed for PNG output and is not installed."""


def attention_patterns(model, prompt, layers=None, heads=None):
    """Run ``prompt`` (a str or 1-D ids) and collect the chosen heads' patterns.

    layers, heads: an int, a list of ints, or None (all).  Returns (tokens,
    {(layer, head): pattern [T, T]}) in layer-major order.
    """
    cfg = check_model("attention_patterns", model).config
    layers = _pick("attention_patterns: layer", layers, cfg.n_layer)
    heads = _pick("attention_patterns: head", heads, cfg.n_head)
    ids = as_ids(model, prompt, "attention_patterns")
    _, cache = model.run_with_cache(ids, names=[f"blocks.{i}.attn.hook_pattern" for i in layers])
    patterns = {(i, h): cache[f"blocks.{i}.attn.hook_pattern"][h] for i in layers for h in heads}
    return token_labels(model, ids), patterns


def _pick(what, value, n):
    values = list(range(n)) if value is None else [value] if np.ndim(value) == 0 else list(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < n:
            raise ValueError(f"{what} must be in 0..{n - 1}, got {v!r}")
    return [int(v) for v in values]


_NO_MATPLOTLIB = ("PNG output needs matplotlib: pip install 'cyformer[plot]' "
                  "(or write HTML, which needs nothing)")


def require_matplotlib():
    """Raise PlotUnavailable unless matplotlib can be imported (check before long work)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(_NO_MATPLOTLIB) from None


def _check_picture(fn, path, tokens, patterns):
    """-> (path as str, tokens as a list of str, {(layer, head): float64 [T, T]}),
    or ValueError naming the argument that is not what the pictures need."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise ValueError(f"{fn}: path must be a str or os.PathLike, got {type(path).__name__}") from None
    try:
        listed = None if isinstance(tokens, (str, bytes)) else list(tokens)
    except TypeError:
        listed = None
    if listed is None:
        raise ValueError(f"{fn}: tokens must be a list of str, got {type(tokens).__name__}")
    tokens = [_checks.text(fn, f"tokens[{i}]", t) for i, t in enumerate(listed)]
    T = len(tokens)
    if not isinstance(patterns, Mapping) or not patterns:
        raise ValueError(f"{fn}: patterns must be a non-empty dict {{(layer, head): [T, T] array}}, "
                         f"got {type(patterns).__name__}")
    out = {}
    for key, pat in patterns.items():
        if (not isinstance(key, tuple) or len(key) != 2
                or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in key)):
            raise ValueError(f"{fn}: patterns keys must be (layer, head) pairs of ints, got {key!r}")
        try:
            a = np.asarray(pat, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{fn}: patterns[{key}] is not an array of numbers ({e})") from None
        if a.shape != (T, T):
            raise ValueError(f"{fn}: patterns[{key}] has shape {a.shape}; {T} tokens need ({T}, {T})")
        visible = a[np.tril_indices(T)]  # the masked upper triangle is never drawn
        if not np.isfinite(visible).all():
            raise ValueError(f"{fn}: patterns[{key}] holds NaN or infinity where a weight is drawn")
        out[(int(key[0]), int(key[1]))] = a
    return path, tokens, out


def save_png(path, tokens, patterns, dpi=110):
    """Draw the patterns ({(layer, head): [T, T]}) as a grid, layers down and
    heads across, with token labels on the axes, and write it to ``path``."""
    path, tokens, patterns = _check_picture("save_png", path, tokens, patterns)
    dpi = _checks.integer("save_png", "dpi", dpi)
    if not 1 <= dpi <= 2400:
        raise ValueError(f"save_png: dpi must be in [1, 2400], got {dpi}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(_NO_MATPLOTLIB) from None
    layers = sorted({i for i, _ in patterns})
    heads = sorted({h for _, h in patterns})
    T = len(tokens)
    labels = [display_token(t) for t in tokens]
    nr, nc = len(layers), len(heads)
    single = nr * nc == 1
    panel = max(3.0, min(12.0, 0.28 * T)) if single else max(1.8, min(4.5, 0.16 * T + 0.6))
    show_labels = T <= (80 if single else 40)
    fontsize = max(4.0, min(9.0, 360.0 / max(T, 1) / (1 if single else max(nc, 2) / 2)))
    fig = Figure(figsize=(panel * nc + 1.2, panel * nr + 0.8), dpi=dpi, constrained_layout=True)
    FigureCanvasAgg(fig)
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)
    axes = fig.subplots(nr, nc, squeeze=False)
    image = None
    for r, i in enumerate(layers):
        for c, h in enumerate(heads):
            ax = axes[r][c]
            data = np.ma.masked_array(patterns[(i, h)], mask=mask)
            image = ax.imshow(data, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_facecolor("#f2f2f2")
            ax.set_title(f"L{i} H{h}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
            if show_labels and (single or c == 0):
                ax.set_yticks(range(T), labels, fontsize=fontsize)
            if show_labels and (single or r == nr - 1):
                ax.set_xticks(range(T), labels, fontsize=fontsize, rotation=90)
    fig.colorbar(image, ax=[ax for row in axes for ax in row], shrink=0.8 if single else 0.6,
                 label="attention weight")
    for ax in axes[-1]:
        ax.set_xlabel("key (attended to)", fontsize=8)
    for row in axes:
        row[0].set_ylabel("query (attending)", fontsize=8)
    fig.suptitle("attention patterns: each row is one query position's weights over the keys",
                 fontsize=10)
    fig.savefig(path, format="png", bbox_inches="tight")  # PNG whatever the file is called
    return path


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.2em; } h2 { font-size: 1em; margin: 1.2em 0 .4em; }
.prompt { font-family: ui-monospace, monospace; white-space: pre-wrap; background: #f6f6f6; padding: .5em; }
.prompt span:nth-child(even) { background: #dde6f3; }
.panels { display: flex; flex-wrap: wrap; gap: 1.2em; align-items: flex-start; }
.panel h3 { font-size: .9em; margin: 0 0 .3em; }
table.attn { border-collapse: collapse; font-family: ui-monospace, monospace; font-size: 11px; }
table.attn td { width: 14px; height: 14px; padding: 0; border: 1px solid #fff; }
table.attn td.m { background: #f2f2f2; }
table.attn th { font-weight: normal; padding: 0 4px; white-space: pre; max-width: 9em;
                overflow: hidden; text-overflow: ellipsis; }
table.attn th.k { writing-mode: vertical-rl; transform: rotate(180deg); vertical-align: bottom;
                  padding: 4px 0; max-height: 9em; }
table.attn th.q { text-align: right; }
.note { color: #666; font-size: .85em; }
"""


def _cell(w, tip):
    # white at 0 to dark blue at 1, as matplotlib's "Blues" ends
    a = float(min(max(w, 0.0), 1.0))
    r, g, b = (int(round(255 + (t - 255) * a)) for t in (8, 48, 107))
    return f'<td style="background:#{r:02x}{g:02x}{b:02x}" title="{tip} {w:.3f}"></td>'


def save_html(path, tokens, patterns, title="cyformer attention"):
    """Write the patterns ({(layer, head): [T, T]}) as one self-contained HTML
    page: a panel per head with the tokens on both axes; hovering a cell
    shows its weight.  About 50 bytes per visible cell: heads x T (T + 1) / 2
    cells in all, so pick layers or heads for long prompts."""
    path, tokens, patterns = _check_picture("save_html", path, tokens, patterns)
    title = _checks.text("save_html", "title", title)
    labels = [display_token(t) for t in tokens]
    esc = [html.escape(t) for t in labels]
    T = len(tokens)
    tips = [[html.escape(f"{labels[q]}\u2192{labels[k]}", quote=True) for k in range(q + 1)]
            for q in range(T)]
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             '<div class="prompt">' + "".join(f'<span title="token {i}">{html.escape(t)}</span>'
                                              for i, t in enumerate(tokens)) + "</div>",
             '<p class="note">The prompt above shades alternate tokens. Each panel is one head. '
             "Row: the query position attending; column: the key position attended to; darker "
             "is more weight (rows sum to 1). Hover a cell for its value. Grey cells are masked: "
             "a position never sees later ones.</p>"]
    layers = sorted({i for i, _ in patterns})
    for i in layers:
        parts.append(f"<h2>layer {i}</h2><div class=\"panels\">")
        for (li, h), pat in patterns.items():
            if li != i:
                continue
            rows = ["<tr><th></th>" + "".join(f'<th class="k">{t}</th>' for t in esc) + "</tr>"]
            for q in range(T):
                cells = "".join(_cell(pat[q, k], tips[q][k]) if k <= q else '<td class="m"></td>'
                                for k in range(T))
                rows.append(f'<tr><th class="q">{esc[q]}</th>{cells}</tr>')
            parts.append(f'<div class="panel"><h3>L{i} H{h}</h3><table class="attn">'
                         + "".join(rows) + "</table></div>")
        parts.append("</div>")
    parts.append("</body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return path
