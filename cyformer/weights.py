"""Read a checkpoint (safetensors, one file or sharded) into typed, read-only
arrays in cyformer's kernel layout.

What fills each parameter comes from the model's family (cyformer.arch): for
GPT-2 its Conv1D [in, out] weights are already the kernel layout, so they are
read straight into place; for the Llama family the [out, in] ``nn.Linear``
weights are transposed, and q/k/v and gate/up are placed side by side, once,
at load.  Every shape is checked against the config.

The header is parsed and validated here before any data is read, so that a
truncated, corrupt or hostile file gives a ModelLoadError naming the file and
tensor, never a crash.  float32 and bfloat16 (which NumPy lacks) are read raw;
float16 and float64 go through the safetensors package and are narrowed or
widened.  All tensors live in one arena backed by huge pages where the OS
offers them (see _arena).  The format
(https://github.com/huggingface/safetensors#format):

    8 bytes    N, little-endian unsigned: the header's length
    N bytes    JSON: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
    the rest   the data; offsets are relative to its start

Every entry is checked (offsets inside the file, no two tensors overlapping,
end - begin == itemsize x prod(shape)) before a byte of data is read, and
nothing is ever unpickled.  A sharded checkpoint's
``model.safetensors.index.json`` names the file of every tensor; each shard
is checked the same way, and a tensor found in two shards is an error.
"""

import json
import mmap
import os
import sys
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .arch import GLOBAL_PARAMS, LAYER_PARAMS, global_shapes, layer_shapes  # noqa: F401 (re-exported)
from .config import Config
from .errors import ModelLoadError

# Tensors that hub checkpoints carry but that hold no parameters: the causal
# mask buffers of older transformers versions, old Llama rotary tables.
_BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")

# Bytes per element of every safetensors dtype; sub-byte float types (F4,
# F6_*) are left out and only accepted on tensors that are not read.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
            "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
            "I64": 8, "U64": 8, "F64": 8}
# The dtypes accepted for weights; all are stored as float32.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# The safetensors package refuses larger headers too.
MAX_HEADER_BYTES = 100_000_000
MAX_INDEX_BYTES = 2**26


@dataclass(frozen=True)
class NormWeights:
    weight: np.ndarray            # [C] gain
    bias: Optional[np.ndarray]    # [C] (layer norm), None (RMSNorm)


LayerNormWeights = NormWeights


@dataclass(frozen=True)
class LinearWeights:
    weight: np.ndarray            # [in, out]
    bias: Optional[np.ndarray]    # [out], or None where the family has none


# parameter name prefix (arch.LAYER_PARAMS) -> BlockWeights field
MODULES = {"ln_1": "ln_1", "attn.c_attn": "c_attn", "attn.c_proj": "attn_c_proj",
           "ln_2": "ln_2", "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_c_proj"}


@dataclass(frozen=True)
class BlockWeights:
    ln_1: NormWeights
    c_attn: LinearWeights       # [C, (H + 2G) D]: q | k | v
    attn_c_proj: LinearWeights  # [H D, C]: heads' outputs back into the residual stream
    ln_2: NormWeights
    c_fc: LinearWeights         # [C, F] (GELU) or [C, 2F] (SwiGLU: gate | up)
    mlp_c_proj: LinearWeights   # [F, C]

    def param(self, name):
        """A parameter by its name in arch.LAYER_PARAMS ("attn.c_attn.weight")."""
        module, kind = name.rsplit(".", 1)
        return getattr(getattr(self, MODULES[module]), kind)

    @classmethod
    def from_params(cls, get):
        """Build from get(name) -> array or None, name in arch.LAYER_PARAMS."""
        parts = {}
        for module, field in MODULES.items():
            kind = NormWeights if module.startswith("ln_") else LinearWeights
            parts[field] = kind(get(module + ".weight"), get(module + ".bias"))
        return cls(**parts)


