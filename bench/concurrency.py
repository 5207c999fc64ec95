"""N concurrent clients against the real daemon: aggregate and per-request speed, time to first token.

    flock /tmp/memspec-bench.lock python bench/concurrency.py --clients 1,2,4 \\
        --tree old=/tmp/base19 --tree new=.:bench/batching.toml [--prompts 16] [--max-tokens 128] [--rounds 2]

Each --tree LABEL=PATH[:CONFIG] is a memspec source tree (PYTHONPATH) and the config its daemon
runs with (none: the defaults).  All daemons are started first, each on its own socket; then,
round after round, every client count runs on every tree in turn (interleaved, so that the
machine's drift falls on all alike).  A run sends the same prompts (the built-in workload, one of
each category in turn, greedy) from N client threads that take the next prompt as they finish
one, and reports:

  agg_tok_s     completion tokens of all requests / wall time of the run
  req_tok_s     per-request decode speed (the daemon's tok_per_s): p50 and p10
  ttft_ms       time to first token as the client saw it: p50 and p99

The summary gives the median over rounds of each figure, and the ratios the issue asks for:
agg at N / agg at 1 on the same tree, each tree's agg over the first tree's, and p10 at N over the
single-client p50.
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


def start_daemon(label: str, tree: str, config: str | None, folder: Path) -> tuple[subprocess.Popen, Path]:
    sock = folder / f"{label}.sock"
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    cmd = [sys.executable, "-m", "memspec.cli", *(["--config", config] if config else []),
           "serve", "--listen", str(sock)]
    log = open(folder / f"{label}.log", "ab")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    from memspec.serving.client import wait_until_serving

    if wait_until_serving(str(sock), lambda: proc.poll() is None, 300, poll=0.3):
        return proc, sock
    if proc.poll() is not None:
        raise SystemExit(f"the {label} daemon exited with {proc.returncode}; see {folder / (label + '.log')}")
    proc.kill()
    raise SystemExit(f"the {label} daemon did not start serving within 300 s")


def prompts(n: int) -> list[str]:
    """n prompts of the built-in workload, taking each category in turn."""
    from memspec.bench.policies import load_workload

    by_cat: dict[str, list[str]] = {}
    for item in load_workload(None):
        by_cat.setdefault(item["category"], []).append(item["prompt"])
    cats = sorted(by_cat)
    return [by_cat[cats[i % len(cats)]][i // len(cats)] for i in range(n)]


def run(sock: Path, texts: list[str], clients: int, max_tokens: int) -> dict:
    from memspec.request import Completion
    from memspec.serving.client import Client

    todo = list(enumerate(texts))
    lock = threading.Lock()
    done: list[dict] = []

    def client() -> None:
        with Client(str(sock), timeout=600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    _, text = todo.pop(0)
                t0 = time.perf_counter()
                first = None
                for item in c.generate(text, max_tokens=max_tokens, temperature=0.0):
                    if first is None:
                        first = time.perf_counter() - t0
                    if isinstance(item, Completion):
                        with lock:
                            done.append({"tokens": len(item.token_ids), "tok_s": item.timings["tok_per_s"],
                                         "ttft_ms": first * 1e3})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
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
    args = ap.parse_args()
    trees = []
    for spec in args.tree:
        label, _, rest = spec.partition("=")
        path, _, config = rest.partition(":")
        if not label or not path:
            raise SystemExit(f"--tree {spec!r}: expected LABEL=PATH[:CONFIG]")
        trees.append((label, path, config or None))
    counts = [int(x) for x in args.clients.split(",")]
    texts = prompts(args.prompts)
    folder = Path(tempfile.mkdtemp(prefix="memspec-conc-"))
    procs = {}
    try:
        for label, path, config in trees:
            procs[label] = start_daemon(label, path, config, folder)
        for label, _ in procs.items():  # warm-up: the first requests load drafts
            run(procs[label][1], texts[:4], 2, 16)
        runs: list[dict] = []
        for r in range(args.rounds):
            for n in counts:
                for label, _, _ in trees:
                    res = run(procs[label][1], texts, n, args.max_tokens)
                    res.update(tree=label, clients=n, round=r)
                    runs.append(res)
                    print(json.dumps(res), flush=True)
        summary = summarise(runs, [t[0] for t in trees], counts)
        print(json.dumps(summary, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            proc.wait(60)


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
