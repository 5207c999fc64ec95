"""What crosses the wire: proto messages <-> memspec objects, and errors <-> status codes.

Shared by the server and the client, so both directions live side by side.
Importing this module loads (and in a checkout regenerates) the gRPC code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from memspec import errors
from memspec.serving import proto
from memspec.errors import (
    CancelledError, DeadlineExceededError, InvalidRequestError, MemspecError, ModelNotFoundError, NotLoadedError,
    OverloadedError, RemoteError, UnavailableError,
)
from memspec.request import (Chunk, Completion, Constraint, GenerationRequest, PolicyName, SamplingParams, SpecStats,
                             Timings, Tool, format_keep_alive, parse_keep_alive)

pb2, pb2_grpc = proto.load()

SERVICE = pb2.DESCRIPTOR.services_by_name["MemSpec"].full_name  # "memspec.v1.MemSpec"
ERROR_KEY = "memspec-error"  # trailing metadata: the memspec exception's class name
_REQ = GenerationRequest()
_TOOL = Tool("")
_SAMPLING = SamplingParams()

# -- errors <-> status codes: memspec.errors.STATUS, the one table -----------------------
CODES: dict[type, grpc.StatusCode] = {cls: grpc.StatusCode[st.grpc] for cls, st in errors.STATUS.items()}
# A code with no memspec-error metadata (e.g. from grpc itself) comes back as:
ERRORS: dict[grpc.StatusCode, type] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: NotLoadedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthError,
}
NAMED = {name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, MemspecError)}


def code_for(exc: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode[errors.status_of(exc).grpc]


def error_from_rpc(err: grpc.RpcError, where: str = "") -> MemspecError:
    """The memspec exception an RpcError stands for (the server names it in trailing metadata)."""
    code, details = err.code(), err.details() or ""
    named = dict(err.trailing_metadata() or ()).get(ERROR_KEY)
    cls = NAMED.get(named) or ERRORS.get(code, RemoteError)
    if cls is UnavailableError and named is None:
        return UnavailableError(f"no memspec daemon answers at {where or 'the address'} ({_why(details)}); start one "
                                f"with `memspec serve` (or `systemctl start memspec`), or generate without one: "
                                f"`memspec generate --local PROMPT`")
    if cls is RemoteError:
        return RemoteError(f"the daemon failed: {code.name}: {details}")
    return cls(details)


def _why(details: str) -> str:
    """Why a connection failed, in words, from gRPC's details ("failed to connect to all addresses;
    last error: FAILED_PRECONDITION: unix:/run/...: connect failed: ... No such file or directory")."""
    for needle, words in (("No such file or directory", "no socket there"),
                          ("Connection refused", "nothing listens there"),
                          ("Permission denied", "permission denied: join the daemon's group (usermod -aG memspec USER)")):
        if needle in details:
            return words
    return details


# -- bytes that are not a request -----------------------------------------------------
class Unparsable:
    """What the lenient deserializer hands the servicer for bytes that are not a valid request."""

    def __init__(self, reason: str):
        self.reason = reason  # "field: what is wrong", for INVALID_ARGUMENT


def lenient(cls: type[Message]):
    """A request deserializer that never fails.  grpc answers INTERNAL when a
    deserializer raises (protobuf rejects strings that are not UTF-8 at parse
    time); this one returns Unparsable instead, naming the field, so the
    servicer answers INVALID_ARGUMENT."""

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            bad = bad_utf8_field(data, cls.DESCRIPTOR)
            if bad:
                return Unparsable(f"{bad}: is not valid UTF-8")
            return Unparsable(f"request: not a valid {cls.DESCRIPTOR.full_name} ({exc})")

    return parse


