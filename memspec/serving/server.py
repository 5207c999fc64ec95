"""The gRPC servicer: parse the request, call the domain layer (memspec.serving.service), build the reply.

Every failure leaves through one place, `_abort`, which maps the named
exception to its status code (memspec.serving.wire.CODES) and names it in the trailing
metadata.  The daemon's lifecycle (socket, signals, systemd) is memspec.serving.daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memspec.serving import wire
from memspec.serving.admission import Admission
from memspec.serving.backend import Backend
from memspec.serving.service import Final, Service
from memspec.serving.status import Status
from memspec.errors import ConfigError, InvalidRequestError, MemspecError
from memspec.request import Limits

pb2 = wire.pb2
log = logging.getLogger("memspec.server")


class MemSpecServicer:
    """memspec.v1.MemSpec over a Service (a Backend and an Admission queue)."""

    def __init__(self, backend: Backend, admission: Admission, listen: str = "", clock=time.monotonic,
                 service: Service | None = None):
        self.service = service or Service(backend, admission, clock)
        self.service.listen["grpc"] = listen
        self.backend = backend
        self.admission = admission
        self.health = health.HealthServicer()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def state(self) -> str:
        return self.service.state

    @property
    def counters(self):
        return self.service.counters

    def set_state(self, state: str) -> None:
        """starting -> serving -> draining; health follows."""
        self.service.set_state(state)
        if state == "serving":
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
        elif state == "draining":
            self.health.enter_graceful_shutdown()  # NOT_SERVING, and stays so

    def _set_health(self, status) -> None:
        for name in ("", wire.SERVICE):
            self.health.set(name, status)

    # -- Generate -----------------------------------------------------------------
    def Generate(self, request, context):
        fields = {"method": "Generate", "peer": context.peer()}
        cancel = threading.Event()
        if not context.add_callback(cancel.set):  # client cancel, deadline, shutdown past grace
            cancel.set()  # the call ended already: refused once it is parsed and checked

        def parse():
            if isinstance(request, wire.Unparsable):
                raise InvalidRequestError(request.reason)
            return wire.request_from_pb(request, self.backend.config.limits.max_tokens)

        for item in self.service.generate(parse, cancel, context.time_remaining, fields):
            if isinstance(item, Final):
                yield wire.final_to_pb(item.completion, item.model, item.variant, item.queued_s)
            else:
                yield wire.chunk_to_pb(item)

    # -- the rest -----------------------------------------------------------------------
    def ListModels(self, request, context):
        return pb2.ListModelsResponse(models=[wire.from_dict(pb2.ModelInfo, m) for m in self.backend.models()])

    def GetStatus(self, request, context):
        return wire.from_dict(pb2.GetStatusResponse, self.service.status().to_dict())

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

    def status(self) -> Status:
        return self.service.status()


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


RPC_BACKLOG = 4  # calls in flight per worker before grpc refuses more (see create_server)


def create_server(servicer: MemSpecServicer, address: str, max_workers: int,
                  max_message_bytes: int = Limits().request_bytes()) -> tuple[grpc.Server, int]:
    """A server with MemSpec, health and reflection bound to `address` (not started).

    Every queued request holds a worker while it waits, so max_workers should be
    max_concurrent + max_queue plus a few for status and health calls.  grpc refuses
    calls beyond RPC_BACKLOG x max_workers in flight with RESOURCE_EXHAUSTED; below that
    a call waits for a worker.  (A cap of max_workers itself let a flood of streams, each
    refused by admission within milliseconds but counted while it was, crowd out health
    and GetStatus.)  A request larger than
    `max_message_bytes` (what [limits] allow: Limits.request_bytes) is refused by
    grpc before it is parsed, with RESOURCE_EXHAUSTED.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="memspec-rpc"),
        maximum_concurrent_rpcs=RPC_BACKLOG * max_workers,
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
