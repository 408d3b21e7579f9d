"""Chat: templates rendered as transformers renders them, model.chat, cyformer chat."""

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime

import pytest

import cyformer
from cyformer import ChatTemplateError, ModelLoadError, TokenizerError
from cyformer.chat import ChatTemplate, check_messages
from cyformer.loader import default_model_path

import chat_templates as public
from helpers import make_hf_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>",
            "<|start_header_id|>", "<|end_header_id|>"]
ENDOFTEXT, IM_START, IM_END, BEGIN, EOT = range(5)

TEXT = ("def add(a, b):\n    return a + b\nHello, how are you? I am fine, thank you.\n"
        "What is two plus two? It is four.\n") * 30


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def hf_tokenizer(tok, template, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special)


# -- rendering: the same text as transformers' apply_chat_template -----------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "  You answer in one word. "}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "What's <b>2 & 2</b>?"},
     {"role": "assistant", "content": "Four.\n"}, {"role": "user", "content": "Grüße 🙂, and \"quotes\""}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}],
]

TEMPLATES = {  # template, its checkpoint's special tokens (from tokenizer_config.json)
    "llama-3.2": (public.LLAMA_3_2, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")),
    "llama-3": (public.LLAMA_3, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")),
    "qwen-2.5": (public.QWEN_2_5, dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    "smollm2": (public.SMOLLM2, dict(bos_token="<|im_start|>", eos_token="<|im_end|>",
                                     unk_token="<|endoftext|>", pad_token="<|im_end|>")),
}

# Llama 3.2 writes today's date unless told one.
FIXED_DATE = {"date_string": "26 Jul 2024"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tokenizer, name, conv, add_generation_prompt):
    template, special = TEMPLATES[name]
    messages = CONVERSATIONS[conv]
    hf = hf_tokenizer(tokenizer, template, **special)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                  **FIXED_DATE)
    got = ChatTemplate(template, special).render(messages, add_generation_prompt, FIXED_DATE)
    assert got == want


def test_render_qwen_default_system_prompt(tokenizer):
    template, special = TEMPLATES["qwen-2.5"]
    text = ChatTemplate(template, special).render([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                    "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & later, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("name", ["llama-3.2", "qwen-2.5"])
def test_render_tools_through_tojson(tokenizer, name):
    """tojson with indent, no HTML escaping, non-ASCII kept: as transformers' filter."""
    template, special = TEMPLATES[name]
    messages = CONVERSATIONS[1]
    hf = hf_tokenizer(tokenizer, template, **special)
    want = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                  **FIXED_DATE)
    got = ChatTemplate(template, special).render(messages, True, {"tools": TOOLS, **FIXED_DATE})
    assert got == want and "<now> & later, in °C" in got


def test_llama_3_2_dates_itself_with_strftime_now():
    template, special = TEMPLATES["llama-3.2"]
    before = datetime.now().strftime("%d %b %Y")
    text = ChatTemplate(template, special).render([{"role": "user", "content": "Hi"}])
    after = datetime.now().strftime("%d %b %Y")  # in case midnight passed
    assert f"Today Date: {before}" in text or f"Today Date: {after}" in text


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{{ m.content }}|{% endfor %}",
    "{% generation %}{{ messages[0].content }}{% endgeneration %}!",
    "{{ messages | tojson }}{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
    "{%- set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{{ eos_token }}{{ pad_token }}{{ bos_token is defined }}",
])
def test_environment_matches_transformers(tokenizer, source):
    messages = [{"role": "user", "content": "<a href='x'>&amp;</a> ü"}, {"role": "skip", "content": "no"}]
    special = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    want = hf_tokenizer(tokenizer, source, **special).apply_chat_template(messages, tokenize=False)
    assert ChatTemplate(source, special).render(messages, False) == want


@pytest.mark.parametrize("source,needle", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant') }}", "roles must alternate"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
    ("{{ messages.append(1) }}", "unsafe"),                 # the immutable sandbox
    ("{{ messages[0].content + 1 }}", "TypeError"),
])
def test_template_failures_are_chat_template_errors(source, needle):
    with pytest.raises(ChatTemplateError, match=needle):
        ChatTemplate(source, where="tc.json").render([{"role": "user", "content": "x"}])


def test_template_syntax_error_names_file_and_line():
    with pytest.raises(ChatTemplateError, match=r"tc\.json: .*not valid Jinja \(line 2"):
        ChatTemplate("ok\n{% for m in messages %}", where="tc.json")


