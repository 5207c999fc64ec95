"""The OpenAI API's wire types: JSON bodies -> GenerationRequest, and what goes back.

One parse function per endpoint turns a decoded JSON body into an `ApiRequest`
(memspec's GenerationRequest plus what only HTTP needs: stream, usage, logprobs),
checking each field's type and naming it when it is wrong; ranges are checked
once, by memspec.request.validate, with the same field names.  Fields memspec
cannot honour (best_of > 1, the legacy functions) are refused with the field's
name; fields it does not know are ignored, listed in `ignored` for a debug log.
The builders below make the responses and the streamed chunks.

OpenAI's `n` asks for n choices: n independent generations of the same request,
each its own request to the daemon (`ApiRequest.choice`).  With a seed s, choice
i samples with seed (s + i) mod 2^64 (vLLM's rule), so choice 0 is the n = 1
answer and the whole response repeats; without one the request is given a fresh
seed (`seeded`), which the `memspec` object reports.  Greedy choices are all the same answer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from memspec.errors import INTERNAL, InvalidRequestError, status_of
from memspec.models.tools import ToolCall, call_text, parse_calls
from memspec.request import (MAX_TOP_LOGPROBS, TOOL_CHOICES, Constraint, GenerationRequest, PolicyName, SamplingParams,
                             Tool, fresh_seed, parse_keep_alive, quote)

EXTENSION = "memspec"  # the object that carries memspec's own options: draft, policy, top_k
FINISH = {"stop": "stop", "eos": "stop", "length": "length", "cancelled": "stop"}  # memspec -> OpenAI
TOOL_CALLS = "tool_calls"  # the finish reason of an answer that calls tools

# Known fields that change nothing here (or that only OpenAI's own service uses).
HARMLESS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "modalities",
            "reasoning_effort", "web_search_options", "audio"}
_REFUSED = {
    "functions": "the legacy functions are not supported; give tools",
    "suffix": "suffix (insertion) is not supported",
}
# sampling fields beyond OpenAI's own that vLLM and llama-server take at the top level too
_CONTROLS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "logit_bias")
_REQ = GenerationRequest()
_SAMPLING = SamplingParams()
MAX_CHOICES = 128  # n: OpenAI's own bound; the daemon's [server] max_concurrent bounds it further (serving.http)
SEEDS = 2**64  # a seed is a 64-bit unsigned integer (memspec.request.validate)


@dataclass(frozen=True)
class ApiRequest:
    """One /v1/chat/completions or /v1/completions request."""

    kind: str  # "chat" or "text"
    model: str | None  # a pulled target's name; None: the daemon's default target
    request: GenerationRequest
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    logprobs: int | None = None  # None: off; k: the chosen token's log-probability and the k most likely
    ignored: tuple[str, ...] = ()  # fields memspec does not know
    tools: bool = False  # the answer may call tools: calls are read out of it (memspec.models.tools)
    n: int = 1  # choices: independent generations of `request`, each run as a request of its own

    @property
    def tool_names(self) -> frozenset[str]:
        """The offered tools' names: an answer that is one bare JSON call of one of them is a call."""
        return frozenset(t.name for t in self.request.tools or ())

    def choice(self, index: int) -> GenerationRequest:
        """Choice `index`'s request: `request` itself, but with a seed s sampled with seed
        (s + index) mod 2^64, so that seeded choices draw differently and repeat (a sampled request
        of several choices without a seed was given one: `seeded`); greedy ones are all the same answer."""
        seed = self.request.sampling.seed
        if index == 0 or seed is None:
            return self.request
        return replace(self.request, sampling=replace(self.request.sampling, seed=(seed + index) % SEEDS))


def seeded(api: ApiRequest) -> ApiRequest:
    """A sampled request of several choices without a seed gets one (memspec.request.fresh_seed), so
    that choice i draws with seed + i and the response reports a seed that replays every choice
    (the engine draws one for a request of one choice itself)."""
    s = api.request.sampling
    if api.n == 1 or s.greedy or s.seed is not None:
        return api
    return replace(api, request=replace(api.request, sampling=replace(s, seed=fresh_seed())))


def _bad(name: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name}: {msg}")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"must be a number, got {_kind(value)} {quote(str(value), 32)}")
    return float(value)


