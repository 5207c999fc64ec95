"""Named exceptions.  Each layer raises these; the server maps them to gRPC codes
and the CLI to messages and exit codes."""


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


class UnavailableError(MemspecError, ConnectionError):
    """No daemon answers at the address, or it is starting or shutting down."""


class DeadlineExceededError(MemspecError, TimeoutError):
    """The call's deadline passed before the answer was complete."""


class CancelledError(MemspecError):
    """The call was cancelled before it finished."""


class RemoteError(MemspecError):
    """The daemon failed in a way no other exception names (an internal error)."""