@pytest.mark.parametrize("messages,needle", [
    ("hello", "list"),
    ({"role": "user", "content": "x"}, "list"),
    ([], "at least one"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\]\['role'\]"),
    ([{"role": "", "content": "x"}], r"messages\[0\]\['role'\]"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\]\['content'\] must be a str"),
    ([{"role": "user", "content": ["x"]}], r"messages\[0\]\['content'\] must be a str"),
    ([{"role": "user", "content": "x", "extra": object()}], r"messages\[0\]\['extra'\]"),
])
def test_bad_messages(messages, needle):
    with pytest.raises(ValueError, match=needle):
        check_messages(messages)


def test_messages_are_copied_and_none_dropped():
    m = [{"role": "user", "content": "x", "name": None, "meta": {"k": (1, 2.5, True)}}]
    out = check_messages(m)
    assert out == [{"role": "user", "content": "x", "meta": {"k": [1, 2.5, True]}}]
    out[0]["content"] = "changed"
    assert m[0]["content"] == "x"


@pytest.mark.parametrize("name,end", [("llama-3.2", "<|eot_id|>"), ("llama-3", "<|eot_id|>"),
                                      ("qwen-2.5", "<|im_end|>"), ("smollm2", "<|im_end|>")])
def test_end_of_turn_token(name, end):
    template, special = TEMPLATES[name]
    ids = {t: i for i, t in enumerate(SPECIALS)}
    assert ChatTemplate(template, special).end_of_turn_ids(ids) == {ids[end]}


def test_end_of_turn_token_found_by_probe():
    """A token no list knows: the one the template writes after an assistant message."""
    source = "{% for m in messages %}<|who|>{{ m.role }}\n{{ m.content }} <|done|>\n{% endfor %}"
    specials = {"<|who|>": 7, "<|done|>": 8, "<|do|>": 9}
    assert ChatTemplate(source).end_of_turn_ids(specials) == {8}
    assert ChatTemplate("{{ raise_exception('no') }}").end_of_turn_ids(specials) == set()


# -- model.chat end to end -------------------------------------------------

@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory, tokenizer):
    """A random GPT-2 with a ChatML tokenizer whose <|im_end|> is not the eos:
    only the template says that it ends a turn."""
    path = tmp_path_factory.mktemp("chat")
    make_hf_checkpoint(str(path), seed=11, n_layer=2, n_embd=32, n_head=2,
                       vocab_size=tokenizer.get_vocab_size(), n_positions=256,
                       eos_token_id=ENDOFTEXT, bos_token_id=ENDOFTEXT)
    tokenizer.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "bos_token": {"content": "<|endoftext|>", "special": True},
                   "chat_template": public.SMOLLM2}, f)
    return str(path)


def load(path):
    return cyformer.load(path, threads=1)


def force_token(model, monkeypatch, token, at_call):
    """Make ``token`` the greedy choice of the at_call-th run of the backend."""
    run, calls = model.backend.run, []

    def forced(*args, **kwargs):
        logits = run(*args, **kwargs)
        calls.append(1)
        if len(calls) == at_call:
            logits = logits.copy()
            logits[-1, token] = logits[-1].max() + 100.0
        return logits

    monkeypatch.setattr(model.backend, "run", forced)


MESSAGES = [{"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is two plus two?"}]


def test_chat_is_generate_on_the_rendered_prompt(chat_checkpoint, tokenizer):
    m = load(chat_checkpoint)
    hf = hf_tokenizer(tokenizer, public.SMOLLM2, eos_token="<|endoftext|>")
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == IM_START  # the template's own tokens, nothing added in front
    out = m.chat(MESSAGES, max_new_tokens=12, token_healing=False)  # healed, the prompt would end a token earlier
    want = m.generate(ids, max_new_tokens=12, stop=[IM_END])  # and config.json's eos, <|endoftext|>
    assert out.token_ids == list(want)
    assert out == m.decode(want) and out.stats["prompt_tokens"] == len(ids)
    assert isinstance(out, str) and out.finish_reason in ("length", "eos")


def test_chat_stops_at_the_end_of_turn_token(chat_checkpoint, monkeypatch):
    m = load(chat_checkpoint)
    free = m.chat(MESSAGES, max_new_tokens=6)
    force_token(m, monkeypatch, IM_END, at_call=4)  # the prompt's run, then three decode steps
    out = m.chat(MESSAGES, max_new_tokens=20)
    assert out.finish_reason == "eos" and out.token_ids == free.token_ids[:3]
    assert "<|im_end|>" not in out


def test_chat_stream_yields_the_reply(chat_checkpoint, monkeypatch):
    m = load(chat_checkpoint)
    force_token(m, monkeypatch, IM_END, at_call=6)
    stream = m.chat_stream(MESSAGES, max_new_tokens=20)
    pieces = list(stream)
    assert all(isinstance(p, str) for p in pieces) and stream.finish_reason == "eos"
    force_token(m, monkeypatch, IM_END, at_call=6)
    assert "".join(pieces) == m.chat(MESSAGES, max_new_tokens=20)


