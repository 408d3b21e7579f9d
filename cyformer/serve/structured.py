"""The server's structured-output fields: response_format, tools, tool_choice.

    response_format  {"type": "text"} | {"type": "json_object"}
                     | {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    tools            [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice      "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    guided_json, guided_grammar   vLLM's extensions: a schema, a Lark grammar (llguidance's dialect)
    token_healing    true | false: token healing of text prompts (cyformer.healing); default:
                     on, except when logprobs are asked for

The tools go to the chat template as its ``tools`` variable (templates that
support tools list them in the prompt; others ignore them).  A call is the
JSON object {"name": ..., "arguments": {...}}, as Hermes-style templates
ask for; with tool_choice "required" or a named function the reply is
constrained to exactly that (the arguments to the tool's parameters schema);
with "auto" a reply that is such an object for a given tool, bare or inside
<tool_call></tool_call>, is reported as a tool call and any other reply as
text.
"""

import json
import re
import secrets

TOOL_CALL = re.compile(r"^\s*(?:<tool_call>)?\s*(\{.*\})\s*(?:</tool_call>)?\s*$", re.S)


class Structure:
    """What a request asks of its output's form.

    options: GenerationRequest fields (json_schema, grammar, token_healing);
    tools: the names of the tools the reply may call (None: no tools);
    forced: the reply must be a call; template_vars: for the chat template."""

    def __init__(self, options, tools=None, forced=False, template_vars=None):
        self.options, self.tools, self.forced, self.template_vars = options, tools, forced, template_vars


def read(req, chat, bad):
    """The Structure of a parsed request (protocol.SamplingFields);
    ``bad(param, message)`` makes the 400 error to raise."""
    schema = None
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad("response_format", "'response_format' json_schema must be an object "
                                             "{'name': ..., 'schema': {...}}")
            schema = spec.get("schema") or {}
        elif kind != "text":
            raise bad("response_format", f"'response_format' type must be 'text', 'json_object' or "
                                         f"'json_schema', got {json.dumps(kind)[:40]}")
    given = [n for n, v in (("response_format", schema), ("guided_json", req.guided_json),
                            ("guided_grammar", req.guided_grammar)) if v is not None]
    if len(given) > 1:
        raise bad(given[1], f"give one of response_format, guided_json and guided_grammar, "
                            f"not {' and '.join(given)}")
    schema = req.guided_json if req.guided_json is not None else schema
    grammar = req.guided_grammar
    names, forced, template_vars = None, False, None
    tools = getattr(req, "tools", None) if chat else None
    if tools:
        funcs = {}
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
            params = fn.get("parameters", {"type": "object"})
            if not isinstance(params, dict):
                raise bad("tools", f"tools[{i}].function.parameters must be a JSON schema object")
            funcs[fn["name"]] = params
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in funcs:
                raise bad("tool_choice", f"'tool_choice' names no given tool: {json.dumps(choice)[:80]}")
            chosen = [name]
        elif choice in ("required", "auto", "none"):
            chosen = list(funcs) if choice != "none" else []
        else:
            raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                     "{'type': 'function', 'function': {'name': ...}}")
        template_vars = {"tools": tools}
        if chosen:
            names = chosen
            if choice != "auto":
                if schema is not None or grammar is not None:
                    raise bad("tool_choice", "a forced tool call cannot also take response_format or a grammar")
                forced = True
                schema = {"anyOf": [{"type": "object", "properties": {
                    "name": {"const": n}, "arguments": funcs[n]}, "required": ["name", "arguments"],
                    "additionalProperties": False} for n in chosen]}
    options = {"token_healing": req.token_healing}
    if schema is not None:
        options["json_schema"] = schema
    if grammar is not None:
        options["grammar"] = grammar
    return Structure(options, names, forced, template_vars)


def tool_calls(text, names):
    """The reply as OpenAI tool_calls when it is {"name": one of names,
    "arguments": {...}} (bare or in <tool_call> tags), else None."""
    m = TOOL_CALL.match(text)
    if not m:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(args)}}]
