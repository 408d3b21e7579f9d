"""cyformer.load(): a Hugging Face GPT-2 directory -> Model."""

import os

from .config import read_config
from .errors import ModelLoadError
from .model import Model
from .tokenizer import load_tokenizer
from .weights import load_weights

DEFAULT_MODEL = "pycode"


def default_model_path():
    """The small code model that ships inside the package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", DEFAULT_MODEL)


def load(path=None, *, threads=None, backend="cython"):
    """Load a GPT-2 checkpoint directory: config.json, model.safetensors and,
    when present, tokenizer.json.  With no path, the bundled default model.

    threads: kernel threads; default OMP_NUM_THREADS or the cores this
    process may run on.  A call uses fewer while other processes keep those
    cores busy (cyformer._cores; CYFORMER_ADAPTIVE_THREADS=0 turns that
    off); results are the same at any count.  backend: "cython" (compiled
    kernels, default), "numpy" (vectorised reference) or "naive"
    (pure-Python teaching code).  Raises ModelLoadError naming the file, key
    or tensor that is missing or malformed.
    """
    try:
        path = default_model_path() if path is None else os.fsdecode(os.fspath(path))
    except TypeError:
        raise ValueError(f"load: path must be a str or os.PathLike, got {path!r}") from None
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: model directory not found")
    cfg = read_config(os.path.join(path, "config.json"))
    weights = load_weights(os.path.join(path, "model.safetensors"), cfg)
    tokenizer = load_tokenizer(path)
    return Model(cfg, weights, threads=threads, path=path, tokenizer=tokenizer, backend=backend)


def reload(path, threads, backend):
    """Unpickling or copying a Model: load its directory again (Model.__reduce__)."""
    return load(path, threads=threads, backend=backend)
