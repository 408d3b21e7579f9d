"""The model's hyperparameters, read from a Hugging Face GPT-2 config.json."""

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

from .errors import ModelLoadError

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
        aliases = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                   "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}
        values = {}
        for key in cls.__dataclass_fields__:
            if key in raw:
                values[key] = raw[key]
        for alias, key in aliases.items():
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
                raise ModelLoadError(f"{source}: {name} must be a positive integer, got {v!r}")

        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            positive_int(name)
        if self.n_inner is not None:
            positive_int("n_inner")
        if self.n_embd % self.n_head:
            raise ModelLoadError(
                f"{source}: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation_function not in ACTIVATIONS:
            raise ModelLoadError(
                f"{source}: activation_function {self.activation_function!r} is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1) or not math.isfinite(eps):
            raise ModelLoadError(f"{source}: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size):
                # Hugging Face only warns here; a model without a usable eos
                # simply never stops on it.
                warnings.warn(f"{source}: {name}={v!r} is not a token id below vocab_size; ignoring it")
                object.__setattr__(self, name, None)
        # Guard against absurd sizes before anything is allocated from them.
        if self.n_params() > 2**36:
            raise ModelLoadError(f"{source}: the geometry implies {self.n_params():,} parameters; refusing")


def read_config(path):
    """Read and validate config.json at ``path``."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: config.json not found")
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return Config.from_dict(raw, source=path)
    except TypeError as e:
        raise ModelLoadError(f"{path}: {e}") from None
