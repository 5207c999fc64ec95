"""A draft cut from a smaller model of the target's own family (`memspec pull qwen2.5-coder-0.5b-draft`).

Qwen2.5-Coder-0.5B shares the 1.5B's tokenizer and accepts well as its draft, but as its GGUF
ships it costs too much a step to pay on a CPU: its 151,936-row LM head and its 5- and 8-bit
matrices.  A draft may be lossy (only its acceptance moves, never the answer), so the build

* keeps the embedding and LM head rows of a fixed vocabulary list only (SiblingDraft.vocab,
  shipped in memspec/data/, with the draft -> target id map the draft pool already reads), and
* re-quantizes every matrix to symmetric 4-bit blocks of 32 (ggml's Q4_0),

and writes the result as a GGUF (memspec.models.gguf_write), which the native engine runs as it
is; where ONNX Runtime runs the drafts, the graph is built from it at first load (4-bit
MatMulNBits with no block-sum correction, no attention padding: memspec.speculation.drafts).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import numpy as np

from memspec.errors import ModelFormatError
from memspec.models.catalog import SiblingDraft
from memspec.models.gguf import HEAD_TENSORS, ArrayWeights, GGUFModel  # HEAD_TENSORS: the rows a vocabulary list trims

VARIANT = "gguf"  # what the draft's manifest calls its one file (memspec.speculation.drafts.GGUF_VARIANT)
FILE = "draft.gguf"


def vocab_list(recipe: SiblingDraft) -> list[int]:
    """The recipe's target ids (list index = draft id), from memspec/data/ (or an absolute path):
    a JSON list, or an object whose "ids" is one."""
    try:
        where = Path(recipe.vocab) if Path(recipe.vocab).is_absolute() else resources.files("memspec.data").joinpath(recipe.vocab)
        data = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"the vocabulary list {recipe.vocab} of the draft recipe cannot be read: {exc}") from None
    ids = data["ids"] if isinstance(data, dict) else data
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ModelFormatError(f"{recipe.vocab}: the vocabulary list is empty, repeats an id or holds a negative one")
    return [int(i) for i in ids]


def trimmed_weights(model: GGUFModel, vocab: list[int], quantize: str | None = None,
                    context_length: int | None = None) -> ArrayWeights:
    """The GGUF's tensors as float32, embedding and head cut to `vocab`'s rows (offered as
    `quantize` blocks, where given)."""
    if max(vocab) >= model.config.vocab:
        raise ModelFormatError(f"{model.path.name}: the vocabulary list holds id {max(vocab)}, "
                               f"the model's vocabulary has {model.config.vocab}")
    rows = np.asarray(vocab, dtype=np.int64)
    tensors = {}
    for name in model.tensor_names:
        w = model.float32(name)
        tensors[name] = w[rows] if name in HEAD_TENSORS else w
    cfg = dataclasses.replace(model.config, vocab=len(vocab),
                              context_length=context_length or model.config.context_length)
    return ArrayWeights(cfg, tensors, quantize=quantize)


def build(gguf: Path, recipe: SiblingDraft, out_dir: Path, vocab: list[int]) -> tuple[Path, Path, dict]:
    """Write `<out_dir>/draft.gguf` and `vocab.json` (the draft -> target id map) for the target ids
    `vocab` (the recipe's vocab_list); returns their paths and the draft's architecture."""
    from memspec.models.gguf_write import write_decoder

    model = GGUFModel(gguf)
    weights = trimmed_weights(model, vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.onnx"):  # an older build's graph (ONNX Runtime now builds one from the GGUF)
        old.unlink()
    path, vocab_path = out_dir / FILE, out_dir / "vocab.json"
    write_decoder(path, weights.config, {n: weights.float32(n) for n in model.tensor_names}, recipe.quantize,
                  name=out_dir.name)
    vocab_path.write_text(json.dumps(vocab) + "\n")
    return path, vocab_path, dict(weights.config.__dict__)


def same_tokens(gguf: Path, target_tokenizer: Path) -> bool:
    """Whether the GGUF's token list is the target's (tokenizer.json's vocabulary, id for id)."""
    from memspec.models.gguf import read_metadata

    tokens = read_metadata(gguf).get("tokenizer.ggml.tokens") or []
    data = json.loads(target_tokenizer.read_text())
    vocab = data["model"]["vocab"]
    added = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
    by_id = {i: t for t, i in vocab.items()} | added
    return len(tokens) == len(by_id) and all(by_id.get(i) == t for i, t in enumerate(tokens))
