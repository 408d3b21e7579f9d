"""Model.save(): a converted model as a Hugging Face-style directory.

The directory holds the source's config.json and tokenizer files, and a
model.safetensors with cyformer's parameter names (cyformer.arch) in the
kernel layout: float32 norms, biases and position table, and every matrix
in the chosen format (bfloat16 as BF16, int8 as I8 with a ``<name>.scale``
tensor, int4 as U8 pairs with its group scales).  The header's metadata says
the format and which formats hold a row per output (``cyformer.rows_out``),
so ``cyformer.load(dir)`` maps the file without converting anything.
"""

import json
import os
import shutil

import numpy as np

from ._checks import path_arg
from .errors import CyformerError
from .formats import TABLE
from .weights import SAVED_FORMAT_KEY, SAVED_GROUP_KEY, SAVED_LAYOUT_KEY, SAVED_ROWS_OUT_KEY

# Files copied from the source directory when present.
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "chat_template.jinja")


def save(model, directory):
    """Write ``model`` (its current weight format) to ``directory``; returns the path."""
    try:
        return _save(model, directory)
    except UnicodeError:
        raise ValueError("save: directory is not a valid file name (undecodable characters)") from None
    except OSError as e:
        raise CyformerError(f"save: cannot write {str(directory)[:200]!r}: {e.strerror or e}") from None


def _save(model, directory):
    from ._version import __version__
    from .formats import Packed

    directory = path_arg("save: directory", directory)
    done = [k for k, v in (getattr(model, "processing", None) or {}).items() if v]
    if done:
        raise CyformerError(f"save: the weights are processed for analysis ({', '.join(done)}); save the model "
                            f"as loaded and process it after loading (cyformer.load(..., {done[0]}=True))")
    src = model.path
    if src is None or not os.path.isfile(os.path.join(src, "config.json")):
        raise CyformerError("save: the model was not loaded from a directory with a config.json, "
                            "so there is no configuration to write")
    _refuse_source(directory, src)
    os.makedirs(directory, exist_ok=True)
    w, cfg = model.weights, model.config
    tensors = {}

    def put(name, arr):
        if arr is None:
            return
        if isinstance(arr, Packed):
            tensors[name] = np.ascontiguousarray(arr.data)
            if arr.scale is not None:
                tensors[name + ".scale"] = np.ascontiguousarray(arr.scale)
        else:
            tensors[name] = np.ascontiguousarray(arr)

    put("wte", w.wte)
    put("wpe", w.wpe)
    put("ln_f.weight", w.ln_f.weight)
    put("ln_f.bias", w.ln_f.bias)
    if not w.tied:
        put("lm_head", w.lm_head)
    from .arch import LAYER_PARAMS
    for i, b in enumerate(w.blocks):
        for name in LAYER_PARAMS:
            put(f"blocks.{i}.{name}", b.param(name))
    fmt = model.dtype
    meta = {SAVED_LAYOUT_KEY: "kernel", SAVED_FORMAT_KEY: fmt, SAVED_GROUP_KEY: "32",
            SAVED_ROWS_OUT_KEY: ",".join(name for name, f in TABLE.items() if f.rows_out),
            "cyformer.version": __version__}
    _refuse_source(directory, src)  # again, just before writing: nothing may have moved in between
    tmp = os.path.join(directory, "model.safetensors.tmp")
    write_safetensors(tmp, tensors, meta)
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["cyformer_dtype"] = fmt
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in COPIED:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(directory, name))
    return directory


WRITTEN = ("model.safetensors", "model.safetensors.tmp", "config.json") + COPIED


def _refuse_source(directory, src):
    """Refuse a target that is the source or would write into it: the
    directories compared by real path (a symlink or another spelling of the
    same directory is the same directory), and every file save writes
    compared with the source's files, since the weights are memory-mapped
    from there and a write through a link would overwrite them."""
    real_src = os.path.realpath(src)
    if os.path.realpath(directory) == real_src:
        raise CyformerError(f"save: {directory} is the directory the model was loaded from "
                            f"({real_src}); choose another")
    if not os.path.isdir(directory):
        return
    for name in WRITTEN:
        target = os.path.realpath(os.path.join(directory, name))
        if os.path.dirname(target) == real_src or (
                os.path.exists(target) and any(os.path.exists(os.path.join(src, f)) and
                                               os.path.samefile(target, os.path.join(src, f))
                                               for f in os.listdir(src))):
            raise CyformerError(f"save: {os.path.join(directory, name)} leads to the source model's "
                                f"files ({real_src}); choose another directory")


# safetensors tags of the stored dtypes: every format's (formats.TABLE)
TAGS = {np.dtype(f.storage): f.tag for f in TABLE.values()}


def write_safetensors(path, tensors, metadata):
    """The safetensors format written directly (uint16 arrays as BF16, the
    bits bfloat16 keeps): an 8-byte header length, the JSON header padded to
    8 bytes, then the tensors in order."""
    header, offset = {"__metadata__": metadata}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": TAGS[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for arr in tensors.values():
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