@dataclass(frozen=True)
class Weights:
    wte: np.ndarray             # [V, C] token embedding
    wpe: Optional[np.ndarray]   # [P, C] position embedding (None: rotary positions)
    blocks: Tuple[BlockWeights, ...]
    ln_f: NormWeights
    lm_head: np.ndarray         # [V, C] unembedding; the same array as wte when tied
    lm_head_bias: Optional[np.ndarray] = None  # [V] b_U: only weight processing makes one

    @property
    def tied(self) -> bool:
        return self.lm_head is self.wte

    @classmethod
    def from_params(cls, cfg: Config, params):
        """Build from a flat dict: globals (arch.GLOBAL_PARAMS) and
        blocks.{i}.{name}; absent parameters may be missing or None."""
        blocks = tuple(BlockWeights.from_params(lambda n, i=i: params.get(f"blocks.{i}.{n}"))
                       for i in range(cfg.n_layer))
        wte = params["wte"]
        lm_head = params.get("lm_head")
        return cls(wte=wte, wpe=params.get("wpe"), blocks=blocks,
                   ln_f=NormWeights(params["ln_f.weight"], params.get("ln_f.bias")),
                   lm_head=wte if lm_head is None else lm_head)


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


def _slots(specs):
    """One arena holding an array per (shape, dtype), each 64-byte aligned."""
    sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    arena = _arena(max(end, 1))
    return [arena[o:o + n].view(dtype).reshape(shape) for o, n, (shape, dtype) in zip(offsets, sizes, specs)]


def _read_raw(f, path, name, info: TensorInfo, data_start, out, skip=0):
    """The tensor's bytes from byte ``skip`` on, straight from the file into ``out``."""
    buf = memoryview(out.reshape(-1)).cast("B")
    f.seek(data_start + info.begin + skip)
    got = 0
    while got < len(buf):
        k = f.readinto(buf[got:])
        if not k:
            raise ModelLoadError(f"{path}: tensor {name!r}: file ended after {skip + got} of its "
                                 f"{info.end - info.begin} bytes (truncated while being read?)")
        got += k


def _read_tensor(f, path, name, info: TensorInfo, data_start, out, first=0):
    """Fill the float32 array ``out`` with the tensor (of info.shape), or with
    its rows first .. first + len(out)."""
    row = int(np.prod(info.shape[1:], dtype=np.int64))
    if info.dtype == "F32" and sys.byteorder == "little":
        _read_raw(f, path, name, info, data_start, out, first * row * 4)
    elif info.dtype == "BF16":  # the top half of a float32
        raw = np.empty(out.shape, dtype=np.uint16)
        _read_raw(f, path, name, info, data_start, raw, first * row * 2)
        out.view(np.uint32)[...] = raw.astype(np.uint32) << 16
    else:  # F16, F64 (or F32 on a big-endian machine): the package converts
        from safetensors import safe_open

        # One short-lived handle per read: the package maps the file, and
        # pages of a mapping that stays open would count on top of the copies.
        with safe_open(path, framework="numpy") as st:
            arr = st.get_tensor(name) if out.shape == info.shape else st.get_slice(name)[first:first + len(out)]
        with np.errstate(over="ignore"):  # F64 beyond float32's range becomes Inf: warned later
            np.copyto(out, arr, casting="unsafe")


def _checkpoint_missing(path):
    d = os.path.dirname(path) or "."
    if os.path.exists(path):
        return ModelLoadError(f"{path}: model.safetensors is not a regular file")
    if os.path.exists(os.path.join(d, "pytorch_model.bin")):
        return ModelLoadError(f"{path}: model.safetensors not found; pytorch_model.bin is a pickle "
                              "and is never loaded (convert it with safetensors first)")
    return ModelLoadError(f"{path}: model.safetensors not found")


def _read_index(index_path):
    """model.safetensors.index.json -> {tensor name: shard path}."""
    d = os.path.dirname(index_path) or "."
    try:
        with open(index_path, "rb") as f:
            data = f.read(MAX_INDEX_BYTES + 1)
    except OSError as e:
        raise ModelLoadError(f"{index_path}: cannot read ({e.strerror})") from None
    if len(data) > MAX_INDEX_BYTES:
        raise ModelLoadError(f"{index_path}: over {MAX_INDEX_BYTES} bytes; not an index")
    try:
        index = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{index_path}: not valid JSON ({str(e)[:200]})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise ModelLoadError(f"{index_path}: expected an object with a non-empty \"weight_map\"")
    out = {}
    for name, shard in wmap.items():
        # a shard is a file beside the index: no paths that lead elsewhere
        if (not isinstance(shard, str) or not shard or os.path.basename(shard) != shard
                or shard in (".", "..")):
            raise ModelLoadError(f"{index_path}: tensor {_short(name)} maps to {_short(shard)}, "
                                 "not a file name in the checkpoint directory")
        out[name] = os.path.join(d, shard)
    for shard in sorted(set(out.values())):
        if not os.path.isfile(shard):
            raise ModelLoadError(f"{index_path}: shard {os.path.basename(shard)!r} is missing "
                                 "(an incomplete download?)")
    return out


