"""Soak the real daemon: many clients, random cancels and deadlines, model calls in the middle.

    python bench/soak.py [--requests 10000] [--clients 8] [--max-tokens 24] [--json FILE]

It starts `memspec serve` on a socket of its own (the configured target, the scheduler's
drafts), then N client threads send a mix until --requests have been sent: greedy, sampled
(seeded) and forced-draft requests; some cancelled after a few chunks, some with a deadline
too short to finish.  Every --model-calls-every requests one client unloads a resident draft
and another reloads the target (LoadModel: a new engine while streams run on the old one).
A thread checks health every 0.1 s.  The report:

  unexpected    status codes no client should see (must be 0): anything but OK, CANCELLED
                for a cancel, DEADLINE_EXCEEDED for a deadline, and for UnloadModel
                NOT_FOUND (not resident) or INVALID_ARGUMENT (in use)
  rss_growth    the daemon's RSS from request 100 to the end (must be under 5%)
  at the end    active streams, queue depth and KV bytes (must all be 0)
  health        the slowest health check while it ran

Exit status 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is 17 times 23? Show your work.",
    "Summarize in one sentence: the meeting moved to Thursday because the room was booked.",
    "Tell me a short story about a lighthouse keeper.",
    "Repeat exactly: alpha beta gamma delta alpha beta gamma delta",
    "List three colors and one fruit for each.",
]
EXPECTED = {  # what each kind of call may end with
    "plain": {"OK"},
    "cancel": {"OK", "CANCELLED"},
    "deadline": {"OK", "DEADLINE_EXCEEDED"},
    "unload": {"OK", "NOT_FOUND", "INVALID_ARGUMENT"},
    "load": {"OK"},
}


def start_daemon(folder: Path, config: str | None, args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    """`memspec serve` on a socket in `folder` (with more serve options `args`), once it serves;
    its log is folder/daemon.log."""
    sock = folder / "soak.sock"
    cmd = [sys.executable, "-m", "memspec.cli", *(["--config", config] if config else []),
           "serve", "--listen", str(sock), *args]
    log = open(folder / "daemon.log", "ab")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    from memspec.serving.client import wait_until_serving

    if wait_until_serving(str(sock), lambda: proc.poll() is None, 180):
        return proc, sock
    if proc.poll() is not None:
        raise SystemExit(f"the daemon exited with {proc.returncode}; see {folder / 'daemon.log'}")
    proc.kill()
    raise SystemExit("the daemon did not start serving within 180 s")


class Soak:
    def __init__(self, sock: Path, args):
        from memspec.serving.client import Client

        self.client = Client(str(sock), timeout=120)
        self.args = args
        self.codes: Counter[tuple[str, str]] = Counter()  # (kind, code) -> calls
        self.unexpected: list[str] = []
        self.sent = 0
        self.lock = threading.Lock()
        self.rss_at_100: int | None = None
        self.slowest_health_ms = 0.0
        self.done = threading.Event()
        st = self.client.status()
        self.target = st["resident"][0]
        self.drafts = [d["name"] for d in st["drafts"]]
        self.daemon_pid = 0  # set by main once the daemon runs

    def _next(self) -> int | None:
        with self.lock:
            if self.sent >= self.args.requests:
                return None
            self.sent += 1
            return self.sent

    def _record(self, kind: str, code: str, detail: str = "") -> None:
        with self.lock:
            self.codes[(kind, code)] += 1
            if code not in EXPECTED[kind]:
                self.unexpected.append(f"{kind}: {code} {detail[:200]}")

    def _generate(self, rng: random.Random) -> None:
        kind = rng.choices(["plain", "cancel", "deadline"], [0.8, 0.1, 0.1])[0]
        draw = rng.random()
        opts = {"max_tokens": rng.randint(4, self.args.max_tokens)}
        if draw < 0.25:
            opts.update(temperature=0.8, top_p=0.9, seed=rng.randrange(2**32))
        elif draw < 0.5 and self.drafts:
            opts["draft"] = rng.choice(["none", *self.drafts])
        timeout = rng.uniform(0.01, 0.3) if kind == "deadline" else None
        try:
            items = self.client.generate(rng.choice(PROMPTS), timeout=timeout, **opts)
            for n, _ in enumerate(items):
                if kind == "cancel" and n >= rng.randint(1, 3):
                    items.close()  # the client goes away mid-stream
                    self._record(kind, "CANCELLED")
                    return
            self._record(kind, "OK")
        except Exception as exc:  # the client's named errors carry the gRPC code
            self._record(kind, _code(exc), str(exc))

    def _model_call(self, rng: random.Random, n: int) -> None:
        if n % 2 and self.drafts:
            kind, call = "unload", lambda: self.client.unload(rng.choice(self.drafts))
        else:
            kind, call = "load", lambda: self.client.load(self.target["name"], self.target["variant"])
        try:
            call()
            self._record(kind, "OK")
        except Exception as exc:
            self._record(kind, _code(exc), str(exc))

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while (n := self._next()) is not None:
            if n == 100:
                self.rss_at_100 = psutil.Process(self.daemon_pid).memory_info().rss
            if n % self.args.model_calls_every == 0:
                self._model_call(rng, n // self.args.model_calls_every)
            else:
                self._generate(rng)
            if n % 500 == 0:
                print(f"[{n}/{self.args.requests}] {dict(self.codes)}", file=sys.stderr, flush=True)

    def health_loop(self) -> None:
        while not self.done.wait(0.1):
            t0 = time.perf_counter()
            try:
                state = self.client.health(timeout=10)
            except Exception as exc:
                state = _code(exc)
            ms = (time.perf_counter() - t0) * 1e3
            self.slowest_health_ms = max(self.slowest_health_ms, ms)
            if state != "SERVING":
                with self.lock:
                    self.unexpected.append(f"health: {state}")


def _code(exc: Exception) -> str:
    """The gRPC status a failed call ended with (the client raises memspec's named errors)."""
    from memspec.serving import wire

    return exc.code().name if isinstance(exc, grpc.RpcError) else wire.code_for(exc).name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--model-calls-every", type=int, default=250, help="a LoadModel or UnloadModel every N requests")
    ap.add_argument("--config", help="the daemon's TOML config (default: the defaults)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ms-soak-") as d:
        proc, sock = start_daemon(Path(d), args.config)
        try:
            soak = Soak(sock, args)
            soak.daemon_pid = proc.pid
            t0 = time.monotonic()
            health = threading.Thread(target=soak.health_loop, daemon=True)
            health.start()
            clients = [threading.Thread(target=soak.client_loop, args=(args.seed + i,)) for i in range(args.clients)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            soak.done.set()
            health.join()
            seconds = time.monotonic() - t0
            time.sleep(0.5)  # cancelled streams end at their next step
            st = soak.client.status()
            rss_end = psutil.Process(proc.pid).memory_info().rss
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    rss_100 = soak.rss_at_100 or rss_end
    growth = (rss_end - rss_100) / rss_100
    end = {"active_streams": st["active_streams"], "queue_depth": st["queue_depth"], "kv_bytes": st["kv_bytes"]}
    report = {
        "requests": args.requests, "clients": args.clients, "seconds": round(seconds, 1),
        "requests_per_s": round(args.requests / seconds, 1),
        "codes": {f"{k}:{c}": n for (k, c), n in sorted(soak.codes.items())},
        "unexpected": len(soak.unexpected), "unexpected_examples": soak.unexpected[:10],
        "rss_at_100_mb": round(rss_100 / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_growth": round(growth, 4), "at_end": end, "slowest_health_ms": round(soak.slowest_health_ms, 1),
        "daemon_exit": proc.returncode,
    }
    ok = not soak.unexpected and growth < 0.05 and not any(end.values()) and proc.returncode == 0
    print(json.dumps(report, indent=2))
    print(f"{args.requests} requests from {args.clients} clients in {seconds:.0f} s: {len(soak.unexpected)} unexpected "
          f"codes; RSS {rss_100 / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB ({growth:+.1%}); at the end {end}; "
          f"slowest health check {soak.slowest_health_ms:.0f} ms; {'PASS' if ok else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
