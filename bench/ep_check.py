"""Check an ONNX Runtime execution provider against the CPU, model by model.

    python bench/ep_check.py [--providers CUDAExecutionProvider,CPUExecutionProvider]
                             [--variants fp32,q4] [--json FILE]

For the target's variants and every draft made for it, each loaded once on the CPU and once
with the given providers (the way memspec loads them: shared KV buffers on the provider's
device, IOBinding), it reports:

* placement: whether the given providers take every node, or some fall back to the CPU.  A
  second session is opened with CPU fallback disabled; it loads only if no node needs the CPU,
  else its error names the node that does;
* logits: a real prompt fed as one prefill, then one token at a time through the KV cache, then
  rolled back 6 tokens and fed again as one verification pass.  The largest difference from the
  CPU's logits, and how often the argmax agrees;
* rollback: how far the provider's verification-pass logits are from its own one-token steps
  over the same positions (the speculative loop relies on the two agreeing);
* speed: the median time of a 1-token step and of a 6-token verification pass on each.

Exit status 1 if any model's argmax agreement with the CPU is below --min-agreement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from memspec.bench.policies import load_workload
from memspec.speculation.drafts import draft_variant, read_vocab_map, target_drafts, target_to_draft
from memspec.errors import MemspecError
from memspec.runtime.config import SessionConfig
from memspec.runtime.sessions import DecoderSession, resolve_providers
from memspec.models.store import ModelStore, default_home
from memspec.models.tokenizer import Tokenizer

TARGET = "smollm2-135m"
VERIFY = 6  # tokens in one verification pass (gamma 5 + 1)


def placement(path: Path, providers: list[str]) -> str:
    """'all nodes' if the providers other than the CPU take every node, else ORT's reason."""
    if providers[0] == "CPUExecutionProvider":
        return "all nodes (CPU)"
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as exc:  # ORT raises its own Fail/InvalidArgument types
        return "fallback needed: " + " ".join(str(exc).split())[:300]
    return "all nodes"


def run_sequence(session: DecoderSession, ids: list[int], prefill: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits of positions prefill-1 .. len(ids)-1: one prefill, then one token per step.  Then
    the last VERIFY tokens again, rolled back and fed as one pass.  Returns (steps, verify)."""
    cache = session.new_cache(len(ids) + 8)
    rows = [session.forward(cache, ids[:prefill], keep=1)[-1]]
    for t in ids[prefill:]:
        rows.append(session.forward(cache, [t], keep=1)[-1])
    cache.truncate(len(ids) - VERIFY)
    verify = session.forward(cache, ids[-VERIFY:], keep=VERIFY)
    return np.stack(rows), verify


def check_model(name: str, path: Path, ids: list[int], providers: list[str], max_context: int,
                threads: int) -> dict:
    cpu = DecoderSession(path, SessionConfig(providers=("CPUExecutionProvider",), max_context=max_context),
                         threads=threads)
    dev = DecoderSession(path, SessionConfig(providers=tuple(providers), max_context=max_context),
                         threads=threads)
    prefill = len(ids) // 2
    cpu_steps, _ = run_sequence(cpu, ids, prefill)
    dev_steps, dev_verify = run_sequence(dev, ids, prefill)
    # steps row i holds the logits at position prefill-1+i; verify row j, at len(ids)-VERIFY+j
    tail = dev_steps[len(ids) - VERIFY - prefill + 1:]
    cpu_cost = cpu.measure_step_costs(VERIFY)
    dev_cost = dev.measure_step_costs(VERIFY)
    return {
        "model": name,
        "file": path.name,
        "providers": list(dev.session.get_providers()),
        "kv_device": dev.device,
        "placement": placement(path, providers),
        "positions": int(len(cpu_steps)),
        "max_abs_logit_diff": float(np.max(np.abs(cpu_steps - dev_steps))),
        "argmax_agreement": float(np.mean(cpu_steps.argmax(-1) == dev_steps.argmax(-1))),
        "rollback_max_abs_diff": float(np.max(np.abs(tail - dev_verify))),
        "step_ms_cpu": [round(1e3 * cpu_cost[1], 3), round(1e3 * cpu_cost[VERIFY], 3)],
        "step_ms_dev": [round(1e3 * dev_cost[1], 3), round(1e3 * dev_cost[VERIFY], 3)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", default="CUDAExecutionProvider,CPUExecutionProvider",
                    help="comma-separated execution providers to check, in priority order")
    ap.add_argument("--variants", default="fp32,q4", help="target variants to check (comma-separated)")
    ap.add_argument("--tokens", type=int, default=96, help="prompt + continuation tokens per model")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per session (0: one per core)")
    ap.add_argument("--min-agreement", type=float, default=0.98)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    providers = resolve_providers([p.strip() for p in args.providers.split(",") if p.strip()])
    print(f"onnxruntime {ort.__version__}; available: {', '.join(ort.get_available_providers())}; "
          f"checking: {', '.join(providers)}")
    store = ModelStore(default_home())
    m = store.get(TARGET)
    folder = Path(m.folder)
    tok = Tokenizer.from_file(folder / "tokenizer.json", folder / "tokenizer_config.json")
    text = "\n".join(w["prompt"] for w in load_workload(None)[::8])
    target_ids = tok.encode(text)[: args.tokens]
    models = [(f"{TARGET}:{v}", m.variant_path(v), target_ids) for v in args.variants.split(",") if v]
    vocab = int(m.architecture["vocab"])
    for d in target_drafts(store, TARGET):
        to_draft = target_to_draft(read_vocab_map(d, vocab), vocab)
        models.append((d.name, d.variant_path(draft_variant(d)), to_draft[target_ids].tolist()))
    results, bad = [], []
    print(f"{'model':<22} {'placement':<10} {'max|dlogit|':>11} {'argmax':>7} {'rollback':>9} "
          f"{'cpu ms 1/6':>13} {'dev ms 1/6':>13}")
    for name, path, ids in models:
        r = check_model(name, path, ids, providers, args.tokens + 16, args.threads)
        results.append(r)
        place = "all" if r["placement"].startswith("all") else "fallback"
        print(f"{name:<22} {place:<10} {r['max_abs_logit_diff']:>11.2e} {r['argmax_agreement']:>7.3f} "
              f"{r['rollback_max_abs_diff']:>9.2e} {r['step_ms_cpu'][0]:>6.2f}/{r['step_ms_cpu'][1]:<6.2f} "
              f"{r['step_ms_dev'][0]:>6.2f}/{r['step_ms_dev'][1]:<6.2f}")
        if place == "fallback":
            print(f"  {r['placement']}")
        if r["argmax_agreement"] < args.min_agreement:
            bad.append(name)
    if args.json:
        Path(args.json).write_text(json.dumps({"onnxruntime": ort.__version__, "providers": providers,
                                               "results": results}, indent=1) + "\n")
    if bad:
        print(f"argmax agreement below {args.min_agreement}: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except MemspecError as exc:  # an unknown provider, a store without the target: say so, no traceback
        print(f"ep_check: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