def _int(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {_kind(value)} {quote(str(value), 32)}")
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {_kind(value)}")
    return value


def _object(body: dict, name: str) -> dict:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(name, f"must be an object, got {_kind(value)}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _bad(name, f"must be a string, got {_kind(value)}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(_text(s, f"stop[{i}]") for i, s in enumerate(value))
    raise _bad("stop", f"must be a string or an array of strings, got {_kind(value)}")


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias}, as ((id, bias), ...); the JSON types are checked here,
    the ranges by memspec.request and the vocabulary by the engine."""
    out = []
    for key, value in _object(body, "logit_bias").items():
        if not re.fullmatch(r"[0-9]{1,12}", key):
            raise _bad("logit_bias", f"key {quote(key, 32)} is not a token id (a non-negative integer)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _bad("logit_bias", f"the bias of token {key} must be a number, got {_kind(value)}")
        out.append((int(key), float(value)))
    return tuple(out)


def _choices(body: dict) -> int:
    """n: how many choices, 1..MAX_CHOICES."""
    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise _bad("n", f"{n} choices asked for; allowed 1..{MAX_CHOICES}")
    return n


def _refuse_unsupported(body: dict) -> None:
    """400 for what memspec cannot do, naming the field, rather than an answer that ignores it."""
    best_of = _int(body, "best_of", 1)
    if best_of != 1:
        raise _bad("best_of", f"{best_of}; memspec ranks no candidates (best_of = 1): ask for n choices instead")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, [], {}, ""):
            raise _bad(name, why)
    if body.get("function_call") not in (None, "none", "auto"):
        raise _bad("function_call", "the legacy function_call is not supported; give tool_choice")
    if _bool(body, "echo"):
        raise _bad("echo", "echoing the prompt is not supported")


FORMATS = ("text", "json_object", "json_schema")  # response_format.type


def _constraint(body: dict) -> Constraint | None:
    """response_format (OpenAI's JSON mode and structured outputs) or grammar (llama-server's GBNF,
    Lark too) as the request's Constraint; None for free text."""
    fmt, grammar = body.get("response_format"), body.get("grammar")
    c = None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _bad("response_format", f"must be an object like {{\"type\": \"json_object\"}}, got {_kind(fmt)}")
        kind = fmt.get("type")
        if kind not in FORMATS:
            shown = quote(kind, 32) if isinstance(kind, str) else _kind(kind)
            raise _bad("response_format.type", f"{shown} is not one of {', '.join(FORMATS)}")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise _bad("response_format.json_schema", f"must be an object with name and schema, got {_kind(spec)}")
            name = spec.get("name")
            if not isinstance(name, str) or not name:
                raise _bad("response_format.json_schema.name", "is required: a name for the schema")
            schema = spec.get("schema")
            if schema is None:  # a name and no schema: any JSON object
                c = Constraint("json_object", field="response_format.json_schema.schema")
            elif not isinstance(schema, dict):
                raise _bad("response_format.json_schema.schema",
                           f"must be an object (a JSON schema), got {_kind(schema)}")
            else:
                c = Constraint("json_schema", json.dumps(schema), field="response_format.json_schema.schema")
        elif kind == "json_object":
            schema = fmt.get("schema")  # llama-server's extension: JSON mode with a schema
            if schema is not None and not isinstance(schema, dict):
                raise _bad("response_format.schema", f"must be an object (a JSON schema), got {_kind(schema)}")
            c = (Constraint("json_schema", json.dumps(schema), field="response_format.schema") if schema is not None
                 else Constraint("json_object", field="response_format"))
    if grammar is not None:
        if c is not None:
            raise _bad("grammar", "give either grammar or a JSON response_format, not both")
        c = Constraint("grammar", _text(grammar, "grammar"), field="grammar")
    return c


def _sampling_and_options(body: dict, limits_max_tokens: int) -> dict:
    """The GenerationRequest fields both endpoints share, and the extension object's."""
    ext = _object(body, EXTENSION)
    unknown_ext = sorted(set(ext) - {"draft", "policy", "top_k"})
    if unknown_ext:
        raise _bad(f"{EXTENSION}.{unknown_ext[0]}", "unknown option; known: draft, policy, top_k")
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)  # None: to the end of sequence or context (request.new_tokens)
    seed = _int(body, "seed", None)
    top_k = _int(ext, "top_k", _int(body, "top_k", _SAMPLING.top_k))  # vLLM and llama.cpp take it at the top too
    draft = ext.get("draft")
    policy = ext.get("policy")
    keep_alive = body.get("keep_alive")  # Ollama's: a duration ("5m") or seconds; 0 unloads, negative keeps
    return dict(
        model=_model(body),
        keep_alive=None if keep_alive is None else parse_keep_alive(keep_alive),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=_number(body, "temperature", _SAMPLING.temperature),
                                top_k=top_k,
                                top_p=_number(body, "top_p", _SAMPLING.top_p), seed=seed,
                                min_p=_number(body, "min_p", _SAMPLING.min_p),
                                frequency_penalty=_number(body, "frequency_penalty", _SAMPLING.frequency_penalty),
                                presence_penalty=_number(body, "presence_penalty", _SAMPLING.presence_penalty),
                                repetition_penalty=_number(body, "repetition_penalty", _SAMPLING.repetition_penalty),
                                logit_bias=_logit_bias(body)),
        stop=_stop(body),
        constraint=_constraint(body),
        draft=None if draft is None else _text(draft, f"{EXTENSION}.draft"),
        policy=None if policy is None else PolicyName.parse(_text(policy, f"{EXTENSION}.policy"),
                                                              f"{EXTENSION}.policy"),
    )


