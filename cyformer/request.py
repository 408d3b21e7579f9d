"""One generation request: what to sample and when to stop, as one value.

Every way in (``Model.generate(..., temperature=0.7)``, ``Engine.chat``,
``cyformer generate -t 0.7``, an HTTP request, a job row) builds one
GenerationRequest at its edge; Generation, the engine, chat and jobs pass
it along instead of a list of keywords.  The fields and their defaults are
declared here and nowhere else.

Resolving it against a model (``sampling(generation_config)``) turns the
fields left at DEFAULT into the checkpoint's values (generation_config.json)
and gives the Sampler its SamplingParams.
"""

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from . import _checks
from .model_files import DEFAULT

LOGPROBS_MODES = ("raw", "processed")
MAX_NEW_TOKENS = 64        # generate's default
CHAT_MAX_NEW_TOKENS = 256  # chat's default: a reply is longer than a continuation
NOT_GIVEN = type("NotGiven", (), {"__repr__": lambda self: "NOT_GIVEN", "__reduce__": lambda self: "NOT_GIVEN"})()
# The fields whose default is the checkpoint's generation_config.json value.
CHECKPOINT_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationRequest:
    """The sampling and stopping options of one generation.

    max_new_tokens: new tokens at most.
    temperature (0: greedy), top_k, top_p, repetition_penalty: DEFAULT takes
    the checkpoint's generation_config.json value; None switches a filter off.
    min_p: keep tokens whose probability is at least min_p times the most
    likely one's (after the temperature).
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: every
    generated token's logit is lowered by presence_penalty once it has
    appeared and by frequency_penalty times its count (generated tokens only).
    logit_bias: {token id: bias in [-100, 100]} added to the logits.
    stop: a stop string, a stop token id, or a list of them; a stop string is
    cut from the text, a stop token is not part of it.
    ignore_eos: keep going past the end-of-sequence tokens (they become text).
    min_tokens: no end (eos, stop ids, stop strings) before this many tokens.
    seed: makes sampling reproducible.
    logprobs: record each new token's log-probability; top_logprobs: and the
    k most likely tokens at its position.  logprobs_mode "raw" (default)
    reports log_softmax of the model's logits; "processed" that of the
    scores sampled from (after logit_bias, the penalties and the
    temperature, before top-k/top-p/min-p).
    truncate: keep the end of a prompt too long for the context.
    skip_special_tokens: leave special tokens out of the text.
    json_schema: a JSON schema (a dict or JSON text; kept as JSON text) the
    output must be one valid value of; grammar: a Lark grammar (llguidance's
    dialect) the output must be a sentence of; at most one of them
    (cyformer.structured; pip install 'cyformer[structured]').
    token_healing: back a str prompt up over its last token and let the
    first new token re-spell it (cyformer.healing); None (default): on for
    str prompts unless logprobs or a constraint are asked for.

    Sampling order: logit_bias and the presence/frequency penalties are added,
    then repetition_penalty scales (CTRL's rule: positive logits divided,
    negative multiplied, over prompt and generated tokens), then the
    temperature, then top-k, top-p and min-p filter.
    """

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: Union[float, object] = DEFAULT
    top_k: Union[int, None, object] = DEFAULT
    top_p: Union[float, None, object] = DEFAULT
    repetition_penalty: Union[float, None, object] = DEFAULT
    min_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[Mapping] = None
    stop: object = None
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"
    truncate: bool = False
    skip_special_tokens: bool = True
    json_schema: Optional[str] = None
    grammar: Optional[str] = None
    token_healing: Optional[bool] = None

    def __post_init__(self):
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen
        n = _checks.integer("generate", "max_new_tokens", self.max_new_tokens)
        if n < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        set_("max_new_tokens", n)
        m = _checks.integer("generate", "min_tokens", self.min_tokens)
        if m < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        set_("min_tokens", m)
        if self.min_p is not None:
            set_("min_p", _real("min_p", self.min_p, 0, 1))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, _real(name, getattr(self, name), -2, 2))
        set_("logit_bias", _logit_bias(self.logit_bias))
        set_("stop", _stop_items(self.stop))
        for name in ("ignore_eos", "logprobs", "truncate", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
            set_(name, bool(getattr(self, name)))
        k = _checks.integer("generate", "top_logprobs", self.top_logprobs)
        if k < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {k}")
        if k and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        set_("top_logprobs", k)
        set_("json_schema", _json_schema(self.json_schema))
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("grammar must be a non-empty Lark grammar string")
            _checks.text("generate", "grammar", self.grammar)
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("give one of json_schema and grammar, not both")
        if self.token_healing is not None:
            if not isinstance(self.token_healing, (bool, np.bool_)):
                raise ValueError(f"token_healing must be True, False or None, got {self.token_healing!r}")
            set_("token_healing", bool(self.token_healing))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")

    @classmethod
    def fields(cls):
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def build(cls, request=None, max_new_tokens=NOT_GIVEN, default_max_new_tokens=MAX_NEW_TOKENS, **options):
        """The request an entry point was called with: ``request`` (or the
        defaults) with ``max_new_tokens`` and the keyword ``options`` over it.
        An unknown keyword is a TypeError naming it."""
        unknown = set(options) - set(cls.fields())
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}; "
                            f"the options are {', '.join(cls.fields())}")
        if max_new_tokens is not NOT_GIVEN:
            options["max_new_tokens"] = max_new_tokens
        if request is None:
            options.setdefault("max_new_tokens", default_max_new_tokens)
            return cls(**options)
        if not isinstance(request, cls):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        return dataclasses.replace(request, **options) if options else request

    @classmethod
    def given(cls, **options):
        """A request from a command line's options, where None means not
        given: the checkpoint's value for the sampling fields that have one,
        the default for the others."""
        return cls(**{k: (DEFAULT if v is None else v)
                      for k, v in options.items() if v is not None or k in CHECKPOINT_FIELDS})

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def sampling(self, generation_config):
        """The Sampler's SamplingParams, DEFAULT fields from ``generation_config``."""
        return generation_config.sampling(
            self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.seed,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias)


