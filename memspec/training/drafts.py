"""Train small draft models by self-distillation from the target (`memspec train-draft`).

Pipeline, each stage a function:

  1. `teacher.domain_data`  the target (on the native engine, or a torch copy built from
     its GGUF) answers domain prompts greedily, as the served path does, and keeps its
     top-k log-probs at every answer position (soft labels).  Cached per domain in --work.
  2. `select_vocab`   the draft's own vocabulary: control and whitespace tokens,
     then the target ids most frequent in that data.
  3. `train`          KL(teacher || draft) on the draft vocabulary plus
     cross-entropy on the teacher's greedy token, answers only.
  4. `evaluate_draft` teacher-forced top-1 agreement and the mean acceptance
     length of greedy speculative decoding at gamma=5 on held-out prompts.
  5. `write_draft`    the same ONNX layout as the target (convert.DecoderBuilder),
     weights as 8-bit blocks (or float16), plus vocab.json and manifest.json.

The model itself is memspec.training.torch_model.  torch is imported inside
functions only: the runtime, and `memspec --help`, never need it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from memspec.errors import MemspecError
from memspec.models.gguf import DecoderConfig
from memspec.training import log, require_torch
from memspec.training.prompts import DOMAINS, near_measured
from memspec.training.teacher import TEACHER_DTYPES, TEACHERS, NativeTeacher, TorchTeacher, data_key, domain_data

GAMMA = 5  # draft tokens per verification step in the acceptance simulation
N_CONTROL = 17  # SmolLM2 control tokens are ids 0..16
UNKNOWN_TARGET_ID = 0  # target ids outside a draft vocab are fed as this one (<|endoftext|>)


# -- vocabulary ----------------------------------------------------------------------
def select_vocab(counts: np.ndarray, size: int, required: list[int]) -> list[int]:
    """Draft vocabulary: `required` ids first, then the most counted ids (ties: lower id first).

    Returns target ids; list index = draft id.  Lower BPE ids were merged earlier,
    i.e. are more frequent in the tokenizer's own corpus, so they fill any gap.
    """
    required = list(dict.fromkeys(int(i) for i in required))
    if UNKNOWN_TARGET_ID not in required:
        required.insert(0, UNKNOWN_TARGET_ID)
    assert len(required) <= size, f"{len(required)} required tokens do not fit a vocabulary of {size}"
    order = np.lexsort((np.arange(len(counts)), -np.asarray(counts, dtype=np.float64)))
    chosen = set(required)
    rest = [int(i) for i in order if int(i) not in chosen][: size - len(required)]
    return sorted(required) + rest


def required_ids(tokenizer) -> list[int]:
    """Control tokens, EOS, and every whitespace-only token."""
    ids = set(range(N_CONTROL)) | set(tokenizer.special_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for i in range(tokenizer.vocab_size):
        b = tokenizer.token_bytes(i)
        if b and b.strip() == b"":
            ids.add(i)
    return sorted(ids)


class VocabMap:
    """Target ids <-> draft ids."""

    def __init__(self, target_ids: list[int], target_vocab: int):
        self.to_target = np.asarray(target_ids, dtype=np.int64)  # (Vd,) draft id -> target id
        assert len(set(target_ids)) == len(target_ids), "draft vocabulary has duplicate target ids"
        assert UNKNOWN_TARGET_ID in target_ids, f"target id {UNKNOWN_TARGET_ID} must be in the draft vocabulary"
        unk = target_ids.index(UNKNOWN_TARGET_ID)
        self.to_draft = np.full(target_vocab, unk, dtype=np.int64)  # (V,) target id -> draft id
        self.to_draft[self.to_target] = np.arange(len(target_ids))
        self.known = np.zeros(target_vocab, dtype=bool)  # (V,) target id is in the draft vocab
        self.known[self.to_target] = True

    def draft(self, ids) -> np.ndarray:
        return self.to_draft[np.asarray(ids, dtype=np.int64)]

    def target(self, ids) -> np.ndarray:
        return self.to_target[np.asarray(ids, dtype=np.int64)]


def token_counts(samples: list[dict], vocab: int) -> np.ndarray:
    """Answer-token frequency plus the teacher's probability mass on each id (alternatives)."""
    counts = np.zeros(vocab, dtype=np.float64)
    for s in samples:
        np.add.at(counts, np.asarray(s["answer"]), 1.0)
        np.add.at(counts, np.asarray(s["prompt"]), 0.25)
        np.add.at(counts, s["top_ids"].reshape(-1), np.exp(s["top_lp"].astype(np.float64)).reshape(-1) * 0.5)
    return counts


