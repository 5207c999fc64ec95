"""What a client asks for, checked at the boundary, and what comes back."""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field

from memspec.errors import ContextOverflowError, InvalidRequestError

ROLES = ("system", "user", "assistant", "tool")  # "tool": a tool's result (memspec.models.tools)
FINISH_REASONS = ("stop", "length", "eos", "cancelled")
NO_DRAFT = "none"  # the draft a request names for target-only decoding
POLICY_KINDS = ("target-only", "fixed", "bandit", "memspec", "oracle")
MAX_TOP_LOGPROBS = 20  # most alternatives a request may ask for at each position (OpenAI's limit)
MAX_LOGIT_BIAS = 1024  # most token ids one request may bias
MAX_REPETITION_PENALTY = 100.0  # a larger one only flattens the same tokens further
POLICY_FORMS = ("target-only", "fixed:<draft>", "bandit", "memspec", "oracle")  # what a policy may be written as


@dataclass(frozen=True)
class Limits:
    """Bounds every request is checked against (from the config)."""

    max_tokens: int = 0  # most new tokens one request may ask for or get; 0 = as many as the context holds
    max_prompt_chars: int = 65536  # longest prompt text accepted
    max_stop: int = 8  # most stop strings
    max_stop_chars: int = 64  # longest stop string
    max_name_chars: int = 128  # longest draft or policy name
    max_messages: int = 256  # most chat messages in one request
    max_chat_chars: int = 262144  # most characters in all of a request's chat messages together

    def request_bytes(self) -> int:
        """The largest request these limits let through, as protobuf bytes (UTF-8 is at most
        4 bytes a character): what the server's max_receive_message_length is set to."""
        text = max(self.max_prompt_chars, self.max_chat_chars + self.max_messages * 16)  # 16: a role
        text += self.max_prompt_chars  # a schema or grammar (Constraint) is held to a prompt's length
        return 4 * (text + self.max_stop * self.max_stop_chars + 2 * self.max_name_chars) + 64 * 1024


FRESH_SEED_BITS = 53  # a seed drawn for a request without one is below 2^53: exact as a double (JSON, JS)


def fresh_seed() -> int:
    """A seed for a sampled request that names none (reported back, so that its answer replays)."""
    return secrets.randbits(FRESH_SEED_BITS)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; otherwise in (0, 2]
    top_k: int = 0  # 0 = off; otherwise keep the k most likely tokens
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # a sampled answer's randomness (0..2^64-1); None: the engine draws one and reports it
    min_p: float = 0.0  # in [0, 1]; after temperature, drop tokens below min_p x the top probability
    # the logits controls (memspec.speculation.logits applies them at every position, drafts included):
    frequency_penalty: float = 0.0  # [-2, 2]; logit -= this x times the token was generated
    presence_penalty: float = 0.0  # [-2, 2]; logit -= this once the token was generated
    repetition_penalty: float = 1.0  # > 0 (1 = off); prompt and generated tokens: logit / it if > 0, else x it
    logit_bias: tuple[tuple[int, float], ...] = ()  # ((token id, bias in [-100, 100]), ...) added to the logits

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PolicyName:
    """A draft-selection policy, parsed once from its text form at the boundary (a request,
    the config, a command line): "target-only", "fixed:<draft>", "bandit", "memspec", "oracle"."""

    kind: str  # one of POLICY_KINDS
    draft: str | None = None  # the one draft of a "fixed" policy; None for the others

    @classmethod
    def parse(cls, text: str, field: str = "policy") -> "PolicyName":
        kind, colon, draft = text.partition(":")
        if kind == "fixed" and draft:
            return cls(kind, draft)
        if not colon and kind in POLICY_KINDS and kind != "fixed":
            return cls(kind)
        raise unknown_policy(text, POLICY_FORMS, field)

    @classmethod
    def of_draft(cls, draft: str) -> "PolicyName":
        """The policy of a request that names its draft: that draft, or target-only for "none"."""
        return cls("target-only") if draft == NO_DRAFT else cls("fixed", draft)

    def __str__(self) -> str:
        return f"fixed:{self.draft}" if self.kind == "fixed" else self.kind


