"""The OpenAI API's request bodies as typed models: declared once, they validate the JSON a client
sends (``router.http.parse_request``) and generate the OpenAPI schema (``openapi_schema``).

Ranges come from ``tandem.protocol`` (``SAMPLING_LIMITS`` and the request bounds), so the
validator, the engine's ``SamplingParams`` and the schema cannot disagree. Models are strict (no
``"1"`` for 1, no ``true`` for 1) and ignore unknown fields, as OpenAI's API does. What depends on
the served model (``max_tokens`` against the context length) is checked after validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.protocol import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_MESSAGES,
    MAX_NUM_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SAMPLING_LIMITS,
)

MAX_N = 16
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions body (each its own request, n choices each)
MAX_CHOICES = 256  # prompts x n: the generations one HTTP request may start
MAX_SEED = 2**63 - 1  # seed + i must fit the proto's uint64 and torch's generator


def _limited(name: str) -> Any:
    """Field bounds for a finite float in ``SAMPLING_LIMITS[name]``."""
    limit = SAMPLING_LIMITS[name]
    if limit.lo_open:
        return Field(allow_inf_nan=False, gt=limit.lo, le=limit.hi)
    return Field(allow_inf_nan=False, ge=limit.lo, le=limit.hi)


Temperature = Annotated[float, _limited("temperature")]
TopP = Annotated[float, _limited("top_p")]
MinP = Annotated[float, _limited("min_p")]
PresencePenalty = Annotated[float, _limited("presence_penalty")]
FrequencyPenalty = Annotated[float, _limited("frequency_penalty")]
RepetitionPenalty = Annotated[float, _limited("repetition_penalty")]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=2**32)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_NUM_LOGPROBS)]
Bias = Annotated[float, Field(allow_inf_nan=False, ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
# OpenAI's logit_bias: token ids as JSON keys (strings of digits), each bias added to that logit
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Bias],
                      Field(max_length=MAX_LOGIT_BIAS_TOKENS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False  # a last chunk with the usage of every choice


class _Request(BaseModel):
    """What both endpoints read."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = ""  # "", "default" or the served model's name
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # at most the context length
    temperature: Temperature | None = None  # left out: the model's generation_config.json default
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None  # -1 or 0: off
    min_p: MinP | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # choices, generated concurrently
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED - MAX_N)] | None = None  # choice i uses seed + i
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None  # stop tokens are masked until this many
    ignore_eos: bool = False
    logit_bias: LogitBias | None = None  # ids past the vocabulary are refused by the router
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # vLLM's extra
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that matched ends the text
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    spaces_between_special_tokens: bool = True  # vLLM's; its fast tokenizers ignore it, and so does this server
    user: str | None = None
    stream: bool | None = None  # server-sent events, ending with "data: [DONE]"
    stream_options: StreamOptions | None = None
    # Structured output (one of these; read from the body by the router's _structured_output):
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    # vLLM's: exactly one of json (a schema), json_object, regex, choice, grammar (Lark or GBNF)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str  # 1-64 letters, digits, _ or -
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]  # only text is supported
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str  # a JSON object as text


