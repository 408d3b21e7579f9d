"""tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
generation_config.json: what they change, and clear errors when malformed."""

import json
import shutil

import pytest

import cyformer
from cyformer import ModelLoadError
from cyformer.model_files import GenerationConfig, read_generation_config, read_tokenizer_config
from cyformer.sampling import SamplingParams
from cyformer.tokenizer import load_tokenizer


def write(path, name, value):
    with open(path / name, "w", encoding="utf-8") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))


# -- tokenizer_config.json ----------------------------------------------------

def test_no_files_means_defaults(tmp_path):
    tc = read_tokenizer_config(str(tmp_path))
    assert tc.special_tokens == {} and tc.add_bos_token is None and tc.chat_template is None
    assert read_generation_config(str(tmp_path), 100) == GenerationConfig()


def test_special_tokens_strings_and_added_token_dicts(tmp_path):
    write(tmp_path, "special_tokens_map.json", {"bos_token": "<old>", "unk_token": {"content": "<unk>"},
                                                "additional_special_tokens": ["<a>"]})
    write(tmp_path, "tokenizer_config.json", {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True},
        "eos_token": "</s>", "pad_token": None, "image_token": "<img>", "add_bos_token": True,
        "add_eos_token": False, "model_max_length": 2048, "chat_template": "{{ bos_token }}"})
    tc = read_tokenizer_config(str(tmp_path))
    assert tc.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                 "image_token": "<img>"}
    assert tc.add_bos_token is True and tc.chat_template == "{{ bos_token }}"
    assert tc.template_source.endswith("tokenizer_config.json")


