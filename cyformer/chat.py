"""Chat: messages -> the checkpoint's chat template -> a reply that ends with the turn.

    model.chat([{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a tensor?"}])

The template is Jinja source from the checkpoint (tokenizer_config.json's
chat_template or chat_template.jinja), so it is untrusted code: it runs in
Jinja's immutable sandbox, set up as transformers' apply_chat_template sets
it up (trim_blocks, lstrip_blocks, loop controls, raise_exception,
strftime_now, a tojson that does not escape HTML), with the same variables
(messages, add_generation_prompt, tools, documents and the special tokens),
so the same messages give the same text, character for character.

The rendered text already holds the template's special tokens (bos
included where the template puts it), so it is encoded without adding any,
as apply_chat_template(tokenize=True) does.  The reply ends at the template's
end-of-turn token as well as at the model's eos ids.
"""

import functools
import json
import math
import numbers
import threading
import time
from collections.abc import Mapping
from datetime import datetime

from .errors import ChatTemplateError, TokenizerError
from .generate import Generation
from .request import CHAT_MAX_NEW_TOKENS, GenerationRequest

JINJA_MIN = (3, 1, 6)  # earlier versions have known sandbox escapes

# Tokens that end a turn in the common template families; taken when the
# tokenizer has them as special tokens and the template writes them.  The
# probe in end_of_turn_ids() finds the others.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

_PROBE = "\u2063cyformer-probe\u2063"  # text no template writes by itself

# A template is untrusted code, so a rendering is bounded: nested loops or
# 'x' * 10**8 must fail with a clear error, not hang or take GBs.  A
# prompt is at most a context of tokens; no real template comes near these.
MAX_RENDER_CHARS = 4_000_000
MAX_RENDER_SECONDS = 5.0
_render = threading.local()  # this thread's rendering: deadline


def _tick():
    """Refuse to go on past the rendering's deadline (called at every
    attribute, item, call, loop step and output piece of the template)."""
    deadline = getattr(_render, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        _render.deadline = None
        raise ChatTemplateError(f"the chat template did not finish rendering within "
                                f"{MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)")


def _check_size(value):
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise ChatTemplateError(f"the chat template built a value of {len(value):,} items, over the "
                                f"{MAX_RENDER_CHARS:,} a rendering may hold (MAX_RENDER_CHARS)")
    return value


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ChatTemplateError("chat templates need the jinja2 package: "
                                "pip install 'jinja2>=3.1.6'") from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < JINJA_MIN:
        raise ChatTemplateError(f"chat templates need jinja2>=3.1.6 (earlier versions have sandbox "
                                f"escapes), found {jinja2.__version__}")
    return jinja2


@functools.lru_cache(maxsize=1)
def _environment():
    jinja2 = _jinja()

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's part for
        training masks; rendering keeps the body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names, which lead to Python internals."""

        def __init__(*args, **kwargs):  # Jinja's own signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"namespace attribute {name!r} starts with an underscore")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML; chat text must stay as it is.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """The sandbox with every step checked against the rendering's
        deadline, and sizes checked where one step can make a huge value:
        repetition (*), powers (**) and calls."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            _tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDER_CHARS:
                        raise ChatTemplateError(f"the chat template repeats a value {n:,} times, over the "
                                                f"{MAX_RENDER_CHARS:,} a rendering may hold (MAX_RENDER_CHARS)")
            elif (isinstance(left, numbers.Integral) and isinstance(right, numbers.Integral)
                  and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > 1_000_000):
                raise ChatTemplateError(f"the chat template raises a number to the power {str(right)[:20]}, "
                                        "a result of over a million bits")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            _tick()
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _tick()
            return super().getitem(obj, argument)

    safe_range = jinja2.sandbox.safe_range

    def bounded_range(*args):
        for i in safe_range(*args):  # at most Jinja's MAX_RANGE items each
            if not i & 1023:
                _tick()
            yield i

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.pop("lipsum", None)  # lorem ipsum of any length: no use in a chat template
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace,
                       range=bounded_range)
    return env


@functools.lru_cache(maxsize=8)
def _compile(source, where):
    jinja2 = _jinja()
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: the chat template is not valid Jinja "
                                f"(line {e.lineno}: {e.message})") from None


