"""Constrained decoding: outputs that follow a JSON schema or a grammar.

At each step the constraint marks which tokens may come next, the others'
logits become -inf before sampling, and the chosen token advances it.  The
token masks come from llguidance (an optional dependency:
pip install 'cyformer[structured]'), chosen over xgrammar and outlines-core
because on CPU with cyformer's tokenizers it compiled a schema fastest and
computed masks fastest on a 50K vocabulary, and needs no torch
(bench/structured.py, bench/results/).

A Constraint is one generation's state; the tokenizer's llguidance form is
built once per tokenizer (about 2 s for a 50K vocabulary) and kept.

Kinds (what ``Constraint.make`` takes):
    json_schema  a JSON schema (dict or JSON text): the output is one JSON
                 value that validates against it
    json_object  True: the output is one JSON object
    grammar      a Lark grammar (llguidance's dialect; ``%json {...}`` embeds a schema)
    regex        a regular expression the whole output matches
"""

import json
import threading
import weakref

import numpy as np

from . import _checks
from .errors import StructuredOutputUnavailable

_TOKENIZERS = weakref.WeakKeyDictionary()  # cyformer Tokenizer -> {(n_vocab, eos ids): LLTokenizer}
_LOCK = threading.Lock()

# JSON as OpenAI's models write it: ", " and ": " between items, no other whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputUnavailable("structured output (json_schema, grammar, response_format) needs llguidance: "
                          "pip install 'cyformer[structured]'") from None
    return llguidance


def _ll_tokenizer(tokenizer, n_vocab, eos_ids):
    ll = _llguidance()
    key = (n_vocab, tuple(sorted(eos_ids)))
    with _LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            if not eos_ids:
                raise ValueError("structured output needs the model's end-of-sequence token id")
            per[key] = ll.LLTokenizer(tokenizer.to_json(), n_vocab=n_vocab, eos_token=list(key[1]))
        return per[key]


def grammar_text(json_schema=None, json_object=False, grammar=None, regex=None):
    """The llguidance grammar for exactly one of the kinds, or None when none is given."""
    given = [k for k, v in (("json_schema", json_schema), ("json_object", json_object), ("grammar", grammar),
                            ("regex", regex)) if v is not None and v is not False]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give one of json_schema, json_object, grammar and regex, not {' and '.join(given)}")
    ll = _llguidance()
    try:
        return _grammar(ll, json_schema, json_object, grammar, regex)
    except (RuntimeError, TypeError) as e:  # llguidance's own complaint about the schema
        raise ValueError(f"the grammar or schema cannot be used: {e}") from None


def _grammar(ll, json_schema, json_object, grammar, regex):
    if json_schema is not None:
        if isinstance(json_schema, str):
            _checks.text("generate", "json_schema", json_schema)
            try:
                json_schema = json.loads(json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(json_schema, dict):
            raise ValueError(f"json_schema must be a JSON schema object, got {type(json_schema).__name__}")
        return ll.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_OPTIONS)
    if json_object:
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("grammar must be a non-empty Lark grammar string")
        _checks.text("generate", "grammar", grammar)
        return ll.LLMatcher.grammar_from_lark(grammar)
    if not isinstance(regex, str):
        raise ValueError("regex must be a string")
    return ll.LLMatcher.grammar_from_regex(regex)


class Constraint:
    """One generation's grammar state over a model's vocabulary.

    ``mask(logits)``: a copy of logits [V] with every token the grammar
    forbids at -inf; ``advance(token)``: take the chosen token; ``done``:
    the grammar allows nothing more (the output is complete).
    """

    def __init__(self, tokenizer, n_vocab, eos_ids, grammar):
        ll = _llguidance()
        self.tokenizer = _ll_tokenizer(tokenizer, n_vocab, eos_ids)
        try:
            self.matcher = ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        except (RuntimeError, TypeError) as e:  # llguidance's own complaint about the grammar
            raise ValueError(f"the grammar or schema cannot be used: {e}") from None
        if self.matcher.is_error():
            raise ValueError(f"the grammar or schema cannot be used: {self.matcher.get_error()}")
        self.n_vocab = n_vocab
        self.bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    @classmethod
    def of(cls, model, eos_ids, grammar):
        """The Constraint of an llguidance grammar (``grammar_text``) over model's vocabulary."""
        if not model.tokenizer.available:
            raise ValueError("structured output needs the model's tokenizer")
        return cls(model.tokenizer, model.config.vocab_size, eos_ids, grammar)

    def allowed(self):
        """bool [V]: the tokens that may come next."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self.matcher.get_error()}")
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def mask(self, logits):
        out = np.array(logits, dtype=np.float32, copy=True)
        out[~self.allowed()] = -np.inf
        return out

    def advance(self, token):
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"constrained decoding: token {token} was not allowed "
                               f"({self.matcher.get_error()})")

    @property
    def done(self):
        return self.matcher.is_stopped()

    @property
    def accepting(self):
        return self.matcher.is_accepting()
