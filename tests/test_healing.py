"""Token healing: a text prompt that ends inside what the tokenizer would
merge is continued as the model would have tokenized it (cyformer.healing)."""

import numpy as np
import pytest

import cyformer
from cyformer.engine import Engine
from cyformer.healing import TokenTexts, heal, token_texts


@pytest.fixture(scope="module")
def m():
    from cyformer.model_files import GenerationConfig

    model = cyformer.load()
    # greedy, the checkpoint's eos only: the comparisons below are deterministic
    model.generation_config = GenerationConfig(eos_token_ids=model.generation_config.eos_ids(model.config))
    return model


def test_a_trailing_newline_continues_indented(m):
    """The bundled model learned '\\n' + indentation as one token: after a
    lone '\\n' it starts a new top-level statement; healed, it writes the body."""
    before = m.generate("def f(x):\n", max_new_tokens=8, token_healing=False)
    after = m.generate("def f(x):\n", max_new_tokens=8)
    assert before.startswith("def ")  # column 0: a new top-level def
    assert after.startswith("    ") and after.strip()  # the function's body
    # the first new token re-spelled the removed '\n' (and more), which is not handed out again
    first = m.decode(after.token_ids[:1])
    assert first.startswith("\n") and len(first) > 1
    assert "def f(x):\n" + after == "def f(x):" + m.decode(after.token_ids)


def test_healing_backs_up_one_token_and_constrains_the_first(m):
    ids = m.encode("import o")
    kept, text = heal(m.tokenizer, ids, m.config.vocab_size)
    assert kept == ids[:-1] and text == m.decode(ids[-1:]) == " o"
    table = token_texts(m.tokenizer, m.config.vocab_size)
    assert isinstance(table, TokenTexts)
    ok = table.allowed(" o")
    texts = [table.texts[i] for i in np.flatnonzero(ok)]
    assert texts and all(t.startswith(" o") for t in texts) and ok[ids[-1]]
    assert ok.sum() == sum(1 for t in table.texts if t.startswith(" o"))
    # only whole tokens that start with it: one that spells part of it ( " ") would force a
    # tokenization the model never saw
    assert not ok[m.encode(" ")[0]]
    out = m.generate("import o", max_new_tokens=4)
    assert m.decode(out.token_ids).startswith(" o")


def test_ids_prompts_are_never_healed(m):
    ids = m.encode("def f(x):\n")
    a = m.generate(ids, max_new_tokens=6)
    assert a.stats["prompt_tokens"] == len(ids)
    assert a == m.generate(ids, max_new_tokens=6, token_healing=False)
    text = m.generate("def f(x):\n", max_new_tokens=6, token_healing=False)
    assert text.token_ids == list(a)


def test_stop_strings_do_not_match_the_healed_text(m):
    # the healed '\n' is the prompt's, so stop='\n' ends the first line of the body, not at once
    out = m.generate("def f(x):\n", max_new_tokens=20, stop=["\n"])
    assert out.finish_reason == "stop" and out.startswith("    ") and "\n" not in out


def test_stream_engine_and_batch_agree(m):
    prompts = ["def f(x):\n", "import o", "x = [1, 2"]
    alone = [m.generate(p, max_new_tokens=10) for p in prompts]
    assert ["".join(m.stream(p, max_new_tokens=10)) for p in prompts] == alone
    assert m.generate(prompts, max_new_tokens=10) == alone
    with Engine(m) as engine:
        assert [engine.generate(p, max_new_tokens=10).result(timeout=60) for p in prompts] == alone


def test_heal_is_checked(m):
    with pytest.raises(ValueError, match="token_healing"):
        m.generate("x", token_healing="yes")


def test_cli_flag(capsys):
    from cyformer.cli import main

    assert main(["generate", "-n", "6", "-t", "0", "--no-prompt", "def f(x):\n"]) == 0
    healed = capsys.readouterr().out
    assert main(["generate", "-n", "6", "-t", "0", "--no-prompt", "--no-token-healing", "def f(x):\n"]) == 0
    plain = capsys.readouterr().out
    assert healed.startswith("    ") and healed != plain
