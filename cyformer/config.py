"""The model's hyperparameters, read from a Hugging Face GPT-2 config.json."""

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

from .errors import ModelLoadError

# Sanity bounds, far above any GPT-2-style model, so that a corrupt or
# hostile config.json is refused before anything is sized from it (and no
# size can overflow a C index).  Raise one here if a real model ever needs it.
MAX_SIZES = {
    "vocab_size": 2**24,   # 16.7M tokens (GPT-2: 50257)
    "n_positions": 2**24,  # 16.7M positions (GPT-2: 1024)
    "n_embd": 2**17,       # 131072 (GPT-2 XL: 1600)
    "n_layer": 2**12,      # 4096 (GPT-2 XL: 48)
    "n_head": 2**12,
    "n_inner": 2**20,
}
MAX_PARAMS = 2**36  # 256 GiB of float32
MAX_CONFIG_BYTES = 2**24  # a real config.json is about 1 KB

# The geometry keys config.json must spell out (or one of their aliases):
# without them the defaults would describe some other model.
REQUIRED = {
    "vocab_size": (),
    "n_positions": ("max_position_embeddings",),
    "n_embd": ("hidden_size",),
    "n_layer": ("num_hidden_layers",),
    "n_head": ("num_attention_heads",),
}


def _clip(v, n=60):
    """repr(v), cut short: a corrupt config must not make a megabyte message."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


# config.json's activation_function -> the GELU form the kernels compute.
ACTIVATIONS = {
    "gelu_new": "gelu_new",           # tanh approximation (GPT-2's own)
    "gelu_pytorch_tanh": "gelu_new",  # the same formula, fused in PyTorch
    "gelu_fast": "gelu_new",
    "gelu": "gelu",                   # exact, erf-based
}


@dataclass(frozen=True)
class Config:
    """GPT-2 geometry.  Defaults are those of Hugging Face's GPT2Config.

    V = vocab_size, P = n_positions, C = n_embd, L = n_layer, H = n_head,
    D = C // H (d_head), n_inner = MLP width (4 C when None).
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    bos_token_id: Optional[int] = 50256
    eos_token_id: Optional[int] = 50256

    @property
    def d_head(self) -> int:
        return self.n_embd // self.n_head

    @property
    def d_mlp(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def gelu(self) -> str:
        return ACTIVATIONS[self.activation_function]

    def n_params(self) -> int:
        """Parameters counted once (the tied unembedding is wte)."""
        C, D, L = self.n_embd, self.d_mlp, self.n_layer
        per_layer = 4 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * D + D) + (D * C + C)
        return self.vocab_size * C + self.n_positions * C + L * per_layer + 2 * C

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, raw, source="config"):
        """Build and validate a Config from config.json's dict (unknown keys ignored)."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        values = {}
        for key in cls.__dataclass_fields__:
            if key in raw:
                values[key] = raw[key]
        for key, aliases in REQUIRED.items():
            for alias in aliases:
                if key not in values and alias in raw:
                    values[key] = raw[alias]
        # Options of GPT2Config that change the arithmetic and that the kernels
        # do not implement: refuse rather than compute something else.
        if raw.get("scale_attn_by_inverse_layer_idx"):
            raise ModelLoadError(f"{source}: scale_attn_by_inverse_layer_idx=true is not supported")
        if raw.get("scale_attn_weights") is False:
            raise ModelLoadError(f"{source}: scale_attn_weights=false is not supported")
        if raw.get("add_cross_attention"):
            raise ModelLoadError(f"{source}: add_cross_attention=true (an encoder-decoder model) is not supported")
        cfg = cls(**values)
        cfg.validate(source)
        return cfg

    def validate(self, source="config"):
        def positive_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelLoadError(f"{source}: {name} must be a positive integer, got {_clip(v)}")
            if v > MAX_SIZES[name]:
                raise ModelLoadError(f"{source}: {name}={v} is absurdly large (limit {MAX_SIZES[name]})")

        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            positive_int(name)
        if self.n_inner is not None:
            positive_int("n_inner")
        if self.n_embd % self.n_head:
            raise ModelLoadError(
                f"{source}: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not isinstance(self.activation_function, str) or self.activation_function not in ACTIVATIONS:
            raise ModelLoadError(
                f"{source}: activation_function {_clip(self.activation_function)} is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1) or not math.isfinite(eps):
            raise ModelLoadError(f"{source}: layer_norm_epsilon must be a number in (0, 1), got {_clip(eps)}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size):
                # Hugging Face only warns here; a model without a usable eos
                # simply never stops on it.
                warnings.warn(f"{source}: {name}={_clip(v)} is not a token id below vocab_size; ignoring it")
                object.__setattr__(self, name, None)
        # Guard against absurd sizes before anything is allocated from them.
        if self.n_params() > MAX_PARAMS:
            raise ModelLoadError(f"{source}: the geometry implies {self.n_params():,} parameters; refusing")


def read_config(path):
    """Read and validate config.json at ``path``.

    Raises ModelLoadError naming the file and the key for a missing or
    unreadable file, text that is not a JSON object, a missing geometry key
    (vocab_size, n_positions, n_embd, n_layer, n_head) or a bad value.
    """
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: config.json not found")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: config.json is not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ModelLoadError(f"{path}: over {MAX_CONFIG_BYTES} bytes; not a config.json")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON (not UTF-8: {e.reason} at byte {e.start})") from None
    # ValueError covers JSONDecodeError and integers too long to convert;
    # RecursionError a pathologically nested document.
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    for key, aliases in REQUIRED.items():
        if key not in raw and not any(a in raw for a in aliases):
            raise ModelLoadError(f"{path}: missing key {key!r}")
    try:
        return Config.from_dict(raw, source=path)
    except TypeError as e:
        raise ModelLoadError(f"{path}: {e}") from None
