"""TransformerLens's surface on a cyformer Model, over NumPy arrays.

TransformerLens (Nanda et al.) is where most interpretability code is
written; this package lets that code run here unchanged where it does not
need PyTorch itself.  It is the same machinery as cyformer's own API, not a
second one: the hook points of cyformer.hooks, the hooked backend, the
weight views of cyformer.parts.

    names    get_act_name: "pattern", 0 -> "blocks.0.attn.hook_pattern"
    cache    ActivationCache: shorthand keys, accumulated_resid,
             decompose_resid, stack_head_results, apply_ln_to_stack,
             logit_attrs, remove_batch_dim
    api      LensAPI, the Model's TransformerLens attributes: cfg, stacked
             W_Q ... b_U, QK/OV, hook_dict, add_hook, hooks(), to_tokens ...
    run      run_with_cache / run_with_hooks with TransformerLens's arguments
    process  fold_ln, center_writing_weights, center_unembed, fold_value_biases

What needs PyTorch (gradients, backward hooks, devices) raises
cyformer.errors.TorchRequired.
"""

from .cache import ActivationCache
from .names import get_act_name

__all__ = ["ActivationCache", "get_act_name"]
