"""cyformer: transformer inference on the CPU (GPT-2 and the Llama family:
Llama, Mistral, Qwen2, SmolLM), in Cython + OpenMP.

    import cyformer
    model = cyformer.load("path/to/model")     # a Hugging Face checkpoint directory or a GGUF file
    logits = model.forward([464, 3290, 318])   # [T, vocab] float32
"""

import importlib.util as _util
import os as _os

if _util.find_spec("cyformer._runtime") is None:
    # Python found this source directory before the installed package (the
    # current directory comes first on sys.path), and nothing is built here.
    _here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    raise ImportError(
        f"cyformer is being imported from its source checkout ({_here}), where the compiled "
        "kernels are not built, instead of from the installed package.  Run Python from "
        "outside the checkout (cd elsewhere), or install it editable (pip install -e .), or "
        "build in place (python setup.py build_ext --inplace).")

from ._version import __version__
from .errors import ChatTemplateError, CyformerError, ModelLoadError, TokenizerError
from .config import Config
from .loader import load
from .model import Model
from .info import build_info

__all__ = ["load", "Model", "Config", "build_info", "CyformerError", "ModelLoadError",
           "TokenizerError", "ChatTemplateError", "__version__"]
