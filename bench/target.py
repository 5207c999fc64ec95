"""Target-only kernels of each variant, side by side with llama.cpp on the same GGUF.

    python bench/target.py [--model NAME] [--variant q4 --variant fp32] [--threads 2] [--json out.json]
                           [--native-isa avx2,avx512] [--no-llama-cpp] [--no-onnx]
                           [--prompt-tokens 512] [--decode-tokens 128]

A long prompt (--prompt-tokens 8000: decode after a long document) repeats the text, and every
engine gets a context that holds it.

Per engine (each ONNX variant through ONNX Runtime, and memspec's native engine on the GGUF
itself, `native`): load time and RSS, prefill tok/s and time to first token, decode
tok/s (greedy, one token per step), and cost(k)/cost(1) for k = 1..16 (one
target pass over k tokens against a single-token pass: what verification
costs).  llama.cpp (llama-cpp-python, `pip install -e .[bench]`) runs the same
token ids with the same thread count in a subprocess; the two are interleaved
round by round so that machine noise hits both, and medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

from memspec.config import load_config
from memspec.errors import ModelNotFoundError
from memspec.runtime import kernels
from memspec.runtime.config import SessionConfig
from memspec.runtime.native_target import NativeTarget
from memspec.runtime.sessions import DecoderSession
from memspec.models.store import ModelStore
from memspec.models.tokenizer import Tokenizer

TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships. Later, towers were built "
    "so that the light could be seen from farther away. The Pharos of Alexandria, completed around 280 BC, was "
    "one of the Seven Wonders of the Ancient World. In the modern era, lighthouses used oil lamps, then "
    "electric lamps with Fresnel lenses that concentrate the light into a beam. Today most lighthouses are "
    "automated, and satellite navigation has reduced their importance, but many still stand as landmarks. "
) * 8

LLAMA_CPP_SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"], n_batch=512,
            verbose=False, use_extra_bufts=False)  # AMX weight buffers SIGILL on some VMs
ids = cfg["prompt"]
n_vocab = llm.n_vocab()
def last_argmax():  # the last row of logits, read in place (llm.scores only holds n_batch rows)
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())
out = {"prefill_s": [], "decode_s": []}
for _ in range(cfg["repeats"]):
    llm.reset()
    t = time.perf_counter(); llm.eval(ids); out["prefill_s"].append(time.perf_counter() - t)
    tok = last_argmax()
    t = time.perf_counter()
    for _ in range(cfg["decode"]):
        llm.eval([tok]); tok = last_argmax()
    out["decode_s"].append(time.perf_counter() - t)
del llm
# cost(k): one pass over k tokens after 256 cached ones, every row's logits kept, as verification needs
llm = Llama(cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"], n_batch=512,
            verbose=False, use_extra_bufts=False, logits_all=True)
llm.eval(ids[:256])
out["cost_s"] = {}
for k in range(1, cfg["max_k"] + 1):
    times = []
    for _ in range(3 * cfg["repeats"]):
        llm.n_tokens = 256  # eval() trims the KV cache back to n_tokens first
        t = time.perf_counter(); llm.eval(ids[256:256 + k]); times.append(time.perf_counter() - t)
    out["cost_s"][k] = sorted(times)[len(times) // 2]
print(json.dumps(out))
"""


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_engine(load, prompt: list[int], args) -> dict:
    """One engine's figures; load() makes its target (memspec.runtime.target.Target)."""
    before = rss_mb()
    t = time.perf_counter()
    s = load()
    load_s = time.perf_counter() - t
    cache = s.new_cache()
    s.forward(cache, prompt[:8], keep=1)  # warm-up
    res = {"load_s": round(load_s, 3), "rss_mb": round(rss_mb() - before, 1)}

    def prefill():
        cache.truncate(0)
        return s.forward(cache, prompt, keep=1)

    res["prefill_ms"] = median_ms(prefill, args.repeats)
    res["prefill_tok_per_s"] = len(prompt) / res["prefill_ms"] * 1e3
    decode = []
    for _ in range(args.repeats):
        logits = prefill()
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            logits = s.forward(cache, [int(logits[-1].argmax())], keep=1)
        decode.append(time.perf_counter() - t)
    res["decode_tok_per_s"] = args.decode_tokens / statistics.median(decode)
    cache.truncate(0)
    s.forward(cache, prompt[:256], keep=1)
    base = cache.length
    cost = {}
    for k in range(1, args.max_k + 1):
        def step():
            cache.truncate(base)
            s.forward(cache, prompt[256: 256 + k], keep=k)
        cost[k] = median_ms(step, 3 * args.repeats)
    res["cost_ms"] = {k: round(v, 3) for k, v in cost.items()}
    res["cost_ratio"] = {k: round(v / cost[1], 3) for k, v in cost.items()}
    return res


