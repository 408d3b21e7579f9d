"""Looking inside a model: activations, interventions, parts and analyses.

    logits, cache = model.run_with_cache(ids)                # every hook point
    cache["blocks.3.attn.hook_pattern"]                      # [H, T, T]
    model.run_with_hooks(ids, fwd_hooks=[("blocks.3.attn.hook_z", ablate)])
    head = model.blocks[3].attn.heads[5]                     # W_Q, W_K, W_V, W_O views
    head.ov_circuit().singular_values()
    logit_lens(model, "def add(a, b):")
    direct_logit_attribution(model, ids, token)

(hook names, HookPoints and ActivationCache live in cyformer.hooks; heads,
neurons, the unembedding and FactoredMatrix in cyformer.parts: the Model
hands them out.  Both are re-exported here.)
lens     logit lens and direct logit attribution
export   attention patterns as PNG (matplotlib) or self-contained HTML
cost     what caching everything costs next to a plain forward
"""

from .export import PlotUnavailable, attention_patterns, save_html, save_png
from ..hooks import ActivationCache, HookPoints, hook_names
from .lens import LogitAttribution, LogitLens, direct_logit_attribution, logit_lens
from .tokens import token_labels
from ..parts import FactoredMatrix

__all__ = ["ActivationCache", "HookPoints", "hook_names", "FactoredMatrix", "logit_lens",
           "LogitLens", "direct_logit_attribution", "LogitAttribution", "attention_patterns",
           "save_png", "save_html", "PlotUnavailable", "token_labels"]