def _repeated(f: FieldDescriptor) -> bool:
    # protobuf >= 5.28 has is_repeated; older releases only `label` (removed in 7)
    rep = getattr(f, "is_repeated", None)
    return rep if rep is not None else f.label == FieldDescriptor.LABEL_REPEATED


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def bad_utf8_field(data: bytes, desc: Descriptor, prefix: str = "") -> str | None:
    """Path ("messages[1].content") of the first string field whose bytes are not UTF-8, else None."""
    seen: dict[int, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, i = _varint(data, i)
            elif wire_type in (1, 5):
                i += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                n, i = _varint(data, i)
                value, i = data[i:i + n], i + n
                f = desc.fields_by_number.get(number)
                if f is None:
                    continue
                name = prefix + f.name
                if _repeated(f):
                    name += f"[{seen.get(number, 0)}]"
                    seen[number] = seen.get(number, 0) + 1
                if f.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif f.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = bad_utf8_field(value, f.message_type, name + ".")
                    if inner:
                        return inner
            else:
                return None
    except ValueError:
        return None
    return None


# -- Generate ---------------------------------------------------------------------------
def _opt(msg: Message, name: str, default):
    return getattr(msg, name) if msg.HasField(name) else default


def request_from_pb(m, max_tokens_limit: int | None = None) -> GenerationRequest:
    """A GenerateRequest as the engine's GenerationRequest (unset fields take the defaults; an unset
    max_tokens is None: until the end of sequence or of the context, within the server's limit,
    memspec.request.new_tokens).  max_tokens_limit: unused, kept for callers."""
    return GenerationRequest(
        prompt=_opt(m, "prompt", None),
        messages=tuple((x.role, x.content) for x in m.messages) or None,
        raw=m.raw,
        max_tokens=_opt(m, "max_tokens", None),
        sampling=SamplingParams(
            temperature=_opt(m, "temperature", _SAMPLING.temperature),
            top_k=_opt(m, "top_k", _SAMPLING.top_k),
            top_p=_opt(m, "top_p", _SAMPLING.top_p),
            seed=_opt(m, "seed", None),
            min_p=_opt(m, "min_p", _SAMPLING.min_p),
            frequency_penalty=_opt(m, "frequency_penalty", _SAMPLING.frequency_penalty),
            presence_penalty=_opt(m, "presence_penalty", _SAMPLING.presence_penalty),
            repetition_penalty=_opt(m, "repetition_penalty", _SAMPLING.repetition_penalty),
            logit_bias=tuple(sorted(m.logit_bias.items())),
        ),
        stop=tuple(m.stop),
        draft=_opt(m, "draft", None),
        policy=PolicyName.parse(m.policy) if m.HasField("policy") else None,
        model=_opt(m, "model", None) or None,
        keep_alive=parse_keep_alive(m.keep_alive) if m.HasField("keep_alive") else None,
        constraint=constraint_from_pb(m),
        tools=tuple(Tool(t.name, t.description, t.parameters or _TOOL.parameters) for t in m.tools),
        tool_choice=_opt(m, "tool_choice", _REQ.tool_choice),
    )


def constraint_from_pb(m) -> Constraint | None:
    """The request's json_schema, json_object or grammar (at most one of them) as a Constraint."""
    given = [Constraint(name, getattr(m, name), field=name) for name in ("json_schema", "grammar") if m.HasField(name)]
    if m.json_object:
        given.append(Constraint("json_object", field="json_object"))
    if len(given) > 1:
        raise InvalidRequestError(f"{given[1].field}: give at most one of json_schema, json_object and grammar")
    return given[0] if given else None


def _text_fields(req: GenerationRequest) -> Iterable[tuple[str, object]]:
    yield "prompt", req.prompt
    for i, (role, content) in enumerate(req.messages or ()):
        yield f"messages[{i}].role", role
        yield f"messages[{i}].content", content
    for i, s in enumerate(req.stop):
        yield f"stop[{i}]", s
    yield "draft", req.draft
    yield "model", req.model
    yield "policy", str(req.policy) if req.policy is not None else None
    if req.constraint is not None:
        yield req.constraint.field, req.constraint.text
    for i, t in enumerate(req.tools):
        yield f"tools[{i}].name", t.name
        yield f"tools[{i}].description", t.description
        yield f"tools[{i}].parameters", t.parameters
    yield "tool_choice", req.tool_choice


def request_to_pb(req: GenerationRequest, default_max_tokens: bool = False):
    """The GenerateRequest for a GenerationRequest; InvalidRequestError for text protobuf cannot carry.

    default_max_tokens: leave max_tokens unset, for the daemon's default.
    """
    for name, value in _text_fields(req):
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name}: must be text, got {type(value).__name__}")
        try:
            value is not None and value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(f"{name}: is not valid UTF-8 ({exc.reason} at {exc.start})") from None
    s = req.sampling
    m = pb2.GenerateRequest(
        messages=[pb2.ChatMessage(role=r, content=c) for r, c in req.messages or ()], raw=req.raw,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop=list(req.stop),
    )
    for name in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if getattr(s, name) != getattr(_SAMPLING, name):  # unset: an older daemon sees no field it lacks
            setattr(m, name, getattr(s, name))
    _logit_bias_to_pb(s.logit_bias, m)
    policy = str(req.policy) if req.policy is not None else None
    keep_alive = format_keep_alive(req.keep_alive) if req.keep_alive is not None else None
    for name, value in (("prompt", req.prompt), ("seed", s.seed), ("draft", req.draft), ("policy", policy),
                        ("model", req.model), ("keep_alive", keep_alive)):
        if value is not None:
            setattr(m, name, value)
    m.tools.extend(pb2.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in req.tools)
    if req.tool_choice != _REQ.tool_choice:
        m.tool_choice = req.tool_choice
    c = req.constraint
    if c is not None:  # the wire names the kind by its field
        if c.kind == "json_object":
            m.json_object = True
        else:
            setattr(m, c.kind, c.text)
    if req.max_tokens is not None and not default_max_tokens:  # unset: to the end of sequence or context
        m.max_tokens = req.max_tokens
    return m