# -- model -------------------------------------------------------------------------
HEAD_DIM = 64  # drafts' attention head size (GroupQueryAttention on the CPU needs a multiple of 16)


def draft_config(layers: int, width: int, vocab: int, head_dim: int = HEAD_DIM, context: int = 2048) -> DecoderConfig:
    """A llama config for a draft: GQA with half as many KV heads (1 if odd), SwiGLU 8/3 wide."""
    heads = max(1, width // head_dim)
    assert heads * head_dim == width, f"width {width} is not a multiple of head_dim {head_dim}"
    kv = max(d for d in range(1, heads + 1) if heads % d == 0 and (d <= heads // 2 or heads == 1))
    ffn = int(round(width * 8 / 3 / 64)) * 64
    return DecoderConfig(n_layers=layers, hidden=width, n_heads=heads, n_kv_heads=kv, head_dim=head_dim, ffn=ffn,
                         vocab=vocab, rope_theta=100000.0, rms_eps=1e-5, context_length=context, tied_embeddings=True)


# -- training ---------------------------------------------------------------------
@dataclass(frozen=True)
class DraftTrainConfig:
    """How `train-draft` fits a draft (AdamW, loss weights)."""

    steps: int = 600  # optimizer steps
    batch: int = 16  # sequences per step
    lr: float = 2e-3  # peak AdamW learning rate (cosine decay, linear warm-up)
    warmup: int = 30  # warm-up steps
    ce_weight: float = 0.5  # weight of the cross-entropy on the greedy token
    seed: int = 0


def _batch(samples: list[dict], vmap: VocabMap):
    """Right-padded draft ids (B, T) and, per answer position, the flat index and teacher labels."""
    torch = require_torch()
    seqs = [list(s["prompt"]) + list(s["answer"][:-1]) for s in samples]
    T = max(len(q) for q in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    flat, tid, tlp = [], [], []
    for r, (s, q) in enumerate(zip(samples, seqs)):
        ids[r, :len(q)] = torch.from_numpy(vmap.draft(q))
        start = len(s["prompt"]) - 1  # position whose logits predict answer[0]
        flat.append(r * T + start + np.arange(len(s["answer"])))
        tid.append(s["top_ids"])
        tlp.append(s["top_lp"])
    return ids, torch.from_numpy(np.concatenate(flat)), np.concatenate(tid), np.concatenate(tlp)


def _labels(tid: np.ndarray, tlp: np.ndarray, vmap: VocabMap):
    """Teacher probs renormalised over the draft vocab: (N, K) draft ids, (N, K) probs; greedy draft id or -1."""
    torch = require_torch()
    known = vmap.known[tid]  # (N, K)
    p = np.exp(tlp.astype(np.float32)) * known
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-9)
    greedy = np.where(known[:, 0], vmap.to_draft[tid[:, 0]], -1)
    return torch.from_numpy(vmap.to_draft[tid]), torch.from_numpy(p), torch.from_numpy(greedy)


def init_draft(cfg: DecoderConfig, target_emb: np.ndarray, vmap: VocabMap, seed: int):
    """A draft whose embedding is the PCA projection of the target's rows for its vocabulary."""
    torch = require_torch()
    from memspec.training.torch_model import Llama

    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.02)
                if name.endswith(("attn_output.weight", "ffn_down.weight")):
                    p.mul_(1 / math.sqrt(2 * cfg.n_layers))
        e = target_emb[vmap.to_target].astype(np.float64)
        e -= e.mean(0)
        _, _, vt = np.linalg.svd(e[:: max(1, len(e) // 8192)], full_matrices=False)
        proj = e @ vt[: cfg.hidden].T
        proj *= 0.05 / proj.std()
        model.token_embd.weight.copy_(torch.from_numpy(proj.astype(np.float32)))
    return model


def train(model, samples: list[dict], vmap: VocabMap, tc: DraftTrainConfig, eval_fn=None) -> dict:
    """Distil into `model`; returns a summary of the loss curve."""
    torch = require_torch()
    F = torch.nn.functional
    rng = np.random.default_rng(tc.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / tc.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / tc.steps))))
    model.train()
    curve, window, t0 = [], [], time.time()
    perm, cursor = rng.permutation(len(samples)), 0
    for step in range(tc.steps):
        if cursor + tc.batch > len(perm):
            perm, cursor = rng.permutation(len(samples)), 0
        chunk = [samples[i] for i in perm[cursor:cursor + tc.batch]]
        cursor += tc.batch
        ids, flat, tid, tlp = _batch(chunk, vmap)
        d_ids, p, greedy = _labels(tid, tlp, vmap)
        logits = model(ids)  # (B, T, Vd)
        lp = F.log_softmax(logits.reshape(-1, logits.shape[-1])[flat], dim=-1)  # (N, Vd)
        kl = (p * (torch.log(p.clamp_min(1e-9)) - lp.gather(1, d_ids))).sum(-1).mean()
        ce = F.nll_loss(lp, greedy, ignore_index=-1)
        loss = kl + tc.ce_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window.append((kl.item(), ce.item()))
        if (step + 1) % 25 == 0 or step + 1 == tc.steps:
            kl_m, ce_m = np.mean(window, axis=0)
            curve.append({"step": step + 1, "kl": round(float(kl_m), 4), "ce": round(float(ce_m), 4),
                          "seconds": round(time.time() - t0, 1)})
            window = []
            log(f"  step {step + 1}/{tc.steps} kl {kl_m:.3f} ce {ce_m:.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    n_tokens = sum(len(s["answer"]) for s in samples)
    return {"steps": tc.steps, "batch": tc.batch, "lr": tc.lr, "ce_weight": tc.ce_weight,
            "epochs": round(tc.steps * tc.batch / max(1, len(samples)), 2), "train_sequences": len(samples),
            "train_answer_tokens": n_tokens, "seconds": round(time.time() - t0, 1), "loss_curve": curve}


# -- evaluation -------------------------------------------------------------------
def acceptance(match: np.ndarray, gamma: int = GAMMA) -> tuple[int, int]:
    """Greedy speculative decoding over one answer, teacher-forced.

    match[t] = the draft's greedy token at answer position t equals the target's.
    While a draft matches, its context equals the target's text, so the proposals
    of one step are the teacher-forced predictions at t, t+1, ...  Each step
    accepts the run of matches (at most gamma) plus one bonus token from the
    target.  Returns (tokens, steps); mean acceptance length = tokens / steps.
    """
    n, t, steps = len(match), 0, 0
    while t < n:
        run = 0
        while run < gamma and t + run < n and match[t + run]:
            run += 1
        t += run + 1
        steps += 1
    return n, steps


def evaluate_draft(model, samples: list[dict], vmap: VocabMap, batch: int = 16) -> dict:
    """Top-1 agreement with the target's greedy token and mean acceptance length at gamma=5."""
    torch = require_torch()
    agree, total, tokens, steps = 0, 0, 0, 0
    with torch.inference_mode():
        for b0 in range(0, len(samples), batch):
            chunk = samples[b0:b0 + batch]
            ids, flat, tid, _ = _batch(chunk, vmap)
            pred = model(ids).reshape(-1, vmap.to_target.shape[0])[flat].argmax(-1).numpy()
            match = vmap.to_target[pred] == tid[:, 0]
            agree += int(match.sum())
            total += len(match)
            o = 0
            for s in chunk:
                n = len(s["answer"])
                a, b = acceptance(match[o:o + n])
                tokens, steps, o = tokens + a, steps + b, o + n
    return {"top1": round(agree / max(1, total), 4), "mean_accept_len": round(tokens / max(1, steps), 3),
            "positions": total}


# -- export --------------------------------------------------------------------------
WEIGHTS = {  # --weights: how a draft's matrices are stored -> (manifest variant, quantize, note)
    "q8": ("gguf", "Q8_0", "Q8_0 blocks of 32 in a GGUF: the native engine runs them as they are, ONNX Runtime "
                           "a graph built from them (8-bit MatMulNBits)"),
    "q4": ("gguf", "Q4_0", "Q4_0 blocks of 32 in a GGUF (half of q8's bytes; acceptance may drop)"),
    "fp16": ("fp32", None, "float16 initializers of an ONNX graph (Cast to float32 at load)"),
}


def export_onnx(model, path: Path, max_positions: int = 2048) -> Path:
    """Write `model` in the target's ONNX layout, matrices as float16-stored float32 (--weights fp16)."""
    import onnx

    from memspec.models.convert import DecoderBuilder
    from memspec.models.gguf import ArrayWeights

    arrays = ArrayWeights(model.c, model.tensors())
    proto = DecoderBuilder(arrays, "fp32", max_positions, weight_dtype="float16", pad_attention=False).build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    onnx.save_model(proto, str(tmp))
    tmp.replace(path)
    return path


def write_draft(folder: Path, name: str, model, vmap: VocabMap, provenance: dict, extra: dict,
                weights: str = "q8") -> Path:
    """The draft's weights (draft.gguf; fp32.onnx for --weights fp16), vocab.json and manifest.json in
    `folder`.  A GGUF of Q8_0 blocks (q8) is what a draft ships as: on draft-code 8-bit weights kept
    the argmax of the float weights at 97.7% of held-out positions."""
    from memspec.models.gguf_write import write_decoder
    from memspec.models.store import Manifest, ModelStore, file_record

    folder.mkdir(parents=True, exist_ok=True)
    variant, quantize, note = WEIGHTS[weights]
    path = folder / ("draft.gguf" if variant == "gguf" else f"{variant}.onnx")
    for old in [*folder.glob("*.onnx"), *folder.glob("*.gguf")]:  # a draft ships one variant
        if old != path:
            old.unlink()
    if variant == "gguf":
        write_decoder(path, model.c, model.tensors(), quantize, name=name)
    else:
        export_onnx(model, path)
    vocab_path = folder / "vocab.json"
    vocab_path.write_text(json.dumps([int(i) for i in vmap.to_target]) + "\n")
    manifest = Manifest(
        name=name, role="draft", format="gguf" if variant == "gguf" else "onnx", variants={variant: file_record(path)},
        tokenizer={"vocab.json": file_record(vocab_path)}, provenance={**provenance, "weights_stored_as": note},
        architecture=asdict(model.c), extra={**extra, "draft_vocab": "vocab.json"}, folder=folder,
    )
    return ModelStore(folder.parent).write_manifest(manifest)


# -- command line ---------------------------------------------------------------------
def add_train_draft_parser(subparsers) -> argparse.ArgumentParser:
    """Register `train-draft` (torch needed only when it runs)."""
    p = subparsers.add_parser("train-draft", help="train a draft model by self-distillation from the target")
    p.add_argument("--name", required=True, help="draft name, e.g. draft-code")
    p.add_argument("--domain", nargs="+", default=None, help=f"built-in prompt domains ({', '.join(DOMAINS)})")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="JSONL files with a 'prompt' field per line (memspec write-prompts writes them), beside "
                        "or instead of --domain; each file's answers are cached as one data set")
    p.add_argument("--prompt-categories", nargs="+", default=None,
                   help="train on the --prompts lines of these categories only (their 'category' field); the "
                        "files' cached answers are reused whatever the choice")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --epochs)")
    p.add_argument("--epochs", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--n-prompts", type=int, default=256, help="prompts generated per built-in domain")
    p.add_argument("--max-new", type=int, default=160, help="longest teacher answer in tokens")
    p.add_argument("--out", default=None, help="models folder (default: the repository's models/)")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "memspec-train"), help="data cache folder")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--eval-domains", nargs="*", default=None, help="domains to evaluate on (default: all cached)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads for training and for the teacher (0 = default: torch's; the native teacher one "
                        "per physical core)")
    p.add_argument("--teacher", choices=TEACHERS, default="native",
                   help="what answers the prompts: the target on the native engine (the kernels that verify the "
                        "draft when served; default), or a torch copy of it (--teacher-dtype)")
    p.add_argument("--teacher-dtype", choices=TEACHER_DTYPES, default="float32",
                   help="what a torch teacher (--teacher torch) computes in (bfloat16: about 2.4x faster "
                        "on a CPU with AVX512-BF16; the data records which)")
    p.add_argument("--seed", type=int, default=0, help="training seed (initialisation and batch order)")
    p.add_argument("--data-seeds", type=int, nargs="+", default=[0],
                   help="prompt seeds: one cached data set of --n-prompts new prompts per domain and seed "
                        "(no prompt repeats across seeds; held-out evaluation uses seed 0's)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the weights of the last run of --name (kept in --work)")
    p.add_argument("--weights", choices=sorted(WEIGHTS), default="q8",
                   help="how the draft's matrices are stored: q8 (8-bit blocks, default) or fp16")
    p.add_argument("--export-only", action="store_true",
                   help="write the draft again from the weights of its last run (kept in --work), keeping "
                        "its manifest's record of how it was made; no data, no training")
    return p


