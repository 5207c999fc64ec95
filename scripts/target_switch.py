#!/usr/bin/env python3
"""The daemon's RSS against its memory budget while chat clients switch between two targets.

Starts `memspec serve --http` over a store holding SmolLM2-135M and Qwen2.5-Coder-0.5B (links to
the real store's folders), with a budget that holds one target at a time, samples the daemon's
RSS every 20 ms, and runs what a chat front end does through the `openai` SDK: list the models,
ask each, ask the first again, then two clients alternating between the two at once.  Writes a
figure (RSS and budget over time, loads and unloads marked) and prints the figures behind it.

Usage::

    python scripts/target_switch.py --budget-mb 1450 --out docs/target_switch_rss.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from openai import OpenAI

from memspec.models.store import ModelStore, default_home
from memspec.serving.client import Client, wait_until_serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from two_targets import QUESTION, QWEN, SMOL, config, store_of_two  # noqa: E402  (shared with the e2e test)

TARGETS = (SMOL, QWEN)


def sample(pid: int, out: list, stop: threading.Event, t0: float) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        try:
            out.append((time.monotonic() - t0, proc.memory_info().rss / 2**20))
        except psutil.NoSuchProcess:
            return
        stop.wait(0.02)


def flow(sdk: OpenAI, marks: list, t0: float) -> list[tuple[str, str, float]]:
    """List, ask each listed model, ask the first again; then two clients alternating."""
    answers = []

    def ask(model: str, who: str) -> None:
        s = time.monotonic()
        r = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
        answers.append((who, model, time.monotonic() - s, r.choices[0].message.content))
        marks.append((time.monotonic() - t0, f"{who}: {model}"))

    listed = [m.id for m in sdk.models.list().data]
    for model in [*listed, listed[0]]:
        ask(model, "one client")
    clients = [threading.Thread(target=lambda order, who: [ask(m, who) for m in order], args=(order, who))
               for order, who in ((list(TARGETS) * 2, "client a"), (list(reversed(TARGETS)) * 2, "client b"))]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    return answers


def events(log: Path, epoch0: float) -> list[tuple[float, str, str]]:
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    wanted = ("target loading", "target loaded", "target unloaded")
    return [(r["ts"] - epoch0, r["msg"], r["model"]) for r in rows if r["msg"] in wanted]


SHORT = {SMOL: "SmolLM2", QWEN: "0.5B"}


def plot(rss: list, evs: list, budget: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    started: dict[str, float] = {}
    for t, msg, model in evs:  # each load shaded from its start to its end, each unload a line
        if msg == "target loading":
            started[model] = t
        elif msg == "target loaded":
            t0 = started.pop(model, t)
            ax.axvspan(t0, t, color="green" if model == SMOL else "orange", alpha=0.15, lw=0)
            ax.text(t0 + 0.5, budget * 1.04, SHORT[model], fontsize=7, va="bottom")
        else:
            ax.axvline(t, color="grey", lw=0.7, ls=":")
    ax.plot([t for t, _ in rss], [m for _, m in rss], lw=1.2, label="daemon RSS")
    ax.axhline(budget, color="crimson", ls="--", lw=1, label=f"budget ({budget} MiB)")
    ax.set(xlabel="seconds since the daemon started", ylabel="MiB", ylim=(0, budget * 1.12))
    ax.set_title("SmolLM2 and Qwen2.5-Coder-0.5B, a budget that holds one: the daemon's RSS while clients "
                 "switch\n(shaded: a load, SmolLM2 green, the 0.5B orange; dotted: an unload)", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-mb", type=int, default=1450)
    ap.add_argument("--out", type=Path, default=Path("docs/target_switch_rss.png"))
    ap.add_argument("--data", type=Path, default=Path("/tmp/target_switch_rss.json"), help="the samples, as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ms-sw-") as d:
        folder = Path(d)
        conf, sock, log = folder / "c.toml", folder / "d.sock", folder / "d.log"
        conf.write_text(config(store_of_two(folder / "home", ModelStore(default_home()).models_dir), args.budget_mb))
        epoch0, t0 = time.time(), time.monotonic()
        with open(log, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "memspec.cli", "--config", str(conf), "serve",
                                     "--listen", str(sock), "--http", "127.0.0.1:0"], stderr=err,
                                    stdout=subprocess.DEVNULL, env=dict(os.environ))
        rss, marks, stop = [], [], threading.Event()
        threading.Thread(target=sample, args=(proc.pid, rss, stop, t0), daemon=True).start()
        try:
            if not wait_until_serving(str(sock), lambda: proc.poll() is None, 300):
                print(log.read_text()[-3000:], file=sys.stderr)
                return 1
            with Client(str(sock)) as c:
                sdk = OpenAI(base_url=f"http://{c.status()['http_listen']}/v1", api_key="-", timeout=900)
            answers = flow(sdk, marks, t0)
            hwm = int(next(x for x in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                           if x.startswith("VmHWM")).split()[1]) / 1024
        finally:
            stop.set()
            proc.terminate()
            proc.wait(60)
        evs = events(log, epoch0)
    plot(rss, evs, args.budget_mb, args.out)
    print(f"budget {args.budget_mb} MiB; peak RSS sampled {max(m for _, m in rss):.0f} MiB, VmHWM {hwm:.0f} MiB")
    args.data.write_text(json.dumps({"budget_mb": args.budget_mb, "rss": rss, "events": evs, "answers": answers}))
    print(f"{sum(1 for _, m, _ in evs if m == 'target loaded')} loads, "
          f"{sum(1 for _, m, _ in evs if m == 'target unloaded')} unloads")
    for who, model, s, text in answers:
        print(f"  {who:<10} {model:<20} {s:6.1f} s  {text!r}")
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