class ChatTemplate:
    """A checkpoint's chat template, compiled in the sandbox.

    special_tokens: name -> text ("bos_token": "<|begin_of_text|>", ...), the
    variables transformers gives a template; where: the file, for messages.
    """

    def __init__(self, source, special_tokens=None, where="chat template"):
        if not isinstance(source, str):
            raise ChatTemplateError(f"{where}: the chat template must be a str, got {type(source).__name__}")
        self.source = source
        self.where = where
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source, where)

    @classmethod
    def of(cls, model):
        """The chat template of a loaded model; a clear error when it has none."""
        tc = model.tokenizer.config
        if tc.chat_template is None:
            if tc.chat_templates:
                raise ChatTemplateError(
                    f"{tc.template_source}: chat templates named {', '.join(sorted(tc.chat_templates))} "
                    "but none named 'default'")
            raise ChatTemplateError(
                f"{model.path}: this model has no chat template (no chat_template in tokenizer_config.json, "
                "no chat_template.jinja); use generate() with a plain prompt")
        return cls(tc.chat_template, tc.special_tokens, tc.template_source)

    def render(self, messages, add_generation_prompt=True, variables=None):
        """The conversation as the model's prompt text.

        messages: [{"role": str, "content": str, ...}, ...] (checked by
        check_messages); add_generation_prompt: end with the header of an
        assistant turn; variables: more template variables (say
        {"enable_thinking": False}), over the special tokens.
        """
        messages = check_messages(messages)
        if variables is not None and not isinstance(variables, Mapping):
            raise ValueError(f"template_vars must be a dict, got {type(variables).__name__}")
        context = {**self.special_tokens, **_plain(dict(variables or {}), "template_vars")}
        context.update(messages=messages, add_generation_prompt=bool(add_generation_prompt))
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        jinja2 = _jinja()
        _render.deadline = time.monotonic() + MAX_RENDER_SECONDS
        try:
            pieces, size = [], 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise ChatTemplateError(f"{self.where}: the chat template rendered over "
                                            f"{MAX_RENDER_CHARS:,} characters (MAX_RENDER_CHARS)")
                _tick()
                pieces.append(piece)
            return "".join(pieces)
        except ChatTemplateError as e:
            msg = str(e)
            raise ChatTemplateError(msg if msg.startswith(self.where) else f"{self.where}: {msg}") from None
        except jinja2.TemplateError as e:  # raise_exception(), undefined names, sandbox refusals
            raise ChatTemplateError(f"{self.where}: the chat template refused the messages: {e}") from None
        except Exception as e:  # the template is code: any runtime error is its failure
            raise ChatTemplateError(f"{self.where}: the chat template failed "
                                    f"({type(e).__name__}: {str(e)[:300]})") from None
        finally:
            _render.deadline = None

    def end_of_turn_ids(self, special_ids):
        """Ids of the special tokens that end an assistant turn in this template.

        special_ids: text -> id of the tokenizer's special tokens.  The
        template writes a probe reply; the special token right after it is
        the end of a turn (<|im_end|>, <|eot_id|>, </s>, ...).  The common
        end-of-turn tokens that the template writes count too.
        """
        ids = {special_ids[t] for t in END_OF_TURN if t in special_ids and t in self.source}
        try:
            text = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
                               add_generation_prompt=False)
        except ChatTemplateError:
            return ids
        at = text.find(_PROBE)
        if at >= 0:
            rest = text[at + len(_PROBE):].lstrip()
            after = [t for t in special_ids if t and rest.startswith(t)]
            if after:
                ids.add(special_ids[max(after, key=len)])
        return ids


def _plain(value, where):
    """value as the JSON-like data a template may see (str, numbers, lists, dicts)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: keys must be str, got {k!r}")
            out[k] = _plain(v, f"{where}[{k!r}]")
        return out
    raise ValueError(f"{where}: expected text, numbers, lists or dicts, got {type(value).__name__}")


def check_messages(messages):
    """Validated plain copies of chat messages: a non-empty list of dicts, each
    with a non-empty str "role" and a str "content"; other keys are kept
    (None values dropped, as transformers drops them)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must hold at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty str, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a str, got {type(content).__name__}")
        out.append(_plain({k: v for k, v in m.items() if v is not None}, f"messages[{i}]"))
    return out


def chat_generation(model, messages, request=None, template_vars=None):
    """The Generation of the assistant's next turn (Model.chat and chat_stream);
    request: a GenerationRequest (None: the defaults, max_new_tokens 256)."""
    tokenizer = model.tokenizer
    if not tokenizer.available:
        raise TokenizerError(f"{model.path}: chat needs the checkpoint's tokenizer.json")
    template = ChatTemplate.of(model)
    prompt = template.render(messages, add_generation_prompt=True, variables=template_vars)
    if not prompt:
        raise ChatTemplateError(f"{template.where}: the chat template rendered these messages as no text")
    special = tokenizer.special_tokens()
    end_ids = template.end_of_turn_ids(special)
    eos = template.special_tokens.get("eos_token")  # tokenizer_config.json's, which may differ
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        end_ids.add(tokenizer.token_to_id(eos))
    if request is None:
        request = GenerationRequest(max_new_tokens=CHAT_MAX_NEW_TOKENS)
    return Generation(model, prompt, request, add_special_tokens=False, end_ids=end_ids)
