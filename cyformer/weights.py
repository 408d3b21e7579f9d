"""Read a GPT-2 checkpoint (model.safetensors) into typed, read-only arrays.

One explicit map from checkpoint names to parameters, every shape checked
against the config.  Hugging Face's GPT-2 uses Conv1D layers, which store
weights as [in, out]: exactly the layout the linear kernels read, so no
tensor is transposed or copied after it is read.

The header is parsed and validated here before any data is read, so that a
truncated, corrupt or hostile file gives a ModelLoadError naming the file and
tensor, never a crash.  float32 and bfloat16 (which NumPy lacks) are read raw
into place; float16 and float64 go through the safetensors package and are
narrowed or widened.  All tensors live in one arena backed by huge pages
where the OS offers them (see _arena).
The format (https://github.com/huggingface/safetensors#format):

    8 bytes    N, little-endian unsigned: the header's length
    N bytes    JSON: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
    the rest   the data; offsets are relative to its start

Every entry is checked (offsets inside the file, no two tensors overlapping,
end - begin == itemsize x prod(shape)) before a byte of data is read, and
nothing is ever unpickled.
"""

import json
import mmap
import os
import sys
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Tuple

import numpy as np

from .config import Config
from .errors import ModelLoadError

# Tensors that hub checkpoints carry but that hold no parameters: the causal
# mask buffers of older transformers versions.
_BUFFERS = ("attn.bias", "attn.masked_bias")

# Bytes per element of every safetensors dtype; sub-byte float types (F4,
# F6_*) are left out and only accepted on tensors that are not read.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
            "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
            "I64": 8, "U64": 8, "F64": 8}
# The dtypes accepted for weights; all are stored as float32.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# The safetensors package refuses larger headers too.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class LayerNormWeights:
    weight: np.ndarray  # [C] gain
    bias: np.ndarray    # [C]


@dataclass(frozen=True)
class LinearWeights:
    weight: np.ndarray  # [in, out]
    bias: np.ndarray    # [out]


@dataclass(frozen=True)
class BlockWeights:
    ln_1: LayerNormWeights
    c_attn: LinearWeights       # [C, 3C]: q | k | v
    attn_c_proj: LinearWeights  # [C, C]: heads' outputs back into the residual stream
    ln_2: LayerNormWeights
    c_fc: LinearWeights         # [C, D_mlp]
    mlp_c_proj: LinearWeights   # [D_mlp, C]


@dataclass(frozen=True)
class Weights:
    wte: np.ndarray             # [V, C] token embedding
    wpe: np.ndarray             # [P, C] position embedding
    blocks: Tuple[BlockWeights, ...]
    ln_f: LayerNormWeights
    lm_head: np.ndarray         # [V, C] unembedding; the same array as wte when tied

    @property
    def tied(self) -> bool:
        return self.lm_head is self.wte


def _expected_shapes(cfg: Config):
    V, P, C, D = cfg.vocab_size, cfg.n_positions, cfg.n_embd, cfg.d_mlp
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(cfg.n_layer):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
            h + "mlp.c_fc.weight": (C, D), h + "mlp.c_fc.bias": (D,),
            h + "mlp.c_proj.weight": (D, C), h + "mlp.c_proj.bias": (C,),
        })
    return shapes


class TensorInfo(NamedTuple):
    """One header entry: where a tensor's bytes lie, relative to the data start."""

    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int


def _short(v, n=80):
    """repr(v), cut short: a corrupt header must not make a megabyte message."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _no_duplicates(pairs):
    """object_pairs_hook for json: a repeated key is an error, not last-one-wins."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {_short(k)}")
        out[k] = v
    return out


def _nbytes(dtype, shape, limit):
    """itemsize x prod(shape), or limit + 1 as soon as it exceeds limit (a
    hostile shape of many huge dimensions must not build a giant integer)."""
    if 0 in shape:
        return 0
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
        if n > limit:
            return limit + 1
    return n


