"""The OpenAI API's requests and answers as pydantic models, with OpenAI's
field names (and vLLM's extension fields, marked below).

Requests are strict (no "9" for 9, no true for 1) and closed: a field this
server does not know is refused with a 400 naming it, never dropped, since a
dropped option silently changes what the client asked for.  OpenAI fields
that change nothing about the output (``user``, ``metadata``, ``store``,
``service_tier``) are accepted.  Field ranges here are OpenAI's; what depends
on the model (token ids, the context) is checked when the request is served.
"""

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128                  # choices per prompt (OpenAI's limit for n)
MAX_BEST_OF = 20             # OpenAI's limit for best_of
MAX_COMPLETION_LOGPROBS = 20  # /v1/completions logprobs (vLLM's default max_logprobs)
MAX_TOP_LOGPROBS = 20         # chat top_logprobs (OpenAI's limit)
MAX_STOP_CHARS = 16384        # all stop strings together: any number of them within this
SEED_MAX = 2**63 - 1
TOKEN_MAX = 2**31 - 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Open(BaseModel):
    """An answer's part: more fields may appear in later versions."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(Strict):
    include_usage: Optional[bool] = None


class SamplingFields(Strict):
    """The fields both generation endpoints take."""

    model: str
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Optional[int] = Field(None, ge=0, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None   # {"token id": -100..100}
    user: Optional[str] = None                       # accepted: it changes nothing in the output
    metadata: Optional[dict[str, str]] = None        # likewise
    store: Optional[bool] = None                     # likewise (nothing is stored)
    service_tier: Optional[str] = None               # likewise
    # vLLM's extensions
    top_k: Optional[int] = Field(None, ge=-1)        # -1 or 0: off (vLLM's convention)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=TOKEN_MAX)
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    # structured output (cyformer.serve.structured)
    response_format: Optional[dict] = None           # {"type": "text" | "json_object" | "json_schema", ...}
    guided_json: Optional[Union[dict, str]] = None   # vLLM's: a JSON schema
    guided_grammar: Optional[str] = None             # vLLM's: a grammar (Lark, llguidance's dialect)
    token_healing: Optional[bool] = None             # cyformer's: null: on for text prompts without logprobs


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0, le=TOKEN_MAX)   # OpenAI's default 16; null: to the context
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_BEST_OF)
    suffix: Optional[str] = None                     # only "" (no insertion mode)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message: role and content (a str, or OpenAI's text parts); other
    keys (name, tool_calls, ...) go to the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1)
    content: Optional[Union[str, list[TextPart]]] = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0, le=TOKEN_MAX)  # null: to the end of the context
    max_completion_tokens: Optional[int] = Field(None, ge=0, le=TOKEN_MAX)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM's extensions
    chat_template_kwargs: Optional[dict] = None
    add_generation_prompt: bool = True


class TokenizeRequest(Strict):
    """POST /tokenize (vLLM): a prompt, or chat messages through the template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None   # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict] = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    """POST /detokenize (vLLM)."""

    model: Optional[str] = None
    tokens: list[int]


# -- answers --------------------------------------------------------------------------

class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Open):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: Optional[list[Optional[dict[str, float]]]]
    text_offset: list[int]


class CompletionChoice(Open):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(Open):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Open):
    content: Optional[list[TokenLogprobEntry]]
    refusal: Optional[list] = None


class AssistantMessage(Open):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]


class ChatChoice(Open):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(Open):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorBody(Open):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(Open):
    error: ErrorBody