class ToolCallMessage(BaseModel):
    """A call an earlier assistant turn made (its ``tool_calls``)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Annotated[str, Field(min_length=1)]  # system, user, assistant, tool, or what the template knows
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"model": "default", "messages": [{"role": "system", "content": "Answer in one word."},
                                          {"role": "user", "content": "Hi!"}],
         "max_tokens": 64, "temperature": 0.2, "stream": True, "stream_options": {"include_usage": True}},
        {"model": "default", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "logprobs": True, "top_logprobs": 2, "n": 2, "seed": 7, "stop": ["\n"]},
    ]})

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # wins over max_tokens
    logprobs: bool | None = None  # log probabilities of the chosen tokens
    top_logprobs: NumLogprobs | None = None  # and of this many alternatives (needs logprobs)
    # vLLM's chat template options
    add_generation_prompt: bool = True  # the prompt ends with the assistant turn's opening
    continue_final_message: bool = False  # generation continues the last message (not with the above)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    add_special_tokens: bool = False  # BOS and the like on top of what the template writes
    # Tool calling (router.tools): the functions the model may call, and whether it must
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "default", "prompt": "Once upon a time", "max_tokens": 32},
        {"model": "default", "prompt": [1, 2, 3], "logprobs": 2, "echo": False},
    ]})

    # text, token ids, or a batch of either (choices numbered prompt by prompt, n each)
    prompt: (str | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_BATCH_PROMPTS)])
    logprobs: NumLogprobs | None = None  # top logprobs per token
    echo: bool = False  # the prompt's text before the completion's (not with logprobs)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like before a text prompt


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): the ids a prompt or chat would be sent as, with the chat
    template as generation renders it."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"examples": [
        {"model": "default", "prompt": "Hello"},
        {"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
    ]})

    model: str = ""
    prompt: str | None = None  # exactly one of prompt and messages
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    # as in the generation requests: the chat template's options, and the tokenizer's special tokens
    # (default: true for a prompt, false for messages)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None  # messages: told as generation tells them


class InputText(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["input_text", "output_text"]  # only text is supported (output_text: an earlier answer's)
    text: str


class InputMessage(BaseModel):
    """An item of a Responses ``input``: a message (the only kind of item supported)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """An item of a Responses ``input``: a call an earlier answer made."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str  # a JSON object as text


class FunctionCallOutputItem(BaseModel):
    """An item of a Responses ``input``: what a call's function gave back."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (OpenAI's Responses API, ``client.responses.create``), run as the chat
    request it means: ``instructions`` as a system message, then ``input``. Nothing is stored.
    vLLM's sampling extras (``top_k``, ``seed``, ``stop``, ``ignore_eos``, ...) are taken as the
    chat endpoint takes them."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"examples": [
        {"model": "default", "input": "What is the capital of France?"},
        {"model": "default", "instructions": "Answer in one word.", "max_output_tokens": 16, "stream": True,
         "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}]},
    ]})

    model: str = ""
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None  # at most the context length
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None  # server-sent events: response.created ... response.completed
    store: bool | None = None  # accepted; this server stores no responses
    metadata: dict[str, str] | None = None  # returned as sent
    user: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None  # an input past the context is refused either way
    include: list[str] | None = None  # "message.output_text.logprobs": the answer's logprobs
    top_logprobs: NumLogprobs | None = None  # alternatives per token, with those logprobs
    text: dict[str, Any] | None = None  # {"format": ...}: text, json_object or json_schema (structured output)
    # function tools ({"type": "function", "name", "description", "parameters"}) and how they may be called
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob] | None = None  # sent only when asked for (include)


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    """A call the answer made (an item of a response's ``output``)."""

    type: Literal["function_call"]
    id: str
    call_id: str  # what the function's output names in the next request's input
    name: str
    arguments: str  # a JSON object as text
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # read from the prefix cache
    cache_write_tokens: int  # computed: their KV goes to the prefix cache (by whole blocks)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A Responses API answer, and what its stream's response.* events carry."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ErrorDetail | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any]
    tools: list[Any]
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    store: bool
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = ""
    tokens: list[TokenId]


# --- responses ------------------------------------------------------------------------------------
# The shapes OpenAI's API answers with; the router builds these and nothing else, so the OpenAPI
# schema below describes what is sent.