def _target_files(target: str, home=None):
    """The target's tokenizer and its GGUF (the teacher's weights), from the store."""
    from memspec.models.store import ModelStore
    from memspec.models.tokenizer import Tokenizer

    store = ModelStore(home)
    m = store.get(target)
    tok = Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")
    gguf = store.downloads_dir / m.provenance.get("gguf_file", "")
    if not gguf.is_file():
        raise MemspecError(f"the target's GGUF {gguf} is missing; run `memspec pull {target} --force`")
    return tok, gguf


def export_only(args) -> int:
    """Write --name again from its checkpoint in --work (say with other --weights), keeping its record."""
    torch = require_torch()
    from memspec.models.store import MANIFEST, SHIPPED_MODELS, Manifest
    from memspec.training.torch_model import Llama

    out = Path(args.out) if args.out else SHIPPED_MODELS
    ckpt = Path(args.work) / args.target / f"{args.name}.pt"
    mf = out / args.name / MANIFEST  # this folder's own record (a store lookup could find the shipped one)
    if not mf.is_file():
        raise MemspecError(f"--export-only rewrites an existing draft, but {mf} does not exist")
    old = Manifest.from_json(json.loads(mf.read_text()), mf.parent)
    if not ckpt.is_file():
        raise MemspecError(f"--export-only needs the weights of {args.name}'s last run, {ckpt}, which is missing")
    a = old.architecture
    cfg = draft_config(a["n_layers"], a["hidden"], a["vocab"], a.get("head_dim", 64), a.get("context_length", 2048))
    model = Llama(cfg)
    model.load_state_dict(torch.load(ckpt))
    model.eval()
    vocab = [int(i) for i in json.loads((old.folder / old.extra.get("draft_vocab", "vocab.json")).read_text())]
    if ckpt.with_suffix(".vocab.json").is_file() and checkpoint_record(ckpt)[0] != vocab:
        raise MemspecError(f"{ckpt} was trained on another vocabulary than {old.folder}'s; --export-only would "
                           f"scramble its tokens (write it with the --out of the run that made it)")
    vmap = VocabMap(vocab, max(vocab) + 1)  # write_draft reads only its draft -> target ids
    extra = {k: v for k, v in old.extra.items() if k != "draft_vocab"}
    provenance = {**old.provenance, "exported": f"memspec train-draft --export-only --weights {args.weights} "
                                                f"({datetime.now(timezone.utc).isoformat(timespec='seconds')})"}
    path = write_draft(out / args.name, args.name, model, vmap, provenance, extra, args.weights)
    log(f"wrote {path}")
    return 0


