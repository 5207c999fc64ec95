"""The request lifecycle both front ends share: gRPC's Generate and the HTTP API's completions.

    parse -> backend.check -> admission (queue, deadline, cancel) -> backend.open
          -> chunks ... completion -> counted, timed and logged (one JSON line)

A front end only turns its wire format into a GenerationRequest (inside `parse`,
so a bad one is counted and logged like any other), sets `cancel` when its client
goes away, and turns what `generate` yields back into its wire format.  The
daemon's state (starting, serving, draining) and GetStatus live here too, so the
two front ends answer health and status from the same counters.
"""

from __future__ import annotations

import logging
import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import psutil

from memspec import __version__
from memspec.errors import CancelledError, MemspecError, UnavailableError, status_of
from memspec.request import Chunk, Completion, GenerationRequest
from memspec.serving.admission import Admission
from memspec.serving.backend import Backend
from memspec.serving.counters import LatencyHistograms, RequestClock, RequestCounters
from memspec.serving.status import RequestTotals, Status, SystemMemory

log = logging.getLogger("memspec.server")
STATES = ("starting", "serving", "draining")
LOG_WAIT_S = 10.0  # how often the log says again that a request still waits for its target's load


@dataclass
class Final:
    """The last thing a generation yields: its Completion and who answered."""

    completion: Completion
    model: str  # target that answered
    variant: str
    queued_s: float  # time spent waiting for admission


