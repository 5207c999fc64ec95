"""`memspec serve`: the daemon's lifecycle around the gRPC server.

    start    socket folder made, stale socket file removed, server up (health
             NOT_SERVING), target loaded, health SERVING, systemd READY=1
    SIGHUP   the config file is read again; what can change at run time is
             applied (limits, queue sizes, budget, grace, log level, socket mode),
             the rest is logged as needing a restart
    SIGTERM  health NOT_SERVING, new requests UNAVAILABLE, streams already
    SIGINT   running or queued get grace_seconds to finish, then exit 0; while
             the target is still loading: stop listening and exit 0 at once

Logs are JSON lines on stderr (journald keeps them): one per request, with its stats.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from memspec.runtime.memory import PsutilProbe
from memspec.serving.address import Address, check_private_folder, default_socket, server_address
from memspec.serving.admission import MiB, Admission, AdmissionConfig
from memspec.scheduling.scheduler import draft_names
from memspec.serving.backend import EngineBackend
from memspec.config import Config, ServerConfig, load_config
from memspec.errors import ConfigError, MemspecError
from memspec.serving.notify import Notifier
from memspec.serving.server import MemSpecServicer, create_server
from memspec.models.store import ModelStore

log = logging.getLogger("memspec.daemon")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LOAD_POLL_S = 0.1  # how often the main thread looks at the load while it waits for signals
SPARE_WORKERS = 8  # threads beyond max_concurrent + max_queue, for status, health and admin calls
RESTART_ONLY = ("home", "model", "runtime", "speculative", "scheduler", "http")  # read only at start (or LoadModel)


# -- logging ---------------------------------------------------------------------------
class JsonLines(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage(), **getattr(record, "fields", {})}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str) -> None:
    root = logging.getLogger("memspec")
    if not any(isinstance(h.formatter, JsonLines) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLines())
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level.upper())


# -- socket -------------------------------------------------------------------------------
def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def prepare_socket(path: Path) -> None:
    """Make the socket's folder; remove a socket file left by a daemon that was killed."""
    parent = path.parent
    if not parent.is_dir():
        # /run/memspec is shared with the group through the socket's own mode; a user's folder is private
        parent.mkdir(parents=True, mode=0o755 if os.getuid() == 0 else 0o700)
    if parent == default_socket({}).parent:
        check_private_folder(parent)  # /tmp/memspec-$UID: someone else may have made it first
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket; remove it or choose another --listen")
        if _answers(path):
            raise ConfigError(f"another daemon is serving at {path}; stop it first (`memspec status --address {path}`)")
        path.unlink()  # stale


def is_jetson(root: Path = Path("/")) -> bool:
    """An NVIDIA Jetson (L4T): its release file, or its GPU's device nodes."""
    return (root / "etc/nv_tegra_release").is_file() or any((root / "dev").glob("nvhost-*"))


# -- signals ------------------------------------------------------------------------------
class Signals:
    """SIGTERM, SIGINT and SIGHUP as numbers on a socket that the main loop waits on."""

    def __init__(self):
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, lambda *_: None) for s in SIGNALS}

    def wait(self, timeout: float | None) -> list[int]:
        ready, _, _ = select.select([self._r], [], [], timeout)
        try:
            return list(self._r.recv(64)) if ready else []
        except BlockingIOError:
            return []

    def close(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_fd)
        self._r.close()
        self._w.close()


# -- the daemon -----------------------------------------------------------------------------
def admission_config(s: ServerConfig) -> AdmissionConfig:
    return AdmissionConfig(max_concurrent=s.max_concurrent, max_queue=s.max_queue,
                           headroom_bytes=s.memory_headroom_mb * MiB)


def _check(s: ServerConfig) -> None:
    if s.max_concurrent < 1 or s.max_queue < 0 or s.grace_seconds < 0:
        raise ConfigError(f"[server] max_concurrent must be >= 1, max_queue >= 0 and grace_seconds >= 0; got "
                          f"{s.max_concurrent}, {s.max_queue}, {s.grace_seconds}")
    if not 0 <= s.socket_mode <= 0o777:
        raise ConfigError(f"[server] socket_mode {s.socket_mode:#o} is not a file mode (0..0o777)")
    if s.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"[server] log_level {s.log_level!r}: use debug, info, warning or error")


