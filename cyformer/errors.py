"""Exceptions cyformer raises on purpose."""


class CyformerError(Exception):
    """Base class of every error cyformer raises for a problem it detected."""


class ModelLoadError(CyformerError):
    """A model directory, config or weights file is missing, malformed or inconsistent."""


class TokenizerError(CyformerError):
    """Text was given or asked for, but the model has no usable tokenizer."""


class ChatTemplateError(CyformerError):
    """The model has no chat template, or its template failed on the messages given."""


class TorchRequired(CyformerError, NotImplementedError):
    """A TransformerLens feature that needs PyTorch (gradients, backward hooks,
    devices); cyformer computes with NumPy on the CPU, forward passes only."""


class StructuredOutputUnavailable(CyformerError, ImportError):
    """Structured output (a JSON schema or grammar) was asked for, but llguidance
    is not installed: pip install 'cyformer[structured]'."""


class IndexOutOfRange(CyformerError, IndexError):
    """A layer, position or other index outside the axis it indexes (an
    IndexError, as NumPy and TransformerLens raise, with a message naming it)."""
