import os
import sys

# transformers' weight-loading progress bars and notices would fill the test
# log; set before anything imports transformers (subprocesses inherit them).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for helpers.py

# Tests that ask for 2 or 3 threads must get them even on a busy machine;
# test_cores.py turns the cap on where it tests it (cyformer._cores).
os.environ.setdefault("CYFORMER_ADAPTIVE_THREADS", "0")

from helpers import make_hf_checkpoint  # noqa: E402

# Geometries compared with Hugging Face.  "odd" has 3 heads, a vocabulary that
# is no multiple of 8 and n_inner != 4 C; "erf" uses the exact GELU.
GEOMETRIES = {
    "odd": dict(n_layer=2, n_embd=48, n_head=3, vocab_size=101, n_positions=40, n_inner=77),
    "erf": dict(n_layer=3, n_embd=64, n_head=4, vocab_size=257, n_positions=67,
                activation_function="gelu"),
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (path, hf_model), built once per session."""
    made = {}

    def get(name):
        if name not in made:
            path = str(tmp_path_factory.mktemp(name))
            made[name] = (path, make_hf_checkpoint(path, seed=len(made), **GEOMETRIES[name]))
        return made[name]

    return get


TEXT = (
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
    "Grüße aus Köln, 日本語のテキスト, emoji 🙂🚀 and ascii text to learn merges from.\n"
) * 20


@pytest.fixture(scope="session")
def tokenized_checkpoint(tmp_path_factory):
    """A random GPT-2 with a small byte-level BPE tokenizer trained here.
    Returns (path, hf_model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path_factory.mktemp("tokenized")
    vocab = tok.get_vocab_size()
    hf = make_hf_checkpoint(str(path), seed=7, n_layer=2, n_embd=32, n_head=2, vocab_size=vocab,
                            n_positions=48, eos_token_id=0, bos_token_id=0)
    tok.save(str(path / "tokenizer.json"))
    return str(path), hf


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