def _shard_files(path):
    """The safetensors files of the checkpoint at ``path`` and the index's
    map (None for one file).  path: a model directory (model.safetensors,
    else a sharded model.safetensors.index.json) or a safetensors file."""
    if not os.path.isdir(path) or os.path.basename(os.path.normpath(path)) == "model.safetensors":
        if os.path.isfile(path):
            return [path], None
        raise _checkpoint_missing(path)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index) and not os.path.exists(single):
        wmap = _read_index(index)
        return sorted(set(wmap.values())), wmap
    if not os.path.isfile(single):
        raise _checkpoint_missing(single)
    return [single], None


def _prefix(names, family, path):
    """The prefix the checkpoint puts before its names ("transformer.",
    "model." or none); a name present with and without it is an error."""
    for p in family.prefixes:
        if p and any(n.startswith(p) for n in names):
            for n in names:
                if n.startswith(p) and n[len(p):] in names:
                    raise ModelLoadError(f"{path}: tensors {_short(n)} and {_short(n[len(p):])} "
                                         "are the same parameter")
            return p
    return ""


def _metadata(f, path):
    """The header's __metadata__ (strings only), read after read_header checked it."""
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    meta = json.loads(f.read(n).decode("utf-8")).get("__metadata__") or {}
    return {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str)}


class _Checkpoint:
    """Every tensor's header entry across the shards, files open for reading."""

    def __init__(self, path):
        files, wmap = _shard_files(path)
        self.metadata = {}
        self.files = {}
        self.nonfinite = set()  # names already warned about
        self.where = {}  # name -> (shard path, TensorInfo, data start)
        try:
            for shard in files:
                f = open(shard, "rb")
                self.files[shard] = f
                entries, data_start = read_header(f, shard, os.fstat(f.fileno()).st_size)
                if shard == files[0]:
                    self.metadata = _metadata(f, shard)
                for name, info in entries.items():
                    if name in self.where:
                        raise ModelLoadError(f"{shard}: tensor {_short(name)} is also in "
                                             f"{self.where[name][0]}; which one holds it is ambiguous")
                    self.where[name] = (shard, info, data_start)
        except OSError as e:
            self.close()
            raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
        except BaseException:
            self.close()
            raise
        if wmap is not None:
            for name, shard in wmap.items():
                if name in self.where and self.where[name][0] != shard:
                    self.close()
                    raise ModelLoadError(f"{shard}: the index puts tensor {_short(name)} here, "
                                         f"but it is in {self.where[name][0]}")
        self.path = path

    def close(self):
        for f in self.files.values():
            f.close()

    def check(self, name, shape):
        if name not in self.where:
            some = sorted(self.where)[:3]
            raise ModelLoadError(f"{self.path}: missing tensor {name!r} (the checkpoint holds "
                                 f"{len(self.where)} tensors, e.g. {_short(some)})")
        shard, info, _ = self.where[name]
        if info.dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"{shard}: tensor {name!r} has dtype {info.dtype[:40]}; expected a "
                                 f"floating-point type ({', '.join(FLOAT_DTYPES)})")
        if info.shape != tuple(shape):
            raise ModelLoadError(f"{shard}: tensor {name!r} has shape {info.shape}, expected "
                                 f"{tuple(shape)} from config.json")

    def read(self, name, out, first=0):
        """The tensor into ``out``, or its rows first .. first + len(out)."""
        shard, info, data_start = self.where[name]
        _read_tensor(self.files[shard], shard, name, info, data_start, out, first)
        if name not in self.nonfinite and not np.isfinite(out).all():
            self.nonfinite.add(name)  # once per tensor, however many pieces it is read in
            warnings.warn(f"{shard}: tensor {name!r} contains NaN or Inf")

    def rows(self, name, cols):
        """rows(first, end) -> float32 [end - first, cols]: a 2-d tensor's
        rows, read into one buffer that each call reuses."""
        buf = np.empty((0, cols), dtype=np.float32)

        def rows(first, end):
            nonlocal buf
            if len(buf) < end - first:
                buf = np.empty((end - first, cols), dtype=np.float32)
            self.read(name, buf[:end - first], first)
            return buf[:end - first]

        return rows