def run_train_draft(args) -> int:
    if not getattr(args, "export_only", False) and (args.width < HEAD_DIM or args.width % HEAD_DIM):
        raise MemspecError(f"--width must be a multiple of {HEAD_DIM} (the attention head size), got {args.width}")
    if args.layers < 1:
        raise MemspecError(f"--layers must be at least 1, got {args.layers}")
    categories = getattr(args, "prompt_categories", None)
    if categories and not args.prompts:
        raise MemspecError("--prompt-categories chooses lines of --prompts files; give --prompts FILE")
    files = prompt_files(args.prompts or [], categories)  # read and checked before any work
    torch = require_torch()
    from memspec.models.store import SHIPPED_MODELS

    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "export_only", False):
        return export_only(args)
    if not args.domain and not args.prompts:
        raise MemspecError(f"give --domain ({', '.join(DOMAINS)}) or --prompts FILE")
    tok, gguf = _target_files(args.target, getattr(getattr(args, "config", None), "store_home", None))
    work = Path(args.work) / args.target
    ckpt = work / f"{args.name}.pt"
    resume = getattr(args, "resume", False) and ckpt.is_file()
    if resume:  # checked before any teacher data is made
        vocab, shape = checkpoint_record(ckpt)
        if (shape["n_layers"], shape["hidden"]) != (args.layers, args.width):
            raise MemspecError(f"--resume continues {ckpt}, which has {shape['n_layers']} layers x {shape['hidden']}; "
                               f"pass --layers {shape['n_layers']} --width {shape['hidden']}, or train without --resume")
    teacher_cache: list = []

    def teacher():
        if not teacher_cache:
            if getattr(args, "teacher", "native") == "native":
                teacher_cache.append(NativeTeacher(gguf, args.threads))
            else:
                teacher_cache.append(TorchTeacher(gguf, getattr(args, "teacher_dtype", "float32")))
            log(f"teacher: {gguf.name} on {teacher_cache[0].kind}")
        return teacher_cache[0]

    near = near_measured()  # the benchmarks' prompts and near copies of them: never trained on
    datasets = {}
    for path, lines in files.items():
        key = "prompts-" + path.stem
        data = domain_data(work, key, teacher, tok, 0, args.max_new, args.seed, [x["prompt"] for x in lines])
        if categories:  # the file's answers made (or cached) for all of it
            data = of_categories(data, lines, categories)
            log(f"{key}: {len(data['train'])} training and {len(data['eval'])} held-out answers of "
                f"{', '.join(categories)}")
        datasets[key] = data
    for d in args.domain or []:
        used: set[str] = set()  # prompts earlier seeds hold (domain_prompts avoids the benchmarks' itself)
        for seed in args.data_seeds:
            data = domain_data(work, d, teacher, tok, args.n_prompts, args.max_new, seed, exclude=used)
            datasets[data_key(d, seed)] = data
            used |= {s["text"] for s in data["train"] + data["eval"]}
    every = [s for d in datasets.values() for s in d["train"]]
    samples = [s for s in every if not near(s.get("text", ""))]
    if len(samples) < len(every):  # data sets made before the benchmarks' prompts (or near copies) were excluded
        log(f"dropping {len(every) - len(samples)} training samples whose prompt is, or nearly is, one a benchmark measures")

    if resume:  # the checkpoint's embedding rows are its own ids, whatever data comes now
        log(f"keeping the vocabulary of {ckpt.name} ({len(vocab)} ids)")
    else:
        vocab = select_vocab(token_counts(samples, tok.vocab_size), args.vocab_size, required_ids(tok))
    vmap = VocabMap(vocab, tok.vocab_size)
    cfg = draft_config(args.layers, args.width, len(vocab))
    from memspec.models.gguf import GGUFModel

    model = init_draft(cfg, GGUFModel(gguf).float32("token_embd.weight"), vmap, args.seed)
    previous = None
    if resume:
        model.load_state_dict(torch.load(ckpt))
        previous = shape.get("training")  # the run(s) these weights come from
        log(f"resuming from {ckpt}")
    n_params = sum(p.numel() for p in model.parameters())
    steps = args.steps or max(1, int(args.epochs * len(samples) / args.batch))
    log(f"{args.name}: {cfg.n_layers} layers x {cfg.hidden}, vocab {cfg.vocab}, {n_params / 1e6:.2f}M params, "
         f"{len(samples)} sequences, {steps} steps")
    summary = train(model, samples, vmap, DraftTrainConfig(steps=steps, batch=args.batch, lr=args.lr, seed=args.seed))

    eval_domains = args.eval_domains
    if eval_domains is None:
        eval_domains = sorted(p.stem[len("data-"):] for p in work.glob("data-*.pt") if "-seed" not in p.stem)
    results = {}
    for d in eval_domains:
        data = datasets.get(d) or domain_data(work, d, teacher, tok, args.n_prompts, args.max_new, 0)
        results[d] = evaluate_draft(model, data["eval"], vmap)
        log(f"  eval {d}: {results[d]}")
    summary["held_out"] = results
    if previous:
        summary["previous"] = previous  # earlier run(s) this one continued from

    out = Path(args.out) if args.out else SHIPPED_MODELS
    domain = ",".join(args.domain or datasets)
    provenance = {
        "source": f"memspec train-draft (self-distillation from {args.target})",
        "teacher": f"{args.target} ({gguf.name}, greedy; each data set's teacher, or teacher_dtype for a torch "
                   f"copy, says what computed it)",
        "data": {k: d["info"] for k, d in datasets.items()},
        "command": "memspec " + " ".join(sys.argv[1:]),  # python -m memspec.training.drafts takes the same arguments
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "params": n_params,
    }
    extra = {"target": args.target, "domain": domain, "training": summary,
             "unknown_target_id": UNKNOWN_TARGET_ID}
    path = write_draft(out / args.name, args.name, model, vmap, provenance, extra, getattr(args, "weights", "q8"))
    save_checkpoint(model, vmap, work / f"{args.name}.pt",
                    {**{k: summary.get(k) for k in ("steps", "epochs", "seconds", "lr")}, "previous": previous})
    log(f"wrote {path}")
    return 0