def _model(body: dict) -> str | None:
    model = body.get("model")
    return None if model is None else _text(model, "model") or None


def _common(body: Any, known: set[str]) -> tuple[str | None, bool, bool, tuple[str, ...]]:
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_kind(body)}")
    _refuse_unsupported(body)
    model = _model(body)
    stream = _bool(body, "stream")
    options = _object(body, "stream_options")
    if options and not stream:
        raise _bad("stream_options", "applies only with \"stream\": true")
    include_usage = _bool(options, "include_usage")
    shared = {"model", "stream", "stream_options", "n", "best_of", "max_tokens", "max_completion_tokens",
              "temperature", "top_p", "top_k", "seed", "stop", "tools", "tool_choice", "function_call",
              "response_format", "grammar", "echo", "logprobs", "top_logprobs", "keep_alive", EXTENSION, *_REFUSED,
              *_CONTROLS, *HARMLESS}
    ignored = tuple(sorted(set(body) - shared - known))
    return model, stream, include_usage, ignored


def _content(value: Any, name: str) -> str:
    """A message's content: a string, or an array of text parts (joined), or null (empty)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(name, f"must be a string or an array of text parts, got {_kind(value)}")
    out = []
    for j, part in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise _bad(where, f"must be an object like {{\"type\": \"text\", \"text\": \"...\"}}, got {_kind(part)}")
        if part.get("type") != "text":
            raise _bad(f"{where}.type", f"{quote(str(part.get('type')), 32)} is not supported; only \"text\" parts")
        out.append(_text(part.get("text"), f"{where}.text"))
    return "".join(out)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def parse_chat(body: Any, max_tokens_limit: int) -> ApiRequest:
    """A /v1/chat/completions body as an ApiRequest (InvalidRequestError naming a bad field)."""
    model, stream, include_usage, ignored = _common(body, {"messages"})
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", f"must be an array of {{\"role\", \"content\"}} objects, got {_kind(messages)}")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"must be an object with role and content, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            shown = quote(role, 32) if isinstance(role, str) else _kind(role)
            raise _bad(f"messages[{i}].role", f"{shown} is not one of system, user, assistant, tool (or developer)")
        content = _content(m.get("content"), f"messages[{i}].content")
        if m.get("tool_calls") is not None:  # the calls an assistant made, written as the model writes them
            if role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", "only an assistant message makes tool calls")
            calls = _history_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            content = "\n".join([content] * bool(content) + calls)
        turns.append((ROLES[role], content))
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", f"{logprobs} is out of range; allowed 0..{MAX_TOP_LOGPROBS}")
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "needs \"logprobs\": true")
    tools, choice = _tools(body)
    req = GenerationRequest(messages=tuple(turns), logprobs=logprobs, tools=tools, tool_choice=choice,
                            **_sampling_and_options(body, max_tokens_limit))
    return seeded(ApiRequest("chat", model, req, stream, include_usage, logprobs, ignored,
                             bool(tools) and choice != "none", _choices(body)))


def _tools(body: dict) -> tuple[tuple[Tool, ...], str]:
    """tools and tool_choice: the functions, and "auto", "none", "required" or "function:<name>"."""
    value = body.get("tools")
    if value is None:
        value = []
    if not isinstance(value, list):
        raise _bad("tools", f"must be an array of {{\"type\": \"function\", \"function\": {{...}}}}, "
                            f"got {_kind(value)}")
    out = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise _bad(f"{where}.type", "only function tools are supported: {\"type\": \"function\", ...}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", f"must be an object with a name, got {_kind(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.function.name", "is required")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", f"must be an object (a JSON schema), got {_kind(params)}")
        description = fn.get("description") or ""
        out.append(Tool(name, _text(description, f"{where}.function.description"), json.dumps(params)))
    choice = body.get("tool_choice")
    if choice is None:
        return tuple(out), "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "must be \"auto\", \"none\", \"required\" or "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        return tuple(out), f"function:{name}"
    if choice not in TOOL_CHOICES:
        shown = quote(choice, 32) if isinstance(choice, str) else _kind(choice)
        raise _bad("tool_choice", f"{shown} is not one of {', '.join(TOOL_CHOICES)} or a function")
    return tuple(out), choice


def _history_calls(value: Any, where: str) -> list[str]:
    """An assistant's tool_calls in the history, each as the model writes a call."""
    if not isinstance(value, list):
        raise _bad(where, f"must be an array, got {_kind(value)}")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{j}].function.name", "is required")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise _bad(f"{where}[{j}].function.arguments", "is not JSON") from None
        if not isinstance(parsed, dict):
            raise _bad(f"{where}[{j}].function.arguments", "must be a JSON object")
        out.append(call_text(fn["name"], json.dumps(parsed)))
    return out


