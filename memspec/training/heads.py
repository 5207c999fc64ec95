"""A head that proposes from the target's features (Medusa, Hydra): trained here with torch, run with
NumPy (torch is imported inside `train_head` only: never a run-time dependency).

    head = train_head(train_data, embedding, lm_head, HeadConfig(ahead=2))
    head.save(path); head = Head.load(path)
    ids, p = head.propose(hidden, next_ids)     # row t's state and its next token -> token t + 2
    report = agreement(head, eval_data)

The head reads row t's last hidden state (the final norm's output, FeatureTarget index -1) and,
as a Hydra head does, the embedding of token t + 1 (the target's own choice at row t, known once
row t is verified), and predicts token t + `ahead` over the draft vocabulary
(memspec.training.features):

    u = [h ; e(x_{t+1})]                        (2H,)   e: the target's embedding rows, draft ids only
    z = h + W2 silu(W1 u + b1)                  (H,)    W2 starts at zero: z = h
    logits = O z                                (Vd,)   O starts as the target's head rows

`ahead` = 1 with W2 at zero is the target's own head cut to the draft vocabulary, a check that the
features are the ones the head reads.  Without `hydra` the head reads h alone (Medusa's heads).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from memspec.training import log, require_torch


@dataclass(frozen=True)
class HeadConfig:
    ahead: int = 2  # the head predicts token t + ahead from row t (2: the token after the target's own next)
    hydra: bool = True  # also read the embedding of token t + 1 (Hydra); False: h alone (Medusa)
    width: int = 0  # W1's outputs; 0: 2 H
    epochs: int = 4  # passes over the training rows
    batch: int = 256  # rows a step
    lr: float = 1e-3  # AdamW's step size, cosine-decayed to zero
    weight_decay: float = 0.0
    seed: int = 0
    threads: int = 0  # torch's threads; 0: torch's default


class Head:
    """The trained head as NumPy arrays (float32); shapes in the module's docstring."""

    def __init__(self, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, out: np.ndarray, emb: np.ndarray | None,
                 vocab: np.ndarray, target_vocab: int, config: HeadConfig):
        self.w1, self.b1, self.w2, self.out = w1, b1, w2, out  # (M, Din), (M,), (H, M), (Vd, H)
        self.emb = emb  # (Vd + 1, H): the draft ids' embedding rows, then zeros for any other id; None: Medusa
        self.vocab = np.asarray(vocab, dtype=np.int32)  # (Vd,) draft id -> target id
        self.config = config
        self.table = np.full(target_vocab, len(self.vocab), dtype=np.int32)  # target id -> draft id (Vd: other)
        self.table[self.vocab] = np.arange(len(self.vocab), dtype=np.int32)

    @property
    def nbytes(self) -> int:
        arrays = (self.w1, self.b1, self.w2, self.out, self.emb, self.table)
        return sum(a.nbytes for a in arrays if a is not None)

    def logits(self, hidden: np.ndarray, next_ids: np.ndarray | None = None) -> np.ndarray:
        """(n, Vd) logits over the draft vocabulary from rows' states (n, H) and, for a Hydra
        head, their next tokens (n,) as target ids."""
        h = np.asarray(hidden, dtype=np.float32)
        u = h if self.emb is None else np.concatenate([h, self.emb[self.table[np.asarray(next_ids)]]], axis=1)
        a = u @ self.w1.T + self.b1
        a *= 1.0 / (1.0 + np.exp(-a))  # silu
        return (h + a @ self.w2.T) @ self.out.T

    def propose(self, hidden: np.ndarray, next_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The likeliest token t + ahead of each row, as target ids (n,), and its probability (n,)."""
        z = self.logits(hidden, next_ids)
        best = z.argmax(-1)
        zb = np.take_along_axis(z, best[:, None], 1)[:, 0]
        p = 1.0 / np.exp(z - zb[:, None]).sum(-1)
        return self.vocab[best], p

    def save(self, path: Path) -> Path:
        arrays = {"w1": self.w1, "b1": self.b1, "w2": self.w2, "out": self.out, "vocab": self.vocab,
                  "target_vocab": np.int64(len(self.table)), **({"emb": self.emb} if self.emb is not None else {}),
                  "config": np.array(list(asdict(self.config).items()), dtype=object)}
        path = Path(path)
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return path

    @classmethod
    def load(cls, path: Path) -> "Head":
        with np.load(path, allow_pickle=True) as z:
            cfg = HeadConfig(**{k: type(getattr(HeadConfig(), k))(v) for k, v in z["config"]})
            return cls(z["w1"], z["b1"], z["w2"], z["out"], z["emb"] if "emb" in z.files else None, z["vocab"],
                       int(z["target_vocab"]), cfg)


def head_rows(data: dict[str, np.ndarray], ahead: int) -> np.ndarray:
    """Indices i of the rows whose token t + ahead is known: row i + ahead - 1 is of the same
    sequence (rows of a sequence are consecutive positions, memspec.training.features)."""
    n, step = len(data["seq"]), ahead - 1
    i = np.arange(n - step)
    return i[(data["seq"][i + step] == data["seq"][i]) & (data["pos"][i + step] == data["pos"][i] + step)]


def labels(data: dict[str, np.ndarray], rows: np.ndarray, ahead: int) -> tuple[np.ndarray, np.ndarray]:
    """For rows t: the target's token t + 1 (its greedy choice at row t, a target id) and the label,
    the target's token t + ahead (its choice at row t + ahead - 1) as a draft id (-1: outside)."""
    return data["top"][rows], data["top_draft"][rows + ahead - 1]


def train_head(data: dict[str, np.ndarray], embedding: np.ndarray, lm_head: np.ndarray, config: HeadConfig,
               target_vocab: int) -> tuple[Head, dict]:
    """A head trained on a features data set (its last hidden state feeds it): cross-entropy on the
    target's token t + ahead, rows whose label is outside the draft vocabulary left out.
    embedding, lm_head: the target's (V, H) float32 matrices (tied models: the same).  Returns the
    head and a record (rows, seconds, final loss)."""
    torch = require_torch()
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    vocab = data["vocab"]
    hidden = data["hidden"][:, -1]  # (N, H): the last state named (the head's input: features -1)
    rows = head_rows(data, config.ahead)
    nxt, y = labels(data, rows, config.ahead)
    rows, nxt, y = rows[y >= 0], nxt[y >= 0], y[y >= 0]
    H, Vd = hidden.shape[1], len(vocab)
    M = config.width or 2 * H
    table = np.full(target_vocab, Vd, dtype=np.int64)
    table[vocab] = np.arange(Vd)
    din = 2 * H if config.hydra else H
    w1 = torch.nn.Linear(din, M)
    w2 = torch.nn.Linear(M, H, bias=False)
    torch.nn.init.zeros_(w2.weight)
    out = torch.nn.Linear(H, Vd, bias=False)
    out.weight.data.copy_(torch.from_numpy(np.ascontiguousarray(lm_head[vocab], dtype=np.float32)))
    emb = torch.from_numpy(np.concatenate([embedding[vocab], np.zeros((1, H))]).astype(np.float32))  # frozen
    params = [*w1.parameters(), w2.weight, out.weight]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    steps = config.epochs * ((len(rows) + config.batch - 1) // config.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * min(s / max(steps, 1), 1))))
    X = torch.from_numpy(np.ascontiguousarray(hidden[rows], dtype=np.float32))
    E = torch.from_numpy(table[nxt])
    Y = torch.from_numpy(y.astype(np.int64))
    gen = torch.Generator().manual_seed(config.seed)
    t0, loss = time.perf_counter(), torch.tensor(0.0)
    for epoch in range(config.epochs):
        total, count = 0.0, 0
        for b in torch.randperm(len(rows), generator=gen).split(config.batch):
            h = X[b]
            u = torch.cat([h, emb[E[b]]], 1) if config.hydra else h
            logits = out(h + w2(torch.nn.functional.silu(w1(u))))
            loss = torch.nn.functional.cross_entropy(logits, Y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total, count = total + float(loss.detach()) * len(b), count + len(b)
        log(f"head (ahead {config.ahead}{', hydra' if config.hydra else ''}): epoch {epoch + 1}/{config.epochs}, "
            f"loss {total / max(count, 1):.3f}, {time.perf_counter() - t0:.0f} s")
    f32 = lambda t: t.detach().numpy().astype(np.float32)  # noqa: E731
    head = Head(f32(w1.weight), f32(w1.bias), f32(w2.weight), f32(out.weight),
                emb.numpy() if config.hydra else None, vocab, target_vocab, config)
    return head, {"rows": int(len(rows)), "seconds": round(time.perf_counter() - t0, 1),
                  "loss": round(total / max(count, 1), 4)}


def agreement(head: Head, data: dict[str, np.ndarray], groups: dict[int, str] | None = None) -> dict:
    """Held-out top-1 agreement: the share of rows t whose proposal is the target's token t + ahead
    (rows outside the draft vocabulary count as misses), overall and per group of sequences
    (groups: sequence index -> name, a prompt's category, say)."""
    a = head.config.ahead
    rows = head_rows(data, a)
    nxt, _ = labels(data, rows, a)
    want = data["top"][rows + a - 1]
    got, _ = head.propose(data["hidden"][rows, -1], nxt)
    hit = got == want
    out = {"rows": int(len(rows)), "agreement": round(float(hit.mean()), 4) if len(rows) else 0.0}
    if groups:
        names = np.array([groups.get(int(s), "") for s in data["seq"][rows]])
        out["by_group"] = {str(g): round(float(hit[names == g].mean()), 4) for g in sorted(set(names)) if g}
    return out
