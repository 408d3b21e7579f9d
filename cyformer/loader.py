"""cyformer.load(): a Hugging Face checkpoint directory (or Hub name) -> Model."""

import os

from . import hub
from .config import read_config
from .errors import ModelLoadError
from .gguf import is_gguf as gguf_file, read as read_gguf
from .model import Model
from .model_files import read_generation_config
from .tokenizer import load_tokenizer
from .weights import load_weights

DEFAULT_MODEL = "pycode"


def default_model_path():
    """The small code model that ships inside the package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", DEFAULT_MODEL)


def load(path: "str | os.PathLike | None" = None, *, threads: "int | None" = None, backend: str = "cython",
         dtype: "str | None" = None, fold_ln: bool = False, center_writing_weights: bool = False,
         center_unembed: bool = False, fold_value_biases: bool = False,
         refactor_factored_attn_matrices: bool = False) -> Model:
    """Load a GGUF file (cyformer.gguf) or a checkpoint directory: config.json, model.safetensors and,
    when present, tokenizer.json, tokenizer_config.json (special tokens, chat
    template) and generation_config.json (eos ids, sampling defaults).  With
    no path (or its name, "pycode"), the bundled default model.  A Hugging Face Hub name such as
    "owner/name" that is not a directory is fetched or found in the local
    Hub cache (cyformer.hub; needs ``pip install cyformer[hub]``).

    threads: kernel threads; default OMP_NUM_THREADS or the cores this
    process may run on.  A call uses fewer while other processes keep those
    cores busy (cyformer._cores; CYFORMER_ADAPTIVE_THREADS=0 turns that
    off); results are the same at any count.  backend: "cython" (compiled
    kernels, default), "numpy" (vectorised reference) or "naive"
    (pure-Python teaching code).  dtype: the format of the weight matrices
    (cyformer.formats): "float32", "bfloat16", "int8", "int4", "q8_0" or "q4_0", converted
    at load from a float32, float16 or bfloat16 checkpoint; None keeps what
    the directory holds (float32 for a Hugging Face checkpoint, the saved
    format for one written by Model.save).  Raises ModelLoadError naming the
    file, key or tensor that is missing or malformed.

    fold_ln, center_writing_weights, center_unembed, fold_value_biases,
    refactor_factored_attn_matrices: TransformerLens's weight processing
    (cyformer.processing), off by default (TransformerLens's from_pretrained
    turns the first four on); float32 weights only.
    """
    from .formats import check_format
    from .processing import check_options, process_weights

    if dtype is not None:
        check_format("load", dtype)
    processing = check_options("load", dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                                            center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                                            refactor_factored_attn_matrices=refactor_factored_attn_matrices))
    if any(processing.values()) and dtype not in (None, "float32"):
        raise ValueError(f"load: weight processing rewrites the matrices in float32; it cannot be combined "
                         f"with dtype={dtype!r}")
    try:
        where: str = default_model_path() if path is None else os.fsdecode(os.fspath(path))
    except TypeError:
        raise ValueError(f"load: path must be a str or os.PathLike, got {path!r}") from None
    if where == DEFAULT_MODEL and not os.path.isdir(where):
        where = default_model_path()  # the bundled model by its name, as `cyformer serve` calls it
    if os.path.isfile(where) and (where.endswith(".gguf") or gguf_file(where)):  # llama.cpp's format
        if any(processing.values()):
            raise ValueError("load: weight processing is not available for a GGUF file")
        cfg, weights, tokenizer, generation, tensors = read_gguf(where, dtype)
        model = Model(cfg, weights, threads=threads, path=where, tokenizer=tokenizer, backend=backend,
                      generation_config=generation, reload=reload)
        model.gguf_tensors = tensors  # cyformer info: per tensor kind
        model.load_dtype = dtype  # pickling loads the file again the same way
        return model
    where = hub.resolve(where)  # a Hub name ("owner/name") -> its cached snapshot
    if not os.path.isdir(where):
        hint = ""
        if "/" not in where and os.sep not in where:
            hint = (f" (a Hugging Face Hub model is named owner/name, e.g. openai-community/{where}; "
                    f"the bundled model is {DEFAULT_MODEL!r})")
        raise ModelLoadError(f"{where}: model directory not found{hint}")
    cfg = read_config(os.path.join(where, "config.json"))
    weights = load_weights(where, cfg, dtype=dtype, progress=_progress(cfg, dtype))
    tokenizer = load_tokenizer(where)
    generation = read_generation_config(where, cfg.vocab_size)
    model = Model(cfg, weights, threads=threads, path=where, tokenizer=tokenizer, backend=backend,
                  generation_config=generation, reload=reload)
    return process_weights(model, **processing) if any(processing.values()) else model


def _progress(cfg, dtype):
    """A progress bar for converting a large model (tqdm, when installed)."""
    if dtype in (None, "float32") or cfg.n_params() < 50_000_000:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = None

    def update(done, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=f"converting to {dtype}", unit="tensor", leave=False)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def reload(path, threads, backend, dtype=None, processing=None):
    """Unpickling or copying a Model: load its directory again (Model.__reduce__)."""
    return load(path, threads=threads, backend=backend, dtype=dtype, **(processing or {}))