def parse_completion(body: Any, max_tokens_limit: int) -> ApiRequest:
    """A /v1/completions body as an ApiRequest: the prompt is raw text, no chat template."""
    model, stream, include_usage, ignored = _common(body, {"prompt"})
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _bad("prompt", "give one prompt as a string (an array of several, or of token ids, is not "
                                 "supported)")
        prompt = prompt[0]
    prompt = _text(prompt, "prompt")
    if body.get("tools") or body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tools", "tools apply to /v1/chat/completions")
    logprobs = _int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise _bad("logprobs", f"{logprobs} is out of range; allowed 0..{MAX_TOP_LOGPROBS}")
    req = GenerationRequest(prompt=prompt, raw=True, logprobs=logprobs,
                            **_sampling_and_options(body, max_tokens_limit))
    return seeded(ApiRequest("text", model, req, stream, include_usage, logprobs, ignored, n=_choices(body)))


# -- llama-server's /tokenize and /detokenize ----------------------------------------------------
@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None  # the target whose tokenizer; None: the daemon's default target
    content: str
    add_special: bool = False  # llama-server's: add the model's BOS.  Checked, and a no-op: memspec's
    #                            tokenizer refuses models that add one (memspec.models.tokenizer)


def parse_tokenize(body: Any, max_chars: int) -> TokenizeRequest:
    """POST /tokenize {"content": str, "add_special": bool?, "model": str?}."""
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_kind(body)}")
    content = _text(body.get("content"), "content")
    if len(content) > max_chars:
        raise _bad("content", f"{len(content)} characters; at most {max_chars}")
    return TokenizeRequest(_model(body), content, _bool(body, "add_special"))


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    """POST /detokenize {"tokens": [int], "model": str?} -> (model, ids); the vocabulary is checked
    against the tokenizer (detokenize)."""
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_kind(body)}")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise _bad("tokens", f"must be an array of token ids, got {_kind(tokens)}")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise _bad(f"tokens[{i}]", f"must be a token id (an integer), got {_kind(t)}")
    return _model(body), tokens


def tokenize(tok, req: TokenizeRequest) -> dict:
    """The content's ids, as a prompt's are encoded (special tokens written in it match whole)."""
    return {"tokens": tok.encode(req.content)}


