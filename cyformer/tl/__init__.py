"""TransformerLens's surface, as a layer that wraps a cyformer Model.

TransformerLens (Nanda et al.) is where most interpretability code is
written; this package lets that code run here unchanged where it does not
need gradients.  It wraps a Model as TransformerLens 4's bridge wraps a
Hugging Face model, and it is the same machinery as cyformer's own API: the
hook points of cyformer.hooks, the Model's hooked pass, the weight views of
cyformer.parts, the weight processing of cyformer.processing.

Which arrays come out is chosen by the entry point:

    TransformerBridge.boot_transformers(path)   torch tensors (views of cyformer's
                                                buffers, no copy); needs torch
    HookedTransformer(model)                    NumPy arrays; no torch needed
    HookedTransformer(model, tensors="torch")   torch tensors over a loaded Model

    api      HookedTransformer / TransformerBridge: cfg, stacked W_Q ... b_U,
             QK/OV, hook points (also as module attributes), run_with_cache,
             run_with_hooks, loss_fn, generate, to_tokens ...
    cache    ActivationCache: shorthand keys, accumulated_resid, decompose_resid,
             stack_head_results, apply_ln_to_stack, logit_attrs, remove_batch_dim
    names    get_act_name, and the bridge's names (hook_in/hook_out) of the same points
    factored FactoredMatrix (eigenvalues, svd(), norm()) over NumPy or torch
    arrays   the NumPy <-> torch edge

What needs gradients (backward hooks, requires_grad tensors) or devices
raises cyformer.errors.TorchRequired.
"""

from .api import HookedTransformer, TransformerBridge
from .cache import ActivationCache
from .factored import FactoredMatrix
from .names import get_act_name
from ..processing import process_weights

__all__ = ["HookedTransformer", "TransformerBridge", "ActivationCache", "FactoredMatrix", "get_act_name",
           "process_weights"]
