"""The teacher's side of self-distillation (`memspec train-draft`): the target answers domain
prompts greedily and keeps its top-k log-probs at every answer position; those soft labels are a
domain's data set, cached in --work.

Two teachers give the same records (their `answers(prompts, max_new, eos)`, `eos` an end id or a
set of them):
- `NativeTeacher` (the default): the target on memspec's own kernels, the very blocks and kernels
  that verify the draft's tokens when it is served, so the draft learns the answers it will be
  checked against; sequences are decoded together, one batched pass a step.
- `TorchTeacher`: a torch copy built from the GGUF, its weights dequantized (float32, or run in
  bfloat16), for machines without the native kernels.

torch is imported inside functions only (memspec.training.require_torch).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from memspec.training import log, require_torch

TOP_K = 64  # teacher log-probs kept per answer position
HELD_OUT = 0.1  # fraction of each domain's prompts kept for evaluation


TEACHER_DTYPES = ("float32", "bfloat16")
TEACHERS = ("native", "torch")  # --teacher
NATIVE_BATCH = 32  # sequences a native teacher decodes together
NUCLEUS_CAP = 256  # the most ids nucleus sampling draws among


def load_teacher(gguf_path: Path, dtype: str = "float32"):
    """The target as a torch module, from its GGUF's weights dequantized to float32.

    dtype="bfloat16" runs it in bfloat16: about 2.4x faster on a CPU with AVX512-BF16 (a 1.5B
    target answers at 26 tok/s against 11 in float32, batch 32), and its greedy answers matched
    the q4 target's first 20 tokens on every prompt tried; a draft is trained on them, so a rare
    difference costs acceptance only, never correctness."""
    torch = require_torch()
    from memspec.models.gguf import GGUFModel
    from memspec.training.torch_model import Llama

    if dtype not in TEACHER_DTYPES:
        raise ValueError(f"teacher dtype {dtype!r} is not one of {', '.join(TEACHER_DTYPES)}")
    g = GGUFModel(gguf_path)
    model = Llama(g.config)
    model.load_tensors(g)
    return model.to(getattr(torch, dtype)).eval()


def end_ids(eos: int | set[int]) -> set[int]:
    """The ids an answer ends at: `eos` itself, or each of a set of them (a model with several)."""
    return {int(eos)} if isinstance(eos, (int, np.integer)) else {int(e) for e in eos}


def generate_answers(teacher, prompts: list[list[int]], max_new: int, eos: int | set[int],
                     batch: int = 64) -> list[dict]:
    """Greedy answers of the teacher with its top-k log-probs at every answer position.

    Prompts are sorted by length and left-padded per batch; positions and the
    attention mask skip the padding, so each row decodes as if alone.
    Returns per prompt {"prompt", "answer" (target ids, EOS included when produced),
    "top_ids" (n, K) int32, "top_lp" (n, K) float16}.
    """
    torch = require_torch()
    ends = torch.tensor(sorted(end_ids(eos)))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[dict | None] = [None] * len(prompts)
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        rows = [prompts[i] for i in idx]
        B, L = len(rows), max(len(r) for r in rows)
        ids = torch.zeros(B, L, dtype=torch.long)
        valid = torch.zeros(B, L, dtype=torch.bool)
        for r, p in enumerate(rows):
            ids[r, L - len(p):] = torch.tensor(p)
            valid[r, L - len(p):] = True
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        mask = (causal[None] & valid[:, None, :]) | torch.eye(L, dtype=torch.bool)[None]  # (B, L, L)
        cache: list = []
        answers = [[] for _ in range(B)]
        tops_i = [[] for _ in range(B)]
        tops_v = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        with torch.inference_mode():
            logits = teacher(ids, pos, mask[:, None], cache)[:, -1]
            cur = pos[:, -1]
            for _ in range(max_new):
                lp = torch.log_softmax(logits.float(), dim=-1)
                v, i = lp.topk(TOP_K, dim=-1)
                nxt = i[:, 0]
                for r in range(B):
                    if not done[r]:
                        answers[r].append(int(nxt[r]))
                        tops_i[r].append(i[r].numpy().astype(np.int32))
                        tops_v[r].append(v[r].numpy().astype(np.float16))
                done |= torch.isin(nxt, ends)
                if bool(done.all()):
                    break
                valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool)], dim=1)
                cur = cur + 1
                logits = teacher(nxt[:, None], cur[:, None], valid[:, None, None, :], cache)[:, -1]
        for r, i in enumerate(idx):
            out[i] = {"prompt": prompts[i], "answer": answers[r],
                      "top_ids": np.stack(tops_i[r]), "top_lp": np.stack(tops_v[r])}
        log(f"  generated {min(b0 + batch, len(order))}/{len(order)} (prompt len {L})")
    return out


def top_logprobs(logits: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """The k best ids of each row of (B, V) logits, best first (equal logits by lower id, so the
    first is np.argmax's, the greedy token), and their log-probabilities: (B, k) int32, float16."""
    logits = np.asarray(logits, dtype=np.float32)
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logits, idx, axis=1)
    order = np.lexsort((idx, -vals), axis=1)
    idx, vals = np.take_along_axis(idx, order, axis=1), np.take_along_axis(vals, order, axis=1)
    return idx.astype(np.int32), (vals - lse).astype(np.float16)


