"""Named exceptions, and the one table of what each means on the wire.

Each layer raises these; the gRPC server and the HTTP front end map them through
`STATUS` (gRPC code, HTTP status, OpenAI error type), and the CLI to messages and
exit codes."""

from __future__ import annotations

from dataclasses import dataclass


class MemspecError(Exception):
    """Base class of every error memspec raises on purpose."""


class ConfigError(MemspecError, ValueError):
    """A configuration file or option is invalid."""


class ModelFormatError(MemspecError, ValueError):
    """A model file is missing, corrupt, or not in a layout memspec understands."""


class ModelNotFoundError(MemspecError, LookupError):
    """The model store has no model (or variant) by that name."""


class InvalidRequestError(MemspecError, ValueError):
    """A generation request has a bad field; the message names it and its allowed range."""


class ContextOverflowError(InvalidRequestError):
    """The prompt (plus what must be generated) does not fit in the context window."""


class TokenizerError(MemspecError, ValueError):
    """Unusable tokenizer metadata (a model's), or text the tokenizer cannot take."""


class ChatTemplateError(TokenizerError, InvalidRequestError):
    """Chat messages are malformed, or the model's template cannot render them (the request's fault)."""


# -- daemon (memspec.serving.server, memspec.serving.client) ---------------------------------------
class NotLoadedError(MemspecError):
    """The daemon has no resident model to serve this (it was unloaded)."""


class OverloadedError(MemspecError):
    """The daemon's queue is full, or the request's KV cache does not fit in memory now."""


class InsufficientMemoryError(OverloadedError):
    """A target cannot be loaded: it does not fit the memory budget even with every other model gone."""


class UnavailableError(MemspecError, ConnectionError):
    """No daemon answers at the address, or it is starting or shutting down."""


class DeadlineExceededError(MemspecError, TimeoutError):
    """The call's deadline passed before the answer was complete."""


class CancelledError(MemspecError):
    """The call was cancelled before it finished."""


class RemoteError(MemspecError):
    """The daemon failed in a way no other exception names (an internal error)."""


# -- HTTP front end (memspec.serving.http) ------------------------------------------------------
class AuthError(MemspecError):
    """The HTTP request carries no API key, or the wrong one."""


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the [limits] let any request be."""


# -- the one status table -----------------------------------------------------------------------
@dataclass(frozen=True)
class Status:
    """What a named exception is on each transport."""

    grpc: str  # grpc.StatusCode name
    http: int  # HTTP status of the OpenAI-compatible API
    type: str  # OpenAI error "type"
    code: str | None = None  # OpenAI error "code" (None: the type says it all)
    outcome: str = "failed"  # how the request is counted: completed, cancelled, invalid, rejected, failed


INTERNAL = Status("INTERNAL", 500, "server_error")
STATUS: dict[type, Status] = {
    ContextOverflowError: Status("INVALID_ARGUMENT", 400, "invalid_request_error", "context_length_exceeded",
                                 "invalid"),
    # before TokenizerError: a malformed turn is the request's fault
    ChatTemplateError: Status("INVALID_ARGUMENT", 400, "invalid_request_error", "invalid_messages", "invalid"),
    RequestTooLargeError: Status("RESOURCE_EXHAUSTED", 413, "invalid_request_error", "request_too_large", "invalid"),
    InvalidRequestError: Status("INVALID_ARGUMENT", 400, "invalid_request_error", None, "invalid"),
    TokenizerError: Status("FAILED_PRECONDITION", 500, "server_error", "tokenizer_error", "rejected"),
    ConfigError: Status("INVALID_ARGUMENT", 400, "invalid_request_error", None, "invalid"),
    ModelNotFoundError: Status("NOT_FOUND", 404, "invalid_request_error", "model_not_found", "invalid"),
    ModelFormatError: Status("FAILED_PRECONDITION", 500, "server_error", "model_format_error", "rejected"),
    NotLoadedError: Status("FAILED_PRECONDITION", 503, "service_unavailable", "no_model_loaded", "rejected"),
    # 507 Insufficient Storage: the server cannot hold what the request needs (a target that does not fit)
    InsufficientMemoryError: Status("RESOURCE_EXHAUSTED", 507, "server_error", "insufficient_memory", "rejected"),
    OverloadedError: Status("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "overloaded", "rejected"),
    UnavailableError: Status("UNAVAILABLE", 503, "service_unavailable", "unavailable", "rejected"),
    DeadlineExceededError: Status("DEADLINE_EXCEEDED", 504, "timeout", "deadline_exceeded", "cancelled"),
    CancelledError: Status("CANCELLED", 499, "cancelled", "cancelled", "cancelled"),  # 499: nginx's "client left"
    AuthError: Status("UNAUTHENTICATED", 401, "authentication_error", "invalid_api_key", "rejected"),
}


def status_of(exc: BaseException) -> Status:
    """The row of the nearest class of `exc` in STATUS; INTERNAL for anything unnamed."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return INTERNAL
