"""A client for the memspec daemon.

    with Client() as c:                      # the default socket (see memspec.serving.address)
        for item in c.generate("What is 2+2?", max_tokens=32):
            print(item.text, end="")         # Chunks, then one Completion with stats

Every method turns grpc.RpcError into the memspec exception the daemon named
(InvalidRequestError, ContextOverflowError, ModelNotFoundError, OverloadedError,
UnavailableError, ...), so callers never see grpc types.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memspec.serving import wire
from memspec.serving.address import client_address
from memspec.errors import InvalidRequestError
from memspec.request import Chunk, Completion, GenerationRequest, PolicyName, SamplingParams, parse_keep_alive

pb2 = wire.pb2
Message = tuple[str, str] | Mapping[str, str]  # (role, content) or {"role": ..., "content": ...}


class Client:
    """A connection to one daemon; use it as a context manager, or call close()."""

    def __init__(self, address: str | None = None, timeout: float | None = None):
        """
        Args:
            address: socket path, "unix:///path", or "HOST:PORT"; None = $MEMSPEC_ADDRESS,
                else the user's default socket, else the system service's.
            timeout: default deadline in seconds for every call (None = no deadline).
        """
        self.address = client_address(address)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(self.address.target)
        self._stub = wire.pb2_grpc.MemSpecStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _error(self, err: grpc.RpcError):
        return wire.error_from_rpc(err, str(self.address))

    def _unary(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as err:
            raise self._error(err) from None

    # -- generation -------------------------------------------------------------------
    def stream(self, req: GenerationRequest, timeout: float | None = None,
               default_max_tokens: bool = False) -> Iterator[Chunk | Completion]:
        """Generate for a GenerationRequest, as Engine.stream does locally.

        Args:
            req: the request (checked by the daemon against its limits).
            timeout: deadline in seconds for the whole stream (None = the client's default).
            default_max_tokens: ignore req.max_tokens and let the daemon pick its
                default (until the end of sequence or of the context, within its [limits] max_tokens).
        Returns:
            an iterator of Chunk (text delta, token ids), then one Completion.
            Stopping early (break, close()) cancels the call: the daemon stops
            generating and frees the request's KV cache.
        Raises (while iterating):
            InvalidRequestError (ContextOverflowError) for a bad field, OverloadedError
            when the queue or memory is full, UnavailableError when no daemon serves,
            DeadlineExceededError, NotLoadedError, RemoteError.
        """
        msg = wire.request_to_pb(req, default_max_tokens)
        call = self._stub.Generate(msg, timeout=timeout if timeout is not None else self.timeout)
        text: list[str] = []
        complete = False
        try:
            for resp in call:
                text.append(resp.text)
                if resp.text or resp.token_ids:
                    yield Chunk(resp.text, list(resp.token_ids))
                if resp.finish_reason:
                    call.code()  # the status follows the last message: wait for it, nothing is left to cancel
                    complete = True
                    yield wire.completion_from_pb(resp, "".join(text))
                    return
        except grpc.RpcError as err:
            raise self._error(err) from None
        finally:
            if not complete:
                call.cancel()

    def generate(self, prompt: str, *, raw: bool = False, max_tokens: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                 draft: str | None = None, policy: str | None = None, model: str | None = None,
                 keep_alive: float | str | None = None, timeout: float | None = None, min_p: float = 0.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 logit_bias: Mapping[int, float] | None = None) -> Iterator[Chunk | Completion]:
        """Generate for one prompt (wrapped in the chat template unless raw).

        Args:
            prompt: the text; raw: send it without the chat template.
            max_tokens, temperature, top_p, top_k, seed, stop: sampling (see GenerateRequest);
                max_tokens None = the daemon's default.
            draft: force a draft ("none" = target only); policy: draft-selection policy.
            model: the target to answer (None: the daemon's default); loaded first if it is not.
            keep_alive: how long that target stays loaded once idle: seconds or a duration
                ("5m"); 0 = unload after the answer; negative = keep (None: the target's own).
            timeout: deadline in seconds for the whole stream (its target's load included).
            min_p, frequency_penalty, presence_penalty, repetition_penalty: sampling controls
                (see GenerateRequest); logit_bias: {token id: bias in [-100, 100]}.
        Returns:
            an iterator of Chunk, then one Completion (see `stream`).
        Raises:
            as `stream`, while iterating.
        """
        return self.stream(GenerationRequest(
            prompt=prompt, raw=raw, max_tokens=max_tokens,
            sampling=_sampling(temperature, top_k, top_p, seed, min_p, frequency_penalty, presence_penalty,
                               repetition_penalty, logit_bias),
            stop=tuple(stop), draft=draft, policy=_policy(policy), model=model,
            keep_alive=_keep_alive(keep_alive)), timeout, max_tokens is None)

    def chat(self, messages: Sequence[Message], *, max_tokens: int | None = None, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
             draft: str | None = None, policy: str | None = None, model: str | None = None,
             keep_alive: float | str | None = None, timeout: float | None = None, min_p: float = 0.0,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repetition_penalty: float = 1.0,
             logit_bias: Mapping[int, float] | None = None) -> Iterator[Chunk | Completion]:
        """Generate the next assistant turn of a chat.

        Args:
            messages: turns as (role, content) pairs or {"role", "content"} dicts;
                roles are "system", "user", "assistant".
            other arguments: as `generate`.
        Returns:
            an iterator of Chunk, then one Completion (see `stream`).
        Raises:
            InvalidRequestError for a malformed turn; otherwise as `stream`, while iterating.
        """
        turns = []
        for i, m in enumerate(messages):
            try:
                turns.append((m["role"], m["content"]) if isinstance(m, Mapping) else tuple(m))
            except (KeyError, TypeError) as exc:
                raise InvalidRequestError(f"messages[{i}]: expected (role, content) or a dict with both ({exc})") from None
        return self.stream(GenerationRequest(
            messages=tuple(turns), max_tokens=max_tokens,
            sampling=_sampling(temperature, top_k, top_p, seed, min_p, frequency_penalty, presence_penalty,
                               repetition_penalty, logit_bias),
            stop=tuple(stop), draft=draft, policy=_policy(policy), model=model,
            keep_alive=_keep_alive(keep_alive)), timeout, max_tokens is None)

    # -- the rest -------------------------------------------------------------------
    def status(self, timeout: float | None = None) -> dict:
        """The daemon's status.

        Returns:
            a dict with the fields of GetStatusResponse (resident, budget_bytes,
            system_memory, queue_depth, active_streams, drafts, predictor, ...).
        Raises:
            UnavailableError when no daemon answers; DeadlineExceededError.
        """
        return wire.to_dict(self._unary(self._stub.GetStatus, pb2.GetStatusRequest(), timeout))

    def models(self, timeout: float | None = None) -> list[dict]:
        """Models in the daemon's store.

        Returns:
            one dict per model: name, role, variants (variant -> bytes), source,
            resident, resident_variant.
        Raises:
            UnavailableError when no daemon answers.
        """
        return wire.to_dict(self._unary(self._stub.ListModels, pb2.ListModelsRequest(), timeout))["models"]

    def load(self, name: str, variant: str | None = None, timeout: float | None = None) -> dict:
        """Make a target resident (admin), kept until told otherwise, and the default target.

        Args:
            name: store name; variant: "q4", "fp32", ... (None = the daemon's configured variant).
        Returns:
            {"model": {name, role, variant, bytes, device, providers}, "load_ms": float}.
        Raises:
            ModelNotFoundError for an unknown model or variant; InvalidRequestError
            for a draft; ModelFormatError when the file cannot be loaded.
        """
        req = pb2.LoadModelRequest(name=name)
        if variant is not None:
            req.variant = variant
        return wire.to_dict(self._unary(self._stub.LoadModel, req, timeout))

    def unload(self, name: str, timeout: float | None = None) -> int:
        """Drop a resident model (admin).

        Returns:
            the weight bytes released (once streams using them end).
        Raises:
            ModelNotFoundError when the model is not resident.
        """
        return self._unary(self._stub.UnloadModel, pb2.UnloadModelRequest(name=name), timeout).freed_bytes

    def health(self, timeout: float | None = 2.0) -> str:
        """The standard health status: "SERVING", "NOT_SERVING", ...

        Raises:
            UnavailableError when no daemon answers.
        """
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=wire.SERVICE), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def wait_until_serving(address: str, alive: Callable[[], bool], timeout: float, poll: float = 0.2) -> bool:
    """Poll a daemon starting at `address` until its health check says SERVING (True), `alive()`
    turns False (the process exited: False), or `timeout` seconds pass (False)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and alive():
        try:
            with Client(address, timeout=2) as c:
                if c.health() == "SERVING":
                    return True
        except Exception:  # not listening yet, or still loading
            pass
        time.sleep(poll)
    return False


def _sampling(temperature: float, top_k: int, top_p: float, seed: int | None, min_p: float, frequency_penalty: float,
              presence_penalty: float, repetition_penalty: float,
              logit_bias: Mapping[int, float] | None) -> SamplingParams:
    """generate()'s and chat()'s sampling arguments as SamplingParams (the daemon checks the ranges)."""
    if logit_bias is not None and not isinstance(logit_bias, Mapping):
        raise InvalidRequestError(f"logit_bias: must be a mapping of token id to bias, got {type(logit_bias).__name__}")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          repetition_penalty=repetition_penalty, logit_bias=tuple((logit_bias or {}).items()))


def _policy(text: str | None) -> PolicyName | None:
    """A policy as the caller wrote it, parsed (InvalidRequestError names the field)."""
    return PolicyName.parse(text) if text is not None else None


def _keep_alive(value: float | str | None) -> float | None:
    """keep_alive as the caller wrote it, in seconds (InvalidRequestError names the field)."""
    return parse_keep_alive(value) if value is not None else None
