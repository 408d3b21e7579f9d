"""TransformerLens's weight processing; it lives in the core (cyformer.processing)."""

from ..processing import OPTIONS, check_options, process_weights, processed_weights

__all__ = ["OPTIONS", "check_options", "process_weights", "processed_weights"]
