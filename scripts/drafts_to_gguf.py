"""Rewrite a shipped draft as a GGUF: from its ONNX graph (q8.onnx, as `memspec train-draft`
exported them), or re-quantize its GGUF (draft.gguf) as another block type.

    python scripts/drafts_to_gguf.py models/qwen2.5-coder-draft-chat [--qtype Q8_0] [--out DIR]

The 8-bit MatMulNBits weights are read back exactly (w = scale * (stored - 128)) and written as
`qtype` blocks (Q8_0: the same 8-bit values, the scale rounded to float16), the head once (the
ONNX graph holds the tied embedding twice: a GatherBlockQuantized copy and the LM head's).  The
fused projections are split back into the GGUF's tensors: qkv_proj -> attn_q, attn_k, attn_v,
gate_up_proj -> ffn_gate, ffn_up.  Writes `<out>/draft.gguf`; with --replace, in the draft's own
folder, the manifest then names the GGUF as the draft's one variant ("gguf") and q8.onnx is removed
(ONNX Runtime builds its graph from the GGUF: memspec.speculation.drafts.draft_graph).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memspec.models.gguf import DecoderConfig  # noqa: E402
from memspec.models.gguf_write import write_decoder  # noqa: E402


def nbits_matrix(inits: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    """(N, K) float32 of an 8-bit MatMulNBits weight: scale * (stored - 128) per block of 32."""
    q = inits[f"{prefix}.qweight"].astype(np.float32)  # (N, K/32, 32)
    s = inits[f"{prefix}.scales"].reshape(q.shape[0], q.shape[1], 1)
    return ((q - 128.0) * s).reshape(q.shape[0], -1)


def onnx_tensors(onnx_path: Path, cfg: DecoderConfig) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"token_embd.weight": nbits_matrix(inits, "/lm_head"), "output_norm.weight": inits["output_norm.weight"]}
    for i in range(cfg.n_layers):
        p = f"/model/layers.{i}"
        qkv = nbits_matrix(inits, f"{p}/attn/qkv_proj")
        out[f"blk.{i}.attn_norm.weight"] = inits[f"blk.{i}.attn_norm.weight"]
        out[f"blk.{i}.attn_q.weight"] = qkv[:q_rows]
        out[f"blk.{i}.attn_k.weight"] = qkv[q_rows:q_rows + kv_rows]
        out[f"blk.{i}.attn_v.weight"] = qkv[q_rows + kv_rows:]
        out[f"blk.{i}.attn_output.weight"] = nbits_matrix(inits, f"{p}/attn/o_proj")
        out[f"blk.{i}.ffn_norm.weight"] = inits[f"blk.{i}.ffn_norm.weight"]
        gu = nbits_matrix(inits, f"{p}/mlp/gate_up_proj")
        out[f"blk.{i}.ffn_gate.weight"], out[f"blk.{i}.ffn_up.weight"] = gu[:cfg.ffn], gu[cfg.ffn:]
        out[f"blk.{i}.ffn_down.weight"] = nbits_matrix(inits, f"{p}/mlp/down_proj")
    if "embed.qweight" in inits:  # the embedding copy must be the head's (a tied draft)
        emb = (inits["embed.qweight"].astype(np.float32) - 128.0).reshape(cfg.vocab, -1, 32) \
            * inits["embed.scales"].reshape(cfg.vocab, -1, 1)
        if not np.array_equal(emb.reshape(cfg.vocab, -1), out["token_embd.weight"]):
            raise SystemExit(f"{onnx_path}: the embedding is not the LM head; this draft is not tied")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft", type=Path, help="a draft folder with manifest.json and q8.onnx")
    ap.add_argument("--qtype", default="Q8_0")
    ap.add_argument("--embd-qtype", default=None, help="the embedding's (and head's) block type (default: --qtype)")
    ap.add_argument("--out", type=Path, help="where to write draft.gguf (default: the draft's folder)")
    ap.add_argument("--replace", action="store_true", help="the GGUF replaces q8.onnx in the draft's manifest")
    args = ap.parse_args()
    manifest = json.loads((args.draft / "manifest.json").read_text())
    arch = dict(manifest["architecture"])
    arch.setdefault("arch", "llama")
    cfg = DecoderConfig(**arch)
    if (args.draft / "q8.onnx").is_file():
        tensors = onnx_tensors(args.draft / "q8.onnx", cfg)
    else:  # its GGUF, dequantized (a second rounding: measure the acceptance it keeps)
        from memspec.models.gguf import GGUFModel

        g = GGUFModel(args.draft / "draft.gguf")
        tensors = {name: g.float32(name) for name in g.tensor_names}
    out = (args.out or args.draft) / "draft.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.out:  # its vocabulary map beside it (bench/draft_acceptance.py reads a GGUF path so)
        import shutil

        shutil.copy(args.draft / manifest.get("extra", {}).get("draft_vocab", "vocab.json"), out.parent / "vocab.json")
    write_decoder(out, cfg, tensors, args.qtype, args.embd_qtype, name=manifest["name"])
    print(f"{out}: {out.stat().st_size:,} bytes")
    if args.replace:
        from memspec.models.store import file_record

        rec = file_record(out)
        manifest["format"] = "gguf"
        manifest["variants"] = {"gguf": rec}
        manifest["files"] = sorted([rec, *manifest.get("tokenizer", {}).values()], key=lambda r: r["path"])
        manifest.setdefault("provenance", {})["converted"] = (
            f"python scripts/drafts_to_gguf.py {args.draft} --qtype {args.qtype} --replace (from q8.onnx)")
        (args.draft / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        (args.draft / "q8.onnx").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