def test_chat_sampling_is_reproducible(chat_checkpoint):
    m = load(chat_checkpoint)
    a = m.chat(MESSAGES, max_new_tokens=10, temperature=1.0, top_k=20, seed=4)
    assert a == m.chat(MESSAGES, max_new_tokens=10, temperature=1.0, top_k=20, seed=4)


def test_chat_errors(chat_checkpoint, checkpoint, tmp_path):
    m = load(chat_checkpoint)
    with pytest.raises(ValueError, match="messages"):
        m.chat("hello")
    with pytest.raises(ValueError, match="top_p"):
        m.chat(MESSAGES, top_p=2.0)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        cyformer.load(default_model_path()).chat(MESSAGES)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        cyformer.load(checkpoint("odd")[0]).chat(MESSAGES)
    d = tmp_path / "named"
    shutil.copytree(chat_checkpoint, d)
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": [{"name": "tool_use", "template": "x"},
                                     {"name": "rag", "template": "y"}]}, f)
    with pytest.raises(ChatTemplateError, match="rag, tool_use but none named 'default'"):
        cyformer.load(d).chat(MESSAGES)


def test_chat_template_jinja_file_wins(chat_checkpoint, tmp_path):
    d = tmp_path / "jinja"
    shutil.copytree(chat_checkpoint, d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}:")
    m = load(d)
    assert m.chat([{"role": "user", "content": "def"}], max_new_tokens=3).stats["prompt_tokens"] == \
        len(m.encode("def:"))
    (d / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: .*not valid Jinja"):
        load(d).chat(MESSAGES)


def test_bundled_model_with_a_chatml_template(tmp_path):
    """The bundled GPT-2 plus a ChatML template: <|im_start|> and <|im_end|> are
    plain text to its tokenizer, so it ends at eos or max_new_tokens."""
    d = tmp_path / "pycode"
    shutil.copytree(default_model_path(), d)
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": public.SMOLLM2}, f)
    out = cyformer.load(d).chat([{"role": "user", "content": "def fib(n):"}], max_new_tokens=8)
    assert isinstance(out, str) and out.finish_reason in ("length", "eos")


# -- cyformer chat ------------------------------------------------------------

def run_cli(*args, stdin=None, env=None):
    exe = os.path.join(os.path.dirname(sys.executable), "cyformer")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "cyformer"]
    return subprocess.run(cmd + list(args), input=stdin, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_cli_chat_one_message(chat_checkpoint):
    r = run_cli("chat", "--model", chat_checkpoint, "--system", "You add numbers.", "--message", "What is two plus two?",
                "-n", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout == load(chat_checkpoint).chat(MESSAGES, max_new_tokens=10) + "\n"
    assert r.stderr == ""


def test_cli_chat_loop_keeps_the_conversation(chat_checkpoint):
    r = run_cli("chat", "--model", chat_checkpoint, "-n", "6", stdin="Hello\n\nWhat is two plus two?\n/exit\nnot read\n")
    assert r.returncode == 0, r.stderr
    m = load(chat_checkpoint)
    first = m.chat([{"role": "user", "content": "Hello"}], max_new_tokens=6)
    second = m.chat([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "What is two plus two?"}], max_new_tokens=6)
    assert r.stdout == f"{first}\n{second}\n"


def test_cli_chat_reset(chat_checkpoint):
    r = run_cli("chat", "--model", chat_checkpoint, "-n", "5", stdin="Hello\n/reset\nHello\n")
    first, second = r.stdout.split("\n")[:2]
    assert r.returncode == 0 and first == second


def test_cli_chat_help():
    r = run_cli("chat", "--help")
    assert r.returncode == 0
    for opt in ("--model", "--message", "--system", "--max-new-tokens", "--temperature", "--top-k",
                "--top-p", "--seed", "/exit"):
        assert opt in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--message", "hi"], "no chat template"),                      # the bundled model
    (["--model", "/no/such/dir", "--message", "hi"], "not found"),
    (["--top-p", "3"], "top_p"),
])
def test_cli_chat_errors_are_one_line(chat_checkpoint, args, needle):
    if "--model" not in args and needle != "no chat template":
        args = args + ["--model", chat_checkpoint]
    r = run_cli("chat", *args, stdin="")
    assert r.returncode == 1 and needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_model_load_error_for_a_bad_tokenizer_config(chat_checkpoint, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(chat_checkpoint, d)
    (d / "tokenizer_config.json").write_text('{"chat_template": 3}')
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: chat_template must be"):
        cyformer.load(d)