def prompt_files(paths, categories=None) -> dict[Path, list[dict]]:
    """The lines of each --prompts file, [{"prompt", "category"}] as a benchmark workload is read
    (memspec.bench.policies.load_workload: JSONL, a non-empty "prompt" on every line), checked: no
    two files sharing a name (each names its cached data set), and each of `categories` found in
    some file."""
    from memspec.bench.policies import load_workload

    out: dict[Path, list[dict]] = {}
    for name in paths:
        path = Path(name)
        if any(p.stem == path.stem for p in out):
            raise MemspecError(f"--prompts {name}: another file is also named {path.stem}.*, and a file's name keys "
                               f"its cached answers; rename one")
        try:
            out[path] = load_workload(str(path))
        except MemspecError as exc:
            raise MemspecError(f"--prompts: {exc}") from None
    found = {x["category"] for lines in out.values() for x in lines}
    missing = [c for c in categories or [] if c not in found]
    if missing:
        raise MemspecError(f"--prompt-categories {', '.join(missing)}: no --prompts line has that category "
                           f"(the files have: {', '.join(sorted(found))})")
    return out


def of_categories(data: dict, lines: list[dict], categories) -> dict:
    """A --prompts file's data set ({"train", "eval", "info"}, answers to all its lines) cut to the
    answers of the lines whose category is one of `categories`."""
    chosen = {x["prompt"] for x in lines if x.get("category") in categories}
    return {**data, "train": [r for r in data["train"] if r["text"] in chosen],
            "eval": [r for r in data["eval"] if r["text"] in chosen],
            "info": {**data["info"], "categories": sorted(categories)}}