class Service:
    """Generation over a Backend and an Admission queue, for any front end."""

    def __init__(self, backend: Backend, admission: Admission, clock: Callable[[], float] = time.monotonic):
        self.backend = backend
        self.admission = admission
        self.clock = clock
        self.started_at = clock()
        self.counters = RequestCounters()
        self.latency = LatencyHistograms()
        self.state = "starting"
        self.listen = {"grpc": "", "http": ""}  # the addresses the daemon serves on, for GetStatus

    def set_state(self, state: str) -> None:
        """starting -> serving -> draining (new requests refused, running ones carry on)."""
        assert state in STATES, state
        self.state = state
        if state == "draining":
            self.admission.close()

    def generate(self, parse: Callable[[], GenerationRequest], cancel: threading.Event,
                 time_remaining: Callable[[], float | None], fields: dict,
                 progress: Callable[[str], None] | None = None) -> Iterator[Chunk | Final]:
        """Run one request: Chunks as tokens are committed, then a Final.

        parse: builds the request (InvalidRequestError for a bad one); cancel: set when the
        client goes away (checked while queued and at every step); time_remaining: seconds
        left before its deadline (None: none), asked when it joins the queue; fields: the
        request's log line, which the caller may have started ("method", "peer"); progress: told
        how the load of its target goes while it waits for one (TargetSet.acquire), and logged, then
        how far its prompt's prefill has come where it is fed in chunks (the engine logs that).
        Raises the named exception (memspec.errors.STATUS) of whatever refused or ended it.
        """
        t0 = self.clock()
        clock = RequestClock(self.latency, t0)
        outcome, code, tokens = "cancelled", "CANCELLED", (0, 0)  # unless it reaches the end
        try:
            if self.state == "draining":
                raise UnavailableError("the daemon is shutting down and takes no new requests")
            req = parse()
            if req.model:
                fields["model"] = req.model
            # holds its target (loaded first if need be) until the request ends
            t_check = self.clock()
            checked = self.backend.check(req, cancel.is_set, time_remaining(), _logged(progress, fields))
            fields["check_ms"] = round((self.clock() - t_check) * 1e3, 3)  # its target's load, if it waited for one
            try:
                fields.update(kv_bytes=checked.kv_bytes, max_tokens=req.max_tokens, draft=req.draft,
                              policy=str(req.policy) if req.policy is not None else None)
                for item in self._run(req, checked, cancel, time_remaining, fields, clock, progress):
                    if isinstance(item, Final):
                        outcome, code = "completed", "OK"  # a cancel after this is not a cancelled request
                        tokens = (len(item.completion.prompt_token_ids), len(item.completion.token_ids))
                    yield item
            finally:
                checked.release()  # its target's keep-alive starts once no request holds it
        except MemspecError as exc:
            if outcome != "completed":
                outcome, code = status_of(exc).outcome, status_of(exc).grpc
            fields["error"] = str(exc)
            raise
        except Exception:
            if outcome != "completed":
                outcome, code = "failed", "INTERNAL"
            raise
        finally:
            self.counters.count(outcome, *tokens)
            fields.update(code=code, ms=round((self.clock() - t0) * 1e3, 3))
            log.info("request", extra={"fields": fields})

    def _run(self, req: GenerationRequest, checked, cancel: threading.Event, time_remaining: Callable,
             fields: dict, clock: RequestClock,
             progress: Callable[[str], None] | None = None) -> Iterator[Chunk | Final]:
        """Admission, then the engine's stream: Chunks, then a Final.  progress: told how far a long
        prompt's prefill has come (the engine logs it too)."""
        if cancel.is_set():
            raise CancelledError("cancelled before it started")  # the client left while it was checked
        if self.admission.would_queue():  # preload what it will want while it waits
            self.backend.hint(req)
        need = f"prompt {len(checked.prompt_ids)} tokens + max_tokens {checked.max_new}"
        with self.admission.enter(checked.kv_bytes, time_remaining(), cancel.is_set, need) as slot:
            self.counters.count("started")
            clock.queued(slot.queued_s)
            fields["queue_ms"] = round(slot.queued_s * 1e3, 3)
            run = self.backend.open(req, cancel, checked, progress)
            fields.update(model=run.model, variant=run.variant)
            try:
                for item in run.items:
                    if isinstance(item, Completion):
                        self.backend.record(item)
                        clock.finished(self.clock())
                        fields.update(finish_reason=item.finish_reason, **item.timings.to_dict(),
                                      stats=item.stats.to_dict())
                        yield Final(item, run.model, run.variant, slot.queued_s)
                    else:
                        clock.tokens(len(item.token_ids), self.clock())
                        yield item
            finally:
                run.close()  # frees the KV cache and draft state now, also when the client went away

    def status(self) -> Status:
        """GetStatus: the backend's models and counters plus the queue and the system."""
        vm, adm, cfg = psutil.virtual_memory(), self.admission.snapshot(), self.admission.config
        models = self.backend.status()
        return Status(
            **{f.name: getattr(models, f.name) for f in dataclasses.fields(models)},
            version=__version__, state=self.state, listen=self.listen["grpc"] or "",
            http_listen=self.listen["http"] or "", uptime_s=self.clock() - self.started_at,
            resident_bytes=sum(m.bytes for m in models.resident), kv_bytes=adm["kv_bytes"],
            queue_depth=adm["waiting"], active_streams=adm["active"],
            max_concurrent=cfg.max_concurrent, max_queue=cfg.max_queue,
            system_memory=SystemMemory(total_bytes=vm.total, available_bytes=vm.available,
                                       process_rss_bytes=psutil.Process(os.getpid()).memory_info().rss),
            requests=RequestTotals(**self.counters.to_dict()),
        )


def _logged(progress: Callable[[str], None] | None, fields: dict) -> Callable[[str], None]:
    """progress, and the log: a request waiting for a load says so when it starts waiting and every
    LOG_WAIT_S after (the load's own lines say what it is doing, such as measuring pass costs)."""
    logged = []  # when it last logged

    def tell(message: str) -> None:
        if not logged or time.monotonic() - logged[-1] >= LOG_WAIT_S:
            logged.append(time.monotonic())
            log.info("request waits for a load", extra={"fields": {
                **{k: fields[k] for k in ("method", "peer", "model") if k in fields}, "progress": message}})
        if progress is not None:
            progress(message)

    return tell