CONSTRAINT_KINDS = ("json_schema", "json_object", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What the answer must match (memspec.speculation.grammar compiles and enforces it)."""

    kind: str  # one of CONSTRAINT_KINDS: "json_schema": text is a JSON schema; "json_object": any
    #            JSON object (text unused); "grammar": text is a Lark or GBNF (llama.cpp) grammar
    text: str = ""
    field: str = "response_format"  # the request field it came from, which its errors name


TOOL_CHOICES = ("auto", "none", "required")  # or "function:<name>": that tool must be called
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class Tool:
    """A function the model may call (OpenAI's tools[i].function)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'  # its arguments' JSON schema, as JSON text


def quote(text: str, limit: int = 64) -> str:
    """A client's string as an error or a log line shows it: repr'd, and no more than `limit`
    characters of it, so that a huge field cannot flood the log or overflow gRPC's metadata."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def unknown_policy(text: str, known, field: str = "policy") -> InvalidRequestError:
    """The one message for a policy nobody can run here; `known`: what may be asked for instead."""
    return _bad(field, f"unknown policy {quote(text)}; known: {', '.join(known)}")


def unknown_draft(name: str, available, field: str = "draft") -> InvalidRequestError:
    """The one message for a draft that is not there; `available`: the drafts that are."""
    return _bad(field, f"unknown draft {quote(name)}; available: {', '.join([NO_DRAFT, *sorted(available)])}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None  # raw text, or the user turn when chat is applied
    messages: tuple[tuple[str, str], ...] | None = None  # ((role, content), ...) chat turns
    raw: bool = False  # send `prompt` as is, without the chat template
    max_tokens: int | None = None  # most new tokens; None: until the end of sequence or of the context,
    #                                 bounded by [limits] max_tokens (new_tokens)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # generation ends before any of these strings
    draft: str | None = None  # force one draft (NO_DRAFT = target only)
    policy: PolicyName | None = None  # draft-selection policy override (None: the configured one)
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives
    model: str | None = None  # the target to answer (a store name); None: the daemon's default target
    keep_alive: float | None = None  # seconds its target stays loaded once idle; 0: unload now; None: default
    constraint: Constraint | None = None  # the answer must match this schema or grammar; None: free text
    tools: tuple[Tool, ...] = ()  # functions the model may call (listed in the prompt; memspec.models.tools)
    tool_choice: str = "auto"  # one of TOOL_CHOICES, or "function:<name>" (a call of that tool is forced)

    @property
    def forced_tool(self) -> str | None:
        """The tool a forced call must name: "" for any ("required"), None when no call is forced."""
        if self.tool_choice == "required":
            return ""
        return self.tool_choice.partition(":")[2] if self.tool_choice.startswith("function:") else None


KEEP_FOREVER = math.inf  # keep_alive of a target that is never unloaded for being idle
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: object, field_name: str = "keep_alive") -> float:
    """Ollama's keep_alive as seconds: a number of seconds, or a Go duration string ("5m", "1h30m",
    "90s", "-1m"); a bare number as a string counts as seconds.  0: unload after the answer;
    negative: KEEP_FOREVER.  InvalidRequestError naming the field for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(field_name, f"must be a duration like \"5m\" or a number of seconds, got {type(value).__name__}")
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise _bad(field_name, f"{quote(value, 32)} is not a duration; use e.g. \"5m\", \"1h30m\", "
                                       f"\"90s\", 0 (unload after the answer) or -1 (keep loaded)") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise _bad(field_name, "is not a number")
    return KEEP_FOREVER if seconds < 0 else seconds


def format_keep_alive(seconds: float) -> str:
    """keep_alive as the wire carries it: seconds as text, "-1" for KEEP_FOREVER."""
    return "-1" if seconds == KEEP_FOREVER else f"{seconds:g}"


def _bad(field_name: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field_name}: {msg}")


def validate(req: GenerationRequest, limits: Limits = Limits()) -> None:
    """Raise InvalidRequestError naming the first bad field and its allowed range."""
    if (req.prompt is None) == (req.messages is None):
        raise _bad("prompt", "give exactly one of prompt or messages")
    if req.prompt is not None:
        _check_text("prompt", req.prompt, limits)
    else:
        if not req.messages:
            raise _bad("messages", "must hold at least one message")
        if len(req.messages) > limits.max_messages:
            raise _bad("messages", f"{len(req.messages)} messages; at most {limits.max_messages}")
        total = sum(len(c) for _, c in req.messages if isinstance(c, str))
        if total > limits.max_chat_chars:
            raise _bad("messages", f"{total} characters in all; at most {limits.max_chat_chars}")
        for i, (role, content) in enumerate(req.messages):
            if role not in ROLES:
                raise _bad(f"messages[{i}].role", f"{quote(role)} is not one of {', '.join(ROLES)}")
            _check_text(f"messages[{i}].content", content, limits, allow_empty=role != "user")
        if req.raw:
            raise _bad("raw", "raw applies to a prompt, not to chat messages")
    for name, value in (("draft", req.draft), ("policy", req.policy and req.policy.draft), ("model", req.model)):
        if value and len(value) > limits.max_name_chars:
            raise _bad(name, f"a name of {len(value)} characters; at most {limits.max_name_chars}")
    c = req.constraint
    if c is not None:
        if c.kind not in CONSTRAINT_KINDS:
            raise _bad(c.field, f"{quote(c.kind, 32)} is not one of {', '.join(CONSTRAINT_KINDS)}")
        if c.kind != "json_object" and not c.text.strip():
            raise _bad(c.field, "is empty")
        if len(c.text) > limits.max_prompt_chars:
            raise _bad(c.field, f"{len(c.text)} characters; at most {limits.max_prompt_chars}")
    _check_tools(req, limits)
    if req.max_tokens is not None and not 1 <= req.max_tokens <= (limits.max_tokens or req.max_tokens):
        raise _bad("max_tokens", f"{req.max_tokens} is out of range; allowed 1..{limits.max_tokens or 'the context'}")
    s = req.sampling
    if not (s.temperature == 0.0 or 0.0 < s.temperature <= 2.0) or s.temperature != s.temperature:
        raise _bad("temperature", f"{s.temperature} is out of range; allowed 0 (greedy) or (0, 2]")
    if not 0 <= s.top_k <= 1_000_000:
        raise _bad("top_k", f"{s.top_k} is out of range; allowed 0 (off) or a positive count")
    if not 0.0 < s.top_p <= 1.0:
        raise _bad("top_p", f"{s.top_p} is out of range; allowed (0, 1]")
    if s.seed is not None and not 0 <= s.seed < 2**64:
        raise _bad("seed", f"{s.seed} is out of range; allowed 0..2^64-1")
    if not 0.0 <= s.min_p <= 1.0:
        raise _bad("min_p", f"{s.min_p} is out of range; allowed [0, 1]")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(s, name)
        if not -2.0 <= value <= 2.0:
            raise _bad(name, f"{value} is out of range; allowed [-2, 2]")
    if not 0.0 < s.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise _bad("repetition_penalty", f"{s.repetition_penalty} is out of range; allowed (0, "
                                         f"{MAX_REPETITION_PENALTY:g}] (1 = off)")
    check_logit_bias(s.logit_bias)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise _bad("top_logprobs", f"{req.logprobs} is out of range; allowed 0..{MAX_TOP_LOGPROBS}")
    if len(req.stop) > limits.max_stop:
        raise _bad("stop", f"{len(req.stop)} stop strings; at most {limits.max_stop}")
    for i, st in enumerate(req.stop):
        if not st or len(st) > limits.max_stop_chars:
            raise _bad(f"stop[{i}]", f"length {len(st)}; allowed 1..{limits.max_stop_chars} characters")


def new_tokens(asked: int | None, prompt_tokens: int, context: int, limit: int = 0) -> int:
    """The most new tokens a request gets, the one rule of every route (OpenAI's, Ollama's, gRPC, the
    CLI): `asked` (its max_tokens, Ollama's num_predict), or None for "until the end of sequence or
    of the context", as OpenAI's API, llama-server and Ollama do, bounded by `limit` ([limits]
    max_tokens; 0: none but the context).  ContextOverflowError (HTTP 400, gRPC INVALID_ARGUMENT),
    naming both figures and the context, where the prompt leaves no room or prompt + asked does not fit."""
    room = context - prompt_tokens
    if room < 1:
        raise ContextOverflowError(f"prompt: {prompt_tokens} tokens do not fit the context of {context} tokens "
                                   f"(at least one token must be left to generate)")
    if asked is None:
        return min(room, limit) if limit > 0 else room
    if asked > room:
        raise ContextOverflowError(f"max_tokens: the prompt's {prompt_tokens} tokens + max_tokens {asked} = "
                                   f"{prompt_tokens + asked} tokens do not fit the context of {context} tokens; "
                                   f"ask for at most {room} new tokens, or leave max_tokens out to generate to "
                                   f"the end of the context")
    return asked


def _check_tools(req: GenerationRequest, limits: Limits) -> None:
    """Tool names (OpenAI's rule, no two alike) and tool_choice; each schema is compiled by the engine."""
    names = set()
    for i, t in enumerate(req.tools):
        if not isinstance(t.name, str) or not _TOOL_NAME.fullmatch(t.name):
            raise _bad(f"tools[{i}].function.name", f"{quote(str(t.name), 32)} is not a name of 1..64 letters, "
                                                    f"digits, '_' or '-'")
        if t.name in names:
            raise _bad(f"tools[{i}].function.name", f"{quote(t.name)} is given twice")
        names.add(t.name)
    if sum(len(t.description) + len(t.parameters) for t in req.tools) > limits.max_chat_chars:
        raise _bad("tools", f"more than {limits.max_chat_chars} characters of descriptions and schemas")
    choice, forced = req.tool_choice, req.forced_tool
    if choice not in TOOL_CHOICES and not forced:
        raise _bad("tool_choice", f"{quote(choice, 32)} is not one of {', '.join(TOOL_CHOICES)} or a function")
    if req.tools and req.raw:
        raise _bad("tools", "tools are listed in the chat template; a raw prompt has none")
    if forced is not None:
        if not req.tools:
            raise _bad("tool_choice", f"{quote(choice, 32)} needs tools to call")
        if forced and forced not in names:
            raise _bad("tool_choice.function.name", f"{quote(forced, 32)} is not one of the tools "
                                                    f"({', '.join(sorted(names))})")
        if req.constraint is not None:
            raise _bad("tool_choice", f"a forced call has its own shape; it cannot be combined with "
                                      f"{req.constraint.field}")


def check_logit_bias(bias: tuple[tuple[int, float], ...], vocab: int | None = None) -> None:
    """logit_bias: at most MAX_LOGIT_BIAS distinct token ids (in 0..vocab-1 where vocab is known),
    each with a bias in [-100, 100]."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"{len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    seen = set()
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _bad("logit_bias", f"key {quote(str(token), 32)} is not a token id (a non-negative integer)")
        if vocab is not None and token >= vocab:
            raise _bad("logit_bias", f"token id {token} is outside the vocabulary (0..{vocab - 1})")
        if token in seen:
            raise _bad("logit_bias", f"token id {token} is given twice")
        seen.add(token)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            raise _bad("logit_bias", f"bias {value!r} of token {token} is out of range; allowed [-100, 100]")


def _check_text(name: str, text: str, limits: Limits, allow_empty: bool = False) -> None:
    if not isinstance(text, str):
        raise _bad(name, f"must be text, got {type(text).__name__}")
    if not text.strip() and not allow_empty:
        raise _bad(name, "is empty")
    if len(text) > limits.max_prompt_chars:
        raise _bad(name, f"{len(text)} characters; at most {limits.max_prompt_chars}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(name, f"is not valid UTF-8 ({exc.reason} at {exc.start})") from None


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target (raw logits: before temperature,
    top-k, top-p, min_p, penalties and logit_bias), and the most likely tokens at its position."""

    token_id: int
    token: bytes  # its bytes (part of a UTF-8 character for a byte token)
    logprob: float
    top: tuple[tuple[int, bytes, float], ...]  # (id, bytes, logprob), most likely first


@dataclass
class Chunk:
    """One streamed piece of output."""

    text: str  # new text (may be empty while bytes of a character are pending)
    token_ids: list[int]  # tokens committed in this step
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked


@dataclass(frozen=True)
class Timings:
    """How long a generation took. Built by the engine; dicts only at the JSON and proto edges."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, taken from a stored prefix rather than computed
    completion_tokens: int = 0
    ttft_ms: float = 0.0  # request start to the first token (the prefill)
    prefill_tok_per_s: float = 0.0
    decode_ms: float = 0.0  # first token to the last
    total_ms: float = 0.0
    tok_per_s: float = 0.0  # decode speed: the first token comes from the prefill, the rest from decode steps

    def to_dict(self) -> dict[str, float]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> "Timings":
        """From the wire: unknown keys (a newer daemon's) are ignored, missing ones default."""
        return from_plain(cls, d)


@dataclass(frozen=True)
class SpecStats:
    """What speculation did for one request (counted by memspec.speculation.metrics.SpecMetrics)."""

    num_drafts: int = 0  # verification steps that had at least one draft token
    num_draft_tokens: int = 0  # tokens proposed by drafts
    num_accepted_tokens: int = 0  # draft tokens the target accepted
    mean_acceptance_length: float = 1.0  # tokens committed per verification step: 1 + accepted / drafts
    acceptance_rate: float = 0.0  # accepted / proposed
    acceptance_by_position: tuple[float, ...] = ()  # [i] = share of drafts whose token i was accepted
    wasted_draft_tokens: int = 0  # proposed and rejected
    draft_ms: float = 0.0  # time spent drafting (including draft catch-up)
    verify_ms: float = 0.0  # time spent in target forwards (prefill excluded)
    itl_p50_ms: float = 0.0  # inter-token latency, median
    itl_p99_ms: float = 0.0
    itl_cv: float = 0.0  # its coefficient of variation
    drafts_used: Mapping[str, int] = field(default_factory=dict)  # draft name -> steps it proposed tokens in
    draft_failures: int = 0  # drafts that raised and were given up (the request went on target-only)
    tree_steps: int = 0  # steps verified as a token tree (memspec.speculation.tree)
    tree_rows: int = 0  # rows those passes added to their chains (the branches' tokens)
    tree_tokens: int = 0  # tokens committed through a branch, beyond what the chain alone would have
    forced_steps: int = 0  # steps that verified the tokens a grammar forced (no draft ran; not in num_drafts)
    forced_tokens: int = 0  # tokens those steps proposed (memspec.speculation.logits.forced)
    forced_accepted: int = 0  # ... and the target accepted

    @property
    def draft(self) -> str:
        """The draft the request ran with: the one that proposed in most steps ("" = target only).
        The one place this is decided: the CLI, HTTP, gRPC and the daemon's counters all ask here."""
        used = self.drafts_used
        return max(used, key=used.get) if used else ""

    def to_dict(self) -> dict:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "SpecStats":
        """From the wire: unknown keys (a newer daemon's) are ignored, missing ones default."""
        return from_plain(cls, d)


def to_plain(obj) -> dict:
    """A frozen result as plain Python: nested results as dicts, tuples as lists, maps as dicts (what
    JSON and a protobuf message take)."""
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(value):
    if dataclasses.is_dataclass(value):
        return to_plain(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


def from_plain(cls, d: Mapping):
    """A frozen result `cls` from plain Python (JSON, or a protobuf message as dicts, where every
    number may be a double): each field given its declared type again; fields missing take their
    defaults, unknown ones (a newer daemon's) are ignored."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _typed(hints[f.name], d[f.name]) for f in dataclasses.fields(cls) if f.name in d})


def _typed(kind, value):
    if dataclasses.is_dataclass(kind):
        return from_plain(kind, value)
    origin = typing.get_origin(kind)
    if origin is tuple:
        return tuple(_typed(typing.get_args(kind)[0], v) for v in value)
    if origin is Mapping:
        item = typing.get_args(kind)[1]
        return {str(k): item(v) for k, v in dict(value).items()}
    return kind(value)


@dataclass
class Completion:
    """The end of a generation: the whole result and its stats."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str
    finish_reason: str  # one of FINISH_REASONS
    timings: Timings = field(default_factory=Timings)
    stats: SpecStats = field(default_factory=SpecStats)  # what speculation did
    seed: int | None = None  # the seed a sampled answer was drawn with (the request's, or one drawn for it:
    #                          sent back as the request's seed, it gives this answer again); None: greedy
