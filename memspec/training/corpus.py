"""The suffix draft's shipped corpus: the target's own greedy answers to training prompts.

    memspec build-corpus --model smollm2-135m [--per-domain 150] [--max-new 128] [--seed 0] \
        [--out models/corpus-smollm2-135m.npz]

The suffix draft (memspec.speculation.suffix) proposes what followed the context's end in what the
daemon has seen; a daemon that has served nothing has seen nothing, and on a small target, where
a model draft costs too much of a step to pay, copies are the draft that pays.  The corpus is
what the target itself writes: its greedy answers (the native engine, NativeTeacher) to prompts
drawn from memspec.training.prompts for every domain, never a benchmark's prompt nor a near copy
of one (tests/test_contamination.py draws them again from the provenance the file records).  The
suffix draft keeps it in an index of its own that requests never evict.

The file's format: memspec.speculation.corpus.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from memspec.speculation.corpus import Corpus, corpus_path
from memspec.training import log

PER_DOMAIN = 150
MAX_NEW = 128


def build_corpus(gguf: Path, target: str, per_domain: int = PER_DOMAIN, max_new: int = MAX_NEW, seed: int = 0,
                 threads: int = 0) -> Corpus:
    """The target's greedy answers to `per_domain` prompts of every domain (memspec.training.prompts,
    drawn with `seed`), each after its prompt in the target's chat template."""
    from memspec.models.tokenizer import Tokenizer
    from memspec.training.prompts import DOMAINS, domain_prompts
    from memspec.training.teacher import NativeTeacher

    tok = Tokenizer.from_gguf(gguf)
    teacher = NativeTeacher(gguf, threads=threads)
    texts = [p for d in DOMAINS for p in domain_prompts(d, per_domain, seed)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    t0 = time.perf_counter()
    recs = teacher.answers(prompts, max_new, tok.eos_token_ids)
    seqs = [np.asarray(list(r["prompt"]) + list(r["answer"]), dtype=np.int64) for r in recs]
    n = sum(len(r["answer"]) for r in recs)
    log(f"corpus: {len(texts)} prompts, {n} answer tokens in {time.perf_counter() - t0:.0f} s ({teacher.kind})")
    meta = {"target": target, "vocab": int(tok.vocab_size), "domains": list(DOMAINS), "per_domain": per_domain,
            "seed": seed, "max_new": max_new}
    return Corpus(seqs, meta)


def add_build_corpus_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("build-corpus", help="the target's answers, the suffix draft's corpus",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the target (a pulled model with a GGUF)")
    p.add_argument("--per-domain", type=int, default=PER_DOMAIN, help="prompts of each domain")
    p.add_argument("--max-new", type=int, default=MAX_NEW, help="answer tokens at most")
    p.add_argument("--seed", type=int, default=0, help="which prompts each domain's generator draws")
    p.add_argument("--threads", type=int, default=0, help="native threads (0: the physical cores)")
    p.add_argument("--out", default=None, help="the file (default: models/corpus-MODEL.npz in the checkout)")
    p.set_defaults(func=run_build_corpus)
    return p


def run_build_corpus(args) -> int:
    from memspec.models.store import SHIPPED_MODELS, ModelStore

    config = getattr(args, "config", None)
    store = ModelStore(config.store_home if config is not None else None)
    gguf = store.gguf_of(store.get(args.model))
    out = Path(args.out) if args.out else corpus_path(SHIPPED_MODELS, args.model)
    corpus = build_corpus(gguf, args.model, args.per_domain, args.max_new, args.seed, args.threads)
    corpus.save(out)
    print(f"{out}: {len(corpus.sequences)} sequences, {corpus.tokens} tokens")
    return 0
