"""What the TransformerLens surface hands out: NumPy arrays or torch tensors.

cyformer computes in NumPy.  The torch surface (``tensors="torch"``, the
TransformerBridge) wraps each array with ``torch.from_numpy``: a view of
the same buffer, no copy, so an in-place edit of a tensor a hook receives
is an edit of the activation the forward pass goes on with.  Tensors that
come back (a hook's replacement, a stack handed to a cache method) are read
through ``Tensor.numpy()``, again without a copy where they are float32 on
the CPU.  Gradients stay out of scope: a tensor that needs one is refused.
"""

import numpy as np

from ..errors import TorchRequired

KINDS = ("numpy", "torch")


def check_kind(fn, tensors):
    if not isinstance(tensors, str) or tensors not in KINDS:
        raise ValueError(f"{fn}: tensors must be 'numpy' or 'torch', got {tensors!r}")
    if tensors == "torch":
        torch_module(fn)
    return tensors


def torch_module(fn="tensors='torch'"):
    try:
        import torch
    except ImportError:
        raise TorchRequired(f"{fn}: torch tensors need PyTorch: pip install 'cyformer[tl]' "
                            "(or use cyformer.tl.HookedTransformer(model), which hands out NumPy arrays)") from None
    return torch


class Arrays:
    """Conversions at the surface's edge for one kind ("numpy" or "torch")."""

    def __init__(self, kind):
        self.kind = kind
        self.torch = torch_module() if kind == "torch" else None

    def out(self, x):
        """A NumPy array (or a Python scalar) -> what users of this kind get."""
        if self.torch is None or x is None:
            return x
        if isinstance(x, np.ndarray):
            if not x.flags.writeable:  # read-only (memory-mapped) weights: torch needs a buffer it may write
                x = x.copy()
            return self.torch.from_numpy(x)
        if isinstance(x, (float, np.floating)):
            return self.torch.tensor(float(x), dtype=self.torch.float64)
        return x

    def scalar(self, x):
        """A float result (a mean loss) -> float (NumPy) or a 0-d float32 tensor (torch)."""
        if self.torch is None:
            return x
        return self.torch.tensor(x, dtype=self.torch.float32)

    def numpy(self, x, fn="cyformer.tl"):
        """Anything array-like (a tensor included) -> a NumPy array, a view where possible."""
        if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor
            if getattr(x, "requires_grad", False):
                raise TorchRequired(f"{fn}: this tensor requires grad; cyformer computes no gradients "
                                    "(use torch.no_grad() or .detach())")
            if getattr(x, "device", None) is not None and x.device.type != "cpu":
                raise TorchRequired(f"{fn}: cyformer's arrays live on the CPU, got a tensor on {x.device}")
            return x.resolve_conj().resolve_neg().numpy()
        return np.asarray(x)

    def hook(self, fn):
        """A user's hook -> a hook that cyformer.hooks calls with NumPy arrays,
        keeping its style (``fn(activation, hook)`` or ``fn(activation, name)``)."""
        if self.torch is None:
            return fn
        from ..hooks import takes_hook_point

        def call(activation, other, keyword):
            if activation.flags.writeable:
                tensor, copied = self.torch.from_numpy(activation), False
            else:  # an edit in place must still reach the pass: hand out a copy, return it
                tensor, copied = self.torch.from_numpy(activation.copy()), True
            new = fn(tensor, **{keyword: other}) if keyword else fn(tensor, other)
            if new is None:
                return tensor.numpy() if copied else None
            if new is tensor and not copied:
                return activation
            return self.numpy(new, f"hook on {getattr(other, 'name', other)}")

        if takes_hook_point(fn):
            def wrapped(activation, hook):
                return call(activation, hook, "hook")
        else:
            def wrapped(activation, name):
                return call(activation, name, None)
        return wrapped