def _real(name, value, lo, hi):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    v = float(value)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    return v


def _logit_bias(bias):
    """{id: bias} -> a sorted tuple of (int id, float bias) pairs (hashable, picklable)."""
    if bias is None or (isinstance(bias, Mapping) and not bias):
        return ()
    if isinstance(bias, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in bias):
        bias = dict(bias)
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():  # JSON keys are strings
            k = int(k)
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        out[int(k)] = _real(f"logit_bias[{k}]", v, -100, 100)
    return tuple(sorted(out.items()))


def _json_schema(schema):
    """A JSON schema (dict or JSON text) -> its JSON text (hashable), or ValueError."""
    if schema is None:
        return None
    if isinstance(schema, str):
        _checks.text("generate", "json_schema", schema)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise ValueError(f"json_schema must be a JSON schema object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema is not JSON: {e}") from None


def _stop_items(stop):
    """stop -> a tuple of stop strings and token ids (checked against the model in Generation)."""
    if stop is None:
        return ()
    if isinstance(stop, (str, numbers.Integral)) and not isinstance(stop, bool):
        return (stop,)
    if isinstance(stop, (list, tuple, set, frozenset)):
        items = list(stop)
        for s in items:
            if isinstance(s, bool) or not isinstance(s, (str, numbers.Integral)):
                raise ValueError(f"stop must hold strings or token ids, got {s!r}")
            if isinstance(s, str) and not s:
                raise ValueError("stop strings must be non-empty")
        return tuple(s if isinstance(s, str) else int(s) for s in items)
    raise ValueError(f"stop must be a string, a token id or a list of them, got {stop!r}")
