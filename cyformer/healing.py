"""Token healing: continue a text prompt as the model would have tokenized it.

A prompt that ends inside what the tokenizer would merge ("def f(x):\\n"
before an indented body, a trailing space, half a word) ends on a token the
model rarely saw there: the bundled model learned "\\n" + indentation as one
token, so after a lone "\\n" it starts a new top-level statement.  Healing
backs the prompt up over its last token and lets the first new token be
only one that starts with the removed text (the removed token among them),
as transformers' ``token_healing`` does; the removed text is then not
handed out again.  Tokens that spell only part of it are not offered: the
rest would then have to follow as a token the tokenizer never produces
there (after ")" the bundled model gives ":" 1 %, since it always saw "):"
merged), and sampling would pick rare merges such as ":`".

Applies to byte-level tokenizers (GPT-2's ``ByteLevel`` decoder), where a
token's text is its decode alone and texts concatenate exactly.
"""

import bisect
import json
import threading
import weakref

import numpy as np

_TABLES = weakref.WeakKeyDictionary()  # Tokenizer -> TokenTexts or None
_LOCK = threading.Lock()


class TokenTexts:
    """Every token's text, sorted so the tokens starting with a string are one range."""

    def __init__(self, tokenizer, n_vocab):
        V = min(n_vocab, tokenizer.vocab_size)
        texts = tokenizer.decode_each(range(V))
        # special tokens and partial UTF-8 characters never heal
        self.texts = [t if t and "\ufffd" not in t else "" for t in texts]
        self.order = sorted((t, i) for i, t in enumerate(self.texts) if t)
        self.keys = [t for t, _ in self.order]
        self.n_vocab = n_vocab

    def allowed(self, text):
        """bool [V]: the tokens whose text starts with ``text``."""
        ok = np.zeros(self.n_vocab, dtype=bool)
        lo = bisect.bisect_left(self.keys, text)
        hi = bisect.bisect_left(self.keys, text + "\U0010ffff")
        ok[[i for _, i in self.order[lo:hi]]] = True
        return ok


def token_texts(tokenizer, n_vocab):
    """The TokenTexts of a byte-level tokenizer, built once; None for other tokenizers."""
    with _LOCK:
        if tokenizer not in _TABLES:
            _TABLES[tokenizer] = TokenTexts(tokenizer, n_vocab) if _byte_level(tokenizer) else None
        return _TABLES[tokenizer]


def _byte_level(tokenizer):
    try:
        decoder = json.loads(tokenizer.to_json()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - a tokenizer we cannot read is not healed
        return False
    return decoder.get("type") == "ByteLevel"


def heal(tokenizer, ids, n_vocab, keep=1):
    """(ids without their last token, its text) when the prompt can be
    healed, else (ids, ''); at least ``keep`` ids stay."""
    if len(ids) <= keep:
        return ids, ""
    table = token_texts(tokenizer, n_vocab)
    if table is None or not 0 <= ids[-1] < len(table.texts):
        return ids, ""
    text = table.texts[ids[-1]]
    if not text:
        return ids, ""
    return ids[:-1], text


class Healing:
    """The first new token's constraint: it starts with the removed text."""

    def __init__(self, table: TokenTexts, text):
        self.table, self.rest = table, text

    @property
    def active(self):
        return bool(self.rest)

    def mask(self, logits):
        out = np.array(logits, dtype=np.float32, copy=True)
        out[~self.table.allowed(self.rest)] = -np.inf
        return out

    def advance(self, token):
        self.rest = ""
