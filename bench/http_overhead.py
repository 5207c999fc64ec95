"""What the HTTP API costs against gRPC: the same requests through both, on one daemon.

    python bench/http_overhead.py                 # tok/s and time to first token, side by side
    python bench/http_overhead.py --cost          # RSS and time to READY=1, with and without --http

It starts `memspec serve --http 127.0.0.1:0` (target-only, greedy: both transports
produce the same tokens), then runs each prompt through gRPC (memspec.serving.client)
and through HTTP (POST /v1/chat/completions with the prompt as the user turn, as
gRPC's prompt is templated; streamed, read with http.client) in
alternating order, round after round.  Per request it measures, on the client:
time to the first text, and decode tok/s = (tokens - 1) / (last text - first text).
It prints the medians and the ratios; the issue asks for HTTP tok/s >= 0.97x gRPC's
and TTFT at most 5 ms higher.  Run it alone (`flock /tmp/memspec-bench.lock ...`
on a shared machine).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from memspec.request import Completion, GenerationRequest
from memspec.serving.client import Client

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works, step by step.",
    "List ten facts about the planet Mars.",
    "Write a Python function that checks whether a number is prime, and explain it.",
]
CONFIG = """\
[runtime]
max_context = 1024
[scheduler]
policy = "target-only"
"""


class Served:
    """A `memspec serve` child with --http, ready when systemd's READY=1 arrives."""

    def __init__(self, folder: Path, http: bool = True, config: Path | None = None):
        self.sock = folder / "d.sock"
        notify = folder / "n"
        self._n = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._n.bind(str(notify))
        self._n.settimeout(120)
        cmd = [sys.executable, "-m", "memspec.cli", *(["--config", str(config)] if config else []), "serve",
               "--listen", str(self.sock), *(["--http", "127.0.0.1:0"] if http else [])]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, NOTIFY_SOCKET=str(notify)),
                                     stderr=subprocess.DEVNULL)
        while not self._n.recv(4096).decode().startswith("READY=1"):
            pass
        self.ready_s = time.monotonic() - self.t0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self._n.close()


def via_grpc(client: Client, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for item in client.stream(GenerationRequest(prompt=prompt, max_tokens=max_tokens)):
        now = time.perf_counter()
        if isinstance(item, Completion):
            n = len(item.token_ids)
        elif item.text:
            first = first or now
            last = now
    return first - t0, (n - 1) / (last - first), n


def via_http(host: str, port: int, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    conn = http.client.HTTPConnection(host, port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions",
                 body=json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                                  "stream": True, "stream_options": {"include_usage": True}}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    first = last = None
    n = 0
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        now = time.perf_counter()
        obj = json.loads(line[6:])
        if obj.get("usage"):
            n = obj["usage"]["completion_tokens"]
        elif obj["choices"] and obj["choices"][0]["delta"].get("content"):
            first = first or now
            last = now
    conn.close()
    return first - t0, (n - 1) / (last - first), n


def overhead(args) -> None:
    with tempfile.TemporaryDirectory(prefix="ms-bench-") as d:
        cfg = Path(d) / "c.toml"
        cfg.write_text(CONFIG)
        served = Served(Path(d), config=cfg)
        try:
            with Client(str(served.sock), timeout=120) as client:
                host, port = client.status()["http_listen"].rsplit(":", 1)
                rows = {"grpc": [], "http": []}
                for p in PROMPTS:  # warm-up, not counted
                    via_grpc(client, p, 8)
                    via_http(host, int(port), p, 8)
                for r in range(args.rounds):
                    for i, p in enumerate(PROMPTS):
                        order = ("grpc", "http") if (r + i) % 2 == 0 else ("http", "grpc")
                        for kind in order:
                            out = (via_grpc(client, p, args.max_tokens) if kind == "grpc"
                                   else via_http(host, int(port), p, args.max_tokens))
                            rows[kind].append(out)
                    n = {k: [x[2] for x in v[-len(PROMPTS):]] for k, v in rows.items()}
                    assert n["grpc"] == n["http"], f"token counts differ: {n}"  # the same requests
        finally:
            served.stop()
    med = {k: (statistics.median(x[0] for x in v) * 1e3, statistics.median(x[1] for x in v))
           for k, v in rows.items()}
    (gt, gs), (ht, hs) = med["grpc"], med["http"]
    print(f"{args.rounds} rounds x {len(PROMPTS)} prompts, max_tokens {args.max_tokens}, medians per request:")
    print(f"  gRPC  TTFT {gt:7.2f} ms   decode {gs:6.2f} tok/s")
    print(f"  HTTP  TTFT {ht:7.2f} ms   decode {hs:6.2f} tok/s")
    print(f"  HTTP/gRPC tok/s {hs / gs:.3f}x (need >= 0.97)   TTFT {ht - gt:+.2f} ms (need <= +5)")


def cost(args) -> None:
    rows = {False: [], True: []}
    for _ in range(args.rounds):
        for http in (False, True):
            with tempfile.TemporaryDirectory(prefix="ms-cost-") as d:
                s = Served(Path(d), http=http)
                time.sleep(0.5)
                rows[http].append((s.ready_s, psutil.Process(s.proc.pid).memory_info().rss / 2**20))
                s.stop()
    for http, r in rows.items():
        print(f"--http {'on ' if http else 'off'}: READY=1 after {statistics.median(x[0] for x in r):.2f} s, "
              f"RSS {statistics.median(x[1] for x in r):.1f} MiB (medians of {len(r)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cost", action="store_true", help="RSS and start-up time with and without --http")
    args = ap.parse_args()
    cost(args) if args.cost else overhead(args)


if __name__ == "__main__":
    main()
