"""cyformer.load(): a Hugging Face GPT-2 directory -> Model."""

import os

from .config import read_config
from .errors import ModelLoadError
from .model import Model
from .weights import load_weights


def load(path, *, threads=None):
    """Load a GPT-2 checkpoint directory (config.json + model.safetensors).

    threads: kernel threads; default OMP_NUM_THREADS or the cores this
    process may run on.  Raises ModelLoadError naming the file or tensor
    that is missing or malformed.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: model directory not found")
    cfg = read_config(os.path.join(path, "config.json"))
    weights = load_weights(os.path.join(path, "model.safetensors"), cfg)
    return Model(cfg, weights, threads=threads, path=path)