def read_header(f, path, file_size):
    """Parse and check the header of an open safetensors file.

    Returns ({name: TensorInfo}, offset of the data in the file).  Raises
    ModelLoadError for a truncated file, a header that is not a JSON object
    of well-formed entries, offsets outside the data, overlapping tensors, or
    byte counts that disagree with dtype x shape.
    """
    if file_size < 8:
        raise ModelLoadError(f"{path}: truncated: {file_size} bytes, fewer than the 8-byte header length")
    n = int.from_bytes(f.read(8), "little")
    if n > file_size - 8:
        raise ModelLoadError(f"{path}: header length {n} points past the end of the file "
                             f"({file_size} bytes): truncated or not a safetensors file")
    if n > MAX_HEADER_BYTES:
        raise ModelLoadError(f"{path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes")
    raw = f.read(n)
    if len(raw) != n:
        raise ModelLoadError(f"{path}: truncated while reading the {n}-byte header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: header is not UTF-8 ({e.reason} at byte {8 + e.start})") from None
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: header is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    data_start = 8 + n
    data_size = file_size - data_start
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            if e is not None and not isinstance(e, dict):
                raise ModelLoadError(f"{path}: header __metadata__ must be an object, got {type(e).__name__}")
            continue
        where = f"{path}: tensor {_short(name)}"
        if not isinstance(e, dict):
            raise ModelLoadError(f"{where}: header entry must be an object, got {type(e).__name__}")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in e:
                raise ModelLoadError(f"{where}: header entry lacks {key!r}")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str):
            raise ModelLoadError(f"{where}: dtype must be a string, got {_short(dtype)}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ModelLoadError(f"{where}: shape must be a list of non-negative integers, got {_short(shape)}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ModelLoadError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                                 f"got {_short(offsets)}")
        begin, end = offsets
        if end > data_size:
            raise ModelLoadError(f"{where}: data_offsets [{begin}, {end}] point past the end of the "
                                 f"data ({data_size} bytes): the file is truncated or corrupt")
        if dtype in ITEMSIZE:
            if _nbytes(dtype, shape, end - begin) != end - begin:
                raise ModelLoadError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, "
                                     f"which is not what dtype {dtype} x shape {_short(shape)} needs")
        entries[name] = TensorInfo(dtype, tuple(shape), begin, end)
    spans = sorted((i.begin, i.end, name) for name, i in entries.items() if i.end > i.begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise ModelLoadError(f"{path}: tensors {_short(a)} and {_short(b)} overlap in the file")
    # The format (and the safetensors package) wants the data to end exactly
    # where the last tensor does.
    data_end = max((i.end for i in entries.values()), default=0)
    if data_start + data_end != file_size:
        raise ModelLoadError(f"{path}: {file_size - data_start - data_end} bytes after the last tensor "
                             "(not a well-formed safetensors file)")
    return entries, data_start


HUGE_PAGE = 2 << 20
# Each tensor starts on a cache line.
ALIGN = 64


def _arena(nbytes):
    """A zero-filled uint8 array of nbytes, 2 MB aligned, that the kernel may
    back with transparent huge pages.

    Decode reads every weight once per token: with 4 KB pages that is one TLB
    miss per 4 KB of weights, and the hardware prefetchers stop at each page
    edge.  Asking for huge pages (MADV_HUGEPAGE, for systems where THP is in
    "madvise" mode) raised matrix-vector bandwidth by 4-15 % on GPT-2 small.
    Elsewhere this is an ordinary anonymous mapping.
    """
    if not (hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")):
        return np.zeros(nbytes, dtype=np.uint8)
    # private: a shared anonymous mapping would be shmem, which THP skips
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: small pages it is
            pass
    buf = np.frombuffer(mm, dtype=np.uint8)  # keeps the mapping alive
    skip = -buf.ctypes.data % HUGE_PAGE
    return buf[skip:skip + nbytes]


def _float32_slots(shapes):
    """One arena holding a float32 array per shape, each 64-byte aligned."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-int(np.prod(shape, dtype=np.int64)) * 4 // ALIGN) * ALIGN
    arena = _arena(max(end, 1))
    return [arena[o:o + int(np.prod(s, dtype=np.int64)) * 4].view(np.float32).reshape(s)
            for o, s in zip(offsets, shapes)]


def _read_raw(f, path, name, info: TensorInfo, data_start, out):
    """The tensor's bytes, straight from the file into ``out``."""
    buf = memoryview(out.reshape(-1)).cast("B")
    f.seek(data_start + info.begin)
    got = 0
    while got < len(buf):
        k = f.readinto(buf[got:])
        if not k:
            raise ModelLoadError(f"{path}: tensor {name!r}: file ended after {got} of its "
                                 f"{len(buf)} bytes (truncated while being read?)")
        got += k


def _read_tensor(f, path, name, info: TensorInfo, data_start, out):
    """Fill the float32 array ``out`` (of info.shape) with the tensor."""
    if info.dtype == "F32" and sys.byteorder == "little":
        _read_raw(f, path, name, info, data_start, out)
    elif info.dtype == "BF16":  # the top half of a float32
        raw = np.empty(info.shape, dtype=np.uint16)
        _read_raw(f, path, name, info, data_start, raw)
        out.view(np.uint32)[...] = raw.astype(np.uint32) << 16
    else:  # F16, F64 (or F32 on a big-endian machine): the package converts
        from safetensors import safe_open

        # One short-lived handle per tensor: the package maps the file, and
        # pages of a mapping that stays open would count on top of the copies.
        with safe_open(path, framework="numpy") as st:
            arr = st.get_tensor(name)
        with np.errstate(over="ignore"):  # F64 beyond float32's range becomes Inf: warned later
            np.copyto(out, arr, casting="unsafe")


def _checkpoint_missing(path):
    d = os.path.dirname(path) or "."
    if os.path.exists(path):
        return ModelLoadError(f"{path}: model.safetensors is not a regular file")
    if os.path.exists(os.path.join(d, "model.safetensors.index.json")):
        return ModelLoadError(f"{path}: model.safetensors not found; sharded checkpoints "
                              "(model.safetensors.index.json) are not supported")
    if os.path.exists(os.path.join(d, "pytorch_model.bin")):
        return ModelLoadError(f"{path}: model.safetensors not found; pytorch_model.bin is a pickle "
                              "and is never loaded (convert it with safetensors first)")
    return ModelLoadError(f"{path}: model.safetensors not found")


def _map_names(entries, path):
    """Checkpoint names -> names without the "transformer." prefix of GPT2LMHeadModel."""
    prefix = "transformer." if any(k.startswith("transformer.") for k in entries) else ""
    present = {}
    for k in entries:
        short = k[len(prefix):] if k.startswith(prefix) else k
        if short in present:
            raise ModelLoadError(f"{path}: tensors {_short(present[short])} and {_short(k)} are the same parameter")
        present[short] = k
    return prefix, present


def load_weights(path: str, cfg: Config) -> Weights:
    """Read model.safetensors at ``path`` and check it against ``cfg``.

    Float16, bfloat16 and float64 tensors are converted to float32; integer
    tensors are refused.  NaN or Inf in a tensor is warned about.  Raises
    ModelLoadError naming the file and tensor for anything malformed.
    """
    if not os.path.isfile(path):
        raise _checkpoint_missing(path)
    expected = _expected_shapes(cfg)
    tensors = {}
    try:
        with open(path, "rb") as f:
            entries, data_start = read_header(f, path, os.fstat(f.fileno()).st_size)
            prefix, present = _map_names(entries, path)
            for name in expected:
                if name not in present:
                    some = sorted(entries)[:3]
                    raise ModelLoadError(f"{path}: missing tensor {prefix + name!r} "
                                         f"(the file holds {len(entries)} tensors, e.g. {_short(some)})")
            unexpected = [k for short, k in present.items()
                          if short not in expected and short != "lm_head.weight"
                          and not short.endswith(_BUFFERS)]
            if unexpected:
                warnings.warn(f"{path}: ignoring {len(unexpected)} unexpected tensor(s), e.g. {_short(unexpected[:3])}")
            names = list(expected) + (["lm_head.weight"] if "lm_head.weight" in present else [])
            # Check every dtype and shape before reading any data.
            for name in names:
                key, info = present[name], entries[present[name]]
                if info.dtype not in FLOAT_DTYPES:
                    raise ModelLoadError(f"{path}: tensor {key!r} has dtype {info.dtype[:40]}; expected a "
                                         f"floating-point type ({', '.join(FLOAT_DTYPES)})")
                want = expected.get(name, (cfg.vocab_size, cfg.n_embd))
                if info.shape != want:
                    raise ModelLoadError(
                        f"{path}: tensor {key!r} has shape {info.shape}, expected {want} from config.json")
            from safetensors import SafetensorError

            try:
                slots = _float32_slots([entries[present[n]].shape for n in expected])
                slots = dict(zip(expected, slots))
                if "lm_head.weight" in present:  # its own arena: freed again when it equals wte
                    slots["lm_head.weight"] = _float32_slots([entries[present["lm_head.weight"]].shape])[0]
                for name in names:
                    key = present[name]
                    arr = slots[name]
                    _read_tensor(f, path, key, entries[key], data_start, arr)
                    if not np.isfinite(arr).all():
                        warnings.warn(f"{path}: tensor {key!r} contains NaN or Inf")
                    arr.flags.writeable = False  # shared by every generation: never written
                    tensors[name] = arr
            except SafetensorError as e:  # the header passed our checks, so this is rare
                raise ModelLoadError(f"{path}: the safetensors package could not read it ({e})") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None

    def ln(p):
        return LayerNormWeights(tensors[p + ".weight"], tensors[p + ".bias"])

    def lin(p):
        return LinearWeights(tensors[p + ".weight"], tensors[p + ".bias"])

    blocks = tuple(
        BlockWeights(
            ln_1=ln(f"h.{i}.ln_1"), c_attn=lin(f"h.{i}.attn.c_attn"),
            attn_c_proj=lin(f"h.{i}.attn.c_proj"), ln_2=ln(f"h.{i}.ln_2"),
            c_fc=lin(f"h.{i}.mlp.c_fc"), mlp_c_proj=lin(f"h.{i}.mlp.c_proj"),
        )
        for i in range(cfg.n_layer)
    )
    wte = tensors["wte.weight"]
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None or np.array_equal(lm_head, wte):
        lm_head = wte  # tied: one array serves both ends
    return Weights(wte=wte, wpe=tensors["wpe.weight"], blocks=blocks, ln_f=ln("ln_f"), lm_head=lm_head)