class TorchTeacher:
    """The target as a torch module (load_teacher), answering with generate_answers."""

    def __init__(self, gguf_path: Path, dtype: str = "float32"):
        self.model = load_teacher(gguf_path, dtype)
        self.kind = f"torch {dtype}"

    def answers(self, prompts: list[list[int]], max_new: int, eos: int | set[int]) -> list[dict]:
        return generate_answers(self.model, prompts, max_new, eos)


class NativeTeacher:
    """The target on the native engine (memspec.runtime.native_target): each answer is, token for
    token, what the served target alone answers greedily, since a row's logits do not depend on
    what shares its pass.  Up to NATIVE_BATCH sequences are decoded together, one pass a step, a
    finished one's slot taken by the next prompt."""

    def __init__(self, gguf_path: Path, threads: int = 0, batch: int = NATIVE_BATCH):
        from memspec.errors import MemspecError
        from memspec.runtime.config import SessionConfig
        from memspec.runtime.target import open_draft

        # opened as a draft is (the runtime's factory, no row check at load): its answers are labels,
        # and a row's logits are the same whatever shares its pass by construction (model.h)
        try:
            self.target = open_draft(Path(gguf_path), "native", SessionConfig(max_context=4096), threads)
        except ImportError as exc:  # the native kernels were not built on this machine
            raise MemspecError(f"the native teacher needs memspec's native kernels: {exc}; or pass --teacher torch "
                               f"(--teacher-dtype float32|bfloat16)") from None
        self.batch = batch
        self.kind = f"{self.target.providers[0]}, {self.target.threads} threads"

    def answers(self, prompts: list[list[int]], max_new: int, eos: int | set[int]) -> list[dict]:
        """Greedy answers with the top-k log-probs at every answer position, the records
        generate_answers gives: {"prompt", "answer" (the end token included when produced: `eos`, or
        any of a set of them), "top_ids" (n, K) int32, "top_lp" (n, K) float16}."""
        tops: list[tuple[list, list]] = [([], []) for _ in prompts]

        def greedy(logits: np.ndarray, rows: list[int]) -> list[int]:
            top_i, top_v = top_logprobs(logits)
            for j, i in enumerate(rows):
                tops[i][0].append(top_i[j])
                tops[i][1].append(top_v[j])
            return top_i[:, 0].tolist()

        answers = self._decode(prompts, max_new, end_ids(eos), greedy, "generated")
        return [{"prompt": p, "answer": a, "top_ids": np.stack(ti), "top_lp": np.stack(tv)}
                for p, a, (ti, tv) in zip(prompts, answers, tops)]

    def sample(self, prompts: list[list[int]], max_new: int, eos: int | set[int], temperature: float = 1.0,
               top_p: float = 0.95, seed: int = 0) -> list[list[int]]:
        """Sampled continuations (ids, without the end token), for text the target writes itself
        (memspec.training.self_instruct): each step draws from the softmax of the logits over
        `temperature`, cut to the fewest tokens whose probability reaches `top_p` (nucleus
        sampling, among the NUCLEUS_CAP likeliest).  Prompt i draws from its own generator,
        seeded (seed, i), and a row's logits do not depend on what shares its pass, so its text
        is the same whatever the batch."""
        if temperature <= 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature must be > 0 and top_p in (0, 1], got {temperature}, {top_p}")
        ends = end_ids(eos)
        rngs = [np.random.default_rng([seed, i]) for i in range(len(prompts))]

        def draw(logits: np.ndarray, rows: list[int]) -> list[int]:
            return nucleus(logits, temperature, top_p, [rngs[i] for i in rows])

        texts = self._decode(prompts, max_new, ends, draw, "sampled")
        return [t[:-1] if t and t[-1] in ends else t for t in texts]

    def _decode(self, prompts: list[list[int]], max_new: int, ends: set[int], pick, verb: str) -> list[list[int]]:
        """Each prompt's continuation, up to max_new tokens, through the first of `ends` (kept), where
        pick(logits (n, V), rows) gives the next token of each live row, rows its prompts' indices.

        Up to `self.batch` sequences are in flight, one batched pass a step; when one ends, the next
        prompt (shortest first) takes its slot, its prompt fed in the same pass as the others' next
        tokens.  A fixed batch would run until its longest answer with its finished rows idle; here
        the passes number about the tokens over the batch."""
        t = self.target
        waiting = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)  # pop() the shortest
        out: list[list[int]] = [[] for _ in prompts]
        caches: dict[int, object] = {}
        feeds: dict[int, list[int]] = {}
        live: list[int] = []  # prompt indices in flight, in the order they entered
        finished, reported = 0, 0
        while live or waiting:
            while waiting and len(live) < self.batch:
                i = waiting.pop()
                caches[i], feeds[i] = t.new_cache(len(prompts[i]) + max_new), list(prompts[i])
                live.append(i)
            logits = np.concatenate(t.forward_batch([caches[i] for i in live], [feeds[i] for i in live],
                                                    [1] * len(live)))
            still = []
            for i, tok in zip(live, pick(logits, live)):
                out[i].append(tok)
                if tok not in ends and len(out[i]) < max_new:
                    still.append(i)
                    feeds[i] = [tok]
                else:
                    del caches[i], feeds[i]
                    finished += 1
            live = still
            if finished - reported >= self.batch or (finished == len(prompts) and finished > reported):
                reported = finished
                log(f"  {verb} {finished}/{len(prompts)}")
        return out


