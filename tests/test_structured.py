"""Structured output: generate(json_schema=...), grammar=, and the server's
response_format / tools through the openai SDK and LangChain, every output
parsed and validated against its schema (jsonschema)."""

import json
import shutil

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import cyformer  # noqa: E402
from cyformer.engine import Engine  # noqa: E402
from cyformer.loader import default_model_path  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def m():
    return cyformer.load()


def test_every_output_validates(m):
    outs = [m.generate("person = ", max_new_tokens=120, temperature=1.0, seed=s, json_schema=PERSON)
            for s in range(6)]
    outs.append(m.generate("person = ", max_new_tokens=120, temperature=0, json_schema=json.dumps(PERSON)))
    for out in outs:
        assert out.finish_reason == "eos", out  # complete: the grammar ended it
        jsonschema.validate(json.loads(out), PERSON)
    # unconstrained, the same prompts give Python, not this JSON
    free = m.generate("person = ", max_new_tokens=30, temperature=0)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), PERSON)


def test_grammar_and_json_object(m):
    yes_no = 'start: answer\nanswer: "yes" | "no"\n'
    for s in range(4):
        out = m.generate("ok? ", max_new_tokens=8, temperature=1.0, seed=s, grammar=yes_no)
        assert out in ("yes", "no") and out.finish_reason == "eos"
    obj = m.generate("d = ", max_new_tokens=200, temperature=0.8, seed=1, json_schema={"type": "object"})
    if obj.finish_reason == "eos":
        assert isinstance(json.loads(obj), dict)
    else:  # cut by max_new_tokens: still a prefix of an object
        assert obj.startswith("{")


def test_constrained_and_free_requests_batch_together(m):
    free = ["def fib(n):", "import os\n"]
    alone = [m.generate(p, max_new_tokens=12, temperature=0) for p in free]
    with Engine(m) as engine:
        streams = [engine.generate(p, max_new_tokens=12, temperature=0) for p in free]
        streams += [engine.generate("p = ", max_new_tokens=120, temperature=1.0, seed=s, json_schema=PERSON)
                    for s in range(3)]
        outs = [s.result(timeout=120) for s in streams]
    assert outs[:2] == alone
    for out in outs[2:]:
        jsonschema.validate(json.loads(out), PERSON)


def test_bad_constraints_are_refused(m):
    with pytest.raises(ValueError, match="not valid JSON"):
        m.generate("x", json_schema="{nope")
    with pytest.raises(ValueError, match="one of"):
        m.generate("x", json_schema={"type": "object"}, grammar='start: "a"')
    with pytest.raises(ValueError, match="grammar"):
        m.generate("x", grammar="start: ???")


# -- the server, through the clients people use --

NAME = "pycode"
TEMPLATE = ("{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|endoftext|>\n{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("fastapi")
    from cyformer.serve import ServerThread, create_app

    path = tmp_path_factory.mktemp("structured") / NAME
    shutil.copytree(default_model_path(), path)
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}, f)
    model = cyformer.load(str(path))
    engine = Engine(model, max_batch=8)
    with ServerThread(create_app(model, engine, model_name=NAME)) as srv:
        yield srv
    assert engine.close(cancel=True, timeout=30)


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Who?"}],
                                       response_format=fmt, max_tokens=150, temperature=1.0, seed=3, n=3)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    r = client.completions.create(model=NAME, prompt="data = ", max_tokens=150, temperature=0,
                                  extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Any object"}],
                                       response_format={"type": "json_object"}, max_tokens=300,
                                       temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_openai_tools(client):
    openai = pytest.importorskip("openai")
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object",
                                                                             "properties": {}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=tools, max_tokens=120, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather)
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=tools, tool_choice="required",
                                       max_tokens=120, temperature=1.0, seed=2, n=3)
    for c in r.choices:
        call = c.message.tool_calls[0]
        params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), params)
    # auto: the model may answer in text; "none": never a call
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=tools, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    with pytest.raises(openai.BadRequestError, match="names no given tool"):
        client.chat.completions.create(model=NAME, messages=msgs, tools=tools, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "other"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8,
                                       response_format={"type": "xml"})


def test_langchain_with_structured_output(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(model=NAME, base_url=server.url + "/v1", api_key="unused", temperature=0,
                     max_tokens=100, max_retries=0, timeout=60)
    for method in ("json_schema", "function_calling"):
        # strict: the schema gets additionalProperties false, as OpenAI's strict mode requires;
        # without it the bundled model may add keys until max_tokens
        person = llm.with_structured_output(Person, method=method, strict=True).invoke("Describe someone.")
        assert isinstance(person, Person), method
