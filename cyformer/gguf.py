"""GGUF files, llama.cpp's format: run them, and write a Model as one.

Reading (``cyformer.load("model.gguf")``): the config comes from the
``{arch}.*`` metadata, the tokenizer from ``tokenizer.ggml.*`` (the ``gpt2``
byte-level BPE kind, rebuilt as a ``tokenizers`` tokenizer that encodes as
the model's tokenizer.json does), the chat template from
``tokenizer.chat_template``, and every tensor is placed in cyformer's kernel
layout.  The ``gguf`` package (ggml's own reader, writer and block formats)
does the parsing; this module checks what it is given first, so that a
truncated or corrupt file is a ModelLoadError naming what is wrong.

GGUF stores a matrix [out, in] (ggml's ne0 = inputs), quantized in blocks
along each row; cyformer's block matrices are [in, out] (cyformer.weights),
so matrices are repacked at load.  What each tensor type runs as is one
table, RUNS: natively where the block format is a cyformer format (Q8_0
is q8_0 and Q4_0 is q4_0, record for record), exact where it maps onto one
without loss (F16 widens to float32), converted to int8 otherwise.
A fused parameter (q | k | v, gate | up) whose parts differ in type runs in
the most precise of their formats.  Where a tensor already has the kernel
layout (a Q8_0 or Q4_0 matrix of one tensor, an F32 embedding, the norms) it
stays memory-mapped from the file; Llama's q | k | v and gate | up are
several tensors (q and k rows permuted), so their records are copied,
unchanged, into one matrix.

llama.cpp's converter permutes the rows of Llama's q and k products (its
rotary kernel pairs dimension i with i + 1, Hugging Face's with i + D/2);
``_unpermute`` undoes it, so the logits equal the safetensors model's.

Writing (``Model.save(path, format="gguf")``): the same names, metadata and
tokenizer keys that llama.cpp's converter writes, quantized with the
``gguf`` package's reference quantizers (bit-exact with ggml's).
"""

import json
import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass

import numpy as np

from ._checks import path_arg
from .errors import CyformerError, ModelLoadError

MAGIC = b"GGUF"
ARCHITECTURES = ("gpt2", "llama", "mistral", "qwen2")
PERMUTED = ("llama", "mistral")  # the converter permutes q and k rows for these

# GGUF tensor type -> (the cyformer format it runs as, exact?).  F16 widens
# to float32 (bfloat16 would drop three bits of its mantissa).  Q8_0 and Q4_0
# run as q8_0 and q4_0, their own records.  The k-quants are dequantized and converted to int8.  Q4_K
# gives each group of 32 a minimum as well as a scale, which symmetric int4
# cannot hold: as int4 it doubled the bundled model's perplexity loss, as
# int8 it keeps Q4_K's own.
RUNS = {
    "F32": ("float32", True),
    "F16": ("float32", True),
    "BF16": ("bfloat16", True),
    "Q8_0": ("q8_0", True),
    "Q4_0": ("q4_0", True),
    "Q4_K": ("int8", False),
    "Q5_K": ("int8", False),
    "Q6_K": ("int8", False),
}
PRECISION = ("int4", "q4_0", "int8", "q8_0", "bfloat16", "float32")  # least to most precise
NATIVE = {"q8_0": "Q8_0", "q4_0": "Q4_0"}  # cyformer formats that are a GGUF type's records

# Model.save(format="gguf") dtype -> the type of every matrix (norms, biases
# and GPT-2's position table stay F32, as llama.cpp writes them).
WRITE_TYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}

# GGUF value types (gguf.GGUFValueType) -> bytes, for the header walk.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4