def nucleus(logits: np.ndarray, temperature: float, top_p: float, rngs: list[np.random.Generator],
            cap: int = NUCLEUS_CAP) -> list[int]:
    """One id per row of (B, V) logits, row b drawn with rngs[b] from softmax(logits / temperature)
    cut to its top-p nucleus, and to the `cap` likeliest ids at most (a full sort of a 150k
    vocabulary a row would cost more than the pass)."""
    z = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z, dtype=np.float32)
    p /= p.sum(axis=1, keepdims=True)
    cap = min(cap, p.shape[1])
    cand = np.argpartition(-p, cap - 1, axis=1)[:, :cap] if cap < p.shape[1] else np.tile(np.arange(cap), (len(p), 1))
    pc = np.take_along_axis(p, cand, axis=1)
    order = np.lexsort((cand, -pc), axis=1)  # likeliest first, ties by the lower id
    cand, pc = np.take_along_axis(cand, order, axis=1), np.take_along_axis(pc, order, axis=1).astype(np.float64)
    out = []
    for b, rng in enumerate(rngs):
        keep = min(int(np.searchsorted(np.cumsum(pc[b]), top_p)) + 1, cap)
        w = pc[b, :keep] / pc[b, :keep].sum()
        out.append(int(cand[b, rng.choice(keep, p=w)]))
    return out


def data_key(domain: str, seed: int) -> str:
    """Cache name of one domain's data set made with prompt seed `seed` (seed 0: the domain's name)."""
    return domain if seed == 0 else f"{domain}-seed{seed}"


def domain_data(work: Path, domain: str, teacher_fn, tokenizer, n_prompts: int, max_new: int, seed: int,
                prompts: list[str] | None = None, exclude=()) -> dict:
    """Load or make one domain's distillation data: {"train": [...], "eval": [...], "info": {...}}.

    `exclude` lists prompts that other data sets already hold; new prompts avoid them.
    """
    torch = require_torch()
    path = work / f"data-{domain if prompts is not None else data_key(domain, seed)}.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    from memspec.training.prompts import domain_prompts

    texts = prompts if prompts is not None else domain_prompts(domain, n_prompts, seed, exclude)
    if not texts:  # every prompt of the domain is in an earlier seed's data set already
        log(f"{domain} (seed {seed}): no new prompts; nothing to add")
        return {"train": [], "eval": [], "info": {"domain": domain, "prompts": 0, "seed": seed}}
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    t0 = time.time()
    teacher = teacher_fn()
    samples = teacher.answers(ids, max_new, tokenizer.eos_token_id)
    for s, t in zip(samples, texts):
        s["text"] = t
    n_eval = max(1, int(round(len(samples) * HELD_OUT)))
    data = {
        "train": samples[:-n_eval], "eval": samples[-n_eval:],
        "info": {"domain": domain, "prompts": len(samples), "eval_prompts": n_eval, "max_new": max_new,
                 "answer_tokens": int(sum(len(s["answer"]) for s in samples)),
                 "prompt_tokens": int(sum(len(s["prompt"]) for s in samples)),
                 "seconds": round(time.time() - t0, 1), "seed": seed, "teacher": teacher.kind},
    }
    work.mkdir(parents=True, exist_ok=True)
    torch.save(data, path.with_suffix(".partial"))
    path.with_suffix(".partial").replace(path)
    log(f"{domain}: {data['info']}")
    return data