class Daemon:
    def __init__(self, config: Config, config_path: str | None, listen: str | None,
                 loader: Callable, notifier: Notifier | None = None, http: str | None = None):
        _check(config.server)
        self.config = config
        self.config_path = config_path
        self.address: Address = server_address(listen or config.server.listen)
        self.notifier = notifier or Notifier()
        store = ModelStore(config.store_home)
        self.backend = EngineBackend(config, loader, store, drafts_of=functools.partial(
            draft_names, store, suffix=config.speculative.suffix_mb > 0, session_config=config.runtime))
        self.admission = Admission(admission_config(config.server), PsutilProbe().available_bytes)  # cgroup-aware
        self.servicer = MemSpecServicer(self.backend, self.admission, listen=str(self.address))
        self.max_workers = config.server.max_concurrent + config.server.max_queue + SPARE_WORKERS
        self.http_listen = http or config.http.listen  # "" = no HTTP API
        self.http = None  # memspec.serving.http.HttpServer, once listening
        self.load_abandoned = False  # a SIGTERM came while the target was loading: its thread is still in it
        if self.http_listen:
            from memspec.serving.http import check_exposure, parse_listen  # uvicorn: only when asked for
            self.http_address = parse_listen(self.http_listen)
            check_exposure(self.http_address, config.http)

    def run(self) -> int:
        setup_logging(self.config.server.log_level)
        signals = Signals()
        try:
            return self._run(signals)
        finally:
            signals.close()

    def _run(self, signals: Signals) -> int:
        server = self._listen()
        pending = self._load(server, signals)
        if self.load_abandoned:
            return 0  # stopped while loading: nothing was served
        while True:
            for signum in pending or signals.wait(self._ping_interval()):
                if signum == signal.SIGHUP:
                    try:
                        self.reload()
                    except Exception:  # a reload must never take the daemon down
                        log.exception("reload failed; keeping the running config")
                elif signum in (signal.SIGTERM, signal.SIGINT):
                    return self.drain(server, signal.Signals(signum).name)
            pending = []
            self._ping()

    def _listen(self):
        """The gRPC server, started (health NOT_SERVING until the target is loaded)."""
        if self.address.is_unix:
            prepare_socket(self.address.path)
        elif not self.address.is_loopback:
            log.warning("listening beyond loopback without TLS or authentication",
                        extra={"fields": {"listen": self.address.target}})
        # sized at start for the limits then: a SIGHUP that raises them needs a restart to take larger requests
        server, _ = create_server(self.servicer, self.address.target, self.max_workers,
                                  self.config.limits.request_bytes())
        server.start()
        if self.address.is_unix:
            os.chmod(self.address.path, self.config.server.socket_mode)
        if self.http_listen:
            try:
                self._listen_http()
            except MemspecError:
                self._stop_serving(server)
                raise
        return server

    def _listen_http(self) -> None:
        """The HTTP API on the same Service (/health answers 503 until the target is loaded)."""
        from memspec.serving.http import Api, HttpServer

        api = Api(self.servicer.service, self.config.http)
        self.http = HttpServer(api, self.http_address, max_connections=2 * self.max_workers + 64).start()
        self.servicer.service.listen["http"] = str(self.http.address)
        log.info("http listening", extra={"fields": {"http": str(self.http.address), "api_key": bool(api.key)}})

    def _load(self, server, signals: Signals) -> list[int]:
        """Load the target, then serve: health SERVING, READY=1.  The load (minutes on a first start:
        the pass costs are measured then) runs on its own thread while this one keeps answering
        signals: SIGTERM or SIGINT stops the daemon at once (`load_abandoned`).  Returns the
        signals that came too late to stop the load (a SIGHUP, or a SIGTERM as it finished), which
        the serving loop then handles."""
        target = f"{self.config.model.target} ({self.config.model.variant})"
        self.notifier.status(f"loading {target}")
        log.info("starting", extra={"fields": {"listen": str(self.address), "target": target, "pid": os.getpid()}})
        done, box = threading.Event(), {}

        def load():
            try:
                box["loaded"] = self.backend.start()
            except BaseException as exc:  # handed to the main thread, which raises it
                box["error"] = exc
            finally:
                done.set()

        pending: list[int] = []
        with self.notifier.busy(watchdog=self.config.server.watchdog):  # the load may take minutes
            threading.Thread(target=load, name="memspec-load", daemon=True).start()
            while not done.is_set():
                for signum in signals.wait(LOAD_POLL_S):
                    if signum in (signal.SIGTERM, signal.SIGINT) and not done.is_set():
                        self.notifier.stopping(f"stopped while loading {target}")
                        log.info("stopped while loading", extra={"fields": {"signal": signal.Signals(signum).name,
                                                                          "target": target}})
                        self._stop_serving(server)
                        self.load_abandoned = True
                        return []
                    pending.append(signum)
        if "error" in box:
            self._stop_serving(server)
            raise box["error"]
        loaded = box["loaded"]
        self.servicer.set_state("serving")
        if is_jetson() and loaded["model"]["device"] == "cpu":
            log.warning("this is a Jetson, but the target runs on the CPU: install the JetPack build of "
                        "onnxruntime-gpu (and not the onnxruntime package beside it), or set [runtime] providers",
                        extra={"fields": {"providers": loaded["model"]["providers"]}})
        self.notifier.ready(f"serving {target} on {self.address}" + (f" and http://{self.http.address}"
                                                                      if self.http else ""))
        log.info("serving", extra={"fields": {"listen": str(self.address), **loaded["model"],
                                              "load_ms": round(loaded["load_ms"], 1)}})
        return pending

    def _stop_serving(self, server) -> None:
        """Stop listening (gRPC, HTTP) and remove the socket file."""
        server.stop(0)
        self._stop_http()
        self._remove_socket()

    def _ping_interval(self) -> float | None:
        return self.notifier.watchdog_interval if self.config.server.watchdog else None

    def _ping(self) -> None:
        if self._ping_interval():
            self.notifier.watchdog()

    def drain(self, server, why: str) -> int:
        """Refuse new work, let running and queued streams finish within the grace, stop."""
        grace = self.config.server.grace_seconds
        snap = self.admission.snapshot()
        self.servicer.set_state("draining")  # health NOT_SERVING; Generate UNAVAILABLE; status still answers
        self.notifier.stopping(f"draining {snap['active']} streams (grace {grace:g} s)")
        log.info("draining", extra={"fields": {"signal": why, "grace_seconds": grace, **snap}})
        t0 = time.monotonic()
        deadline, next_ping = t0 + grace, t0
        while self._busy() and time.monotonic() < deadline:
            if time.monotonic() >= next_ping:
                self._ping()
                next_ping = time.monotonic() + (self._ping_interval() or 1.0)
            time.sleep(0.05)
        # what is still running now is cancelled; short calls get a second
        done = server.stop(0 if self._busy() else 1.0)
        while not done.wait(self._ping_interval() or 1.0):
            self._ping()
        self._stop_http()
        self._remove_socket()
        self.backend.close()
        log.info("stopped", extra={"fields": {"drain_ms": round((time.monotonic() - t0) * 1e3, 1),
                                              "requests": self.servicer.counters.to_dict()}})
        return 0

    def _stop_http(self) -> None:
        if self.http is not None:
            self.http.stop()
            self.http = None

    def _busy(self) -> bool:
        snap = self.admission.snapshot()
        return bool(snap["active"] or snap["waiting"])

    def _remove_socket(self) -> None:
        if self.address.is_unix:
            try:
                if stat.S_ISSOCK(self.address.path.lstat().st_mode):
                    self.address.path.unlink()
            except FileNotFoundError:
                pass

    def reload(self) -> None:
        """SIGHUP: apply the config file's run-time options; keep serving on any error."""
        self.notifier.reloading("reloading the config")
        try:
            new = load_config(self.config_path) if self.config_path else Config()
            _check(new.server)
        except ConfigError as exc:
            log.error("reload failed; keeping the running config", extra={"fields": {"error": str(exc)}})
            self.notifier.ready(f"serving on {self.address} (reload failed: {exc})")
            return
        old = self.config
        restart = [k for k in RESTART_ONLY if getattr(old, k, None) != getattr(new, k, None)]
        if new.server.listen != old.server.listen:
            restart.append("server.listen")
        s = new.server
        if s.max_concurrent + s.max_queue + SPARE_WORKERS > self.max_workers:
            log.warning("max_concurrent + max_queue exceed the thread pool sized at start; restart to use them",
                        extra={"fields": {"max_workers": self.max_workers}})
        self.admission.configure(admission_config(s))
        self.backend.reconfigure(new)
        setup_logging(s.log_level)
        if self.address.is_unix and s.socket_mode != old.server.socket_mode:
            try:
                os.chmod(self.address.path, s.socket_mode)
            except OSError as exc:  # the socket file was removed under the daemon: it still serves
                log.warning("cannot change the socket's mode", extra={"fields": {"error": str(exc)}})
        self.config = dataclasses.replace(new, **{k: getattr(old, k) for k in RESTART_ONLY if hasattr(old, k)},
                                          server=dataclasses.replace(s, listen=old.server.listen))
        log.info("reloaded", extra={"fields": {"config": self.config_path, "limits": dataclasses.asdict(new.limits),
                                               "server": dataclasses.asdict(s), "needs_restart": restart}})
        self.notifier.ready(f"serving on {self.address}")


def serve(config: Config, config_path: str | None, listen: str | None, loader: Callable,
          http: str | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status.  http: the HTTP API's
    HOST:PORT (None: [http] listen)."""
    daemon = Daemon(config, config_path, listen, loader, http=http)
    status = daemon.run()
    if daemon.load_abandoned:  # the loader thread may be inside ONNX Runtime or the native engine, which
        logging.shutdown()    # abort at interpreter shutdown: leave without it, the logs flushed
        os._exit(status)
    return status