def detokenize(tok, tokens: list[int]) -> dict:
    for i, t in enumerate(tokens):
        if not 0 <= t < tok.vocab_size:
            raise _bad(f"tokens[{i}]", f"token id {t} is outside the vocabulary (0..{tok.vocab_size - 1})")
    return {"content": tok.decode(tokens)}


# -- errors ------------------------------------------------------------------------------------
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")
_EXTENSION_FIELDS = ("draft", "policy")  # the request fields a client sends in the EXTENSION object


def error(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body for an exception (memspec.errors.STATUS)."""
    st = status_of(exc)
    message = str(exc) if st is not INTERNAL else f"internal error: {type(exc).__name__}: {exc}"
    m = _PARAM.match(message) if st.http in (400, 404, 413) else None
    param = m.group(1) if m and m.group(1) != "body" else None
    if param in _EXTENSION_FIELDS:  # checked past the wire (the engine, the scheduler), sent in "memspec"
        param, message = f"{EXTENSION}.{param}", f"{EXTENSION}.{message}"
    return st.http, {"error": {"message": message, "type": st.type, "param": param, "code": st.code}}



# -- responses ---------------------------------------------------------------------------------
def _piece(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def logprob_entries(logprobs) -> list[dict]:
    """memspec.request.TokenLogprob list -> the chat API's logprobs.content entries."""
    return [{"token": _piece(t.token), "logprob": t.logprob, "bytes": list(t.token),
             "top_logprobs": [{"token": _piece(b), "logprob": v, "bytes": list(b)} for _, b, v in t.top]}
            for t in logprobs]


def usage(completions: list) -> dict:
    """OpenAI's usage object over the choices' Completions: the prompt counted once, the choices'
    tokens added up; prompt_tokens_details.cached_tokens: prompt tokens taken from a stored prefix
    (memspec.runtime.prefixes) rather than computed, the fewest any choice took."""
    prompt = len(completions[0].prompt_token_ids)
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": min(c.timings.cached_prompt_tokens for c in completions)}}


def _stats(final) -> dict:
    c, st = final.completion, final.completion.stats
    return {
        "model": final.model, "variant": final.variant, "draft": st.draft,
        "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
        "num_accepted_tokens": st.num_accepted_tokens, "mean_acceptance_length": st.mean_acceptance_length,
        "ttft_ms": round(c.timings.ttft_ms, 3), "queue_ms": round(final.queued_s * 1e3, 3),
        "tok_per_s": round(c.timings.tok_per_s, 3),
        # tokens a schema or grammar forced, proposed without a draft (memspec.speculation.logits.forced)
        "forced_tokens": st.forced_tokens, "forced_accepted": st.forced_accepted,
        # the seed a sampled answer was drawn with (sent back as `seed`, it gives this answer again); null: greedy
        "seed": c.seed,
    }


def memspec_stats(finals: list) -> dict:
    """The `memspec` object of a response: who answered and what speculation did.  With several
    choices: the counts added up (mean_acceptance_length from the sums), the draft most choices ran
    with, the first first token (ttft_ms), the longest wait (queue_ms), the decode speeds added up
    (the choices decode at once), and each choice's own object under "choices"."""
    if len(finals) == 1:
        return _stats(finals[0])
    each = [_stats(f) for f in finals]
    drafts, accepted = sum(s["num_drafts"] for s in each), sum(s["num_accepted_tokens"] for s in each)
    names = [s["draft"] for s in each]
    return {
        "model": each[0]["model"], "variant": each[0]["variant"], "draft": max(names, key=names.count),
        "num_drafts": drafts, "num_draft_tokens": sum(s["num_draft_tokens"] for s in each),
        "num_accepted_tokens": accepted, "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "ttft_ms": min(s["ttft_ms"] for s in each), "queue_ms": max(s["queue_ms"] for s in each),
        "tok_per_s": round(sum(s["tok_per_s"] for s in each), 3),
        "forced_tokens": sum(s["forced_tokens"] for s in each),
        "forced_accepted": sum(s["forced_accepted"] for s in each), "seed": each[0]["seed"], "choices": each,
    }


def finish_reason(completion) -> str:
    return FINISH.get(completion.finish_reason, completion.finish_reason)


def _choice(api: ApiRequest, rid: str, index: int, final, text: str, logprobs: list | None) -> dict:
    c = final.completion
    if api.kind == "text":
        return {"index": index, "text": text,
                "logprobs": text_logprobs(logprobs) if logprobs is not None else None,
                "finish_reason": finish_reason(c)}
    message, finish = {"role": "assistant", "content": text}, finish_reason(c)
    content, calls = parse_calls(text, api.tool_names) if api.tools else (text, [])
    if calls:
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": [tool_call(rid, i, call, index) for i, call in enumerate(calls)]}
        finish = TOOL_CALLS
    return {"index": index, "message": message,
            "logprobs": {"content": logprobs} if logprobs is not None else None, "finish_reason": finish}


def response(api: ApiRequest, rid: str, created: int, finals: list, texts: list[str],
             logprobs: list[list | None]) -> dict:
    """The whole (non-streamed) answer: choice i from finals[i], texts[i] and logprobs[i]."""
    choices = [_choice(api, rid, i, f, t, lp) for i, (f, t, lp) in enumerate(zip(finals, texts, logprobs))]
    return {"id": rid, "object": "chat.completion" if api.kind == "chat" else "text_completion", "created": created,
            "model": finals[0].model, "choices": choices, "usage": usage([f.completion for f in finals]),
            EXTENSION: memspec_stats(finals)}


def chunk(api: ApiRequest, rid: str, created: int, model: str, text: str | None, logprobs: list | None = None,
          finish: str | None = None, role: bool = False, index: int = 0) -> dict:
    """One streamed chunk of choice `index`: a piece of text (or the role, first; or the finish
    reason, last)."""
    if api.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": index, "delta": delta,
                  "logprobs": {"content": logprobs} if logprobs is not None else None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": text_logprobs(logprobs) if logprobs else None,
                  "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def tool_call(rid: str, index: int, call: ToolCall, choice: int = 0) -> dict:
    """One entry of a message's tool_calls; its id is the answer's id, the choice's (past the first)
    and the call's index."""
    tail = f"{index}" if choice == 0 else f"{choice}_{index}"
    return {"id": f"call_{rid.rpartition('-')[2][:20]}_{tail}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_chunks(api: ApiRequest, rid: str, created: int, model: str, index: int, call: ToolCall,
                     choice: int = 0) -> list[dict]:
    """A streamed call of choice `choice`, as OpenAI streams one: its id and name first, then its arguments."""
    whole = tool_call(rid, index, call, choice)
    head = {"index": index, "id": whole["id"], "type": "function", "function": {"name": call.name, "arguments": ""}}
    tail = {"index": index, "function": {"arguments": call.arguments}}
    return [{"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": choice, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}]}
            for d in (head, tail)]