def _logit_bias_to_pb(bias: tuple[tuple[int, float], ...], m) -> None:
    """logit_bias into the message's map: a duplicate id or one no int64 holds is refused here,
    naming the field, rather than lost or crashing protobuf."""
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or not -2**63 <= token < 2**63:
            raise InvalidRequestError(f"logit_bias: key {token!r} is not a token id (a non-negative integer)")
        if token in m.logit_bias:
            raise InvalidRequestError(f"logit_bias: token id {token} is given twice")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(f"logit_bias: the bias of token {token} must be a number, "
                                      f"got {type(value).__name__}")
        m.logit_bias[token] = value


def chunk_to_pb(chunk: Chunk):
    return pb2.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids)


def _plain(value):
    """JSON-able copy of the engine's stats (numpy scalars become floats)."""
    return json.loads(json.dumps(value, default=float))


def final_to_pb(c: Completion, model: str, variant: str, queue_s: float):
    """The last GenerateResponse of a stream: finish_reason and the request's stats."""
    t, st = c.timings, c.stats
    stats = pb2.RequestStats(
        prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens,
        ttft_ms=t.ttft_ms, tok_per_s=t.tok_per_s, total_ms=t.total_ms,
        queue_ms=queue_s * 1e3, draft=st.draft,
        num_drafts=st.num_drafts, num_draft_tokens=st.num_draft_tokens, num_accepted_tokens=st.num_accepted_tokens,
        acceptance_rate=st.acceptance_rate, mean_acceptance_length=st.mean_acceptance_length,
        timings={k: float(v) for k, v in t.to_dict().items()},
    )
    stats.engine_stats.update(_plain(st.to_dict()))
    return pb2.GenerateResponse(
        finish_reason=c.finish_reason, stats=stats, prompt_token_ids=c.prompt_token_ids,
        completion_token_ids=c.token_ids, model=model, variant=variant, seed=c.seed,
    )


def _ints(value):
    """Struct numbers are doubles: give whole numbers back their int type."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


@dataclass
class RemoteCompletion(Completion):
    """A Completion from the daemon, with who answered and how long it queued."""

    model: str = ""  # target that answered
    variant: str = ""  # its variant
    queue_ms: float = 0.0  # time spent waiting for admission


def completion_from_pb(final, text: str) -> RemoteCompletion:
    """The Completion a stream ends with, as Engine.stream gives it locally."""
    return RemoteCompletion(
        prompt_token_ids=list(final.prompt_token_ids), token_ids=list(final.completion_token_ids), text=text,
        finish_reason=final.finish_reason, timings=Timings.from_dict(final.stats.timings),
        stats=SpecStats.from_dict(json_format.MessageToDict(final.stats.engine_stats)),
        model=final.model, variant=final.variant, queue_ms=final.stats.queue_ms,
        seed=final.seed if final.HasField("seed") else None,
    )


# -- other messages <-> dicts --------------------------------------------------------------
def to_dict(msg: Message) -> dict:
    """Every field of a message as plain Python (ints stay ints, unlike json_format)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.full_name == "google.protobuf.Struct":
            out[f.name] = _ints(json_format.MessageToDict(value))
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            out[f.name] = {k: to_dict(v) if vf.message_type else v for k, v in value.items()}
        elif _repeated(f):
            out[f.name] = [to_dict(v) if f.message_type else v for v in value]
        elif f.message_type is not None:
            out[f.name] = to_dict(value)
        else:
            out[f.name] = value
    return out


def from_dict(cls: type[Message], data: dict) -> Message:
    """A message from a dict; keys the message does not know are ignored (newer servers, plug-ins)."""
    return json_format.ParseDict(data, cls(), ignore_unknown_fields=True)
