"""A second client's inter-token latency while a long prompt prefills, by [runtime] prefill_chunk.

    flock /tmp/memspec-bench.lock python bench/prefill_share.py --model smollm2-135m \\
        --prompt-tokens 4000 --chunks 0,fixed:512,512 [--short-tokens 256] [--floor 32] [--rounds 1] [--threads 0]

One target on the native engine, loaded once; for each chunk setting an engine with two batch
slots: N, chunks sized by time (batching.PrefillPace) of at most N tokens, as the daemon runs;
fixed:N, every chunk N tokens (the loop before chunks were sized by time); 0, the whole prompt in
one pass.  Client B streams a greedy answer of --short-tokens tokens (ask for enough that B is
still streaming when A's prefill ends); once it has 4 tokens, client A sends a prompt of
--prompt-tokens tokens (a document of the repository's own text) and waits for its first token.
Reported per setting: B's inter-token latency while A prefilled (median, p99, max, tokens B got
meanwhile), B's median before A came, p99 over the median during and over the median before, the
chunks A was fed in, and A's time to first token and prefill tok/s.  Issue 69's bar: p99 at most
3x the median while an 8k prompt prefills.  On a shared machine treat the figures as rough: run
it where nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

from memspec.config import Config
from memspec.request import Chunk, Completion, GenerationRequest
from memspec.runtime.config import SessionConfig
from memspec.speculation.batching import PREFILL_FLOOR, PrefillPace

DOCS = ("docs/architecture.md", "docs/serving.md", "docs/models.md", "docs/jetson.md")


def long_prompt(tokenizer, tokens: int) -> str:
    text = "".join(Path(p).read_text() for p in DOCS)
    ids = tokenizer.encode(text)
    while len(ids) < tokens:
        ids += ids
    return tokenizer.decode(ids[:tokens])


def one_run(engine, long_req: GenerationRequest, short_req: GenerationRequest) -> dict:
    stamps: list[float] = []
    a_window: dict[str, float] = {}
    four = threading.Event()

    def short() -> None:
        for item in engine.stream(short_req):
            if isinstance(item, Chunk) and item.token_ids:
                stamps.extend([time.perf_counter()] * len(item.token_ids))
                if len(stamps) >= 4:
                    four.set()

    def long() -> None:
        a_window["start"] = time.perf_counter()
        for item in engine.stream(long_req):
            if isinstance(item, Chunk) and "first" not in a_window:
                a_window["first"] = time.perf_counter()
            if isinstance(item, Completion):
                a_window["prompt"] = len(item.prompt_token_ids)

    tb = threading.Thread(target=short)
    tb.start()
    four.wait(300)
    ta = threading.Thread(target=long)
    ta.start()
    ta.join()
    tb.join()
    t = np.array(stamps)
    gaps = np.diff(t)
    during = gaps[(t[1:] > a_window["start"]) & (t[:-1] < a_window["first"])]
    before = gaps[t[1:] <= a_window["start"]]
    ttft = a_window["first"] - a_window["start"]
    p50 = float(np.median(during)) if len(during) else None
    p99 = float(np.percentile(during, 99)) if len(during) else None
    before_p50 = float(np.median(before)) if len(before) else None
    return {"itl_during_ms": {"p50": p50 and p50 * 1e3, "p99": p99 and p99 * 1e3,
                              "max": float(during.max() * 1e3) if len(during) else None, "tokens": int(len(during))},
            "itl_before_p50_ms": before_p50 and before_p50 * 1e3,
            "p99_over_p50": p99 / p50 if p50 else None, "p99_over_before_p50": p99 / before_p50 if before_p50 else None,
            "b_streamed_through": bool(t[-1] >= a_window["first"]),  # else B ended first: A went on alone
            "a_ttft_s": ttft, "a_prefill_tok_s": a_window["prompt"] / ttft, "a_prompt_tokens": a_window["prompt"]}


def logged(observe, fed: list[int]):
    """The pace's observe, also noting the prompt tokens of each pass that fed some."""
    def wrapped(steps: bool, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens:
            fed.append(prompt_tokens)
        observe(steps, prompt_tokens, seconds)
    return wrapped


def chunk_summary(fed: list[int]) -> dict:
    """The chunks of the passes that fed prompt tokens (B's own prompt included, first)."""
    if not fed:
        return {}
    return {"passes": len(fed), "min": min(fed), "median": float(np.median(fed)), "max": max(fed)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--chunks", default="0,fixed:512,512",
                   help="prefill_chunk settings: N (sized by time, at most N), fixed:N, 0 (one pass)")
    p.add_argument("--short-tokens", type=int, default=256, help="tokens client B asks for")
    p.add_argument("--floor", type=int, default=PREFILL_FLOOR, help="fewest tokens in a chunk sized by time")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    from memspec.models.store import ModelStore
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine

    store = ModelStore(Config().store_home)
    target = load_target(store, args.model, None, SessionConfig(backend="native", max_context=args.prompt_tokens + 512,
                                                                intra_op_threads=args.threads))
    long_req = GenerationRequest(prompt=long_prompt(target.tokenizer, args.prompt_tokens), raw=True, max_tokens=1)
    short_req = GenerationRequest(prompt="1, 2, 3, 4, 5,", raw=True, max_tokens=args.short_tokens)
    for r in range(args.rounds):
        for setting in args.chunks.split(","):
            chunk = int(setting.removeprefix("fixed:"))
            engine = Engine(target, batched=open_batched(target.session, 2), prefill_chunk=chunk or 10**9)
            fixed = setting.startswith("fixed:") or not chunk
            engine.batch.pace = PrefillPace(floor=10**9 if fixed else args.floor)  # fixed: never under the bound
            fed: list[int] = []
            engine.batch.pace.observe = logged(engine.batch.pace.observe, fed)
            out = one_run(engine, long_req, short_req)
            engine.close()
            print(json.dumps({"model": args.model, "round": r, "prefill_chunk": setting, **out,
                              "a_chunks": chunk_summary(fed)}), flush=True)


if __name__ == "__main__":
    main()
