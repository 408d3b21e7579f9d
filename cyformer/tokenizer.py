"""Text <-> token ids through the checkpoint's tokenizer.json (the `tokenizers` package)."""

import os

from . import _checks
from .errors import ModelLoadError, TokenizerError


class Tokenizer:
    """GPT-2 byte-level BPE (or whatever tokenizer.json describes)."""

    available = True

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:  # pragma: no cover
            raise ModelLoadError("the tokenizers package is required to read tokenizer.json") from None
        try:
            self._tok = _HFTokenizer.from_file(os.fspath(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({e})") from None
        self.path = os.fspath(path)

    @property
    def vocab_size(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        _checks.text("encode", "text", text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_to_id(self, token):
        return self._tok.token_to_id(token)

    def stream(self):
        return StreamDecoder(self)


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, never splitting a
    multi-byte UTF-8 character: while the decoded bytes end inside a
    character (shown as U+FFFD), the tokens are held back."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = []

    def push(self, token_id):
        self.pending.append(token_id)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self):
        """Whatever is still held (an incomplete character decodes to U+FFFD)."""
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending = []
        return text


class NoTokenizer:
    """Stands in when the checkpoint has no tokenizer.json: ids work, text does not."""

    available = False

    def __init__(self, directory):
        self.directory = directory

    def _fail(self, *_):
        raise TokenizerError(
            f"{self.directory}: no tokenizer.json, so text cannot be encoded or decoded; "
            "pass token ids instead")

    encode = decode = stream = token_to_id = _fail


def load_tokenizer(directory):
    path = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(path):
        return Tokenizer(path)
    return NoTokenizer(directory)