def _clip(v, n=80):
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def is_gguf(path):
    """True when ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


# -- the header, checked before the gguf package reads it ------------------

def _check_header(path, size):
    """Walk the header (metadata and tensor infos) checking every length
    against the file, so that the gguf package never loops over a lying
    array length or slices past the end; every tensor must lie inside the
    file, in whole blocks of its type, without overlapping another.  Returns
    the tensor infos: {name: (GGMLQuantizationType, dims (ne0 first), offset)}."""
    import gguf

    if size == 0:
        raise ModelLoadError(f"{path}: empty file (truncated?)")
    with open(path, "rb") as f:  # mapped: the header is read, the tensors are not
        head = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _walk_header(path, size, head, gguf)
    finally:
        head.close()


def _walk_header(path, size, head, gguf):
    pos = 0

    def take(n, what):
        nonlocal pos
        if n < 0 or pos + n > len(head):
            raise ModelLoadError(f"{path}: truncated in the header ({what} at byte {pos} needs {n} bytes, "
                                 f"the file has {size})")
        out = head[pos:pos + n]
        pos += n
        return out

    def u32(what):
        return struct.unpack("<I", take(4, what))[0]

    def u64(what):
        return struct.unpack("<Q", take(8, what))[0]

    def string(what):
        n = u64(what)
        raw = take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelLoadError(f"{path}: {what} is not UTF-8 text") from None

    def value(vtype, what):
        if vtype in _SCALAR_BYTES:
            return take(_SCALAR_BYTES[vtype], what)
        if vtype == _STRING:
            take(u64(what), what)
        elif vtype == _ARRAY:
            itype, n = u32(what), u64(what)
            if itype in _SCALAR_BYTES:
                take(n * _SCALAR_BYTES[itype], what)
            elif itype == _STRING:
                if n * 8 > len(head) - pos:
                    raise ModelLoadError(f"{path}: {what}: an array of {n} strings cannot fit in the file: "
                                         "truncated or corrupt")
                for _ in range(n):
                    take(u64(what), what)
            else:
                raise ModelLoadError(f"{path}: {what}: array of unknown value type {itype}")
        else:
            raise ModelLoadError(f"{path}: {what}: unknown value type {vtype}")

    if take(4, "magic") != MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
    version = u32("version")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} (this reader knows 2 and 3)")
    n_tensors, n_kv = u64("tensor count"), u64("metadata count")
    if n_tensors > size // 24 or n_kv > size // 12:
        raise ModelLoadError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                             f"more than a {size}-byte file can hold")
    alignment = 32  # GGUF's default
    for i in range(n_kv):
        key = string(f"metadata key #{i}")
        vtype = u32(f"metadata {key!r}")
        raw = value(vtype, f"metadata {key!r}")
        if key == "general.alignment":
            alignment = struct.unpack("<I", raw)[0] if vtype == 4 else 0
            if alignment == 0 or alignment & (alignment - 1):
                raise ModelLoadError(f"{path}: general.alignment must be a power of two (uint32)")
    infos = {}
    for i in range(n_tensors):
        name = string(f"tensor name #{i}")
        n_dims = u32(f"tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelLoadError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack(f"<{n_dims}Q", take(8 * n_dims, f"tensor {name!r}"))
        ttype, offset = u32(f"tensor {name!r}"), u64(f"tensor {name!r}")
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown tensor type {ttype}") from None
        if name in infos:
            raise ModelLoadError(f"{path}: tensor {name!r} appears twice")
        infos[name] = (qtype, dims, offset)
    data_start = -(-pos // alignment) * alignment
    spans = []
    for name, (qtype, dims, offset) in infos.items():
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ModelLoadError(f"{path}: tensor {name!r}: rows of {dims[0]} are not whole "
                                 f"{qtype.name} blocks of {block}")
        n = 1
        for d in dims:
            n = min(n * d, size * block)  # beyond the file already: stop growing
        nbytes = n // block * type_size
        if offset % alignment:
            raise ModelLoadError(f"{path}: tensor {name!r}: offset {offset} is not a multiple of the "
                                 f"alignment {alignment}")
        if data_start + offset + nbytes > size:
            raise ModelLoadError(f"{path}: tensor {name!r} ({qtype.name} {list(dims)}) at offset {offset} "
                                 f"ends past the end of the file ({size} bytes): truncated or corrupt")
        if nbytes:
            spans.append((offset, offset + nbytes, name))
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise ModelLoadError(f"{path}: tensors {a!r} and {b!r} overlap in the file")
    return infos


@dataclass
class GGUFFile:
    """An open GGUF file: its metadata and tensors (gguf.GGUFReader underneath)."""

    path: str
    reader: object
    arch: str
    tensors: dict  # name -> gguf ReaderTensor

    def has(self, key):
        return key in self.reader.fields

    def get(self, key, default=None, kind=None):
        """A metadata value (scalar, string or list), or default when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            v = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{self.path}: metadata {key!r} is malformed ({e})") from None
        if kind is not None and not _is_kind(v, kind):
            raise ModelLoadError(f"{self.path}: metadata {key!r} must be {kind}, got {_clip(v)}")
        if isinstance(v, float) and field.types == [gguf_float32()]:
            # the shortest decimal of the stored float32: config.json's 1e-05, not 9.99999974e-06
            v = float(str(np.float32(v)))
        return v

    def need(self, key, kind=None):
        if key not in self.reader.fields:
            raise ModelLoadError(f"{self.path}: missing metadata key {key!r}")
        return self.get(key, kind=kind)

    def type_name(self, name):
        return self.tensors[name].tensor_type.name


def gguf_float32():
    import gguf

    return gguf.GGUFValueType.FLOAT32


def _is_kind(v, kind):
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind == "str":
        return isinstance(v, str)
    if kind == "list":
        return isinstance(v, list)
    if kind == "bool":
        return isinstance(v, bool)
    return True


def open_gguf(path):
    """Check and open a GGUF file; raises ModelLoadError for anything malformed."""
    import gguf

    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    infos = _check_header(path, size)
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({_clip(str(e), 200)})") from None
    tensors = {t.name: t for t in reader.tensors}  # every one checked by _check_header
    f = GGUFFile(path, reader, "", tensors)
    arch = f.need("general.architecture", "str")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {_clip(arch)} is not supported (supported: "
                             f"{', '.join(ARCHITECTURES)})")
    f.arch = arch
    return f


# -- config ---------------------------------------------------------------