def _place(params, shapes, packed, dtype):
    """One arena holding every parameter's arrays: float32, or for a matrix
    converted to dtype (those in ``packed``) a formats.Packed to convert into."""
    from .formats import Packed, matrix_format, packed_layout

    fmt = {p: matrix_format(dtype, p in TRANSPOSED) for p in params if p in packed}
    layout = {}
    for p in params:
        data, data_dtype, scale = (packed_layout(fmt[p], shapes[p], p in TRANSPOSED) if p in packed
                                   else (shapes[p], np.float32, None))
        layout[p] = [(data, data_dtype)] + ([] if scale is None else [(scale, np.float32)])
    arrays = iter(_slots([spec for p in params for spec in layout[p]]))
    out = {}
    for p in params:
        mine = [next(arrays) for _ in layout[p]]
        out[p] = (Packed(fmt[p], mine[0], mine[1] if len(mine) > 1 else None, tuple(shapes[p]), p in TRANSPOSED)
                  if p in packed else mine[0])
    return out


def _fill(ck, src, slot):
    """Read a parameter's source tensors into its float32 slot."""
    if len(src.parts) == 1 and not src.transpose:
        ck.read(src.parts[0][0], slot)
        return
    o = 0
    for name, shape in src.parts:
        tmp = np.empty(shape, dtype=np.float32)
        ck.read(name, tmp)
        n = shape[0]
        if src.transpose:  # [out, in] -> columns o .. o+n of [in, out]
            slot[:, o:o + n] = tmp.T
        else:
            slot[o:o + n] = tmp
        o += n


MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TRANSPOSED = ("wte", "lm_head")  # stored a row per token


def is_matrix(param):
    """True for the parameters a weight format converts (every product's
    weights, the embedding and the unembedding); norms and biases stay float32."""
    return param in TRANSPOSED or param.endswith(MATRICES)


