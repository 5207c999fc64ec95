"""Which ONNX Runtime CPU operators give a row a result that depends on how many rows share the pass?

    .venv/bin/python bench/row_invariance.py [--threads 2] [--model smollm2-135m]

Each operator runs alone, in a one-node graph with random weights of the shapes our targets use
(SmolLM2-135M: hidden 576, MLP 1536; Qwen2.5-Coder-1.5B: hidden 1536, MLP 8960), over M = 1, 2, 3, 4,
5, 8 and 16 rows.  Each row of every pass is compared with the same row in the 16-row pass, and
with the row computed alone (M = 1); the table prints the largest absolute difference (0 = bit for
bit).  GroupQueryAttention (packed QKV, 9 query heads, 3 KV heads, 64 per head, after 20 cached
tokens) compares each query row with the same row fed after the rows before it.  Then the whole
target (q4 and fp32) through memspec.runtime.invariance, unpadded and padded to two rows.

The CPU's vector extensions head the output: compare runs on machines of one kind only.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"
ROWS = (1, 2, 3, 4, 5, 8, 16)
SHAPES = ((576, 1536), (1536, 8960))  # (K, N): SmolLM2's and the 1.5B's gate/up projections


def session(nodes, inits, inputs, outputs, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "probe", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 9
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def rows_io(k: int, n: int):
    return ([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, n])])


def matmul_nbits(k: int, n: int, bits: int, accuracy: int, rng, threads: int):
    nb, block = k // 32, 32
    q = rng.integers(0, 2 ** bits, (n, nb, block)).astype(np.uint8)
    data = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8) if bits == 4 else q
    scales = (rng.random(n * nb) * 0.02).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain=MS, K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=accuracy)
    return session([node], [numpy_helper.from_array(data, "w"), numpy_helper.from_array(scales, "s")],
                   *rows_io(k, n), threads)


def matmul(k: int, n: int, rng, threads: int):
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    return session([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(w, "w")],
                   *rows_io(k, n), threads)


def gemm_tied(k: int, n: int, rng, threads: int):
    """The fp32 LM head: Gemm(transB) over the (V, H) embedding, rows flattened."""
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    shape = numpy_helper.from_array(np.array([-1, k], dtype=np.int64), "flat")
    back = numpy_helper.from_array(np.array([1, -1, n], dtype=np.int64), "back")
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["f"]),
             helper.make_node("Gemm", ["f", "w"], ["g"], transB=1),
             helper.make_node("Reshape", ["g", "back"], ["y"])]
    return session(nodes, [numpy_helper.from_array(w, "w"), shape, back], *rows_io(k, n), threads)


def row_table(sess, k: int, rng) -> dict[int, tuple[float, float]]:
    """{M: (largest difference from the 16-row pass, from the rows computed alone)}."""
    x = rng.standard_normal((1, max(ROWS), k)).astype(np.float32)
    full = sess.run(None, {"x": x})[0]
    alone = np.concatenate([sess.run(None, {"x": x[:, i:i + 1]})[0] for i in range(max(ROWS))], axis=1)
    out = {}
    for m in ROWS:
        y = sess.run(None, {"x": x[:, :m]})[0]
        out[m] = (float(np.abs(y - full[:, :m]).max()), float(np.abs(y - alone[:, :m]).max()))
    return out


def gqa_table(rng, threads: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64, past: int = 20):
    """GroupQueryAttention, packed QKV, no rotary: each query row of an M-row pass against the same
    row fed after the rows before it, in a 16-row pass and one row at a time."""
    width = (heads + 2 * kv_heads) * head_dim
    f = TensorProto.FLOAT
    node = helper.make_node("GroupQueryAttention", ["q", "", "", "pk", "pv", "seqlens", "total"],
                            ["y", "ok", "ov"], domain=MS, num_heads=heads, kv_num_heads=kv_heads)
    sess = session([node], [], [
        helper.make_tensor_value_info("q", f, [1, None, width]),
        helper.make_tensor_value_info("pk", f, [1, kv_heads, None, head_dim]),
        helper.make_tensor_value_info("pv", f, [1, kv_heads, None, head_dim]),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("y", f, [1, None, heads * head_dim]),
         helper.make_tensor_value_info("ok", f, [1, kv_heads, None, head_dim]),
         helper.make_tensor_value_info("ov", f, [1, kv_heads, None, head_dim])], threads)
    qkv = rng.standard_normal((1, max(ROWS), width)).astype(np.float32)
    pk, pv = (rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32) for _ in range(2))

    def run(start: int, m: int):
        """Rows start..start+m-1 after the past and rows 0..start-1 (their K/V from an earlier pass)."""
        k, v = pk, pv
        if start:
            _, k, v = run(0, start)
        total = past + start + m
        return sess.run(None, {"q": qkv[:, start:start + m], "pk": k, "pv": v,
                               "seqlens": np.array([total - 1], np.int32), "total": np.array(total, np.int32)})

    full = run(0, max(ROWS))[0]
    alone = np.concatenate([run(i, 1)[0] for i in range(max(ROWS))], axis=1)
    out = {}
    for m in ROWS:
        y = run(0, m)[0]
        out[m] = (float(np.abs(y - full[:, :m]).max()), float(np.abs(y - alone[:, :m]).max()))
    return out


def fmt(v: float) -> str:
    return "0" if v == 0.0 else f"{v:.1e}"


def print_table(name: str, table: dict[int, tuple[float, float]]) -> None:
    print(f"| {name} | " + " | ".join(f"{fmt(table[m][0])} / {fmt(table[m][1])}" for m in ROWS) + " |")


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|avx2|fma|amx[a-z_0-9]*|asimddp|asimd)\b", text)))
    model = re.search(r"model name\s*:\s*(.*)", text)
    return f"{model.group(1) if model else 'unknown CPU'}: {' '.join(flags) or 'no AVX'}"


def whole_target(name: str, threads: int) -> None:
    from memspec.models.store import ModelStore, default_home
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.invariance import row_differences
    from memspec.runtime.sessions import DecoderSession

    store = ModelStore(default_home())
    m = store.get(name)
    for variant in m.variants:
        s = DecoderSession(m.variant_path(variant), SessionConfig(max_context=64, intra_op_threads=threads))
        for pad in (1, 2):
            s.pad_rows = pad
            diffs = ", ".join(f"{k}: {fmt(v)}" for k, v in row_differences(s).items())
            print(f"| {name} {variant}, one-token passes padded to {pad} row(s) | {diffs} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", action="append", default=[], help="also probe this pulled target (repeatable)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{cpu_flags()}; onnxruntime {ort.__version__}; {args.threads} threads\n")
    print("Largest difference of a row: against the 16-row pass / against the row alone.\n")
    print("| operator | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    for k, n in SHAPES:
        for bits, acc in ((4, 4), (4, 0), (8, 4), (8, 0)):
            print_table(f"MatMulNBits {bits}-bit acc {acc}, K {k} N {n}", row_table(matmul_nbits(k, n, bits, acc, rng,
                                                                                                 args.threads), k, rng))
        print_table(f"MatMul (fp32), K {k} N {n}", row_table(matmul(k, n, rng, args.threads), k, rng))
        print_table(f"MatMul (block sums), K {k // 32} N {n}", row_table(matmul(k // 32, n, rng, args.threads),
                                                                        k // 32, rng))
    print_table("Gemm transB (fp32 LM head), K 576 N 49152", row_table(gemm_tied(576, 49152, rng, args.threads), 576, rng))
    print_table("GroupQueryAttention, 9/3 heads, 20 cached", gqa_table(rng, args.threads))
    if args.model:
        print("\nWhole targets (memspec.runtime.invariance.row_differences: the probe rows' largest logit difference)\n")
        print("| target | passes compared |")
        print("|---|---|")
        for name in args.model:
            whole_target(name, args.threads)


if __name__ == "__main__":
    main()