def bench_llama_cpp(gguf: Path, prompt: list[int], args, context: int = 2048) -> dict | None:
    cfg = {"gguf": str(gguf), "threads": args.threads, "prompt": prompt, "repeats": args.repeats,
           "decode": args.decode_tokens, "max_k": args.max_k, "n_ctx": context}
    proc = subprocess.run([sys.executable, "-c", LLAMA_CPP_SCRIPT, json.dumps(cfg)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"llama.cpp run failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    pre = statistics.median(raw["prefill_s"])
    cost = {int(k): v * 1e3 for k, v in raw["cost_s"].items()}
    return {"prefill_ms": pre * 1e3, "prefill_tok_per_s": len(prompt) / pre,
            "decode_tok_per_s": args.decode_tokens / statistics.median(raw["decode_s"]),
            "cost_ms": {k: round(v, 3) for k, v in cost.items()},
            "cost_ratio": {k: round(v / cost[1], 3) for k, v in cost.items()}}


def weight_bytes_per_token(onnx_path: Path, gguf: Path) -> tuple[int, int]:
    """Bytes of weights one decode step reads: memspec's graph (the initializers of every node but the
    gathers, which read one row of the embedding table and of the rotary tables) and the GGUF's
    (every tensor but token_embd, unless it is also the LM head).  Decoding is memory-bound, so
    their ratio is about the floor of the time ratio."""
    import onnx
    from gguf import GGUFReader
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    read = {x for n in graph.node if not n.op_type.startswith("Gather") for x in n.input}
    ours = sum(int(ExternalDataInfo(t).length) if uses_external_data(t) else len(t.raw_data) or t.ByteSize()
               for t in graph.initializer if t.name in read and t.name not in ("cos_cache", "sin_cache"))
    tensors = GGUFReader(str(gguf)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    theirs = sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")
    return ours, theirs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", metavar="NAME", help="target from the store (default: [model] target of --config)")
    ap.add_argument("--config", metavar="FILE", help="memspec TOML config (for [model] target and the store)")
    ap.add_argument("--variant", action="append", choices=("fp32", "q4"))
    ap.add_argument("--threads", type=int, default=psutil.cpu_count(logical=False) or 2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of memspec and llama.cpp")
    ap.add_argument("--max-k", type=int, default=16)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-native", action="store_true", help="leave out memspec's native engine")
    ap.add_argument("--no-onnx", action="store_true", help="leave out the ONNX variants (native and llama.cpp only)")
    ap.add_argument("--native-isa", metavar="PATHS",
                    help="run the native engine once per dispatch path, e.g. avx2,avx512 (default: the best here)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.prompt_tokens < 256 + args.max_k:  # cost(k) feeds prompt[256:256 + k] after 256 cached tokens
        ap.error(f"--prompt-tokens {args.prompt_tokens}: cost(k) needs at least 256 + --max-k ({256 + args.max_k})")
    config = load_config(args.config)
    store = ModelStore(config.store_home)
    try:
        m = store.get(args.model or config.model.target)
    except ModelNotFoundError as exc:
        print(f"target: {exc}", file=sys.stderr)
        return 2
    variants = [] if args.no_onnx else args.variant or [v for v in ("q4", "fp32") if v in m.variants]
    tok = Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")
    text = TEXT * (1 + args.prompt_tokens // 900)  # TEXT is about 1,100 tokens: long prompts repeat it
    prompt = tok.encode(text)[: args.prompt_tokens]
    context = max(2048, len(prompt) + args.decode_tokens + args.max_k + 16)  # the engines' context: room for it all
    gguf = store.gguf_path(m)
    if gguf is None or not gguf.is_file():
        print(f"target: no GGUF for {m.name} in the store ({gguf}); memspec pull {m.name} fetches it", file=sys.stderr)
        return 2
    loaders = {v: (lambda v=v: DecoderSession(m.variant_path(v), SessionConfig(max_context=context,
                                                                           intra_op_threads=args.threads)))
               for v in variants}
    if not args.no_native and kernels.available():  # memspec's native engine on the GGUF itself
        isas = args.native_isa.split(",") if args.native_isa else [None]
        unknown = [i for i in isas if i is not None and i not in kernels.isas()]
        if unknown:
            ap.error(f"--native-isa {','.join(unknown)}: this CPU runs {', '.join(kernels.isas())}")
        for isa in isas:
            name = f"native-{isa}" if isa else "native"
            loaders[name] = lambda isa=isa: NativeTarget(gguf, threads=args.threads, max_context=context, isa=isa)
    rounds: dict[str, list[dict]] = {name: [] for name in loaders}
    rounds["llama.cpp"] = []
    for r in range(args.rounds):
        for name, load in loaders.items():
            rounds[name].append(bench_engine(load, prompt, args))
        if not args.no_llama_cpp:
            lc = bench_llama_cpp(gguf, prompt, args, context)
            if lc:
                rounds["llama.cpp"].append(lc)
    results = {name: _median_of(runs) for name, runs in rounds.items() if runs}
    report(results, args, len(prompt))
    if "q4" in variants:
        ours, theirs = weight_bytes_per_token(m.variant_path("q4"), gguf)
        results["q4"]["weight_mb_per_token"] = round(ours / 1e6, 1)
        print(f"weights read per decode step: q4 {ours / 1e6:.0f} MB, the GGUF {theirs / 1e6:.0f} MB "
              f"({ours / theirs:.2f}x: MatMulNBits keeps a float32 scale per block of 32, Q6_K as 8-bit "
              f"blocks of 16, and Q4_K's mins as a float32 block-sum correction)")
    if args.json:
        Path(args.json).write_text(json.dumps({"prompt_tokens": len(prompt), "threads": args.threads,
                                               "results": results}, indent=2))
    return 0


def _median_of(runs: list[dict]) -> dict:
    out = {}
    for key, val in runs[0].items():
        if isinstance(val, dict):
            out[key] = {k: round(statistics.median(r[key][k] for r in runs), 3) for k in val}
        elif key == "rss_mb":  # only the first load in this process shows the model's footprint
            out[key] = round(max(r[key] for r in runs), 3)
        else:
            out[key] = round(statistics.median(r[key] for r in runs), 3)
    return out


def report(results: dict, args, n_prompt: int) -> None:
    lc = results.get("llama.cpp")
    print(f"\nprompt {n_prompt} tokens, decode {args.decode_tokens} tokens, {args.threads} threads, "
          f"medians of {args.rounds} interleaved rounds x {args.repeats} repeats")
    print(f"{'engine':<11} {'decode tok/s':>12} {'vs llama.cpp':>12} {'prefill tok/s':>13} {'vs llama.cpp':>12} "
          f"{'TTFT ms':>8} {'load s':>7} {'RSS MB':>7}")
    for name, r in results.items():
        d_ratio = f"{r['decode_tok_per_s'] / lc['decode_tok_per_s']:.2f}x" if lc else "-"
        p_ratio = f"{r['prefill_tok_per_s'] / lc['prefill_tok_per_s']:.2f}x" if lc else "-"
        print(f"{name:<11} {r['decode_tok_per_s']:>12.1f} {d_ratio:>12} {r['prefill_tok_per_s']:>13.1f} "
              f"{p_ratio:>12} {r['prefill_ms']:>8.1f} {r.get('load_s', float('nan')):>7.2f} "
              f"{r.get('rss_mb', float('nan')):>7.0f}")
    for name, r in results.items():
        if "cost_ratio" in r:
            ks = ", ".join(f"{k}:{v:.2f}" for k, v in r["cost_ratio"].items())
            print(f"cost(k)/cost(1) {name}: {ks}")


if __name__ == "__main__":
    sys.exit(main())