def load_weights(path: str, cfg: Config, dtype=None, progress=None) -> Weights:
    """Read the checkpoint at ``path`` (a model directory holding
    model.safetensors or a sharded model.safetensors.index.json, or a
    safetensors file) and check it against ``cfg``.

    Float16, bfloat16 and float64 tensors are converted to float32; integer
    tensors are refused.  NaN or Inf in a tensor is warned about.  dtype
    (cyformer.formats): the weight matrices are converted to it as they are
    read, so the float32 model never exists; a matrix stored as one tensor
    in the kernel layout (every embedding, GPT-2's products) goes from the
    file a step of rows at a time (formats.convert), and one assembled from
    parts (Llama's [out, in] q/k/v) exists whole in float32 only while it
    is converted.  progress: a callable(done, total) called per parameter.  Raises
    ModelLoadError naming the file and tensor for anything malformed.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise ModelLoadError(f"load_weights: path must be a str or os.PathLike, got {path!r}") from None
    ck = _Checkpoint(path)
    try:
        if ck.metadata.get(SAVED_LAYOUT_KEY) is not None:
            return _load_saved(ck, cfg, dtype)
        return _load(ck, cfg, dtype or "float32", progress)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        ck.close()


def _load(ck, cfg, dtype="float32", progress=None):
    family = cfg.family
    prefix = _prefix(ck.where, family, ck.path)
    sources = family.sources(cfg, prefix)
    shapes = {**global_shapes(cfg),
              **{f"blocks.{i}.{n}": s for i in range(cfg.n_layer) for n, s in layer_shapes(cfg).items()}}
    # The unembedding: its own tensor unless tied (Llama family: the config
    # says; GPT-2: tied unless the checkpoint has a different lm_head).
    lm_name = sources["lm_head"].parts[0][0]
    want_lm = lm_name in ck.where if family.name == "gpt2" else not cfg.tie_word_embeddings
    wanted = [p for p, s in shapes.items() if s is not None and (p != "lm_head" or want_lm)]
    used = set()
    for p in wanted:  # every name, dtype and shape before any data is read
        for name, shape in sources[p].parts:
            ck.check(name, shape)
            used.add(name)
    unexpected = [k for k in ck.where if k not in used and not k.endswith(_BUFFERS)
                  and not (k == lm_name and cfg.tie_word_embeddings)]
    if unexpected:
        warnings.warn(f"{ck.path}: ignoring {len(unexpected)} unexpected tensor(s), e.g. "
                      f"{_short(unexpected[:3])}")
    from safetensors import SafetensorError

    from .formats import convert

    params = {}
    packed = {p for p in wanted if dtype != "float32" and is_matrix(p)}
    try:
        slots = _place([p for p in wanted if p != "lm_head"], shapes, packed, dtype)
        if want_lm:  # its own arena: freed again when it equals wte
            slots.update(_place(["lm_head"], shapes, packed, dtype))
        for i, p in enumerate(wanted):
            src, slot, shape = sources[p], slots.pop(p), shapes[p]
            if p not in packed:
                _fill(ck, src, slot)
                slot.flags.writeable = False  # shared by every generation: never written
                params[p] = slot
            elif len(src.parts) == 1 and not src.transpose:
                # a step of rows at a time from the file: the float32 matrix never exists whole
                params[p] = convert(ck.rows(src.parts[0][0], shape[1]), slot.fmt, shape, p in TRANSPOSED,
                                    out=slot)
            else:  # parts side by side, or transposed: assembled in float32 first, then let go
                tmp = np.empty(shape, dtype=np.float32)
                _fill(ck, src, tmp)
                params[p] = convert(lambda first, end: tmp[first:end], slot.fmt, shape, p in TRANSPOSED,
                                    out=slot)
                del tmp
            if progress is not None:
                progress(i + 1, len(wanted))
    except SafetensorError as e:  # the header passed our checks, so this is rare
        raise ModelLoadError(f"{ck.path}: the safetensors package could not read it ({e})") from None
    if "lm_head" in params and _same(params["lm_head"], params["wte"]):
        del params["lm_head"]  # tied: one array serves both ends
    return Weights.from_params(cfg, params)


# Written by cyformer.saving: cyformer's parameter names, the kernel layout,
# matrices in the format the metadata names.
SAVED_LAYOUT_KEY = "cyformer.layout"
SAVED_FORMAT_KEY = "cyformer.format"
SAVED_GROUP_KEY = "cyformer.group"
# The formats whose block matrices the file holds a row per output
# (Format.rows_out); a file without the key predates int8's switch to it,
# when only GGUF's q8_0 and q4_0 were (a file with it from before int4's
# switch does not name int4).
SAVED_ROWS_OUT_KEY = "cyformer.rows_out"
ROWS_OUT_BEFORE_THE_KEY = "q8_0,q4_0"


def stored_shapes(param, shape, fmt):
    """(data shape, scale shape or None) of a parameter saved in format fmt."""
    from .formats import matrix_format, packed_layout

    if fmt == "float32" or not is_matrix(param):
        return shape, None
    data, _, scale = packed_layout(matrix_format(fmt, param in TRANSPOSED), shape, param in TRANSPOSED)
    return data, scale


def _load_saved(ck, cfg, dtype):
    """A model written by Model.save(): memory-mapped, nothing converted."""
    from .formats import FORMATS, TABLE, Packed, block_scales_finite, matrix_format

    meta = ck.metadata
    fmt = meta.get(SAVED_FORMAT_KEY)
    if meta.get(SAVED_LAYOUT_KEY) != "kernel" or fmt not in FORMATS:
        raise ModelLoadError(f"{ck.path}: unknown weight format {_short(fmt)} / layout "
                             f"{_short(meta.get(SAVED_LAYOUT_KEY))} (known: {', '.join(FORMATS)})")
    if meta.get(SAVED_GROUP_KEY, "32") != "32":
        raise ModelLoadError(f"{ck.path}: int4 groups of {meta.get(SAVED_GROUP_KEY)[:20]} inputs; "
                             "this version reads groups of 32")
    if dtype not in (None, fmt):
        raise ModelLoadError(f"{ck.path}: the weights are saved as {fmt}; load with dtype={fmt!r} (or "
                             "convert from the original checkpoint)")
    shapes = {**global_shapes(cfg),
              **{f"blocks.{i}.{n}": s for i in range(cfg.n_layer) for n, s in layer_shapes(cfg).items()}}
    if "lm_head" not in ck.where:
        shapes.pop("lm_head")  # tied
    params = {}

    def mapped(name, want_shape):
        if name not in ck.where:
            raise ModelLoadError(f"{ck.path}: missing tensor {name!r} (a {fmt} model saved by cyformer)")
        shard, info, data_start = ck.where[name]
        f = TABLE[matrix_format(fmt, name in TRANSPOSED) if is_matrix(name) else "float32"]
        tag, np_dtype = f.tag, f.storage
        if info.dtype != tag or info.shape != tuple(want_shape):
            raise ModelLoadError(f"{shard}: tensor {name!r} is {info.dtype} {info.shape}; a {fmt} model "
                                 f"needs {tag} {tuple(want_shape)}")
        if info.end == info.begin:
            return np.zeros(want_shape, dtype=np_dtype)
        return np.memmap(shard, dtype=np_dtype, mode="r", offset=data_start + info.begin, shape=want_shape)

    rows_out = set(meta.get(SAVED_ROWS_OUT_KEY, ROWS_OUT_BEFORE_THE_KEY).split(","))
    for p, shape in shapes.items():
        if shape is None:
            continue
        data_shape, scale_shape = stored_shapes(p, shape, fmt)
        mf = matrix_format(fmt, p in TRANSPOSED) if fmt != "float32" and is_matrix(p) else "float32"
        # a block matrix saved [K, N] before its format became rows_out: the
        # transpose of today's arrays (int4's pairs run along inputs either
        # way), copied once here instead of mapped
        legacy = TABLE[mf].rows_out and mf not in rows_out and p not in TRANSPOSED
        data = mapped(p, data_shape[::-1] if legacy else data_shape)
        _warn_nonfinite(ck.path, p, data)
        if fmt == "float32" or not is_matrix(p):
            params[p] = data
            continue
        scale = None
        if scale_shape is not None:
            scale = mapped(p + ".scale", scale_shape[::-1] if legacy else scale_shape)
            if not np.isfinite(scale).all():
                raise ModelLoadError(f"{ck.path}: tensor {p + '.scale'!r} holds NaN or Inf")
        if legacy:
            data = np.ascontiguousarray(data.T)
            scale = None if scale is None else np.ascontiguousarray(scale.T)
        if TABLE[mf].record and not block_scales_finite(mf, data):
            raise ModelLoadError(f"{ck.path}: tensor {p!r} has NaN or Inf block scales")
        params[p] = Packed(matrix_format(fmt, p in TRANSPOSED), data, scale, tuple(shape), p in TRANSPOSED)
    return Weights.from_params(cfg, params)


def _warn_nonfinite(path, name, data):
    """Warn, as for a Hugging Face checkpoint, about NaN or Inf in a saved
    float32 or bfloat16 tensor (int8 and int4 data hold no such values;
    their scales are checked as they are mapped)."""
    if data.dtype == np.float32:
        bad = not np.isfinite(data).all()
    elif data.dtype == np.uint16:  # bfloat16 bits: exponent all ones
        bad = bool(((data & 0x7F80) == 0x7F80).any())
    else:
        return
    if bad:
        warnings.warn(f"{path}: tensor {name!r} contains NaN or Inf")


def _same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return (a.fmt == b.fmt and np.array_equal(a.data, b.data)
            and (a.scale is None or np.array_equal(a.scale, b.scale)))


def dequantized(w: Weights) -> Weights:
    """The same weights with every Packed matrix widened to float32 (the
    reference backends and the weight views read these); w itself when
    nothing is packed."""
    from .formats import Packed, dequantize

    if not isinstance(w.wte, Packed) and not any(isinstance(b.c_attn.weight, Packed) for b in w.blocks):
        return w
    import dataclasses

    def lin(l):
        return dataclasses.replace(l, weight=dequantize(l.weight))

    blocks = tuple(dataclasses.replace(b, c_attn=lin(b.c_attn), attn_c_proj=lin(b.attn_c_proj),
                                       c_fc=lin(b.c_fc), mlp_c_proj=lin(b.mlp_c_proj)) for b in w.blocks)
    wte = dequantize(w.wte)
    return dataclasses.replace(w, wte=wte, blocks=blocks, lm_head=wte if w.tied else dequantize(w.lm_head))


def weight_format(w: Weights) -> str:
    from .formats import Packed
    return w.blocks[0].c_attn.weight.fmt if isinstance(w.blocks[0].c_attn.weight, Packed) else "float32"