def read_config(f):
    """The Config that the ``{arch}.*`` metadata describes."""
    from .config import Config

    a = f.arch
    V = _vocab_size(f)
    if a == "gpt2":
        raw = {"model_type": "gpt2", "vocab_size": V,
               "n_positions": f.need(f"{a}.context_length", "int"),
               "n_embd": f.need(f"{a}.embedding_length", "int"),
               "n_layer": f.need(f"{a}.block_count", "int"),
               "n_head": f.need(f"{a}.attention.head_count", "int"),
               "n_inner": f.need(f"{a}.feed_forward_length", "int"),  # None below where it is 4 C
               "layer_norm_epsilon": f.need(f"{a}.attention.layer_norm_epsilon", "number")}
    else:
        heads = f.need(f"{a}.attention.head_count", "int")
        raw = {"model_type": a, "vocab_size": V,
               "max_position_embeddings": f.need(f"{a}.context_length", "int"),
               "hidden_size": f.need(f"{a}.embedding_length", "int"),
               "num_hidden_layers": f.need(f"{a}.block_count", "int"),
               "num_attention_heads": heads,
               "num_key_value_heads": f.get(f"{a}.attention.head_count_kv", heads, "int"),
               "intermediate_size": f.need(f"{a}.feed_forward_length", "int"),
               "rms_norm_eps": f.need(f"{a}.attention.layer_norm_rms_epsilon", "number"),
               "rope_theta": f.get(f"{a}.rope.freq_base", 10000.0, "number"),
               "tie_word_embeddings": "output.weight" not in f.tensors,
               "attention_bias": "blk.0.attn_q.bias" in f.tensors,
               "mlp_bias": "blk.0.ffn_up.bias" in f.tensors}
        key_length = f.get(f"{a}.attention.key_length", None, "int")
        if key_length is not None:
            raw["head_dim"] = key_length
        rope_dims = f.get(f"{a}.rope.dimension_count", None, "int")
        head_dim = key_length or raw["hidden_size"] // max(heads, 1)
        if rope_dims is not None and rope_dims != head_dim:
            raise ModelLoadError(f"{f.path}: rotary embeddings over {rope_dims} of {head_dim} head "
                                 "dimensions (partial rotary) are not supported")
        kind = f.get(f"{a}.rope.scaling.type", "none", "str")
        if kind == "linear":
            raw["rope_scaling"] = {"rope_type": "linear", "factor": f.need(f"{a}.rope.scaling.factor", "number")}
        elif kind not in ("none", ""):
            raise ModelLoadError(f"{f.path}: rope scaling type {_clip(kind)} is not supported")
        if "rope_freqs.weight" in f.tensors:
            raise ModelLoadError(f"{f.path}: per-frequency rotary factors (rope_freqs.weight, Llama 3.1 "
                                 "scaling) are not supported")
    for name in ("bos", "eos"):
        v = f.get(f"tokenizer.ggml.{name}_token_id", None, "int")
        if v is not None:
            raw[f"{name}_token_id"] = v
    if a == "gpt2" and raw["n_inner"] == 4 * raw["n_embd"]:
        raw["n_inner"] = None  # GPT2Config's default, as config.json writes it
    try:
        return Config.from_dict(raw, source=f.path)
    except TypeError as e:
        raise ModelLoadError(f"{f.path}: {e}") from None


def _vocab_size(f):
    t = f.tensors.get("token_embd.weight")
    if t is None:
        raise ModelLoadError(f"{f.path}: missing tensor 'token_embd.weight'")
    return int(t.shape[1]) if len(t.shape) == 2 else 0


# -- tensor names -----------------------------------------------------------

def tensor_names(cfg):
    """cyformer parameter -> the GGUF tensors that fill it, each (name,
    numpy shape [out, in] or [n], permuted heads or 0), concatenated along
    the output axis.  Matrices are transposed into place, except the [V, C]
    embedding and unembedding, which GGUF and cyformer both store a row per token."""
    C, H, G, D, F, V = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.d_head, cfg.d_mlp, cfg.vocab_size
    out = {"wte": [("token_embd.weight", (V, C), 0)], "ln_f.weight": [("output_norm.weight", (C,), 0)],
           "lm_head": [("output.weight", (V, C), 0)]}
    if cfg.model_type == "gpt2":
        out.update({"wpe": [("position_embd.weight", (cfg.n_positions, C), 0)],
                    "ln_f.bias": [("output_norm.bias", (C,), 0)]})
    permute = cfg.model_type in PERMUTED
    for i in range(cfg.n_layer):
        b, g = f"blocks.{i}.", f"blk.{i}."
        if cfg.model_type == "gpt2":
            out.update({
                b + "ln_1.weight": [(g + "attn_norm.weight", (C,), 0)], b + "ln_1.bias": [(g + "attn_norm.bias", (C,), 0)],
                b + "attn.c_attn.weight": [(g + "attn_qkv.weight", (3 * C, C), 0)],
                b + "attn.c_attn.bias": [(g + "attn_qkv.bias", (3 * C,), 0)],
                b + "attn.c_proj.weight": [(g + "attn_output.weight", (C, C), 0)],
                b + "attn.c_proj.bias": [(g + "attn_output.bias", (C,), 0)],
                b + "ln_2.weight": [(g + "ffn_norm.weight", (C,), 0)], b + "ln_2.bias": [(g + "ffn_norm.bias", (C,), 0)],
                b + "mlp.c_fc.weight": [(g + "ffn_up.weight", (F, C), 0)], b + "mlp.c_fc.bias": [(g + "ffn_up.bias", (F,), 0)],
                b + "mlp.c_proj.weight": [(g + "ffn_down.weight", (C, F), 0)],
                b + "mlp.c_proj.bias": [(g + "ffn_down.bias", (C,), 0)],
            })
        else:
            out.update({
                b + "ln_1.weight": [(g + "attn_norm.weight", (C,), 0)],
                b + "attn.c_attn.weight": [(g + "attn_q.weight", (H * D, C), H if permute else 0),
                                           (g + "attn_k.weight", (G * D, C), G if permute else 0),
                                           (g + "attn_v.weight", (G * D, C), 0)],
                b + "attn.c_attn.bias": [(g + "attn_q.bias", (H * D,), H if permute else 0),
                                         (g + "attn_k.bias", (G * D,), G if permute else 0),
                                         (g + "attn_v.bias", (G * D,), 0)],
                b + "attn.c_proj.weight": [(g + "attn_output.weight", (C, H * D), 0)],
                b + "attn.c_proj.bias": [(g + "attn_output.bias", (C,), 0)],
                b + "ln_2.weight": [(g + "ffn_norm.weight", (C,), 0)],
                b + "mlp.c_fc.weight": [(g + "ffn_gate.weight", (F, C), 0), (g + "ffn_up.weight", (F, C), 0)],
                b + "mlp.c_fc.bias": [(g + "ffn_gate.bias", (F,), 0), (g + "ffn_up.bias", (F,), 0)],
                b + "mlp.c_proj.weight": [(g + "ffn_down.weight", (C, F), 0)],
                b + "mlp.c_proj.bias": [(g + "ffn_down.bias", (C,), 0)],
            })
    return out