def save_checkpoint(model, vmap: VocabMap, ckpt: Path, training: dict | None = None) -> None:
    """The weights of a run (NAME.pt) and, beside them, what their rows mean (NAME.vocab.json):
    the draft -> target id map and the shape, so that --resume never pairs them with another
    vocabulary, and the record of the run(s) that made them."""
    torch = require_torch()
    record = {"vocab": [int(i) for i in vmap.to_target], "n_layers": model.c.n_layers, "hidden": model.c.hidden,
              "training": training}
    torch.save(model.state_dict(), ckpt)
    ckpt.with_suffix(".vocab.json").write_text(json.dumps(record) + "\n")


def checkpoint_record(ckpt: Path) -> tuple[list[int], dict]:
    """The vocabulary and shape that `save_checkpoint` recorded beside `ckpt`."""
    side = ckpt.with_suffix(".vocab.json")
    if not side.is_file():
        raise MemspecError(f"--resume needs {side}, the record of which target ids the rows of {ckpt} stand for; "
                           "it is missing (a checkpoint from an older train-draft), so train without --resume")
    record = json.loads(side.read_text())
    return [int(i) for i in record["vocab"]], {k: record.get(k) for k in ("n_layers", "hidden", "training")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="memspec-train")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_train_draft_parser(sub)
    args = parser.parse_args(argv)
    try:
        return run_train_draft(args)
    except MemspecError as exc:  # as `memspec train-draft` reports it: a message, no traceback
        print(f"memspec-train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
