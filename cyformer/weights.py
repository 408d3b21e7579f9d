"""Read a GPT-2 checkpoint (model.safetensors) into typed, read-only arrays.

One explicit map from checkpoint names to parameters, every shape checked
against the config.  Hugging Face's GPT-2 uses Conv1D layers, which store
weights as [in, out]: exactly the layout the linear kernels read, so no
tensor is transposed or copied after it is read.
"""

import os
import warnings
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from .config import Config
from .errors import ModelLoadError

# Tensors that hub checkpoints carry but that hold no parameters: the causal
# mask buffers of older transformers versions.
_BUFFERS = ("attn.bias", "attn.masked_bias")


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


def _as_f32(name, arr, path):
    if arr.dtype == np.float32:
        out = arr
    elif arr.dtype in (np.float16, np.float64):
        out = arr.astype(np.float32)
    else:
        raise ModelLoadError(f"{path}: tensor {name!r} has dtype {arr.dtype}; expected a floating-point type")
    out = np.ascontiguousarray(out)
    out.flags.writeable = False  # weights are shared by every generation: never written
    return out


def load_weights(path: str, cfg: Config) -> Weights:
    """Read model.safetensors at ``path`` and check it against ``cfg``."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:  # pragma: no cover
        raise ModelLoadError("the safetensors package is required to load weights") from None
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: model.safetensors not found")
    expected = _expected_shapes(cfg)
    tensors = {}
    try:
        with safe_open(path, framework="numpy") as f:
            keys = list(f.keys())
            prefix = "transformer." if any(k.startswith("transformer.") for k in keys) else ""
            present = {}
            for k in keys:
                short = k[len(prefix):] if k.startswith(prefix) else k
                present[short] = k
            for name, shape in expected.items():
                if name not in present:
                    raise ModelLoadError(f"{path}: missing tensor {prefix + name!r}")
            unexpected = [k for short, k in present.items()
                          if short not in expected and short != "lm_head.weight"
                          and not short.endswith(_BUFFERS)]
            if unexpected:
                warnings.warn(f"{path}: ignoring {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
            names = list(expected) + (["lm_head.weight"] if "lm_head.weight" in present else [])
            for name in names:
                arr = _as_f32(present[name], f.get_tensor(present[name]), path)
                want = expected.get(name, (cfg.vocab_size, cfg.n_embd))
                if arr.shape != want:
                    raise ModelLoadError(
                        f"{path}: tensor {present[name]!r} has shape {arr.shape}, expected {want} from config.json")
                if not np.isfinite(arr).all():
                    warnings.warn(f"{path}: tensor {present[name]!r} contains NaN or Inf")
                tensors[name] = arr
    except ModelLoadError:
        raise
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None

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
