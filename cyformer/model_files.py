"""The checkpoint's files beyond config.json and the weights.

tokenizer_config.json (and the older special_tokens_map.json) name the
special tokens, say whether a prompt starts with the bos token and carry the
chat template, which newer checkpoints keep in chat_template.jinja instead.
generation_config.json lists the end-of-sequence ids (often several) and the
sampling values the model was published with.

Both are optional: without them a checkpoint keeps cyformer's defaults
(greedy, no filters, config.json's eos_token_id).  A file that is present
but malformed is a ModelLoadError naming the file and the key.
"""

import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

from .errors import ModelLoadError
from .sampling import SamplingParams

MAX_JSON_BYTES = 2**26  # a Llama 3 tokenizer_config.json with its added tokens is ~50 KB

# The named special tokens transformers passes to a chat template; any other
# "*_token" key with a token value (Qwen's "image_token", ...) goes too.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# transformers' sampling defaults, applied when a checkpoint asks for sampling
# (do_sample true) without giving a value.
HF_TEMPERATURE = 1.0
HF_TOP_K = 50


class _CheckpointDefault:
    """The default of a sampling argument: the checkpoint's value.  (None is a
    value of its own: top_k=None means no top-k, whatever the checkpoint says.)"""

    def __repr__(self):
        return "DEFAULT"

    def __reduce__(self):
        return "DEFAULT"


DEFAULT = _CheckpointDefault()