def usage_chunk(api: ApiRequest, rid: str, created: int, finals: list) -> dict:
    """stream_options.include_usage: the last chunk, with no choices, once every choice has finished."""
    obj = "chat.completion.chunk" if api.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": finals[0].model, "choices": [],
            "usage": usage([f.completion for f in finals]), EXTENSION: memspec_stats(finals)}


def text_logprobs(entries: list) -> dict:
    """Chat-style logprob entries in the legacy completions shape."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": []}


def models(rows: list[dict], created: int) -> dict:
    """GET /v1/models: every pulled target, loaded ones first (any of them answers: one that is not
    loaded is loaded on demand); drafts are loaded with their target."""
    targets = sorted((r for r in rows if r["role"] == "target"), key=lambda r: not r["resident"])
    return {"object": "list", "data": [model(r, created) for r in targets]}


def model(row: dict, created: int) -> dict:
    return {"id": row["name"], "object": "model", "created": created, "owned_by": "memspec",
            "loaded": row["resident"],  # an extra field, as OpenAI-compatible servers add them
            EXTENSION: {"resident": row["resident"], "variant": row["resident_variant"],
                        "variants": sorted(row["variants"]),
                        # tokens of prompt + answer while loaded (0: not loaded), and what it was trained for
                        "max_context": row.get("context", 0), "trained_context": row.get("trained_context", 0),
                        "kv": row.get("kv", "")}}  # its KV cache's format while loaded; "" = not loaded
