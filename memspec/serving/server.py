"""The gRPC servicer: parse the request, call the domain layer, build the reply.

Every failure leaves through one place, `_abort`, which maps the named
exception to its status code (memspec.serving.wire.CODES) and names it in the trailing
metadata.  The daemon's lifecycle (socket, signals, systemd) is memspec.serving.daemon.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memspec import __version__
from memspec.serving import wire
from memspec.serving.admission import Admission
from memspec.serving.backend import Backend
from memspec.errors import CancelledError, ConfigError, InvalidRequestError, MemspecError, UnavailableError
from memspec.request import Completion, Limits

pb2 = wire.pb2
log = logging.getLogger("memspec.server")
STATES = ("starting", "serving", "draining")


@dataclass
class RequestCounters:
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0
    invalid: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, outcome: str) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)

    def to_dict(self) -> dict:
        with self.lock:
            return {k: getattr(self, k) for k in ("started", "completed", "cancelled", "rejected", "invalid", "failed")}


def _outcome(code: grpc.StatusCode) -> str:
    return {grpc.StatusCode.OK: "completed", grpc.StatusCode.CANCELLED: "cancelled",
            grpc.StatusCode.DEADLINE_EXCEEDED: "cancelled", grpc.StatusCode.INVALID_ARGUMENT: "invalid",
            grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected", grpc.StatusCode.UNAVAILABLE: "rejected",
            grpc.StatusCode.FAILED_PRECONDITION: "rejected"}.get(code, "failed")


class MemSpecServicer:
    """memspec.v1.MemSpec over a Backend and an Admission queue."""

    def __init__(self, backend: Backend, admission: Admission, listen: str = "", clock=time.monotonic):
        self.backend = backend
        self.admission = admission
        self.listen = listen
        self.clock = clock
        self.started_at = clock()
        self.counters = RequestCounters()
        self.health = health.HealthServicer()
        self.state = "starting"
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def set_state(self, state: str) -> None:
        """starting -> serving -> draining; health follows."""
        assert state in STATES, state
        self.state = state
        if state == "serving":
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
        elif state == "draining":
            self.health.enter_graceful_shutdown()  # NOT_SERVING, and stays so
            self.admission.close()

    def _set_health(self, status) -> None:
        for name in ("", wire.SERVICE):
            self.health.set(name, status)

    # -- Generate -----------------------------------------------------------------
    def Generate(self, request, context):
        t0 = self.clock()
        fields = {"method": "Generate", "peer": context.peer()}
        code = grpc.StatusCode.CANCELLED  # what the stream ends with unless we reach the end
        try:
            if self.state == "draining":
                raise UnavailableError("the daemon is shutting down and takes no new requests")
            if isinstance(request, wire.Unparsable):
                raise InvalidRequestError(request.reason)
            req = wire.request_from_pb(request, self.backend.config.limits.max_tokens)
            checked = self.backend.check(req)
            fields.update(kv_bytes=checked.kv_bytes, max_tokens=req.max_tokens, draft=req.draft,
                          policy=str(req.policy) if req.policy is not None else None)
            cancel = threading.Event()
            if not context.add_callback(cancel.set):  # client cancel, deadline, shutdown past grace
                raise CancelledError("cancelled before it started")  # the client left while it was checked
            if self.admission.would_queue():  # preload what it will want while it waits
                self.backend.hint(req)
            with self.admission.enter(checked.kv_bytes, context.time_remaining(), cancel.is_set) as slot:
                self.counters.count("started")
                fields["queue_ms"] = round(slot.queued_s * 1e3, 3)
                yield from self._generate(req, checked, cancel, slot.queued_s, fields)
            code = grpc.StatusCode.OK
        except MemspecError as exc:
            code = wire.code_for(exc)
            fields["error"] = str(exc)
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            raise
        finally:
            if fields.pop("complete", False):
                code = grpc.StatusCode.OK
            self.counters.count(_outcome(code))
            fields.update(code=code.name, ms=round((self.clock() - t0) * 1e3, 3))
            log.info("request", extra={"fields": fields})

    def _generate(self, req, checked, cancel: threading.Event, queued_s: float, fields: dict):
        run = self.backend.open(req, cancel, checked)
        fields.update(model=run.model, variant=run.variant)
        try:
            for item in run.items:
                if isinstance(item, Completion):
                    self.backend.record(item)
                    fields.update(finish_reason=item.finish_reason, **item.timings, stats=item.stats)
                    fields["complete"] = True  # a cancel after this message is not a cancelled request
                    yield wire.final_to_pb(item, run.model, run.variant, queued_s)
                else:
                    yield wire.chunk_to_pb(item)
        finally:
            run.close()  # frees the KV cache and draft state now, also when the client went away

    # -- the rest -----------------------------------------------------------------------
    def ListModels(self, request, context):
        return pb2.ListModelsResponse(models=[wire.from_dict(pb2.ModelInfo, m) for m in self.backend.models()])

    def GetStatus(self, request, context):
        return wire.from_dict(pb2.GetStatusResponse, self.status())

    def LoadModel(self, request, context):
        if not request.name:
            raise InvalidRequestError("name: is empty; give a model name from ListModels")
        variant = request.variant if request.HasField("variant") else None
        out = self.backend.load(request.name, variant)
        log.info("load", extra={"fields": {"method": "LoadModel", **out["model"], "load_ms": out["load_ms"]}})
        return wire.from_dict(pb2.LoadModelResponse, out)

    def UnloadModel(self, request, context):
        if not request.name:
            raise InvalidRequestError("name: is empty; give a resident model's name")
        freed = self.backend.unload(request.name)
        log.info("unload", extra={"fields": {"method": "UnloadModel", "name": request.name, "freed_bytes": freed}})
        return pb2.UnloadModelResponse(freed_bytes=freed)

    def status(self) -> dict:
        """GetStatus as a dict: the backend's models and counters plus the queue and the system."""
        vm, adm, cfg = psutil.virtual_memory(), self.admission.snapshot(), self.admission.config
        out = self.backend.status()
        return {
            **out, "version": __version__, "state": self.state, "listen": self.listen,
            "uptime_s": self.clock() - self.started_at,
            "resident_bytes": sum(m["bytes"] for m in out["resident"]),
            "budget_bytes": out.get("budget_bytes", 0), "kv_bytes": adm["kv_bytes"],
            "queue_depth": adm["waiting"], "active_streams": adm["active"],
            "max_concurrent": cfg.max_concurrent, "max_queue": cfg.max_queue,
            "system_memory": {"total_bytes": vm.total, "available_bytes": vm.available,
                              "process_rss_bytes": psutil.Process(os.getpid()).memory_info().rss},
            "requests": self.counters.to_dict(),
        }


