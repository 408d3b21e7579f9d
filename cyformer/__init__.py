"""cyformer: GPT-2-style transformer inference on the CPU, in Cython + OpenMP.

    import cyformer
    model = cyformer.load("path/to/gpt2")      # a Hugging Face GPT-2 directory
    logits = model.forward([464, 3290, 318])   # [T, vocab] float32
"""

from .errors import CyformerError, ModelLoadError, TokenizerError
from .config import Config
from .loader import load
from .model import Model
from .info import build_info

__version__ = "0.1.0"
__all__ = ["load", "Model", "Config", "build_info", "CyformerError", "ModelLoadError",
           "TokenizerError", "__version__"]
