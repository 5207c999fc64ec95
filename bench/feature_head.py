"""A head on the target's features, end to end: answers, features, training, held-out agreement.

    python bench/feature_head.py --model smollm2-135m [--per-domain 40] [--max-new 96] \
        [--workload bench/fresh_mixed.jsonl] [--work /tmp/feature-head] [--epochs 4] [--coverage 0.99] \
        [--vocab-size 0]

The target answers training prompts (memspec.training.prompts: every domain, never a benchmark's
prompt nor a near copy of one) and the held-out workload's prompts greedily on the native engine
(NativeTeacher; cached in --work).  Its answers are teacher-forced in prefill chunks for their
hidden states (memspec.training.features), the draft vocabulary cut to the tokens covering 99% of
the training answers.  Heads (memspec.training.heads) are trained with torch on the CPU and
measured on the held-out answers: top-1 agreement with the target's token t + 2 from row t, per
category, and the held-out share of the target's tokens the draft vocabulary holds (the ceiling of
any head on it).  The step cost is a head's proposal for one row (NumPy on one BLAS thread, as a
draft step runs beside the target's pool) and a target step (one token after 64), interleaved,
medians of 60.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before NumPy loads its BLAS
    os.environ.setdefault(_var, "1")

from memspec.training import log  # noqa: E402


def answers(teacher, tok, texts: list[str], max_new: int, path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer) per text, cached in `path`."""
    if path.is_file():
        return [(r["prompt"], r["answer"]) for r in json.loads(path.read_text())]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    t0 = time.perf_counter()
    recs = teacher.answers(prompts, max_new, tok.eos_token_ids)
    n = sum(len(r["answer"]) for r in recs)
    log(f"answers: {len(texts)} prompts, {n} tokens in {time.perf_counter() - t0:.0f} s")
    path.write_text(json.dumps([{"prompt": r["prompt"], "answer": r["answer"]} for r in recs]))
    return [(r["prompt"], r["answer"]) for r in recs]


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn `repeats` times (a busy machine slows all alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(v)) for name, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-domain", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--workload", default=str(Path(__file__).resolve().parent / "fresh_mixed.jsonl"))
    ap.add_argument("--work", default="/tmp/feature-head")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--coverage", type=float, default=0.99, help="share of the training answers' tokens the "
                    "draft vocabulary covers")
    ap.add_argument("--vocab-size", type=int, default=0, help="fill the draft vocabulary up to this many ids "
                    "with the lowest ids (features.draft_vocabulary)")
    args = ap.parse_args(argv)

    from memspec.models.gguf import GGUFModel
    from memspec.models.store import ModelStore, default_home
    from memspec.models.tokenizer import Tokenizer
    from memspec.runtime.native_target import NativeTarget
    from memspec.training.features import (draft_vocabulary, extract_features, load_features, save_features,
                                           to_draft_ids)
    from memspec.training.heads import Head, HeadConfig, agreement, train_head
    from memspec.training.prompts import DOMAINS, domain_prompts
    from memspec.training.teacher import NativeTeacher

    store = ModelStore(default_home())
    gguf = store.gguf_of(store.get(args.model))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(gguf)
    teacher = NativeTeacher(gguf, threads=args.threads)
    train_texts = [p for d in DOMAINS for p in domain_prompts(d, args.per_domain)]
    held = [json.loads(line) for line in Path(args.workload).read_text().splitlines() if line.strip()]
    train_seqs = answers(teacher, tok, train_texts, args.max_new, work / f"train-{args.per_domain}-{args.max_new}.json")
    eval_seqs = answers(teacher, tok, [h["prompt"] for h in held], args.max_new,
                        work / f"eval-{Path(args.workload).stem}-{args.max_new}.json")
    del teacher

    target = NativeTarget(gguf, threads=args.threads, check_rows=False)
    vocab = draft_vocabulary([a for _, a in train_seqs], target.vocab_size, args.coverage,
                             required=sorted(tok.eos_token_ids), size=args.vocab_size)
    log(f"draft vocabulary: {len(vocab)} of {target.vocab_size} ids ({args.coverage:.0%} of the training answers' "
        f"tokens, filled to {args.vocab_size})")
    data = {}
    for name, seqs in (("train", train_seqs), ("eval", eval_seqs)):
        path = work / f"features-{name}-{args.per_domain}-{args.max_new}.npz"
        if not path.is_file():
            t0 = time.perf_counter()
            save_features(path, extract_features(target, seqs, vocab, features=(-1,)))
            rows = sum(len(p) + len(a) - 1 for p, a in seqs)
            log(f"features {name}: {rows} rows in {time.perf_counter() - t0:.1f} s")
        data[name] = d = load_features(path)
        if not np.array_equal(d["vocab"], vocab):  # the states do not depend on it: relabel only
            d["vocab"], d["next_draft"], d["top_draft"] = vocab, *(to_draft_ids(d[k], vocab, target.vocab_size)
                                                                  for k in ("next", "top"))

    g = GGUFModel(gguf)
    embedding = g.float32("token_embd.weight")
    lm_head = embedding if g.config.tied_embeddings else g.float32("output.weight")
    groups = {i: h.get("category", "") for i, h in enumerate(held)}
    report = {"model": args.model, "coverage": args.coverage, "vocab_size": args.vocab_size,
              "draft_vocab": int(len(vocab)), "train_rows": int(len(data["train"]["seq"])),
              "eval_rows": int(len(data["eval"]["seq"])),
              "eval_vocab_coverage": round(float((data["eval"]["top_draft"] >= 0).mean()), 4), "heads": {}}
    # the target's own head cut to the draft vocabulary (W2 at zero): the features are the head's input
    H = embedding.shape[1]
    own = Head(np.zeros((1, H), np.float32), np.zeros(1, np.float32), np.zeros((H, 1), np.float32),
               lm_head[vocab].astype(np.float32), None, vocab, target.vocab_size, HeadConfig(ahead=1, hydra=False))
    report["heads"]["target head, t+1"] = agreement(own, data["eval"], groups)
    heads = {}
    for name, cfg in (("medusa t+2", HeadConfig(ahead=2, hydra=False, epochs=args.epochs, threads=args.threads)),
                      ("hydra t+2", HeadConfig(ahead=2, hydra=True, epochs=args.epochs, threads=args.threads))):
        head, record = train_head(data["train"], embedding, lm_head, cfg, target.vocab_size)
        head.save(work / f"{name.replace(' ', '-').replace('+', '')}-{len(vocab)}.npz")
        rep = agreement(head, data["eval"], groups)
        rep["train"] = record
        rep["train_agreement"] = agreement(head, data["train"])["agreement"]
        rep["bytes"] = head.nbytes
        report["heads"][name], heads[name] = rep, head
        log(f"{name}: {rep}")
    cache = target.new_cache()
    target.forward(cache, list(range(1000, 1064)))

    def step():
        target.forward(cache, [1064])
        cache.truncate(64)

    h1, n1 = data["eval"]["hidden"][:1, -1], data["eval"]["top"][:1]
    fns = {"target": step, **{name: (lambda h=h: h.propose(h1, n1)) for name, h in heads.items()}}
    medians = interleaved_medians(fns, 60)
    report["target_step_seconds"] = round(medians["target"], 5)
    for name in heads:
        report["heads"][name]["step_seconds"] = round(medians[name], 5)
        report["heads"][name]["step_fraction"] = round(medians[name] / medians["target"], 4)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