FinishReasonName = Literal["stop", "length", "abort", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None  # sent only when the model called tools


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in the call's first chunk
    arguments: str  # the next piece of the arguments' text


class ToolCallDelta(BaseModel):
    index: int  # the call's place among the choice's calls
    id: str | None = None  # in the call's first chunk, with type and the function's name
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # in a choice's first chunk only
    content: str | None  # null in a chunk that only carries tool calls
    tool_calls: list[ToolCallDelta] | None = None  # sent only when the chunk carries calls


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion; the last one (with
    ``stream_options.include_usage``) has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # sent (null until the last event) only with include_usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReasonName | None


class Completion(BaseModel):
    """A text completion, and also each event of a streamed one (as OpenAI sends them)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def to_json(model: BaseModel) -> dict[str, Any]:
    """What is sent of a response model: every field that was set, explicit nulls included
    (OpenAI sends ``"finish_reason": null``), and none left at a default (a chunk's ``role``)."""
    return model.model_dump(mode="json", exclude_unset=True)


def openapi_schema(context_length: int) -> dict[str, Any]:
    """The API's OpenAPI 3.1 description, generated from the request models; ``max_tokens`` and
    the like are bounded by ``context_length``."""
    components: dict[str, Any] = {}
    for model in (ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion,
                  ModelList, ModelCard, ErrorResponse, TokenizeRequest, TokenizeResponse, DetokenizeRequest,
                  DetokenizeResponse, ResponsesRequest, ResponseObject):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        for name in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
            prop = schema["properties"].get(name)
            if prop is not None and model in (ChatCompletionRequest, CompletionRequest, ResponsesRequest):
                prop["anyOf"][0]["maximum"] = context_length
        components[model.__name__] = schema

    def ref(model: type[BaseModel]) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def answers(ok: str, reply: type[BaseModel], event: type[BaseModel] | str) -> dict[str, Any]:
        streamed = event if isinstance(event, str) else f"each holding a {event.__name__}, then [DONE]"
        out: dict[str, Any] = {"200": {"description": f"{ok}; with stream=true, server-sent events {streamed}",
                                       "content": {"application/json": {"schema": ref(reply)},
                                                   "text/event-stream": {"schema": {"type": "string"}}}}}
        for status, text in (("400", "invalid parameters"), ("401", "bad API key"), ("404", "unknown model"),
                             ("409", "request id in flight"), ("413", "body too large"),
                             ("429", "admission refused; see Retry-After"), ("503", "not ready")):
            out[status] = {"description": text, "content": {"application/json": {"schema": ref(ErrorResponse)}}}
        return out

    def post(request: type[BaseModel], summary: str, reply: type[BaseModel],
             event: type[BaseModel] | str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref(request)}}}, "responses": answers(summary, reply, event)}}

    def get(summary: str, reply: type[BaseModel] | None = None) -> dict[str, Any]:
        ok: dict[str, Any] = {"description": summary}
        if reply is not None:
            ok["content"] = {"application/json": {"schema": ref(reply)}}
        return {"get": {"summary": summary, "responses": {"200": ok, "503": {"description": "not ready"}}}}

    def plain_post(request: type[BaseModel], summary: str, reply: type[BaseModel]) -> dict[str, Any]:
        errors = {status: {"description": text, "content": {"application/json": {"schema": ref(ErrorResponse)}}}
                  for status, text in (("400", "invalid parameters"), ("401", "bad API key"),
                                       ("404", "unknown model"))}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref(request)}}}, "responses": {
            "200": {"description": summary, "content": {"application/json": {"schema": ref(reply)}}}, **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "Tandem OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": post(ChatCompletionRequest, "chat completion", ChatCompletion,
                                         ChatCompletionChunk),
            "/v1/completions": post(CompletionRequest, "text completion", Completion, Completion),
            "/v1/responses": post(ResponsesRequest, "response (OpenAI's Responses API; nothing is stored)",
                                  ResponseObject, "named by their type: response.created, response.in_progress, "
                                  "response.output_item.added, response.content_part.added, "
                                  "response.output_text.delta ..., response.output_text.done, "
                                  "response.content_part.done, response.output_item.done, then "
                                  "response.completed or response.incomplete (error and response.failed "
                                  "when it fails midway)"),
            "/v1/models": get("served models", ModelList),
            "/v1/models/{model}": {"get": {
                "summary": "one served model", "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": {"application/json": {
                    "schema": ref(ModelCard)}}}, "404": {"description": "unknown model", "content": {
                        "application/json": {"schema": ref(ErrorResponse)}}}}}},
            "/tokenize": plain_post(TokenizeRequest, "a prompt's token ids, as generation would send it",
                                    TokenizeResponse),
            "/detokenize": plain_post(DetokenizeRequest, "the text of token ids", DetokenizeResponse),
            "/version": get("the server's version"),
            "/health": get("process is up"),
            "/ready": get("a prefill and a decode service are reachable"),
            "/metrics": get("Prometheus metrics"),
        },
        "components": {"schemas": components},
    }