def _unpermute(rows, heads):
    """Undo llama.cpp's q/k row order: within each head it stores the rotary
    pairs' first halves interleaved with their second halves
    (convert_hf_to_gguf.py's permute); rows [heads * D, ...] -> HF order."""
    if not heads:
        return rows
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _permute(rows, heads):
    """HF order -> llama.cpp's (the inverse of _unpermute)."""
    if not heads:
        return rows
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# -- weights ----------------------------------------------------------------

def _rows(f, name):
    """A tensor's raw data as [rows, bytes per row] (quantized, BF16) or
    [rows, elements]: a view of the mapping."""
    data = np.asarray(f.tensors[name].data)
    return data.reshape(-1, data.shape[-1]) if data.ndim >= 2 else data.reshape(1, -1)


def _float(f, name):
    """A tensor dequantized to float32 (numpy shape)."""
    import gguf

    t = f.tensors[name]
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    w = np.asarray(w, dtype=np.float32)
    if not np.isfinite(w).all():
        warnings.warn(f"{f.path}: tensor {name!r} contains NaN or Inf")
    return w


def _q4_0_nibbles(raw):
    """Q4_0 rows [N, K/32 * 18 bytes] -> (nibbles uint8 [N, K] = code + 8, fp16 scales [N, K/32]).
    A block is its fp16 scale d, then 16 bytes: byte j holds element j in its
    low nibble and element j + 16 in its high; w = d * (nibble - 8)."""
    N = raw.shape[0]
    blocks = raw.reshape(N, -1, 18)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0]
    qs = blocks[:, :, 2:]
    nib = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(N, -1)
    return nib, d


