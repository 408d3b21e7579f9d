"""What the routes do: OpenAI requests -> GenerationRequests -> engine streams -> answers.

``OpenAIServing`` holds the model and its engine and knows nothing of HTTP
beyond APIError; the routes (cyformer.serve.app) parse, call it and send.

Logprobs follow OpenAI's conventions: a token is shown as its text, or as
``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters (chat's
``bytes`` field holds the token's real bytes); ``text_offset`` is each
token's character offset in the prompt followed by the completion (OpenAI's
legacy completions; with ``echo`` that is the returned text).  The values
are the model's own (log-softmax of its logits) unless the server runs with
``logprobs_mode="processed"``; the prompt's (``echo``) are ``Model.score``'s.
"""

import asyncio
import secrets
import time

import numpy as np

from .. import _openmp
from ..chat import ChatTemplate, chat_generation, check_messages
from ..engine import EngineBusy, EngineClosed
from ..errors import ChatTemplateError, CyformerError, TokenizerError
from ..generate import CONTEXT, EOS, LENGTH, STOP, Generation
from ..model_files import DEFAULT
from ..request import GenerationRequest
from ..sampling import log_softmax
from . import protocol as P
from . import structured

FINISH = {EOS: "stop", STOP: "stop", LENGTH: "length", CONTEXT: "length"}
RETRY_AFTER_S = 1
MAX_PROMPTS = 256  # prompts per completions request (--max-prompts)


class APIError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param, message):
    return APIError(400, message, param=param)


def new_id(prefix):
    return f"{prefix}-{secrets.token_hex(12)}"


class Plan:
    """The generations of one request and how to answer with them.

    gens: one Generation per candidate, prompt-major; per_prompt: candidates
    per prompt (best_of, else n); n: choices per prompt in the answer;
    echo: (text, ids) of each prompt when the prompt is echoed, else None;
    logprobs: top tokens asked for (None: no logprobs)."""

    def __init__(self, gens, per_prompt, n, logprobs, echo=None, stream=False, include_usage=False, tools=None):
        self.gens, self.per_prompt, self.n, self.logprobs, self.echo = gens, per_prompt, n, logprobs, echo
        self.stream, self.include_usage = stream, include_usage
        self.tools = tools  # names of the tools a chat reply may call (serve.structured), or None


