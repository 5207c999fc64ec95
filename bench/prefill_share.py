"""A second client's inter-token latency while a long prompt prefills, by [runtime] prefill_chunk.

    flock /tmp/memspec-bench.lock python bench/prefill_share.py --model smollm2-135m \\
        --prompt-tokens 2000 --chunks 0,512,128,32 [--short-tokens 96] [--rounds 1] [--threads 0]

One target on the native engine, loaded once; for each chunk setting (0: the whole prompt in one
pass) an engine with two batch slots.  Client B streams a short greedy answer; once it has 4
tokens, client A sends a prompt of --prompt-tokens tokens (a document of the repository's own text)
and waits for its first token.  Reported per setting: B's inter-token latency while A prefilled
(median, p99, max, tokens B got meanwhile), B's median before A came, and A's time to first token
and prefill tok/s.  Issue 69's bar: p99 at most 3x the median while an 8k prompt prefills.  On a
shared machine treat the figures as rough: run it where nothing else runs.
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
    return {"itl_during_ms": {"p50": float(np.median(during) * 1e3) if len(during) else None,
                              "p99": float(np.percentile(during, 99) * 1e3) if len(during) else None,
                              "max": float(during.max() * 1e3) if len(during) else None, "tokens": int(len(during))},
            "itl_before_p50_ms": float(np.median(before) * 1e3) if len(before) else None,
            "a_ttft_s": ttft, "a_prefill_tok_s": a_window["prompt"] / ttft, "a_prompt_tokens": a_window["prompt"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--chunks", default="0,512,128,32", help="prefill_chunk settings; 0 = one pass")
    p.add_argument("--short-tokens", type=int, default=96, help="tokens client B asks for")
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
        for chunk in (int(c) for c in args.chunks.split(",")):
            engine = Engine(target, batched=open_batched(target.session, 2), prefill_chunk=chunk or 10**9)
            out = one_run(engine, long_req, short_req)
            engine.close()
            print(json.dumps({"model": args.model, "round": r, "prefill_chunk": chunk, **out}), flush=True)


if __name__ == "__main__":
    main()