def test_named_templates_and_the_jinja_file(tmp_path):
    write(tmp_path, "tokenizer_config.json", {"chat_template": [
        {"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]})
    tc = read_tokenizer_config(str(tmp_path))
    assert tc.chat_template == "A" and tc.chat_templates == {"default": "A", "tool_use": "B"}
    write(tmp_path, "chat_template.jinja", "J\n")
    tc = read_tokenizer_config(str(tmp_path))
    assert tc.chat_template == "J\n" and tc.chat_templates["tool_use"] == "B"
    assert tc.template_source.endswith("chat_template.jinja")


@pytest.mark.parametrize("name,text,needle", [
    ("tokenizer_config.json", "{oops", r"tokenizer_config\.json: not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", r"tokenizer_config\.json: expected a JSON object"),
    ("tokenizer_config.json", b"\xff\xfe{}", r"tokenizer_config\.json: not valid JSON \(not UTF-8"),
    ("tokenizer_config.json", {"eos_token": 7}, r"tokenizer_config\.json: eos_token must be a string"),
    ("tokenizer_config.json", {"bos_token": {"text": "<s>"}}, "bos_token must be a string"),
    ("tokenizer_config.json", {"add_bos_token": "yes"}, "add_bos_token must be true or false"),
    ("tokenizer_config.json", {"chat_template": 3}, "chat_template must be a string or a list"),
    ("tokenizer_config.json", {"chat_template": [{"name": "default"}]}, r"chat_template\[0\] must be"),
    ("special_tokens_map.json", {"pad_token": ["x"]}, r"special_tokens_map\.json: pad_token"),
    ("chat_template.jinja", b"{{ \xff }}", r"chat_template\.jinja: not UTF-8"),
])
def test_malformed_tokenizer_files(tmp_path, name, text, needle):
    if isinstance(text, bytes):
        (tmp_path / name).write_bytes(text)
    else:
        write(tmp_path, name, text)
    with pytest.raises(ModelLoadError, match=needle):
        read_tokenizer_config(str(tmp_path))


def test_malformed_files_fail_the_load(tokenized_checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tokenized_checkpoint[0], d)
    write(d, "generation_config.json", {"eos_token_id": "2"})
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: eos_token_id"):
        cyformer.load(d)
    write(d, "generation_config.json", {})
    write(d, "tokenizer_config.json", '{"add_bos_token": tru')
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: not valid JSON"):
        cyformer.load(d)


# -- add_bos_token, as transformers' tokenizers do it -------------------------

def bos_tokenizer(post_processor):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, hello tokenizer. " * 40], trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 0)])
    return tok


@pytest.mark.parametrize("post_processor", [False, True])
@pytest.mark.parametrize("add_bos_token", [None, False, True])
def test_prompt_bos_as_transformers(tmp_path, post_processor, add_bos_token):
    from transformers import AutoTokenizer

    bos_tokenizer(post_processor).save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    write(tmp_path, "tokenizer_config.json", config)
    ours = load_tokenizer(str(tmp_path))
    text = "hello world"
    got, plain = ours.encode(text, add_special_tokens=True), ours.encode(text)
    assert got in (plain, [0] + plain)  # the plain encoding never has bos
    if add_bos_token and not post_processor:
        # transformers 4's Llama tokenizers rebuild the post-processor from
        # add_bos_token; transformers 5 leaves tokenizer.json's as it is.
        assert got == [0] + ours.encode(text)
    else:
        assert got == AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"]
    assert got.count(0) == (1 if add_bos_token or post_processor else 0)  # never two


def test_add_bos_token_needs_a_bos_token(tmp_path):
    bos_tokenizer(False).save(str(tmp_path / "tokenizer.json"))
    write(tmp_path, "tokenizer_config.json", {"add_bos_token": True, "bos_token": "<nope>"})
    with pytest.raises(ModelLoadError, match="add_bos_token.*'<nope>' is not a token"):
        load_tokenizer(str(tmp_path))


def test_generate_prompt_starts_with_bos(tokenized_checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tokenized_checkpoint[0], d)
    plain = cyformer.load(d).generate("def fib(n):", max_new_tokens=1)
    write(d, "tokenizer_config.json", {"add_bos_token": True, "bos_token": "<|endoftext|>"})
    m = cyformer.load(d)
    out = m.generate("def fib(n):", max_new_tokens=1)
    assert out.stats["prompt_tokens"] == plain.stats["prompt_tokens"] + 1
    assert m.encode("def fib(n):") == cyformer.load(d).tokenizer.encode("def fib(n):")  # encode adds nothing


# -- generation_config.json ---------------------------------------------------

def greedy_first_token(model, prompt):
    import numpy as np

    return int(np.argmax(model.forward(model.encode(prompt))[-1]))


def test_generation_stops_at_any_listed_eos(tokenized_checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tokenized_checkpoint[0], d)
    m = cyformer.load(d)
    first = greedy_first_token(m, "def fib(n):")
    other = (first + 1) % m.config.vocab_size
    write(d, "generation_config.json", {"eos_token_id": [other, first], "bos_token_id": 0})
    m = cyformer.load(d)
    assert m.generation_config.eos_ids(m.config) == {other, first}
    out = m.generate("def fib(n):", max_new_tokens=5, token_healing=False)  # first token = the forward argmax
    assert out.finish_reason == "eos" and out.token_ids == []
    write(d, "generation_config.json", {"eos_token_id": other})
    assert cyformer.load(d).generation_config.eos_ids(m.config) == {other}


def test_generation_config_from_model_config_defers_to_config_json(tokenized_checkpoint):
    """transformers writes generation_config.json from config.json on save: config.json governs."""
    m = cyformer.load(tokenized_checkpoint[0])
    assert m.generation_config.eos_token_ids is None
    assert m.generation_config.eos_ids(m.config) == {m.config.eos_token_id}
    object.__setattr__(m.config, "eos_token_id", None)
    assert m.generation_config.eos_ids(m.config) == frozenset()


def test_eos_ids_beyond_the_vocabulary_are_dropped(tmp_path):
    write(tmp_path, "generation_config.json", {"eos_token_id": [3, 500]})
    with pytest.warns(UserWarning, match="not below vocab_size=100"):
        gc = read_generation_config(str(tmp_path), 100)
    assert gc.eos_token_ids == {3}


@pytest.mark.parametrize("file,args,want", [
    ({}, {}, SamplingParams()),                                              # no file: greedy
    ({"temperature": 0.6, "top_p": 0.9}, {}, SamplingParams(0.0, None, 0.9)),  # no do_sample: greedy
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, {},
     SamplingParams(0.6, 50, 0.9)),                                          # transformers' top_k 50
    ({"do_sample": True, "top_k": 0, "repetition_penalty": 1.1}, {},
     SamplingParams(1.0, None, None, 1.1)),                                  # top_k 0 is off
    ({"do_sample": True, "temperature": 0.6, "top_k": 20}, {"temperature": 0.0, "top_k": 7, "seed": 3},
     SamplingParams(0.0, 7, None, None, 3)),                                 # the caller wins
    ({"do_sample": True, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.3},
     {"top_k": None, "top_p": None, "repetition_penalty": None},
     SamplingParams(1.0)),                                                   # None: off
])
def test_sampling_defaults(tmp_path, file, args, want):
    write(tmp_path, "generation_config.json", file)
    assert read_generation_config(str(tmp_path), 100).sampling(**args) == want


def test_generate_uses_the_checkpoint_defaults(tokenized_checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tokenized_checkpoint[0], d)
    m = cyformer.load(d)
    object.__setattr__(m.config, "eos_token_id", None)  # random weights may emit it
    greedy = m.generate("def", max_new_tokens=12)
    write(d, "generation_config.json", {"do_sample": True, "temperature": 1.5, "top_k": 40, "top_p": 0.95,
                                        "repetition_penalty": 1.2})
    m = cyformer.load(d)
    object.__setattr__(m.config, "eos_token_id", None)
    sampled = m.generate("def", max_new_tokens=12, seed=1)
    assert sampled == m.generate("def", max_new_tokens=12, temperature=1.5, top_k=40, top_p=0.95,
                                 repetition_penalty=1.2, seed=1)
    assert sampled != greedy
    assert m.generate("def", max_new_tokens=12, temperature=0, repetition_penalty=None) == greedy


@pytest.mark.parametrize("file,needle", [
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"eos_token_id": [1, None]}, "eos_token_id"),
    ({"eos_token_id": [1, True]}, "eos_token_id"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"pad_token_id": 1.5}, "pad_token_id"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ("[]", "expected a JSON object"),
    ("{", "not valid JSON"),
])
def test_malformed_generation_config(tmp_path, file, needle):
    write(tmp_path, "generation_config.json", file)
    with pytest.raises(ModelLoadError, match=rf"generation_config\.json: {needle}"):
        read_generation_config(str(tmp_path), 100)
