"""N concurrent clients against the real daemon: aggregate and per-request speed, time to first token.

    flock /tmp/memspec-bench.lock python bench/concurrency.py --clients 1,2,4 \\
        --tree old=/tmp/base19 --tree new=.:bench/batching.toml [--prompts 16] [--max-tokens 128] [--rounds 2]
        [--llama-server qwen2.5-coder-1.5b [--llama-slots 8] [--llama-bin PATH]]

Each --tree LABEL=PATH[:CONFIG] is a memspec source tree (PYTHONPATH) and the config its daemon
runs with (none: the defaults).  All daemons are started first, each on its own socket; then,
round after round, every client count runs on every tree in turn (interleaved, so that the
machine's drift falls on all alike).  A run sends the same prompts (the built-in workload, one of
each category in turn, greedy, under the model's chat template) from N client threads that take
the next prompt as they finish one.  Every run starts cold: each server is started anew before it
and warmed on 4 other prompts of the workload (drafts loaded, the template and system prompt in
the prompt caches, as in a server that has been running), so that no run finds the prompts of an
earlier one in a cache (memspec's prefix cache, llama-server's cache_prompt).  It reports:

  agg_tok_s     completion tokens of all requests / wall time of the run
  req_tok_s     per-request decode speed (the daemon's tok_per_s): p50 and p10
  ttft_ms       time to first token as the client saw it: p50 and p99

The summary gives the median over rounds of each figure, and the ratios the issue asks for:
agg at N / agg at 1 on the same tree, each tree's agg over the first tree's, and p10 at N over the
single-client p50.

--llama-server MODEL adds llama.cpp's own server (bench/build_llama_cpp.sh builds it) on MODEL's GGUF
as one more tree, "llama-server", with --llama-slots parallel slots and continuous batching, sent
the same prompts as token ids under the same chat template, greedy, streamed; its per-request speed
is its own timings' predicted_per_second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


class Daemon:
    """A memspec daemon from one source tree, asked over gRPC on its own Unix socket."""

    def __init__(self, label: str, tree: str, config: str | None, folder: Path):
        self.label = label
        self.sock = folder / f"{label}.sock"
        root = Path(tree).resolve()
        env = dict(os.environ, PYTHONPATH=str(root))
        config = str(Path(config).resolve()) if config else None  # as given, from here
        # started in the tree itself: `python -m` puts its working directory before PYTHONPATH, so a
        # daemon started here would import this checkout's memspec whatever its tree
        cmd = [sys.executable, "-m", "memspec.cli", *(["--config", config] if config else []),
               "serve", "--listen", str(self.sock)]
        self.log = folder / f"{label}.log"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), env=env, cwd=root)
        from memspec.serving.client import wait_until_serving

        if wait_until_serving(str(self.sock), lambda: self.proc.poll() is None, 300, poll=0.3):
            return
        if self.proc.poll() is not None:
            raise SystemExit(f"the {label} daemon exited with {self.proc.returncode}; see {self.log}")
        self.proc.kill()
        raise SystemExit(f"the {label} daemon did not start serving within 300 s")

    def client(self):
        from memspec.serving.client import Client

        return Client(str(self.sock), timeout=600)

    def ask(self, conn, item: dict, max_tokens: int) -> dict:
        from memspec.request import Completion

        t0 = time.perf_counter()
        first = None
        for chunk in conn.generate(item["prompt"], max_tokens=max_tokens, temperature=0.0):
            if first is None:
                first = time.perf_counter() - t0
            if isinstance(chunk, Completion):
                return {"tokens": len(chunk.token_ids), "tok_s": chunk.timings.tok_per_s, "ttft_ms": first * 1e3}
        raise RuntimeError(f"{self.label}: the stream ended without a completion")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class LlamaServer:
    """llama.cpp's own server on the same GGUF: `slots` parallel slots, continuous batching on (its
    default), each slot with `ctx` tokens; asked on 127.0.0.1 with the prompt's token ids (the same
    chat template memspec applies), streaming, greedy, its prompt cache on (cache_prompt: a slot
    reuses what its last prompt shares with the next, as memspec's prefix cache does)."""

    def __init__(self, label: str, binary: str, gguf: str, slots: int, threads: int, ctx: int, folder: Path):
        import socket

        if not Path(binary).is_file():
            raise SystemExit(f"no llama-server at {binary}: build it with `bash bench/build_llama_cpp.sh` "
                             "and pass --llama-bin PATH")
        with socket.socket() as s:  # a free port, released for the server to take
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.label = label
        self.log = folder / f"{label}.log"
        t = str(threads)
        self.proc = subprocess.Popen(
            [binary, "-m", gguf, "-t", t, "-tb", t, "-c", str(slots * ctx), "-np", str(slots), "-cb",
             "--no-webui", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode} while loading; see {self.log}")
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"llama-server did not become ready in 300 s; see {self.log}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        import http.client

        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def client(self):
        import contextlib

        return contextlib.nullcontext()  # a connection per request: the server closes one after a stream

    def ask(self, _conn, item: dict, max_tokens: int) -> dict:
        import http.client

        body = json.dumps({"prompt": item["ids"], "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                           "cache_prompt": True, "stream": True})
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"{self.label}: HTTP {r.status}: {r.read()[:300]!r}")
            first = None
            for line in r:  # server-sent events: "data: {...}" lines
                if not line.startswith(b"data: "):
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                event = json.loads(line[6:])
                if event.get("stop"):
                    timings = event["timings"]
                    return {"tokens": int(timings["predicted_n"]), "tok_s": float(timings["predicted_per_second"]),
                            "ttft_ms": first * 1e3}
        finally:
            conn.close()
        raise RuntimeError(f"{self.label}: the stream ended without its last event")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


WORKLOAD = 48  # prompts in the built-in workload
WARM = 4  # of them, kept apart to warm each server on before a run


def prompts(n: int, target=None) -> list[dict]:
    """n prompts of the built-in workload, taking each category in turn; with `target` (a store
    manifest), each with its token ids under that model's chat template (what llama-server is sent)."""
    from memspec.bench.policies import load_workload, spread

    items = [{"prompt": item["prompt"]} for item in spread(load_workload(None), n)]
    if target is not None:
        from engines import chat_ids

        encode = chat_ids(target)
        for item in items:
            item["ids"] = encode(item["prompt"])
    return items


def run(server, items: list[dict], clients: int, max_tokens: int) -> dict:
    todo = list(items)
    lock = threading.Lock()
    done: list[dict] = []
    failed: list[BaseException] = []

    def client() -> None:
        try:
            with server.client() as conn:
                while True:
                    with lock:
                        if not todo or failed:
                            return
                        item = todo.pop(0)
                    res = server.ask(conn, item, max_tokens)
                    with lock:
                        done.append(res)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failed.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failed:
        raise failed[0]
    tps = sorted(d["tok_s"] for d in done)
    ttft = sorted(d["ttft_ms"] for d in done)
    q = lambda xs, p: xs[min(int(p * len(xs)), len(xs) - 1)]  # noqa: E731
    return {"agg_tok_s": sum(d["tokens"] for d in done) / wall, "req_tok_s_p50": statistics.median(tps),
            "req_tok_s_p10": q(tps, 0.10), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": q(ttft, 0.99),
            "requests": len(done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="LABEL=PATH[:CONFIG]")
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write every run and the summary here")
    ap.add_argument("--llama-server", metavar="MODEL",
                    help="also run llama.cpp's server on MODEL's GGUF (a pulled target), as the tree llama-server")
    ap.add_argument("--llama-slots", type=int, default=8, help="llama-server's parallel slots (-np; default 8)")
    ap.add_argument("--llama-ctx", type=int, default=2048, help="llama-server's context per slot (default 2048)")
    ap.add_argument("--llama-bin", metavar="PATH", default=os.environ.get("MEMSPEC_LLAMA_SERVER"),
                    help="the llama-server binary (default: $MEMSPEC_LLAMA_SERVER, else bench/build_llama_cpp.sh's)")
    ap.add_argument("--threads", type=int, help="llama-server's threads (default: the physical cores)")
    args = ap.parse_args()
    trees = []
    for spec in args.tree:
        label, _, rest = spec.partition("=")
        path, _, config = rest.partition(":")
        if not label or not path:
            raise SystemExit(f"--tree {spec!r}: expected LABEL=PATH[:CONFIG]")
        trees.append((label, path, config or None))
    counts = [int(x) for x in args.clients.split(",")]
    llama_target, llama_gguf = None, None
    if args.llama_server:
        from memspec.config import load_config
        from memspec.models.store import ModelStore

        from memspec.errors import MemspecError

        store = ModelStore(load_config(None).store_home)
        try:
            llama_target = store.get(args.llama_server)
            llama_gguf = store.gguf_of(llama_target)  # there, and the file it was pulled from
        except MemspecError as exc:
            raise SystemExit(f"--llama-server: {exc}") from None
    if args.prompts + WARM > WORKLOAD:
        raise SystemExit(f"--prompts: at most {WORKLOAD - WARM} (the workload's {WORKLOAD} prompts, less {WARM} "
                         f"to warm each server on)")
    items = prompts(args.prompts + WARM, llama_target)
    items, warm = items[:args.prompts], items[args.prompts:]
    folder = Path(tempfile.mkdtemp(prefix="memspec-conc-"))
    starts = {label: (lambda label=label, path=path, config=config: Daemon(label, path, config, folder))
              for label, path, config in trees}
    if llama_target is not None:
        from engines import default_llama_server
        from memspec.runtime.contracts import physical_cores

        starts["llama-server"] = lambda: LlamaServer(
            "llama-server", args.llama_bin or str(default_llama_server()), str(llama_gguf),
            args.llama_slots, args.threads or physical_cores(), args.llama_ctx, folder)
    runs: list[dict] = []
    for r in range(args.rounds):
        for n in counts:
            for label, start in starts.items():
                server = start()  # cold: started anew for each run
                try:
                    run(server, warm, 2, 16)  # drafts loaded, the chat template cached; not this run's prompts
                    res = run(server, items, n, args.max_tokens)
                finally:
                    server.close()
                res.update(tree=label, clients=n, round=r)
                runs.append(res)
                print(json.dumps(res), flush=True)
    summary = summarise(runs, list(starts), counts)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


def summarise(runs: list[dict], labels: list[str], counts: list[int]) -> dict:
    med = {}
    for label in labels:
        for n in counts:
            rs = [r for r in runs if r["tree"] == label and r["clients"] == n]
            med[(label, n)] = {k: round(statistics.median(r[k] for r in rs), 2)
                               for k in ("agg_tok_s", "req_tok_s_p50", "req_tok_s_p10", "ttft_ms_p50", "ttft_ms_p99")}
    out = {f"{label} N={n}": v for (label, n), v in med.items()}
    base = labels[0]
    for label in labels:
        one = med[(label, counts[0])]
        for n in counts:
            m = med[(label, n)]
            out[f"{label} N={n} ratios"] = {
                f"agg_over_N={counts[0]}": round(m["agg_tok_s"] / one["agg_tok_s"], 2),
                f"agg_over_{base}": round(m["agg_tok_s"] / med[(base, n)]["agg_tok_s"], 2),
                f"p10_over_N={counts[0]}_p50": round(m["req_tok_s_p10"] / one["req_tok_s_p50"], 2),
            }
    return out


if __name__ == "__main__":
    main()