def _check_shape(f, name, want):
    t = f.tensors.get(name)
    if t is None:
        raise ModelLoadError(f"{f.path}: missing tensor {name!r}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if shape != tuple(want):
        raise ModelLoadError(f"{f.path}: tensor {name!r} has shape {list(shape)}, expected "
                             f"{list(want)} from the metadata")
    if t.tensor_type.name not in RUNS:
        raise ModelLoadError(f"{f.path}: tensor {name!r} has type {t.tensor_type.name}, which cyformer "
                             f"does not read (it reads {', '.join(RUNS)})")


def plan(f, cfg, dtype=None):
    """param -> (cyformer format, [(tensor, its type)]) for every parameter the
    file fills; dtype (a cyformer format) overrides the table for matrices."""
    from .weights import is_matrix

    names = tensor_names(cfg)
    shapes = _shapes(cfg)
    out = {}
    for p, parts in names.items():
        if p not in shapes or shapes[p] is None:
            continue
        present = [n for n, _, _ in parts if n in f.tensors]
        if p == "lm_head" and not present:
            continue  # tied
        if p.endswith(".bias") and not present and not _required_bias(cfg, p):
            continue
        for n, shape, _ in parts:
            _check_shape(f, n, shape)
        types = [f.type_name(n) for n, _, _ in parts]
        if not is_matrix(p):
            fmt = "float32"
        elif dtype is not None:
            fmt = dtype
        else:
            fmt = max((RUNS[t][0] for t in types), key=PRECISION.index)
        out[p] = (fmt, list(zip([n for n, _, _ in parts], types)))
    return out


def _required_bias(cfg, p):
    from .arch import layer_shapes

    return layer_shapes(cfg).get(p.split(".", 2)[2]) is not None if p.startswith("blocks.") else False


def _shapes(cfg):
    from .arch import global_shapes, layer_shapes

    return {**global_shapes(cfg),
            **{f"blocks.{i}.{n}": s for i in range(cfg.n_layer) for n, s in layer_shapes(cfg).items()}}


def load_weights(f, cfg, dtype=None):
    """The file's tensors as cyformer Weights (see the module docstring).

    Where GGUF's layout is the kernel's (an F32 embedding, F32 norms) the
    arrays are views of the file's mapping; everything else is written into
    one arena sized for the result (weights._slots: huge pages where the OS
    offers them, as a checkpoint's weights are), one parameter at a time,
    dropping each source tensor's file pages once it is converted."""
    from .formats import Packed, convert, packed_layout
    from .weights import TRANSPOSED, Weights, _slots, is_matrix

    names, shapes, planned = tensor_names(cfg), _shapes(cfg), plan(f, cfg, dtype)
    mapped = {p for p in planned if _mapped(p, planned[p], names[p])}
    layout = {}
    for p, (fmt, _) in planned.items():
        if p in mapped:
            continue
        if fmt == "float32":
            layout[p] = [(shapes[p], np.float32)]
        else:
            data, data_dtype, scale = packed_layout(fmt, shapes[p], p in TRANSPOSED)
            layout[p] = [(data, data_dtype)] + ([] if scale is None else [(scale, np.float32)])
    arena = iter(_slots([spec for p in layout for spec in layout[p]]))
    slots = {p: [next(arena) for _ in specs] for p, specs in layout.items()}

    params = {}
    for p, (fmt, parts) in planned.items():
        spec, types, transposed = names[p], {t for _, t in parts}, p in TRANSPOSED
        if p in mapped:  # read-only views of the file's mapping
            if fmt in NATIVE:
                params[p] = Packed(fmt, _record_rows(f, spec[0][0], fmt), None, tuple(shapes[p]), transposed)
            else:
                params[p] = np.asarray(f.tensors[spec[0][0]].data).reshape(spec[0][1])
            continue
        out = slots[p]
        if fmt in NATIVE and types == {NATIVE[fmt]}:  # the records themselves, parts one after another
            out[0][...] = np.concatenate([_unpermute(_record_rows(f, n, fmt), h) for n, s, h in spec])
        elif fmt == "int4" and types == {"Q4_0"}:
            data, scale = _q4_0_int4(f, spec)
            out[0][...], out[1][...] = data, scale
        elif fmt == "bfloat16" and types == {"BF16"}:
            raw = np.concatenate([_unpermute(_rows(f, n).view(np.uint16).reshape(s), h) for n, s, h in spec])
            out[0][...] = raw if transposed else raw.T
        else:
            w = np.concatenate([_unpermute(_float(f, n).reshape(s), h) for n, s, h in spec])
            w = np.ascontiguousarray(w if transposed or not is_matrix(p) else w.T)
            if fmt == "float32":
                out[0][...] = w
            else:
                convert(lambda first, end: w[first:end], fmt, shapes[p], transposed,
                        out=Packed(fmt, out[0], out[1] if len(out) > 1 else None, tuple(shapes[p]), transposed))
            del w
        for a in out:
            a.flags.writeable = False
        params[p] = out[0] if fmt == "float32" else Packed(fmt, out[0], out[1] if len(out) > 1 else None,
                                                           tuple(shapes[p]), transposed)
        _release(f, [n for n, _, _ in spec])
    return Weights.from_params(cfg, params)


def _record_rows(f, name, fmt):
    """A Q8_0 / Q4_0 tensor's records [rows, K/32 * 34 or 18], a view of the
    mapping, its scales checked (a NaN or infinite scale would give NaN logits)."""
    from .formats import block_scales_finite

    raw = _rows(f, name)
    if not block_scales_finite(fmt, raw):
        raise ModelLoadError(f"{f.path}: tensor {name!r} has NaN or Inf block scales")
    return raw


def _mapped(p, planned, spec):
    """True where a parameter is one file tensor already in the kernel layout,
    used in place: Q8_0 as q8_0 and Q4_0 as q4_0 (a row of records per
    output, as the file holds it) unless its rows are permuted, or F32 that
    needs no transpose."""
    from .weights import TRANSPOSED, is_matrix

    fmt, parts = planned
    if len(parts) != 1:
        return False
    if fmt in NATIVE:
        return parts[0][1] == NATIVE[fmt] and not spec[0][2]
    return fmt == "float32" and parts[0][1] == "F32" and (p in TRANSPOSED or not is_matrix(p))


def _how(p, planned, spec):
    """How load_weights fills a parameter: "mapped" (the file's bytes in
    place), "copied" (the file's values: every part's type is the format's
    own, or widened to float32) or "converted" (requantized)."""
    fmt, parts = planned
    if _mapped(p, planned, spec):
        return "mapped"
    if fmt == "float32" or all(RUNS[t] == (fmt, True) or (t, fmt) == ("Q4_0", "int4") for _, t in parts):
        return "copied"
    return "converted"


def _q4_0_int4(f, spec):
    """Q4_0 tensors -> int4 (data, scale) without loss: the same codes and
    scales (fp16 widened), regrouped into cyformer's pairs (code 2m low,
    2m + 1 high), a row per output (rows_out) as the records are."""
    nibs, scales = [], []
    for n, s, h in spec:
        nib, d = _q4_0_nibbles(_rows(f, n))
        nibs.append(_unpermute(nib, h))
        scales.append(_unpermute(d, h))
    nib, d = np.concatenate(nibs), np.concatenate(scales).astype(np.float32)  # [N, K], [N, K/32]
    if not np.isfinite(d).all():
        raise ModelLoadError(f"{f.path}: tensor {spec[0][0]!r} has NaN or Inf block scales")
    return nib[:, 0::2] | (nib[:, 1::2] << 4), d


def _release(f, names):
    """Drop the file pages of tensors already repacked from this process's
    memory (madvise DONTNEED on the read-only mapping: a later read would
    fault them in again from the file), so that loading peaks at about the
    converted model plus one tensor, not plus the whole file."""
    mm = getattr(f.reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    for n in names:
        t = f.tensors.get(n)
        if t is None or not t.n_bytes:
            continue
        first = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, first, t.data_offset + t.n_bytes - first)
        except (OSError, ValueError):  # an OS without it: the pages stay until unmapped
            return


def tensor_table(f, cfg, dtype=None):
    """Per tensor kind (attn_q, ffn_down, ...): {kind: {"file": types, "runs":
    format, "how": how}}, how: "mapped" (used in place from the file),
    "copied" (the same values, repacked or widened) or "converted" (requantized
    at load)."""
    names, planned = tensor_names(cfg), plan(f, cfg, dtype)
    kinds = {}
    for p, (fmt, parts) in planned.items():
        for n, t in parts:
            kind = n.split(".")[-2] if n.startswith("blk.") else n.rsplit(".", 1)[0]
            kind += ".bias" if n.endswith(".bias") else ""
            entry = kinds.setdefault(kind, {"file": set(), "runs": set(), "how": set()})
            entry["file"].add(t)
            entry["runs"].add(fmt)
            entry["how"].add(_how(p, planned[p], names[p]))
    return {k: {key: "/".join(sorted(v[key])) for key in ("file", "runs", "how")} for k, v in kinds.items()}


# -- tokenizer ----------------------------------------------------------------

# The pre-tokenizers of tokenizer.ggml.pre that cyformer rebuilds, each as
# the tokenizer.json pieces that encode the same way.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre):
    """tokenizer.ggml.pre -> (normalizer, pre_tokenizer, ignore_merges), tokenizers objects."""
    from tokenizers import Regex, normalizers, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    bytes_only = pt.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt-2", "gpt2"):
        return None, byte_level, False
    if pre == "smollm":
        return None, pt.Sequence([pt.Digits(individual_digits=True), byte_level]), False
    if pre == "llama-bpe":
        return None, pt.Sequence([pt.Split(Regex(LLAMA3_SPLIT), "isolated"), bytes_only]), True
    if pre == "qwen2":
        return normalizers.NFC(), pt.Sequence([pt.Split(Regex(QWEN2_SPLIT), "isolated"), bytes_only]), False
    return None


PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe", "qwen2")

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def read_tokenizer(f, vocab_size):
    """The tokenizer of ``tokenizer.ggml.*`` as a cyformer Tokenizer."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

    from .model_files import TokenizerConfig
    from .tokenizer import NoTokenizer, Tokenizer

    kind = f.get("tokenizer.ggml.model", None, "str")
    if kind is None:
        return NoTokenizer(f.path)
    if kind != "gpt2":
        raise ModelLoadError(f"{f.path}: tokenizer kind {_clip(kind)} (tokenizer.ggml.model) is not supported; "
                             "cyformer rebuilds the 'gpt2' byte-level BPE kind")
    pre = f.get("tokenizer.ggml.pre", "gpt-2", "str")
    built = _pre_tokenizer(pre)
    if built is None:
        raise ModelLoadError(f"{f.path}: pre-tokenizer {_clip(pre)} (tokenizer.ggml.pre) is not supported "
                             f"(supported: {', '.join(PRE_TOKENIZERS)})")
    normalizer, pre_tok, ignore_merges = built
    tokens = f.need("tokenizer.ggml.tokens", "list")
    merges = f.need("tokenizer.ggml.merges", "list")
    types = f.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens), "list")
    if len(types) != len(tokens):
        raise ModelLoadError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens")
    if len(tokens) > vocab_size:
        raise ModelLoadError(f"{f.path}: {len(tokens)} tokens for an embedding of {vocab_size} rows")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"{f.path}: tokenizer.ggml.merges entry {_clip(m)} is not two tokens")
        pairs.append((a, b))
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ModelLoadError(f"{f.path}: the vocabulary and merges do not make a BPE tokenizer ({e})") from None
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    added = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(added)

    names = {}
    for name in ("bos", "eos", "unk", "pad"):
        key = "padding" if name == "pad" else ("unknown" if name == "unk" else name)
        i = f.get(f"tokenizer.ggml.{key}_token_id", None, "int")
        if i is not None and 0 <= i < len(tokens):
            names[f"{name}_token"] = tokens[i]
    template = f.get("tokenizer.chat_template", None, "str")
    config = TokenizerConfig(special_tokens=names,
                             add_bos_token=f.get("tokenizer.ggml.add_bos_token", False, "bool"),
                             chat_templates={"default": template} if template else {},
                             template_source=f.path if template else None)
    if config.add_bos_token and (names.get("bos_token") is None):
        raise ModelLoadError(f"{f.path}: tokenizer.ggml.add_bos_token is set but there is no bos token")
    return Tokenizer(f.path, config, built=tok)


def read_generation(f, cfg):
    """The end-of-sequence ids: eos, plus end-of-turn (eot) and end-of-message (eom) where given."""
    from .model_files import GenerationConfig

    ids = {f.get(f"tokenizer.ggml.{k}_token_id", None, "int") for k in ("eos", "eot", "eom")}
    ids = frozenset(i for i in ids if i is not None and 0 <= i < cfg.vocab_size)
    return GenerationConfig(eos_token_ids=ids or None, source=f.path)


def read(path, dtype=None):
    """A GGUF file -> (config, weights, tokenizer, generation config, tensor table):
    what cyformer.load builds a Model from for a GGUF path (the loader sits
    above both this module and the Model)."""
    f = open_gguf(path)
    cfg = read_config(f)
    weights = load_weights(f, cfg, dtype)
    tokenizer = read_tokenizer(f, cfg.vocab_size)
    return cfg, weights, tokenizer, read_generation(f, cfg), tensor_table(f, cfg, dtype)


# -- writing ----------------------------------------------------------------

def _tokenizer_json(model):
    """The model's tokenizer.json as a dict, or None."""
    tok = getattr(model.tokenizer, "_tok", None)
    if tok is None:
        return None
    return json.loads(tok.to_str())


def _pre_name(tj):
    """The tokenizer.ggml.pre name whose pieces equal tokenizer.json's, or None."""
    from tokenizers import Tokenizer as HFTokenizer, models

    def shape(d):
        if isinstance(d, dict):
            return {k: shape(v) for k, v in d.items() if k not in ("trim_offsets", "prepend_scheme", "invert")}
        if isinstance(d, list):
            return [shape(v) for v in d]
        return d

    for name in PRE_TOKENIZERS:
        normalizer, pre, _ = _pre_tokenizer(name)
        t = HFTokenizer(models.BPE())
        t.pre_tokenizer = pre
        if normalizer is not None:
            t.normalizer = normalizer
        built = json.loads(t.to_str())
        if shape(built["pre_tokenizer"]) == shape(tj.get("pre_tokenizer")) and (
                shape(built.get("normalizer")) == shape(tj.get("normalizer"))):
            return name
    return None


def _write_tokenizer(w, model):
    tj = _tokenizer_json(model)
    if tj is None:
        return
    m = tj.get("model") or {}
    if m.get("type") != "BPE" or m.get("byte_fallback"):
        raise CyformerError("save: only a byte-level BPE tokenizer can be written to GGUF "
                            f"(this one is {m.get('type')!r})")
    pre = _pre_name(tj)
    if pre is None:
        raise CyformerError("save: the tokenizer's pre-tokenizer matches none that GGUF names "
                            f"({', '.join(PRE_TOKENIZERS)}); cannot write it to GGUF")
    tok = model.tokenizer._tok
    n = model.config.vocab_size
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    for t, i in vocab.items():
        if i < n:
            tokens[i], types[i] = t, NORMAL
    for i, added in tok.get_added_tokens_decoder().items():
        if i < n:
            types[i] = CONTROL if added.special else USER_DEFINED
    merges = [" ".join(p) if isinstance(p, list) else p for p in m.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    cfg, tc = model.config, model.tokenizer.config
    specials = {k: tok.token_to_id(v) for k, v in tc.special_tokens.items() if isinstance(v, str)}
    bos = specials.get("bos_token", cfg.bos_token_id)
    eos = specials.get("eos_token", cfg.eos_token_id)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if specials.get("pad_token") is not None:
        w.add_pad_token_id(specials["pad_token"])
    w.add_add_bos_token(bool(tc.add_bos_token))
    if tc.chat_template:
        w.add_chat_template(tc.chat_template)


def _matrix_for_gguf(x, transposed):
    """A cyformer matrix (array or Packed) -> float32 numpy [out, in]."""
    from .formats import dequantize

    w = dequantize(x)
    return np.ascontiguousarray(w if transposed else w.T, dtype=np.float32)


def _encode(x, transposed, heads, qtype):
    """One GGUF tensor's data: raw blocks for quantized types; an int4 matrix
    written as Q4_0 keeps its codes (fp16 scales), and a q8_0 / q4_0 matrix
    written as Q8_0 / Q4_0 is its own records, so a file read and written
    again is the same bytes."""
    import gguf

    from .formats import Packed

    if isinstance(x, Packed) and NATIVE.get(x.fmt) == qtype:
        return _permute(x.data, heads)  # rows of records, a row per output
    if qtype == "Q4_0" and isinstance(x, Packed) and x.fmt == "int4":
        if (np.array_equal(x.scale.astype(np.float16).astype(np.float32), x.scale)
                and x.shape[0 if not transposed else 1] % 32 == 0):
            return _int4_q4_0(x, heads)
    w = _permute(_matrix_for_gguf(x, transposed), heads)
    if qtype == "F32":
        return w
    if qtype == "F16":
        return w.astype(np.float16)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def _int4_q4_0(x, heads):
    """int4 Packed (groups of 32 on whole blocks) -> Q4_0 rows [N, K/32 * 18]."""
    data = x.data                                              # [N, K/2] pairs (rows_out)
    N = data.shape[0]
    nib = np.empty((N, data.shape[1] * 2), dtype=np.uint8)
    nib[:, 0::2], nib[:, 1::2] = data & 15, data >> 4
    d = x.scale.astype(np.float16)                                 # [N, K/32]
    nib, d = _permute(nib, heads), _permute(d, heads)
    blocks = nib.reshape(N, -1, 2, 16)
    qs = blocks[:, :, 0] | (blocks[:, :, 1] << 4)                  # [N, K/32, 16]
    return np.concatenate([np.ascontiguousarray(d).view(np.uint8).reshape(N, -1, 2), qs], axis=2).reshape(N, -1)


def save(model, path, dtype="f32"):
    """Write ``model`` as a GGUF file at ``path`` with every matrix in dtype
    (f32, f16, q8_0, q4_0); returns the path.  Quantized types need inputs
    in whole blocks of 32; a matrix whose rows are not is written F16."""
    import gguf

    from .formats import Packed
    from .weights import TRANSPOSED, is_matrix

    if dtype not in WRITE_TYPES:
        raise ValueError(f"save: GGUF dtype must be one of {', '.join(WRITE_TYPES)}, got {dtype!r}")
    done = [k for k, v in (getattr(model, "processing", None) or {}).items() if v]
    if done:
        raise CyformerError(f"save: the weights are processed for analysis ({', '.join(done)}); save the model "
                            "as loaded")
    path = path_arg("save: path", path)
    cfg, wt = model.config, model.weights
    arch = cfg.model_type
    qtype = WRITE_TYPES[dtype]
    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, arch)
    try:
        w.add_name(os.path.splitext(os.path.basename(path))[0])
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.d_mlp)
        w.add_head_count(cfg.n_head)
        if arch == "gpt2":
            w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        else:
            w.add_head_count_kv(cfg.n_kv_head)
            w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
            w.add_rope_freq_base(cfg.rope_theta)
            w.add_rope_dimension_count(cfg.d_head)
            if cfg.d_head != cfg.n_embd // cfg.n_head:
                w.add_key_length(cfg.d_head)
                w.add_value_length(cfg.d_head)
            rs = cfg.rope_scaling
            if rs is not None:
                if rs.kind != "linear":
                    raise CyformerError(f"save: rope scaling {rs.kind!r} cannot be written to GGUF metadata")
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(rs.factor)
        w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                         "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype])
        _write_tokenizer(w, model)

        params = {"wte": wt.wte, "wpe": wt.wpe, "ln_f.weight": wt.ln_f.weight, "ln_f.bias": wt.ln_f.bias}
        if not wt.tied:
            params["lm_head"] = wt.lm_head
        for i, b in enumerate(wt.blocks):
            from .arch import LAYER_PARAMS
            for n in LAYER_PARAMS:
                params[f"blocks.{i}.{n}"] = b.param(n)
        for p, spec in tensor_names(cfg).items():
            x = params.get(p)
            if x is None:
                continue
            transposed = p in TRANSPOSED
            matrix = is_matrix(p)
            if matrix:
                o = 0
                for n, s, h in spec:  # a fused matrix is split along its outputs
                    part = x if len(spec) == 1 else _columns(x, o, s[0])
                    o += s[0]
                    _add(w, n, part, transposed, h, qtype)
            else:
                v = np.asarray(x, dtype=np.float32)
                o = 0
                for n, s, h in spec:
                    w.add_tensor(n, np.ascontiguousarray(_permute(v[o:o + s[0]], h)))
                    o += s[0]
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, path)
    return path


def _columns(x, o, n):
    """Outputs o .. o + n of a [K, N] block matrix (array or Packed)."""
    from .formats import TABLE, Packed

    if not isinstance(x, Packed):
        return x[:, o:o + n]
    if TABLE[x.fmt].rows_out:  # its data (and any scales) a row per output
        return Packed(x.fmt, x.data[o:o + n], None if x.scale is None else x.scale[o:o + n], (x.shape[0], n), False)
    scale = None if x.scale is None else (x.scale[o:o + n] if x.scale.ndim == 1 else x.scale[:, o:o + n])
    return Packed(x.fmt, x.data[:, o:o + n], scale, (x.shape[0], n), False)


def _add(w, name, x, transposed, heads, qtype):
    """Add one matrix (a cyformer matrix, array or Packed) as qtype, or as F16
    where its rows are not whole blocks of 32."""
    import gguf

    K = x.shape[1] if transposed else x.shape[0]
    t = qtype if (qtype in ("F32", "F16") or K % 32 == 0) else "F16"
    data = np.ascontiguousarray(_encode(x, transposed, heads, t))
    if t in ("F32", "F16"):
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[t])