class OpenAIServing:
    """The serving logic of one model behind its engine."""

    def __init__(self, model, engine, model_name, *, max_prompts=MAX_PROMPTS, logprobs_mode="raw"):
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.model, self.engine, self.model_name = model, engine, model_name
        self.max_prompts = max_prompts
        self.logprobs_mode = logprobs_mode
        self.created = int(time.time())
        self.tokenizer = model.tokenizer
        self._strings = {}  # token id -> its logprobs string

    # -- checks --

    def check_model(self, name, required=True):
        if name is None and not required:
            return
        if name != self.model_name:
            shown = name if len(name) <= 100 else name[:100] + "..."
            raise APIError(404, f"the model '{shown}' does not exist; this server has '{self.model_name}'",
                           param="model", code="model_not_found")

    def model_card(self):
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "cyformer",
                "max_model_len": self.model.config.n_positions}

    # -- requests -> generations --

    def _request(self, req: P.SamplingFields, max_tokens, logprobs, top, choice, structure):
        """The GenerationRequest of one choice (choice j samples with seed + j)."""
        vocab = self.model.config.vocab_size
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad("stop", "'stop' strings must not be empty")
        if any(not _utf8(s) for s in stop):
            raise bad("stop", "'stop' strings must be valid Unicode (a lone surrogate is not)")
        if sum(len(s) for s in stop) > P.MAX_STOP_CHARS:
            raise bad("stop", f"the stop strings hold more than {P.MAX_STOP_CHARS} characters together")
        ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in ids):
            raise bad("stop_token_ids", f"'stop_token_ids' must be token ids in [0, {vocab})")
        bias = {}
        for k, v in (req.logit_bias or {}).items():
            if not k.strip().isdigit() or not 0 <= int(k) < vocab:
                raise bad("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab}), got {k!r}")
            if not -100 <= v <= 100:
                raise bad("logit_bias", f"'logit_bias' values must be in [-100, 100], got {v}")
            bias[int(k)] = v
        top_k = DEFAULT if req.top_k is None else (None if req.top_k in (-1, 0) else req.top_k)
        try:
            return GenerationRequest(
                max_new_tokens=self.model.config.n_positions if max_tokens is None else max_tokens,
                temperature=DEFAULT if req.temperature is None else req.temperature,
                top_p=DEFAULT if req.top_p is None else req.top_p, top_k=top_k,
                repetition_penalty=DEFAULT if req.repetition_penalty is None else req.repetition_penalty,
                min_p=req.min_p, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, logit_bias=bias, stop=stop + ids,
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                seed=None if req.seed is None else (req.seed + choice) % (P.SEED_MAX + 1),
                logprobs=logprobs, top_logprobs=top, logprobs_mode=self.logprobs_mode,
                skip_special_tokens=req.skip_special_tokens, **structure.options)
        except ValueError as e:
            raise bad(_param_of(str(e), None), str(e)) from None

    def completion_plan(self, req: P.CompletionRequest):
        self.check_model(req.model)
        prompts = self._prompts(req.prompt)
        if req.suffix:
            raise bad("suffix", "'suffix' is not supported (this server has no insertion mode)")
        best_of = req.best_of or req.n
        if best_of < req.n:
            raise bad("best_of", f"'best_of' ({best_of}) must be at least 'n' ({req.n})")
        if best_of > req.n and req.stream:
            raise bad("best_of", "'best_of' above 'n' cannot be streamed (the best are known only at the end)")
        self._fits(len(prompts) * best_of)
        want_lp = req.logprobs is not None
        rank = best_of > req.n  # best_of ranks candidates by their mean token logprob
        structure = self._structure(req, chat=False)
        gens = []
        for i, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            for j in range(best_of):
                r = self._request(req, req.max_tokens, want_lp or rank, req.logprobs or 0, j, structure)
                gens.append(self._make(where, lambda r=r, p=p: Generation(self.model, p, r, text=True)))
        echo = None
        if req.echo:
            echo = [(p if isinstance(p, str) else self.tokenizer.decode(p), g.prompt_ids)
                    for p, g in zip(prompts, gens[::best_of])]
        return Plan(gens, best_of, req.n, req.logprobs, echo, req.stream, _include_usage(req))

    def chat_plan(self, req: P.ChatCompletionRequest):
        self.check_model(req.model)
        if req.tool_choice is not None and req.tool_choice != "none" and not req.tools:
            raise bad("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
        structure = self._structure(req, chat=True)
        if structure.forced and req.stream:
            raise bad("stream", "streaming a forced tool call (tool_choice 'required' or a named "
                                "function) is not supported; send it without 'stream'")
        template_vars = req.chat_template_kwargs
        if structure.template_vars:
            template_vars = dict(template_vars or {}, **structure.template_vars)
        messages = self._messages(req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        top = req.top_logprobs or 0
        self._fits(req.n)
        gens = []
        for j in range(req.n):
            r = self._request(req, max_tokens, req.logprobs, top, j, structure)
            gens.append(self._make("messages", lambda r=r: chat_generation(
                self.model, messages, r, template_vars)))
        return Plan(gens, 1, req.n, top if req.logprobs else None, None, req.stream, _include_usage(req),
                    tools=structure.tools)

    def _structure(self, req, chat):
        s = structured.read(req, chat, bad)
        if (s.options.get("json_schema") is not None or s.options.get("grammar") is not None):
            try:  # the grammar compiles (and llguidance is there) before anything is queued
                from ..structured import grammar_text
                grammar_text(json_schema=s.options.get("json_schema"), grammar=s.options.get("grammar"))
            except CyformerError as e:
                raise bad("response_format", str(e)) from None
            except ValueError as e:
                raise bad("guided_grammar" if s.options.get("grammar") is not None else "response_format",
                          str(e)) from None
        return s

    def _make(self, param, build):
        try:
            return build()
        except (TokenizerError, ChatTemplateError) as e:
            raise bad(param, self._public(str(e))) from None
        except ValueError as e:
            raise bad(_param_of(str(e), param), str(e)) from None

    def _prompts(self, prompt):
        vocab = self.model.config.vocab_size
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad("prompt", "'prompt' must not be empty")
        if len(prompts) > self.max_prompts:
            raise bad("prompt", f"at most {self.max_prompts} prompts per request (--max-prompts), "
                                f"got {len(prompts)}")
        for p in prompts:
            if not p:
                raise bad("prompt", "'prompt' must not be empty (nor hold an empty prompt)")
            if isinstance(p, list) and not all(0 <= t < vocab for t in p):
                raise bad("prompt", f"token ids must be in [0, {vocab})")
        return prompts

    def _messages(self, messages):
        plain = []
        for m in messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                d["content"] = "".join(part.text for part in m.content)
            plain.append(d)
        try:
            return check_messages(plain)
        except ValueError as e:
            raise bad("messages", str(e)) from None

    def _public(self, message):
        """An error message without the server's file system: the model's
        directory is shown as the model's name."""
        path = self.model.path
        return message.replace(path, self.model_name) if path else message

    def _fits(self, n):
        """Refuse, before building any Generation, a request of more than the queue ever admits."""
        if n > self.engine.max_queue:  # never admittable: a client fault, not a busy server
            raise bad("n", f"this request needs {n} generations (prompts x n, or best_of); the queue "
                           f"holds {self.engine.max_queue} (--max-queue), so it can never be admitted")

    def submit(self, gens, sinks):
        self._fits(len(gens))
        try:
            return self.engine.submit(gens, sinks)
        except EngineBusy as e:
            raise APIError(503, str(e), kind="server_busy", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosed as e:
            raise APIError(503, str(e), kind="server_shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    # -- prompt logprobs (echo) --

    def prompt_logprobs(self, ids, k):
        """([None] + Model.score's values, [None] + top-k {string: logprob} per position) of ids [T]."""
        ids = np.asarray(ids, dtype=np.int64)
        try:
            logits = self.model.forward(ids)
        finally:  # on a worker thread beside the engine's: leave no idle team (_openmp)
            _openmp.release_this_thread()
        values, tops = [None], [None]
        for t0 in range(0, ids.size - 1, 64):  # as Model.score: float64 rows in blocks of 64
            t1 = min(t0 + 64, ids.size - 1)
            lp = log_softmax(logits[t0:t1])
            values.extend(float(v) for v in lp[np.arange(t1 - t0), ids[t0 + 1:t1 + 1]])
            for row in lp:
                tops.append(self._top(row, k) if k else None)
        return values, tops

    def _top(self, row, k):
        best = np.argpartition(-row, k - 1)[:k] if k < row.size else np.arange(row.size)
        best = best[np.lexsort((best, -row[best]))]
        return [(int(i), float(row[i])) for i in best]

    # -- answers --

    def token_string(self, token):
        """A token's text, or bytes:\\xNN... when its bytes are not whole UTF-8 characters."""
        s = self._strings.get(token)
        if s is None:
            b = self.tokenizer.token_bytes(token)
            try:
                s = b.decode("utf-8")
            except UnicodeDecodeError:
                s = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._strings[token] = s
        return s

    def completion_logprobs(self, ids, values, tops, before=b""):
        """OpenAI's completions logprobs of tokens ``ids`` with their values and
        top lists ([(id, logprob)] or None); ``before``: the bytes of the text
        before them, from which the character offsets count."""
        tokens, offsets = [], []
        seen = before
        for t in ids:
            tokens.append(self.token_string(t))
            # the characters complete before this token: a token inside a character starts at it
            offsets.append(len(seen.decode("utf-8", errors="ignore")))
            seen += self.tokenizer.token_bytes(t)
        top = [None if tl is None else _top_dict(self, tl) for tl in tops]
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": top if any(t is not None for t in top) else None, "text_offset": offsets}

    def chat_logprobs(self, entries):
        def item(t, lp):
            return {"token": self.token_string(t), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(t))}
        return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
                            for e in entries], "refusal": None}

    def choose(self, plan, streams):
        """The streams answered, prompt-major: all of them, or best_of's best n per prompt."""
        if plan.per_prompt == plan.n:
            return streams
        out = []
        for a in range(0, len(streams), plan.per_prompt):
            group = streams[a:a + plan.per_prompt]
            score = [np.mean([e.logprob for e in s.generation.logprobs]) if s.generation.logprobs else -np.inf
                     for s in group]
            order = sorted(range(len(group)), key=lambda i: (-score[i], i))[:plan.n]
            out.extend(group[i] for i in order)
        return out

    def completion_choice(self, plan, index, stream, prompt_index, prompt_lp):
        g = stream.generation
        text = g.text
        lp = None
        if plan.echo is not None:
            text = plan.echo[prompt_index][0] + text
        if plan.logprobs is not None:
            gen_ids = [e.token for e in g.logprobs]
            values = [e.logprob for e in g.logprobs]
            tops = [e.top if plan.logprobs else None for e in g.logprobs]
            prompt_bytes = b"".join(self.tokenizer.token_bytes(t) for t in g.prompt_ids)
            if plan.echo is not None:
                p_values, p_tops = prompt_lp
                lp = self.completion_logprobs([int(t) for t in g.prompt_ids] + gen_ids, p_values + values,
                                              p_tops + tops)
            else:
                lp = self.completion_logprobs(gen_ids, values, tops, before=prompt_bytes)
        return {"index": index, "text": text, "logprobs": lp,
                "finish_reason": FINISH.get(g.finish_reason, g.finish_reason)}

    def chat_choice(self, plan, index, stream):
        g = stream.generation
        out = {"index": index, "message": {"role": "assistant", "content": g.text},
               "logprobs": self.chat_logprobs(g.logprobs) if plan.logprobs is not None else None,
               "finish_reason": FINISH.get(g.finish_reason, g.finish_reason)}
        calls = structured.tool_calls(g.text, plan.tools) if plan.tools else None
        if calls:
            out["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            out["finish_reason"] = "tool_calls"
        return out

    async def echo_logprobs(self, plan):
        """Per prompt, its logprobs (computed off the event loop), or Nones."""
        if plan.echo is None or plan.logprobs is None:
            return [None] * (len(plan.gens) // plan.per_prompt)
        return [await asyncio.to_thread(self.prompt_logprobs, ids, plan.logprobs) for _, ids in plan.echo]

    # -- tokenizer routes --

    def tokenize(self, req: P.TokenizeRequest):
        self.check_model(req.model, required=False)
        if (req.prompt is None) == (req.messages is None):
            raise bad("prompt", "give 'prompt' or 'messages' (one of them)")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=special)
        else:
            try:
                text = ChatTemplate.of(self.model).render(self._messages(req.messages), req.add_generation_prompt,
                                                          req.chat_template_kwargs)
            except ChatTemplateError as e:
                raise bad("messages", self._public(str(e))) from None
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        out = {"count": len(ids), "max_model_len": self.model.config.n_positions, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [self.token_string(t) for t in ids]
        return out

    def detokenize(self, req: P.DetokenizeRequest):
        self.check_model(req.model, required=False)
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise bad("tokens", f"token ids must be in [0, {vocab})")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def tokenizer_info(self):
        tc = self.tokenizer.config
        sp = tc.special_tokens
        eos = sp.get("eos_token")
        if eos is None:  # no tokenizer_config.json: the text of the model's first eos id
            ids = sorted(self.model.generation_config.eos_ids(self.model.config))
            eos = self.tokenizer.token_bytes(ids[0]).decode("utf-8", "replace") if ids else None
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                "bos_token": sp.get("bos_token"), "pad_token": sp.get("pad_token"),
                "chat_template": tc.chat_template, "model_max_length": self.model.config.n_positions}


def _utf8(text):
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _top_dict(serving, pairs):
    return {serving.token_string(t): lp for t, lp in pairs}


def _include_usage(req):
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


_PARAMS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "logit_bias", "stop", "min_tokens", "seed",
           "top_logprobs")
_WIRE = {"max_new_tokens": "max_tokens"}


def _param_of(message, default):
    """The request field a GenerationRequest/Generation message is about."""
    for name in _PARAMS:
        if message.startswith(name) or message.startswith(f"generate: {name}"):
            return _WIRE.get(name, name)
    if message.startswith("stop holds token id"):
        return "stop_token_ids"
    return default


__all__ = ["APIError", "OpenAIServing", "Plan", "CyformerError"]