# -- handlers ---------------------------------------------------------------------------
def _abort(context, exc: MemspecError):
    context.set_trailing_metadata(((wire.ERROR_KEY, type(exc).__name__),))
    context.abort(wire.code_for(exc), str(exc))


def _guarded(fn, streaming: bool):
    """fn with bad bytes and named exceptions turned into status codes."""

    def failed(exc: Exception, context):
        if isinstance(exc, MemspecError):
            _abort(context, exc)
        log.exception("internal error", extra={"fields": {"method": fn.__name__}})
        context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    def bad_bytes(request, context):
        if isinstance(request, wire.Unparsable):
            _abort(context, InvalidRequestError(request.reason))

    if streaming:  # Generate checks the bytes itself, so that they are counted and logged
        def behavior(request, context):
            try:
                yield from fn(request, context)
            except Exception as exc:  # noqa: BLE001 - every failure leaves with a status code
                failed(exc, context)
    else:
        def behavior(request, context):
            bad_bytes(request, context)
            try:
                return fn(request, context)
            except Exception as exc:  # noqa: BLE001
                failed(exc, context)
    return behavior


def _handlers(servicer: MemSpecServicer) -> grpc.GenericRpcHandler:
    """MemSpec's methods with lenient request parsing (see memspec.serving.wire.lenient)."""
    service = pb2.DESCRIPTOR.services_by_name["MemSpec"]
    handlers = {}
    for m in service.methods:
        request_cls, response_cls = getattr(pb2, m.input_type.name), getattr(pb2, m.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(_guarded(getattr(servicer, m.name), m.server_streaming),
                                request_deserializer=wire.lenient(request_cls),
                                response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def create_server(servicer: MemSpecServicer, address: str, max_workers: int,
                  max_message_bytes: int = Limits().request_bytes()) -> tuple[grpc.Server, int]:
    """A server with MemSpec, health and reflection bound to `address` (not started).

    Every queued request holds a worker while it waits, so max_workers should be
    max_concurrent + max_queue plus a few for status and health calls; grpc
    refuses calls beyond that with RESOURCE_EXHAUSTED.  A request larger than
    `max_message_bytes` (what [limits] allow: Limits.request_bytes) is refused by
    grpc before it is parsed, with RESOURCE_EXHAUSTED.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="memspec-rpc"),
        maximum_concurrent_rpcs=max_workers,
        options=[("grpc.so_reuseport", 0),  # a second daemon must fail to bind, not share the port
                 ("grpc.max_receive_message_length", max_message_bytes)],
    )
    server.add_generic_rpc_handlers((_handlers(servicer),))
    health_pb2_grpc.add_HealthServicer_to_server(servicer.health, server)
    reflection.enable_server_reflection(
        (wire.SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server,
    )
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc: "Failed to bind to address"
        raise ConfigError(f"cannot listen on {address}: in use, or not allowed") from None
    return server, port
