"""Text <-> token ids through the checkpoint's tokenizer.json (the `tokenizers` package)."""

import os

from . import _checks
from .errors import ModelLoadError, TokenizerError
from .model_files import TokenizerConfig, read_tokenizer_config


class Tokenizer:
    """GPT-2 byte-level BPE (or whatever tokenizer.json describes)."""

    available = True

    def __init__(self, path, config=None, built=None):
        """path: tokenizer.json; built: a tokenizers.Tokenizer made elsewhere
        (cyformer.gguf rebuilds one from a GGUF file, which ``path`` names)."""
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:  # pragma: no cover
            raise ModelLoadError("the tokenizers package is required to read tokenizer.json") from None
        try:
            self._tok = built if built is not None else _HFTokenizer.from_file(os.fspath(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({e})") from None
        self.path = os.fspath(path)
        self._byte_of = self._specials = None  # token_bytes' tables, made on first use
        self.config = config if config is not None else TokenizerConfig()
        self.bos_id = None  # prepended to prompts when tokenizer_config.json says add_bos_token
        if self.config.add_bos_token:
            bos = self.config.special_tokens.get("bos_token")
            self.bos_id = None if bos is None else self._tok.token_to_id(bos)
            if self.bos_id is None:
                raise ModelLoadError(f"{self.path}: tokenizer_config.json sets add_bos_token but its "
                                     f"bos_token {bos!r} is not a token of tokenizer.json")

    @property
    def vocab_size(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_special_tokens=False):
        """text -> ids.  add_special_tokens: as a prompt, through tokenizer.json's
        post-processor, and starting with bos when add_bos_token asks for it
        (once: a post-processor may already have put it there)."""
        _checks.text("encode", "text", text)
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_each(self, ids):
        """Each id's text alone (special tokens as '')."""
        return self._tok.decode_batch([[int(i)] for i in ids], skip_special_tokens=True)

    def to_json(self):
        """tokenizer.json's text, as the tokenizers library writes it."""
        return self._tok.to_str()

    def token_to_id(self, token):
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id):
        """The bytes one token stands for, which need not be whole UTF-8
        characters: byte-level BPE tokens through GPT-2's byte alphabet,
        SentencePiece's byte fallback (<0xNN>) as that byte, special tokens
        as their text, anything else as its decoded text."""
        if self._byte_of is None:
            self._byte_of = _byte_alphabet() if _decoder_kind(self._tok) == "ByteLevel" else {}
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) in self._special_ids():
            return piece.encode("utf-8")
        if self._byte_of and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self._tok.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def _special_ids(self):
        if self._specials is None:
            self._specials = frozenset(self.special_tokens().values())
        return self._specials

    def special_tokens(self):
        """Text -> id of every added token marked special (<|im_end|>, <|eot_id|>, ...)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def stream(self, skip_special_tokens=True):
        return StreamDecoder(self, skip_special_tokens)


def _decoder_kind(tok):
    """tokenizer.json's decoder type ("ByteLevel", "Sequence", ...), or None."""
    import json

    try:
        return json.loads(tok.to_str()).get("decoder", {}).get("type")
    except (ValueError, AttributeError):
        return None


def _byte_alphabet():
    """GPT-2's printable stand-in of each byte -> the byte (byte-level BPE's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return {c: b for b, c in enumerate(chars)}


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, never splitting a
    multi-byte UTF-8 character: while the decoded bytes end inside a
    character (shown as U+FFFD), the tokens are held back."""

    def __init__(self, tokenizer, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.pending = []

    def push(self, token_id):
        self.pending.append(token_id)
        text = self.tokenizer.decode(self.pending, self.skip)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self):
        """Whatever is still held (an incomplete character decodes to U+FFFD)."""
        text = self.tokenizer.decode(self.pending, self.skip) if self.pending else ""
        self.pending = []
        return text


class NoTokenizer:
    """Stands in when the checkpoint has no tokenizer.json: ids work, text does not."""

    available = False

    def __init__(self, directory, config=None):
        self.directory = directory
        self.config = config if config is not None else TokenizerConfig()

    def _fail(self, *_, **__):
        raise TokenizerError(
            f"{self.directory}: no tokenizer.json, so text cannot be encoded or decoded; "
            "pass token ids instead")

    encode = decode = stream = token_to_id = special_tokens = _fail


def load_tokenizer(directory):
    """tokenizer.json with what tokenizer_config.json adds to it, or a NoTokenizer."""
    config = read_tokenizer_config(directory)
    path = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(path):
        return Tokenizer(path, config)
    return NoTokenizer(directory, config)
