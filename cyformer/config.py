"""The model's hyperparameters, read from a Hugging Face config.json.

One Config describes every family (cyformer.arch): the geometry, and the
family's choices (norm, positions, MLP, biases, key/value heads) as fields
that the loader, the backends and the kernels read.
"""

import math
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Optional, Tuple

from . import arch
from .errors import ModelLoadError
from .model_files import read_json_object

# Sanity bounds, far above any model this engine targets, so that a corrupt
# or hostile config.json is refused before anything is sized from it (and no
# size can overflow a C index).  Raise one here if a real model ever needs it.
MAX_SIZES = {
    "vocab_size": 2**24,   # 16.7M tokens (GPT-2: 50257, Qwen2.5: 151936)
    "n_positions": 2**24,  # 16.7M positions
    "n_embd": 2**17,       # 131072 (Llama-3-70B: 8192)
    "n_layer": 2**12,
    "n_head": 2**12,
    "n_kv_head": 2**12,
    "head_dim": 2**12,
    "n_inner": 2**20,
}
MAX_PARAMS = 2**36  # 256 GiB of float32
MAX_CONFIG_BYTES = 2**24  # a real config.json is a few KB

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
    """Geometry and family choices.  Defaults are those of Hugging Face's GPT2Config.

    V = vocab_size, P = n_positions, C = n_embd, L = n_layer, H = n_head
    query heads, G = n_kv_head key/value heads (H for GPT-2), D = d_head,
    F = d_mlp (4 C for GPT-2 when n_inner is None).
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
    model_type: str = "gpt2"
    n_kv_head: Optional[int] = None  # None: n_head
    head_dim: Optional[int] = None   # None: n_embd // n_head
    qkv_bias: bool = True
    attn_out_bias: bool = True
    mlp_bias: bool = True
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_scaling: Optional[arch.RopeScaling] = None
    more_eos_token_ids: Tuple[int, ...] = ()  # config.json may list several: those after the first

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)

    @property
    def eos_token_ids(self) -> Tuple[int, ...]:
        """Every end-of-sequence id."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return first + tuple(i for i in self.more_eos_token_ids if i != self.eos_token_id)

    @property
    def family(self) -> arch.Family:
        return arch.FAMILIES[self.model_type]

    @property
    def norm(self) -> str:
        return self.family.norm

    @property
    def position(self) -> str:
        return self.family.position

    @property
    def gated(self) -> bool:
        return self.family.mlp == "swiglu"

    @property
    def norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def d_mlp(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def gelu(self) -> str:
        return ACTIVATIONS[self.activation_function]

    @property
    def mlp_activation(self) -> str:
        """What sits between the MLP's products: "gelu_new", "gelu" or "swiglu"."""
        return "swiglu" if self.gated else self.gelu

    def n_params(self) -> int:
        """Parameters counted once (a tied unembedding is wte)."""
        return arch.n_params(self)

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, raw, source="config"):
        """Build and validate a Config from config.json's dict (unknown keys ignored)."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "gpt2")
        if not isinstance(model_type, str) or model_type not in arch.FAMILIES:
            raise ModelLoadError(
                f"{source}: model_type {_clip(model_type)} is not supported (supported: "
                f"{', '.join(sorted(arch.FAMILIES))})")
        values = arch.FAMILIES[model_type].read_config(raw, source)
        values["model_type"] = model_type
        eos = values.get("eos_token_id")
        if isinstance(eos, list):  # Llama 3 lists several
            ids = tuple(e for e in eos if _token_id(e, values.get("vocab_size")))
            if len(ids) != len(eos):
                warnings.warn(f"{source}: eos_token_id {_clip(eos)} holds entries that are not "
                              "token ids below vocab_size; ignoring them")
            values["eos_token_id"] = ids[0] if ids else None
            values["more_eos_token_ids"] = ids[1:]
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in values.items() if k in names})
        cfg.validate(source)
        return cfg

    def validate(self, source="config"):
        def positive_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelLoadError(f"{source}: {name} must be a positive integer, got {_clip(v)}")
            if v > MAX_SIZES[name]:
                raise ModelLoadError(f"{source}: {name}={v} is absurdly large (limit {MAX_SIZES[name]})")

        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_kv_head"):
            positive_int(name)
        for name in ("n_inner", "head_dim"):
            if getattr(self, name) is not None:
                positive_int(name)
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ModelLoadError(
                f"{source}: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ModelLoadError(f"{source}: the {self.n_head} attention heads must be a multiple "
                                 f"of the {self.n_kv_head} key/value heads")
        if self.position == "rotary" and self.d_head % 2:
            raise ModelLoadError(f"{source}: rotary embeddings need an even head_dim, got {self.d_head}")
        if not self.gated and (not isinstance(self.activation_function, str)
                               or self.activation_function not in ACTIVATIONS):
            raise ModelLoadError(
                f"{source}: activation_function {_clip(self.activation_function)} is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1) or not math.isfinite(eps):
            name = "layer_norm_epsilon" if self.norm == "layer_norm" else "rms_norm_eps"
            raise ModelLoadError(f"{source}: {name} must be a number in (0, 1), got {_clip(eps)}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (1 < theta < 1e12):
            raise ModelLoadError(f"{source}: rope_theta must be a number in (1, 1e12), got {_clip(theta)}")
        for name in ("qkv_bias", "attn_out_bias", "mlp_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ModelLoadError(f"{source}: {name} must be true or false, got {_clip(getattr(self, name))}")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if v is not None and not _token_id(v, self.vocab_size):
                # Hugging Face only warns here; a model without a usable eos
                # simply never stops on it.
                warnings.warn(f"{source}: {name}={_clip(v)} is not a token id below vocab_size; ignoring it")
                object.__setattr__(self, name, None)
                if name == "eos_token_id":
                    object.__setattr__(self, "more_eos_token_ids", ())
        # Guard against absurd sizes before anything is allocated from them.
        if self.n_params() > MAX_PARAMS:
            raise ModelLoadError(f"{source}: the geometry implies {self.n_params():,} parameters; refusing")


def _token_id(v, vocab_size):
    return (not isinstance(v, bool) and isinstance(v, int) and isinstance(vocab_size, int)
            and 0 <= v < vocab_size)


def read_config(path):
    """Read and validate config.json at ``path``.

    Raises ModelLoadError naming the file and the key for a missing or
    unreadable file, text that is not a JSON object, a missing geometry key
    (vocab_size, n_positions, n_embd, n_layer, n_head) or a bad value.
    """
    raw = read_json_object(path, MAX_CONFIG_BYTES)
    if raw is None:
        raise ModelLoadError(f"{path}: config.json not found")
    for key, aliases in REQUIRED.items():
        if key not in raw and not any(a in raw for a in aliases):
            raise ModelLoadError(f"{path}: missing key {key!r}")
    try:
        return Config.from_dict(raw, source=path)
    except TypeError as e:
        raise ModelLoadError(f"{path}: {e}") from None