def _clip(v, n=60):
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def read_json_object(path, max_bytes=MAX_JSON_BYTES):
    """A JSON object from ``path`` (at most ``max_bytes``), or None when there is no such file.

    Every failure (unreadable, too large, not UTF-8, not JSON, not an
    object) is a ModelLoadError naming the file.
    """
    if not os.path.exists(path):
        return None
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > max_bytes:
        raise ModelLoadError(f"{path}: over {max_bytes} bytes; refusing to parse it")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON (not UTF-8: {e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > MAX_JSON_BYTES:
        raise ModelLoadError(f"{path}: over {MAX_JSON_BYTES} bytes; refusing to read it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# -- tokenizer_config.json ------------------------------------------------

@dataclass(frozen=True)
class TokenizerConfig:
    """What tokenizer_config.json says beyond tokenizer.json.

    special_tokens: name -> token text ("bos_token": "<s>", ...), the
    variables a chat template sees.  add_bos_token: whether an encoded prompt
    starts with the bos token (None: the file does not say; tokenizer.json's
    post-processor decides alone).  chat_templates: name -> Jinja source;
    "default" is the one chat() uses.  template_source: the file it came from.
    """

    special_tokens: dict = field(default_factory=dict)
    add_bos_token: Optional[bool] = None
    chat_templates: dict = field(default_factory=dict)
    template_source: Optional[str] = None

    @property
    def chat_template(self):
        """The default chat template, or None."""
        return self.chat_templates.get("default")


def _token_text(value, source, key, required):
    """A special token is a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if value is None or not required:
        return None
    raise ModelLoadError(f"{source}: {key} must be a string or an object with a string \"content\", "
                         f"got {_clip(value)}")


def _special_tokens(raw, source):
    tokens = {}
    for key, value in raw.items():
        if isinstance(key, str) and key.endswith("_token"):
            # add_bos_token and friends are flags, not tokens: only the named
            # tokens must be token-shaped, other keys are taken when they are.
            text = _token_text(value, source, key, required=key in NAMED_TOKENS)
            if text is not None:
                tokens[key] = text
    return tokens


def _chat_templates(value, source):
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        templates = {}
        for i, item in enumerate(value):
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ModelLoadError(f"{source}: chat_template[{i}] must be an object with string "
                                     f"\"name\" and \"template\", got {_clip(item)}")
            templates[item["name"]] = item["template"]
        return templates
    raise ModelLoadError(f"{source}: chat_template must be a string or a list of "
                         f"{{\"name\", \"template\"}} objects, got {type(value).__name__}")


def read_tokenizer_config(directory):
    """Read tokenizer_config.json, special_tokens_map.json and chat_template.jinja
    from ``directory`` (each optional) into a TokenizerConfig.

    As in transformers, tokenizer_config.json's values win over the legacy
    special_tokens_map.json, and chat_template.jinja over the template in
    tokenizer_config.json.
    """
    special = {}
    legacy_path = os.path.join(directory, "special_tokens_map.json")
    legacy = read_json_object(legacy_path)
    if legacy is not None:
        special.update(_special_tokens(legacy, legacy_path))

    path = os.path.join(directory, "tokenizer_config.json")
    raw = read_json_object(path) or {}
    special.update(_special_tokens(raw, path))
    add_bos = raw.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise ModelLoadError(f"{path}: add_bos_token must be true or false, got {_clip(add_bos)}")
    templates = _chat_templates(raw.get("chat_template"), path)
    source = path if templates else None

    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        if not os.path.isfile(jinja_path):
            raise ModelLoadError(f"{jinja_path}: not a regular file")
        templates = {**templates, "default": _read_text(jinja_path)}
        source = jinja_path
    return TokenizerConfig(special, add_bos, templates, source)


# -- generation_config.json -----------------------------------------------

def _token_id(path, key, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"{path}: {key} must be a non-negative integer token id, got {_clip(value)}")
    return value


def _number(path, key, value, ok, what):
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not ok(value)):
        raise ModelLoadError(f"{path}: {key} must be {what}, got {_clip(value)}")
    return value


@dataclass(frozen=True)
class GenerationConfig:
    """The checkpoint's generation defaults (generation_config.json).

    eos_token_ids: the ids that end a generation, or None to use config.json's
    eos_token_id (no file, no eos key, or a file that transformers derived
    from config.json).  The sampling fields are None where the file is silent;
    ``sampling()`` turns them and the caller's arguments into SamplingParams.
    """

    eos_token_ids: Optional[frozenset] = None
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    do_sample: Optional[bool] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    source: Optional[str] = None

    def eos_ids(self, cfg):
        """The set of ids that end a generation for a model with config ``cfg``."""
        if self.eos_token_ids is not None:
            return self.eos_token_ids
        return frozenset(cfg.eos_token_ids)

    def sampling(self, temperature=DEFAULT, top_k=DEFAULT, top_p=DEFAULT, repetition_penalty=DEFAULT,
                 seed=None, **others):
        """SamplingParams from the caller's values; DEFAULT takes the checkpoint's.
        ``others`` (min_p, the penalties, logit_bias) have no checkpoint value.

        As in transformers: without do_sample the checkpoint decodes greedily
        (temperature 0); with it, temperature and top_k default to 1.0 and 50
        where the file gives none, and the file's top_k 0 means no top-k.
        Without a generation_config.json: greedy, no filters.  A caller's None
        switches a filter off.
        """
        sample = bool(self.do_sample)
        if temperature is DEFAULT:
            temperature = 0.0 if not sample else (
                self.temperature if self.temperature is not None else HF_TEMPERATURE)
        if top_k is DEFAULT:
            top_k = (self.top_k if self.top_k is not None else HF_TOP_K) if sample else self.top_k
            top_k = top_k or None  # 0: off
        if top_p is DEFAULT:
            top_p = self.top_p
        if repetition_penalty is DEFAULT:
            repetition_penalty = self.repetition_penalty
        return SamplingParams(temperature, top_k, top_p, repetition_penalty, seed, **others)


def read_generation_config(directory, vocab_size):
    """Read ``directory``/generation_config.json into a GenerationConfig
    (an empty one when there is no file).  Ids at or above vocab_size are
    dropped with a warning, as config.json's are."""
    path = os.path.join(directory, "generation_config.json")
    raw = read_json_object(path)
    if raw is None:
        return GenerationConfig()

    eos = raw.get("eos_token_id")
    if eos is None or raw.get("_from_model_config"):
        # transformers wrote this file from config.json: config.json governs.
        eos_ids = None
    else:
        listed = eos if isinstance(eos, list) else [eos]
        ids = [_token_id(path, "eos_token_id", v) for v in listed]
        if any(i is None for i in ids):
            raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of them, "
                                 f"got {_clip(eos)}")
        kept = [i for i in ids if i < vocab_size]
        if len(kept) < len(ids):
            warnings.warn(f"{path}: eos_token_id {_clip(eos)} has ids not below vocab_size={vocab_size}; "
                          "ignoring them")
        eos_ids = frozenset(kept)

    do_sample = raw.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ModelLoadError(f"{path}: do_sample must be true or false, got {_clip(do_sample)}")
    top_k = raw.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ModelLoadError(f"{path}: top_k must be an integer >= 0, got {_clip(top_k)}")
    return GenerationConfig(
        eos_token_ids=eos_ids,
        bos_token_id=_token_id(path, "bos_token_id", raw.get("bos_token_id")),
        pad_token_id=_token_id(path, "pad_token_id", raw.get("pad_token_id")),
        do_sample=do_sample,
        temperature=_number(path, "temperature", raw.get("temperature"), lambda t: t >= 0, "a number >= 0"),
        top_k=top_k,
        top_p=_number(path, "top_p", raw.get("top_p"), lambda p: 0 < p <= 1, "a number in (0, 1]"),
        repetition_penalty=_number(path, "repetition_penalty", raw.get("repetition_penalty"),
                                   lambda r: r > 0, "a number > 0"),
        source=path,
    )
