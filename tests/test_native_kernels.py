"""The native GGUF block matmul (memspec.runtime.kernels over memspec.runtime._native).

Three promises, checked on random blocks of every supported type and on real tensors:
1. close to x @ W.T in float64, W dequantized by the gguf package itself, within the error
   that 8-bit activations allow (floats: within float32 rounding);
2. a row's result is bit for bit the same whatever the other rows, their order, their
   number and the thread count;
3. the AVX2 path equals the scalar reference bit for bit: integer block sums are exact and
   both paths run the same float operations in the same order (native/dot.h).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memspec.runtime import kernels
from blocks import FP16_FIELDS, random_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)  # see test_native_build.py

TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOATS = ("F32", "F16", "BF16")
SIMD = ("avx2", "avx512", "neon")  # every path besides the scalar reference (neon also runs under qemu: test_native_build)
# k per type in the random cases: whole 256-weight chunks for K-quants, a partial last chunk otherwise
K_OF = {**dict.fromkeys(FLOATS, 300), **dict.fromkeys(("Q4_0", "Q4_1", "Q5_0", "Q8_0"), 608),
        **dict.fromkeys(("Q4_K", "Q5_K", "Q6_K"), 768)}
QWEN_GGUF = Path.home() / ".local/share/memspec/downloads/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def type_id(name: str) -> int:
    return int(gguf.GGMLQuantizationType[name])


def random_weights(rng: np.random.Generator, name: str, n: int, k: int) -> np.ndarray:
    """(n, bytes per row) uint8: valid blocks (finite fp16 fields) of weights about N(0, 1/k)."""
    if name in FLOATS:
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        if name == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return (w if name == "F32" else w.astype(np.float16)).view(np.uint8)
    return random_blocks(rng, name, n, k)


def activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """(m, k) float32 like a decoder's: normal, a few outlier channels, and one all-zero row."""
    x = rng.standard_normal((m, k)) * np.where(rng.random(k) < 0.02, 20.0, 1.0)
    x[m // 2] = 0.0
    return x.astype(np.float32)


def error_bound(raw: np.ndarray, name: str, n: int, k: int, x: np.ndarray) -> np.ndarray:
    """(m, n): the largest |kernel - float64 reference| the kernel's arithmetic allows.

    Quantized types round each activation to the nearest step of its block (32 weights for
    the small types, 256 for K-quants), step = max|x| / 127: at most half a step per element,
    so at most sum_i |w_i| * step_i / 2.  The float32 work on top (per-block products, the
    lane sums) rounds at 2^-24 relative a few times per block: 1e-5 of sum |w||x| covers it
    with room.  Float types do only the float32 sum: K/32 fused steps per lane and a
    5-level tree, each at most 2^-24 relative of sum |w||x|."""
    w = np.abs(kernels.dequantize(raw, type_id(name), n, k)).astype(np.float64)  # (n, k)
    size = np.abs(x).astype(np.float64) @ w.T
    if name in FLOATS:
        return (k / 32 + 6) * 2.0**-24 * size
    block = 256 if name.endswith("_K") else 32
    step = np.repeat(np.abs(x).reshape(len(x), -1, block).max(axis=-1), block, axis=-1) / 127
    return 1.001 * (step / 2) @ w.T + 1e-5 * size


def check_close(raw, name, n, k, x, isa=None):
    got = kernels.matmul(raw, type_id(name), n, k, x, isa=isa)
    want = kernels.reference_matmul(raw, type_id(name), n, k, x)
    bound = error_bound(raw, name, n, k, x)
    worst = np.unravel_index(np.argmax(np.abs(got - want) / (bound + 1e-30)), got.shape)
    assert got.shape == (len(x), n) and got.dtype == np.float32
    assert (np.abs(got - want) <= bound).all(), (
        f"{name}: at {worst} got {got[worst]!r}, float64 reference {want[worst]!r}, |diff| "
        f"{abs(got[worst] - want[worst]):.3g} > bound {bound[worst]:.3g}")
    return got


# -- 1. against gguf's dequantization in float64 -----------------------------------------

@pytest.mark.parametrize("isa", ["scalar", *SIMD])
@pytest.mark.parametrize("name", TYPES)
def test_random_blocks_match_the_float64_reference(name, isa):
    if isa not in kernels.isas():
        pytest.skip(f"this CPU has no {isa} (paths: {kernels.isas()})")
    rng = np.random.default_rng(TYPES.index(name))
    n, k = 37, K_OF[name]
    raw, x = random_weights(rng, name, n, k), activations(rng, 5, k)
    got = check_close(raw, name, n, k, x, isa=isa)
    assert (got[2] == 0).all(), f"{name}: the all-zero row gave {got[2][got[2] != 0][:4]}"


def smollm_tensors(gguf_path: Path) -> dict[str, tuple[np.ndarray, str, int, int]]:
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for name, rows in (("blk.0.ffn_gate.weight", 300), ("blk.3.ffn_down.weight", 200), ("token_embd.weight", 300)):
        t = tensors[name]
        k = int(t.shape[0])
        out[name] = (np.ascontiguousarray(t.data[:rows]), t.tensor_type.name, rows, k)
    return out


@pytest.fixture(scope="module")
def smollm(gguf_path):
    """SmolLM2's tensors, a few hundred rows each: Q4_1 (k 576: a partial chunk, and 1536) and Q8_0."""
    return smollm_tensors(gguf_path)


@pytest.fixture(scope="module")
def qwen():
    """The 1.5B's tensors (Q4_K and Q6_K), a few hundred rows each; skipped when it was never pulled."""
    if not QWEN_GGUF.exists():
        pytest.skip(f"{QWEN_GGUF} is not in the store (pull qwen2.5-coder-1.5b)")
    tensors = {t.name: t for t in gguf.GGUFReader(QWEN_GGUF).tensors}
    out = {}
    for name, rows in (("blk.0.ffn_gate.weight", 300), ("blk.0.ffn_down.weight", 100), ("blk.0.attn_v.weight", 256)):
        t = tensors[name]
        out[name] = (np.ascontiguousarray(t.data[:rows]), t.tensor_type.name, rows, int(t.shape[0]))
    return out


def check_real(tensors):
    rng = np.random.default_rng(7)
    for tname, (raw, qtype, n, k) in tensors.items():
        x = activations(rng, 3, k)
        by_isa = {isa: check_close(raw, qtype, n, k, x, isa=isa) for isa in kernels.isas()}
        for isa, got in by_isa.items():
            np.testing.assert_array_equal(got, by_isa["scalar"], err_msg=f"{tname} ({qtype}): {isa} vs scalar")


def test_smollm_tensors_match_the_float64_reference_on_every_path(smollm):
    assert {q for _, q, _, _ in smollm.values()} == {"Q4_1", "Q8_0"}
    check_real(smollm)


@pytest.mark.model  # reaches the 1.5B's GGUF without a model fixture
def test_qwen_tensors_match_the_float64_reference_on_every_path(qwen):
    assert {q for _, q, _, _ in qwen.values()} == {"Q4_K", "Q6_K"}
    check_real(qwen)


# -- 2. a row's result does not depend on the rest of the call ------------------------------

@pytest.mark.parametrize("name", TYPES)
def test_rows_are_bit_identical_whatever_the_batch_order_and_threads(name):
    rng = np.random.default_rng(100 + TYPES.index(name))
    n, k, m = 150, K_OF[name], 19  # 19 rows: one full tile of 16 and a remainder
    raw, x = random_weights(rng, name, n, k), activations(rng, m, k)
    for isa in kernels.isas():
        full = kernels.matmul(raw, type_id(name), n, k, x, isa=isa)
        for size in (1, 2, 3, 4, 5, 7, 8, 9, m):
            rows = rng.permutation(m)[:size]
            for threads in (1, 2, 3):
                got = kernels.matmul(raw, type_id(name), n, k, x[rows], threads=threads, isa=isa)
                same = (got == full[rows]).all(axis=1)
                assert same.all(), (f"{name} {isa}: rows {rows[~same].tolist()} differ when computed as {size} "
                                    f"rows {rows.tolist()} with {threads} threads: "
                                    f"{got[~same][0][:3]} vs {full[rows][~same][0][:3]}")


def test_real_rows_are_bit_identical_alone_and_in_a_batch(smollm):
    raw, qtype, n, k = smollm["blk.0.ffn_gate.weight"]
    x = activations(np.random.default_rng(3), 9, k)
    full = kernels.matmul(raw, type_id(qtype), n, k, x, threads=2)
    for r in range(9):
        alone = kernels.matmul(raw, type_id(qtype), n, k, x[r : r + 1])
        np.testing.assert_array_equal(alone[0], full[r], err_msg=f"row {r} alone vs in 9 rows with 2 threads")


# -- 3. the paths -------------------------------------------------------------------------

@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("name", TYPES)
def test_each_simd_path_equals_the_scalar_reference_bit_for_bit(name, isa):
    if isa not in kernels.isas():
        pytest.skip(f"this CPU has no {isa} (paths: {kernels.isas()})")
    rng = np.random.default_rng(200 + TYPES.index(name))
    n, k = 64, K_OF[name]
    raw, x = random_weights(rng, name, n, k), activations(rng, 6, k)
    if name not in FLOATS:  # row 0: extreme integers (all-ones nibbles, Q8_0's -1, Q6_K's scales -1)
        blocks = raw[0].reshape(k // gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0], -1)
        blocks[:] = 0xFF
        for at in FP16_FIELDS[name]:
            blocks[:, at : at + 2] = np.float16(1e-3).reshape(1).view(np.uint8)
    scalar = kernels.matmul(raw, type_id(name), n, k, x, isa="scalar")
    simd = kernels.matmul(raw, type_id(name), n, k, x, isa=isa)
    differ = np.argwhere(scalar != simd)
    assert len(differ) == 0, f"{name} on {isa}: {len(differ)} outputs differ, first {differ[0]}: " \
                             f"{scalar[tuple(differ[0])]!r} vs {simd[tuple(differ[0])]!r}"


# Decode-sized calls take their own loops on the AVX2 path (native/dot_avx2.c): K-quants one
# row alone (its sum in a register) or rows in groups of up to 8 (sums in vector lanes, each
# block unpacked once per group); small blocks a partial last chunk.  Each must give the
# scalar bits, whatever group a row falls in.
DECODE_K = {**dict.fromkeys(("Q4_0", "Q4_1", "Q5_0", "Q8_0"), 1568),  # 6 chunks and one of a single block
            **dict.fromkeys(("Q4_K", "Q5_K", "Q6_K"), 2304)}          # 9 blocks


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("name", list(DECODE_K))
def test_one_row_and_every_group_size_equal_the_scalar_path(name, isa):
    if isa not in kernels.isas():
        pytest.skip(f"this CPU has no {isa} (paths: {kernels.isas()})")
    rng = np.random.default_rng(300 + TYPES.index(name))
    n, k = 24, DECODE_K[name]
    raw, x = random_weights(rng, name, n, k), activations(rng, 17, k)
    scalar = kernels.matmul(raw, type_id(name), n, k, x, isa="scalar")
    for m in range(1, 18):  # groups 1..8, then 8 + 1 .. 8 + 8 + 1
        got = kernels.matmul(raw, type_id(name), n, k, x[:m], isa=isa, threads=1 + m % 2)
        same = (got == scalar[:m]).all(axis=1)
        assert same.all(), f"{name}: rows {np.flatnonzero(~same).tolist()} of an {m}-row call differ from the scalar path"
    for r in (0, 8, 16):  # each alone: the one-row loop
        alone = kernels.matmul(raw, type_id(name), n, k, x[r : r + 1], isa=isa)
        np.testing.assert_array_equal(alone[0], scalar[r], err_msg=f"{name}: row {r} alone vs the scalar path")


# bytes per interleaved block column of 8 rows (native/pack.h), and the k each case runs at: small
# blocks a partial last 256-weight chunk (their float lanes go by block % 8 across chunks)
PACKED = {"Q4_K": (1184, 1536), "Q6_K": (1680, 1536), "Q4_0": (144, 608), "Q4_1": (160, 608),
          "Q5_0": (176, 608), "Q8_0": (272, 608)}


@pytest.mark.parametrize("isa", ["scalar", *SIMD])
@pytest.mark.parametrize("name", list(PACKED))
def test_the_interleaved_layout_gives_the_row_layouts_bits(name, isa):
    """A path that multiplies a type 8 weight rows at a time (native/pack.h: the x86 paths) repacks
    the matrix; the outputs are the row layout's bits at every row count and thread split (threads
    take whole groups of 8), and a matrix whose rows are not a multiple of 8 keeps its row layout."""
    if isa not in kernels.isas():
        pytest.skip(f"this CPU has no {isa} (paths: {kernels.isas()})")
    rng = np.random.default_rng(400 + TYPES.index(name))
    tid, (column, k) = type_id(name), PACKED[name]
    per = 256 if name.endswith("_K") else 32
    raw, x = random_weights(rng, name, 40, k), activations(rng, 11, k)
    for row, byte in ((3, 0xFF), (4, 0x80), (5, 0x7F)):  # extreme integers: all-ones nibbles, scales 63 / -1; Q8_0 -128, 127
        blocks = raw[row].reshape(k // per, -1)
        blocks[:] = byte
        for at in FP16_FIELDS[name]:
            blocks[:, at : at + 2] = np.float16(1e-3).reshape(1).view(np.uint8)
    packed = kernels.pack(raw, tid, 40, k, isa=isa)
    assert kernels.pack(raw[:36], tid, 36, k, isa=isa) is None  # 36 rows: not whole groups
    assert kernels.pack(random_weights(rng, "Q5_K", 8, 256), type_id("Q5_K"), 8, 256, isa=isa) is None
    if packed is None:
        pytest.skip(f"{isa} multiplies {name} in its row layout")
    assert len(packed) == 40 // 8 * k // per * column
    rows = kernels.matmul(raw, tid, 40, k, x, isa=isa, packed=False)
    np.testing.assert_array_equal(rows, kernels.matmul(raw, tid, 40, k, x, isa="scalar"))
    for m in (1, 2, 3, 4, 5, 11):
        for threads in (1, 2, 3, 6):
            got = kernels.matmul(raw, tid, 40, k, x[:m], isa=isa, threads=threads, packed=packed)
            np.testing.assert_array_equal(got, rows[:m], err_msg=f"{m} rows, {threads} threads, interleaved")
    np.testing.assert_array_equal(kernels.matmul(raw[:36], tid, 36, k, x, isa=isa), rows[:, :36])
    with pytest.raises(ValueError, match=rf"packed holds 10 bytes; path {isa} takes a {name} matrix of n=40"):
        kernels.matmul(raw, tid, 40, k, x, isa=isa, packed=bytearray(10))
    with pytest.raises(ValueError, match="in its row layout only"):
        kernels.matmul(raw, tid, 40, k, x, isa="scalar", packed=packed)
    with pytest.raises(ValueError, match="packed must be None, False or pack"):
        kernels.matmul(raw, tid, 40, k, x, isa=isa, packed="yes")


@pytest.mark.model  # reaches the 1.5B's GGUF without a model fixture
def test_qwen_rows_alone_and_in_a_batch_equal_the_scalar_path(qwen):
    """The 1.5B's Q4_K and Q6_K tensors: a row alone, among 9 (a group of 8 and one) and scalar."""
    rng = np.random.default_rng(11)
    for tname, (raw, qtype, n, k) in qwen.items():
        x = activations(rng, 9, k)
        scalar = kernels.matmul(raw, type_id(qtype), n, k, x, isa="scalar")
        for isa in kernels.isas():
            nine = kernels.matmul(raw, type_id(qtype), n, k, x, isa=isa, threads=2)
            np.testing.assert_array_equal(nine, scalar, err_msg=f"{tname} ({qtype}): 9 rows, {isa} vs scalar")
            for r in (0, 5):
                alone = kernels.matmul(raw, type_id(qtype), n, k, x[r : r + 1], isa=isa)
                np.testing.assert_array_equal(alone[0], scalar[r], err_msg=f"{tname} ({qtype}): row {r} alone, {isa}")


def native_in_subprocess(env_isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEMSPEC_NATIVE_ISA": env_isa}
    code = "from memspec.runtime import _native; print(_native.isa())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_the_environment_forces_the_scalar_path_and_refuses_an_unknown_one():
    forced = native_in_subprocess("scalar")
    assert forced.returncode == 0 and forced.stdout.strip() == "scalar", forced.stderr
    bogus = native_in_subprocess("avx9000")
    assert bogus.returncode != 0 and "MEMSPEC_NATIVE_ISA='avx9000'" in bogus.stderr, bogus.stderr
    assert kernels.isa() in kernels.isas()


@pytest.mark.model
def test_a_refused_native_isa_is_a_one_line_error_of_the_cli(tmp_path):
    """Regression: `memspec generate` under a $MEMSPEC_NATIVE_ISA this CPU lacks ended in an
    ImportError's traceback; it is a configuration error, said in a line, exit 2."""
    env = {**os.environ, "MEMSPEC_NATIVE_ISA": "avx9000"}
    r = subprocess.run([sys.executable, "-m", "memspec", "generate", "--local", "--max-tokens", "2", "hi"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "memspec: error: MEMSPEC_NATIVE_ISA='avx9000'" in r.stderr and "unset MEMSPEC_NATIVE_ISA" in r.stderr


# -- 4. bad inputs ------------------------------------------------------------------------

def bad_cases():
    rng = np.random.default_rng(0)
    raw, x = random_weights(rng, "Q4_K", 4, 512), activations(rng, 2, 512)
    q4k = type_id("Q4_K")
    return [
        ("Q2_K", lambda: kernels.matmul(raw, type_id("Q2_K"), 4, 512, x), r"ggml type 10 \(Q2_K\) is not supported"),
        ("unknown", lambda: kernels.matmul(raw, 99, 4, 512, x), r"ggml type 99 \(\?\) is not supported"),
        ("small", lambda: kernels.matmul(raw[:3], q4k, 4, 512, x), r"weights hold 864 bytes; a Q4_K matrix of n=4 rows, k=512 needs 1152"),
        ("k", lambda: kernels.matmul(raw, q4k, 4, 500, x[:, :500]), r"k=500 is not a multiple of Q4_K's block size 256"),
        ("dtype", lambda: kernels.matmul(raw, q4k, 4, 512, x.astype(np.float64)), r"x must be float32 of shape \(M, 512\), got format 'd'"),
        ("shape", lambda: kernels.matmul(raw, q4k, 4, 512, x[:, :256].copy()), r"x must be float32 of shape \(M, 512\), got format 'f' shape \(2, 256\)"),
        ("1-D", lambda: kernels.matmul(raw, q4k, 4, 512, x[0]), r"x must be 2-D \(M, k=512\), got shape \(512,\)"),
        ("strided", lambda: kernels.matmul(raw, q4k, 4, 512, np.repeat(x, 2, axis=1)[:, ::2]), r"x must be a C-contiguous float32 array"),
        ("threads", lambda: kernels.matmul(raw, q4k, 4, 512, x, threads=0), r"threads must be >= 1, got 0"),
        ("n", lambda: kernels.matmul(raw, q4k, 0, 512, x), r"n and k must be positive"),
        ("isa", lambda: kernels.matmul(raw, q4k, 4, 512, x, isa="avx1024"), r"isa='avx1024' is not available"),
        ("out", lambda: kernels._native.matmul(raw, q4k, 4, 512, x, np.empty((2, 5), np.float32)), r"out must be float32 of shape \(2, 4\), got format 'f' shape \(2, 5\)"),
        ("readonly", lambda: kernels._native.matmul(raw, q4k, 4, 512, x, b"\0" * 32), r"out must be a C-contiguous, writable float32 array"),
    ]


@pytest.mark.parametrize("case", bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise_a_value_error_that_names_the_problem(case):
    _, call, message = case
    with pytest.raises(ValueError, match=message):
        call()


def test_a_missing_extension_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(kernels, "_native", None)
    assert not kernels.available()
    with pytest.raises(ImportError, match="native kernels are not built .* the ONNX Runtime engine still works"):
        kernels.matmul(np.zeros(18, np.uint8), 2, 1, 32, np.zeros((1, 32), np.float32))
