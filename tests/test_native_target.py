"""The native target (memspec.runtime.native_target): SmolLM2's GGUF run as it is by memspec's own
kernels.  A row's logits are the same bit for bit however its tokens are fed: one at a time, in
chunks, or as rows among other sequences in one pass, at any thread count."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from memspec.errors import ContextOverflowError, ModelFormatError
from memspec.runtime import kernels
from memspec.runtime.target import open_batched

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)  # test_native_build.py
IDS = [(31 * i + 7) % 49152 for i in range(48)]


@pytest.fixture(scope="module")
def native(gguf_path):
    from memspec.runtime.native_target import NativeTarget

    return NativeTarget(gguf_path, threads=2, max_context=128)


def whole(t, ids):
    return t.forward(t.new_cache(), ids, keep=len(ids))


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_a_row_is_the_same_fed_alone_in_chunks_or_among_other_sequences(gguf_path, native, threads):
    """7 threads on a machine with fewer cores: threads are descheduled mid-matmul, and the others take
    their chunks (model.c's deal), which must change no output."""
    from memspec.runtime.native_target import NativeTarget

    assert_rows_exact(native if threads == 2 else NativeTarget(gguf_path, threads=threads, max_context=128), native,
                      threads)


def assert_rows_exact(t, native, threads):
    """t's rows, fed alone, in chunks and among other sequences, are `native`'s of one pass (2 threads)."""
    ref = whole(native, IDS[:24])  # 2 threads, one pass of 24 rows
    one = t.new_cache()
    alone = np.concatenate([t.forward(one, [i]) for i in IDS[:24]])
    assert np.array_equal(alone, ref)
    for size in (2, 3, 5, 16):
        c = t.new_cache()
        chunks = [IDS[at:min(at + size, 24)] for at in range(0, 24, size)]
        parts = [t.forward(c, chunk, keep=len(chunk)) for chunk in chunks]
        assert np.array_equal(np.concatenate(parts), ref), size
    rng = np.random.default_rng(threads)
    for n in (2, 5, 8):  # n sequences in one pass, each at its own length, fed 1..6 tokens
        caches, feeds, refs = [], [], []
        for _ in range(n):
            ctx, k = int(rng.integers(1, 17)), int(rng.integers(1, 7))
            seq = list(map(int, rng.integers(0, 49152, ctx + k)))
            c = t.new_cache()
            t.forward(c, seq[:ctx])
            caches.append(c)
            feeds.append(seq[ctx:])
            refs.append(whole(native, seq)[ctx:])
        for got, want in zip(t.forward_batch(caches, feeds, [len(f) for f in feeds]), refs):
            assert np.array_equal(got, want)


def test_a_long_feed_goes_in_passes_of_at_most_pass_rows_with_the_same_rows(gguf_path, monkeypatch):
    """forward feeds a long prompt in passes of PASS_ROWS rows (a pass's activations stay small): the
    kept rows, the features and the cache are those of one pass, and a feed that cannot fit commits
    nothing."""
    from memspec.runtime import native_target
    from memspec.runtime.native_target import NativeTarget

    t = NativeTarget(gguf_path, threads=2, max_context=64)
    ids = IDS[:40]
    one = t.new_cache()
    want, want_h = t.forward(one, ids, keep=12, features=[-1])
    passes = []
    real = t.forward_batch
    monkeypatch.setattr(native_target, "PASS_ROWS", 16)
    monkeypatch.setattr(t, "forward_batch", lambda c, f, k, x=None: passes.append(len(f[0])) or real(c, f, k, x))
    split = t.new_cache()
    got, got_h = t.forward(split, ids, keep=12, features=[-1])
    assert passes == [16, 8, 16]  # the last pass holds the kept rows and at least PASS_ROWS of them
    assert np.array_equal(got, want) and np.array_equal(got_h, want_h)
    assert split.length == one.length == 40 and np.array_equal(split.data, one.data)
    full = t.new_cache()
    t.forward(full, ids[:30])
    with pytest.raises(ContextOverflowError):
        t.forward(full, ids)  # 30 + 40 > 64: refused before a pass
    assert full.length == 30


TREES = [  # parents of each node, node 0 the root: the shapes a verify pass takes, and odd ones
    [-1, 0, 1, 2, 0],  # a chain of 3 drafts and an alternative to the first
    [-1, 0, 1, 2, 3, 0, 1, 2],  # an alternative at each of the first three positions
    [-1, 0, 0, 0, 1, 4, 5, 2, 7],  # three first tokens, chains under two of them
    [-1, 0, 1, 1, 2, 3, 4, 5, 3, 1],  # branches deep in the tree
]


@pytest.mark.parametrize("context", [0, 1, 9, 37])
def test_every_row_of_a_tree_pass_is_its_chain_fed_alone(native, context):
    """Node i's logits in one tree pass: bit for bit the last row of the chain root .. i fed alone
    after the same context, at an empty cache and at full ones."""
    rng = np.random.default_rng(context)
    for parents in TREES:
        ctx = list(map(int, rng.integers(0, 49152, context)))
        ids = list(map(int, rng.integers(0, 49152, len(parents))))
        c = native.new_cache()
        if ctx:
            native.forward(c, ctx)
        rows = native.forward_tree(c, ids, parents)
        assert rows.shape == (len(ids), 49152) and c.length == context + len(ids)
        for i in range(len(ids)):
            chain, node = [], i
            while node >= 0:
                chain.insert(0, ids[node])
                node = parents[node]
            assert np.array_equal(rows[i], whole(native, ctx + chain)[-1]), (parents, i)


def test_keeping_a_branch_of_a_tree_leaves_the_cache_of_that_chain(native):
    """After a pass that accepts a branch that is not the first (its K/V in later slots), the kept
    path's K/V lie at the committed positions: the next pass's logits are a chain-only run's."""
    ctx, ids, parents = IDS[:11], [IDS[11], 101, 102, 103, 201, 202, 301], [-1, 0, 1, 2, 0, 4, 1]
    kept = {(0, 4, 5): [201, 202], (0, 1, 6): [101, 301], (0, 1, 2): [101, 102], (0,): []}  # path: its drafts
    for path, drafts in kept.items():
        chain = [IDS[11], *drafts]
        c = native.new_cache()
        native.forward(c, ctx)
        native.forward_tree(c, ids, parents)
        c.keep_path(11, list(path))
        assert c.length == 11 + len(path)
        got = native.forward(c, IDS[30:34], keep=4)
        assert np.array_equal(got, whole(native, ctx + chain + IDS[30:34])[-4:]), path


def test_a_bad_tree_is_a_clear_error_and_the_target_keeps_working(native):
    c = native.new_cache()
    native.forward(c, IDS[:4])
    for parents in ([0, 0], [-1, 1], [-1, 0, 3], [-1, -1]):
        with pytest.raises(ValueError, match="tree"):
            native.forward_tree(c, [1] * len(parents), parents)
    with pytest.raises(ValueError, match="parent"):  # the extension's own check: a parent a row after its child
        native.model.forward([c.data], [c.capacity], np.asarray([1, 2], np.int32), np.asarray([4, 5], np.int32),
                             np.asarray([0, 0], np.int32), np.asarray([1], np.int32),
                             np.empty((1, 49152), np.float32), np.asarray([1, -1], np.int32))
    native.forward_tree(c, [1, 2, 3], [-1, 0, 0])
    for path in ([1], [0, 2, 1], [0, 3]):
        with pytest.raises(ValueError, match="path"):
            c.keep_path(4, path)
    c.keep_path(4, [0, 2])
    assert c.length == 6 and np.array_equal(native.forward(c, [9]), whole(native, IDS[:4] + [1, 3, 9])[-1:])


def test_rollback_overwrites_rejected_tokens(native):
    c = native.new_cache()
    native.forward(c, IDS[:20])
    want = native.forward(c, IDS[20:24], keep=4)
    c.truncate(20)
    native.forward(c, [5, 6, 7, 8, 9, 10], keep=6)  # a rejected draft run
    c.truncate(20)
    assert np.array_equal(native.forward(c, IDS[20:24], keep=4), want) and c.length == 24


def test_it_agrees_with_the_exact_fp32_graph_as_int8_activations_allow(model_store, native):
    """The fp32 ONNX variant dequantizes the same blocks exactly; the native engine quantizes its
    activations to 8 bits as the q4 graph does: its logits stay as close to fp32 as q4's do."""
    from memspec.models.tokenizer import Tokenizer
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.sessions import DecoderSession

    m = model_store.get("smollm2-135m")
    tok = Tokenizer.from_file(f"{m.folder}/tokenizer.json", f"{m.folder}/tokenizer_config.json")
    ids = tok.encode("Write a Python function that merges two sorted lists. Here is one way to do it:")
    got = whole(native, ids)
    ref = {v: DecoderSession(m.variant_path(v), SessionConfig(max_context=128)) for v in ("fp32", "q4")}
    fp32, q4 = (whole(s, ids) for s in (ref["fp32"], ref["q4"]))
    ours, theirs = np.abs(got - fp32).mean(), np.abs(q4 - fp32).mean()
    agree = (got.argmax(1) == fp32.argmax(1)).mean()
    print(f"\nmean |logit - fp32|: native {ours:.3f}, onnx q4 {theirs:.3f}; argmax agreement {agree:.3f}")
    assert ours < 1.25 * theirs and agree >= 0.85


def test_bad_input_is_a_clear_error_and_the_target_keeps_working(native):
    c = native.new_cache(capacity=8)
    with pytest.raises(ValueError, match="token id 49152 is outside the vocabulary"):
        native.forward(c, [1, 49152])
    with pytest.raises(ContextOverflowError, match="0 cached \\+ 9 new tokens > capacity 8"):
        native.forward(c, list(range(9)))
    with pytest.raises(ValueError, match="a cache appears twice"):
        native.forward_batch([c, c], [[1], [2]], [1, 1])
    assert c.length == 0 and native.forward(c, IDS[:3]).shape == (1, 49152)


def test_the_extension_refuses_more_kept_rows_than_the_pass_has(native):
    """Model.forward is callable from Python directly; keeping more rows than the pass feeds
    (a kept row listed twice) once wrote the head's inputs past a T-row buffer."""
    c = native.new_cache(capacity=8)
    i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    logits = np.empty((3, native.vocab_size), dtype=np.float32)
    with pytest.raises(ValueError, match="kept row out of range"):
        native.model.forward([c.data], [c.capacity], i32([1, 2]), i32([0, 1]), i32([0, 0]), i32([1, 1, 1]), logits)
    assert native.forward(c, IDS[:3]).shape == (1, 49152)


def test_a_truncated_gguf_is_refused_naming_the_tensor(gguf_path, tmp_path):
    from memspec.runtime.native_target import NativeTarget

    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(gguf_path.stat().st_size // 2))
    with pytest.raises(ModelFormatError, match="tensor 'blk.*' needs .* the file is truncated"):
        NativeTarget(cut)


def test_an_unsupported_block_type_is_refused_naming_tensor_and_type(gguf_path, tmp_path):
    """The type field of one tensor rewritten to Q2_K (10): refused at load with both names."""
    from memspec.models.gguf import read_layout
    from memspec.runtime.native_target import NativeTarget

    bad = tmp_path / "q2k.gguf"
    shutil.copy(gguf_path, bad)
    raw = bytearray(bad.read_bytes())
    name = b"blk.3.ffn_up.weight"
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # then n_dims, dims, type
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == 3  # Q4_1
    raw[type_at:type_at + 4] = (10).to_bytes(4, "little")
    bad.write_bytes(bytes(raw))
    assert read_layout(bad)[1]["blk.3.ffn_up.weight"].ggml_type == 10
    with pytest.raises(ModelFormatError, match=r"blk\.3\.ffn_up\.weight is of ggml type 10 \(Q2_K\)"):
        NativeTarget(bad)


# -- as the engine's target ---------------------------------------------------------------------
from test_q4_agreement import assert_every_draft_keeps_target_only_output  # noqa: E402


@pytest.fixture(scope="module")
def native_engine(model_store):
    from memspec.runtime.config import SessionConfig
    from memspec.build import load_pool
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    config = SessionConfig(max_context=512, backend="native", intra_op_threads=2)
    target = load_target(model_store, "smollm2-135m", "q4", config)
    return Engine(target, drafts=DraftPool(load_pool(model_store, "smollm2-135m", 49152, config)))


def test_the_engine_runs_the_gguf_itself_when_the_config_says_native(native_engine, model_store):
    from memspec.runtime.native_target import NativeTarget

    t = native_engine.target
    assert isinstance(t.session, NativeTarget) and t.variant == "gguf" and t.session.rows.exact
    assert t.session.path == model_store.gguf_of(model_store.get("smollm2-135m"))
    assert t.file_bytes == t.session.path.stat().st_size  # what the budget and GetStatus count


def test_speculative_output_is_target_only_output_with_every_draft(native_engine):
    """Greedy: every shipped draft and prompt lookup, token for token the native target's own answer."""
    assert_every_draft_keeps_target_only_output(native_engine, max_tokens=40)


def test_batched_requests_get_their_solo_tokens_greedy_or_sampled(native_engine):
    """Engine(batched=open_batched(target, 3)) on the native target: requests arriving at random, with different
    drafts (or none), greedy and seeded sampling, one cancelled mid-batch, share passes of several
    rows and each gets exactly its solo tokens; the passes hold no copy of the weights."""
    import threading
    import time

    from memspec.request import GenerationRequest, SamplingParams
    from memspec.speculation.config import SpecConfig
    from memspec.speculation.engine import Engine

    step = SpecConfig(gamma=3, controller="step")  # draft lengths that do not depend on timing
    solo = Engine(native_engine.target, drafts=native_engine.drafts, spec=step)
    batched = Engine(native_engine.target, drafts=native_engine.drafts, spec=step,
                     batched=open_batched(native_engine.target.session, 3))
    prompts = ["Write a Python function that reverses a list.", "What is 12 * 13?", "Name three colors.",
               "Tell me a joke about cats.", "Summarise: the sky is blue today.", "Convert to JSON: name Bob."]
    drafts = ["draft-code", "draft-math", "none", "draft-chat", "prompt-lookup", "draft-general"]
    reqs = [GenerationRequest(prompt=p, max_tokens=20, draft=d,
                              sampling=SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=7 + i))
            for i, (p, d) in enumerate(zip(prompts, drafts))]
    expected = [solo.generate(r).token_ids for r in reqs]
    got: dict[int, object] = {}
    cancels = {i: threading.Event() for i in range(len(reqs))}
    delays = np.random.default_rng(5).uniform(0, 0.3, len(reqs))

    def client(i):
        time.sleep(delays[i])
        got[i] = batched.generate(reqs[i], cancels[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    time.sleep(0.4)
    cancels[3].set()
    for t in threads:
        t.join(120)
    assert len(got) == len(reqs)
    for i, r in got.items():
        n = len(r.token_ids) if r.finish_reason == "cancelled" else len(expected[i])
        assert r.token_ids == expected[i][:n], f"request {i} ({drafts[i]}, {reqs[i].sampling}) changed"
    rep = batched.batch.report()
    assert rep["slots_in_use"] == 0 and sum(v for k, v in rep.items() if k.startswith("rows_")) == rep["passes"]
    assert rep.get("rows_2", 0) + rep.get("rows_3", 0) > 0, rep
    assert batched.batch.target.weight_bytes == 0
    batched.batch.close()


def test_a_prefix_loaded_from_another_cache_gives_the_logits_of_the_whole_prompt(native):
    """The prefix cache's premise on the native target: the K/V of a prompt's first n tokens, copied
    from another sequence's cache, and the rest fed on top, give every logit of feeding it whole."""
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 31581, 28, 3570, 16185, 198, 1, 4093, 198, 504, 314, 28, 216]
    whole_cache = native.new_cache()
    want = native.forward(whole_cache, ids, keep=3)
    other = native.new_cache()
    native.forward(other, ids[:12] + [42, 43], keep=1)  # another prompt that starts the same way
    c = native.new_cache()
    c.load_prefix(other.prefix(12), 12)
    got = native.forward(c, ids[12:], keep=3)
    assert np.array_equal(got, want) and c.length == whole_cache.length
    with pytest.raises(ValueError, match="does not fit"):
        native.new_cache().load_prefix(other.prefix(12)[:, :1], 12)


def test_a_prompt_that_starts_like_an_earlier_one_reuses_it_and_no_token_changes(native_engine):
    """Engine(prefix_cache_bytes): every chat prompt shares SmolLM2's template and system prompt, and a
    conversation's next turn resends the last; their K/V are taken from the cache, and every answer,
    greedy or sampled, with a draft or none, alone or batched, is token for token the one computed
    from scratch."""
    import threading

    from memspec.request import GenerationRequest, SamplingParams
    from memspec.speculation.config import SpecConfig
    from memspec.speculation.engine import Engine

    step = SpecConfig(gamma=3, controller="step")
    plain = Engine(native_engine.target, drafts=native_engine.drafts, spec=step)
    reuse = Engine(native_engine.target, drafts=native_engine.drafts, spec=step, prefix_cache_bytes=16 << 20)
    assert plain.prefixes is None and reuse.prefixes is not None
    first = GenerationRequest(prompt="Name three colors.", max_tokens=16)
    answer = plain.generate(first)
    turn2 = GenerationRequest(messages=(("user", "Name three colors."), ("assistant", answer.text),
                                        ("user", "And three animals?")), max_tokens=16, draft="draft-chat")
    reqs = [first, turn2,
            GenerationRequest(prompt="What is 12 * 13?", max_tokens=16, draft="draft-math",
                              sampling=SamplingParams(temperature=0.8, seed=3)),
            GenerationRequest(prompt="Write a haiku about rain.", max_tokens=16, draft="none", logprobs=3)]
    expected = [plain.generate(r) for r in reqs]
    got = [reuse.generate(r) for r in reqs]
    for r, want, have in zip(reqs, expected, got):
        assert have.token_ids == want.token_ids, r
    assert [g.timings.cached_prompt_tokens for g in got][0] == 0  # nothing stored yet
    system = native_engine.prompt_ids(reqs[2])  # the template's system part: what every chat prompt shares
    assert all(g.timings.cached_prompt_tokens >= 10 for g in got[1:]), [g.timings for g in got]
    # the second turn starts from the first turn's prompt and the answer it got
    assert got[1].timings.cached_prompt_tokens >= len(answer.prompt_token_ids), (got[1].timings, len(system))
    rep = reuse.prefixes.report()
    assert rep["hits"] == 3 and rep["entries"] >= 1 and 0 < rep["bytes"] <= 16 << 20

    batched = Engine(native_engine.target, drafts=native_engine.drafts, spec=step,
                     batched=open_batched(native_engine.target.session, 3),
                     prefix_cache_bytes=16 << 20)
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, batched.generate(reqs[i])))
               for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert [out[i].token_ids for i in range(len(reqs))] == [e.token_ids for e in expected]
    finally:
        batched.close()


def test_only_the_daemons_engine_batches(model_store):
    """A local command (generate, chat, profile, the end-to-end bench) runs one request at a time: no
    batch loop, so no batched pass-cost table measured on its first use (30 s for SmolLM2 on 2
    cores); the daemon's engine batches its concurrent requests on the native engine."""
    from memspec.build import build_engine
    from memspec.cli import serving_engine
    from memspec.config import Config

    config = Config()
    local = build_engine(config, drafts="none")
    try:
        assert local.target.variant == "gguf" and local.batch is None
    finally:
        local.close()
    daemon = serving_engine(config)
    try:
        assert daemon.batch is not None and daemon.batch.slots == config.server.max_concurrent
        assert daemon.prefixes is not None and daemon.prefixes.max_bytes == config.runtime.prefix_cache_mb << 20
    finally:
        daemon.close()


def test_load_target_opens_a_store_target_on_the_engine_its_plan_names(gguf_path, model_store):
    from memspec.runtime import load_target
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.native_target import NativeTarget

    t = NativeTarget(gguf_path, threads=2)
    c = t.new_cache()
    logits = t.forward(c, IDS[:5], keep=2)
    assert logits.shape == (2, 49152) and c.length == 5
    c.truncate(3)
    rows = t.forward_batch([c, t.new_cache()], [IDS[3:5], IDS[:4]], keeps=[2, 1])
    assert np.array_equal(rows[0], logits) and rows[1].shape == (1, 49152)
    target = load_target(model_store, "smollm2-135m", config=SessionConfig(backend="native", intra_op_threads=2))
    assert (target.plan.engine, target.variant, target.plan.asked) == ("native", "gguf", "q4")
    assert target.session.path == t.path and target.session.threads == 2
    assert np.array_equal(target.session.forward(target.session.new_cache(), IDS[:5], keep=2), logits)
    assert target.tokenizer.decode(target.tokenizer.encode("Hello")) == "Hello" and target.eos_ids


def test_load_target_refuses_a_store_entry_that_is_not_a_target(model_store):
    from memspec.errors import InvalidRequestError
    from memspec.runtime import load_target
    from memspec.runtime.config import SessionConfig

    drafts = [m for m in model_store.list() if m.role == "draft"]  # the shipped drafts at least
    with pytest.raises(InvalidRequestError, match=f"'{drafts[0].name}' is a draft; name a target"):
        load_target(model_store, drafts[0].name, config=SessionConfig(backend="native"))


def test_a_backend_that_cannot_run_is_a_config_error(gguf_path, model_store):
    from memspec.errors import ConfigError
    from memspec.runtime.batch import BatchedTarget
    from memspec.runtime.native_target import NativeTarget
    from memspec.runtime.plan import resolve_backend

    with pytest.raises(ConfigError, match="'tpu' is not an engine; choose one of auto, native, onnxruntime"):
        resolve_backend("tpu", ("auto",))
    with pytest.raises(ConfigError, match="runs on the CPU; providers CUDAExecutionProvider ask for a GPU"):
        resolve_backend("native", ("CUDAExecutionProvider",))
    with pytest.raises(ConfigError, match="BatchedTarget batches an ONNX Runtime session"):
        BatchedTarget(NativeTarget(gguf_path), rows=2)


def test_auto_runs_the_target_on_a_gpu_that_onnx_runtime_reports(monkeypatch):
    """providers = "auto" on a Jetson with onnxruntime-gpu: ONNX Runtime on CUDA (the README's engine
    table), not the native engine on the CPU; backend = "native" there still runs on the CPU."""
    import onnxruntime as ort

    from memspec.runtime.config import SessionConfig
    from memspec.runtime.plan import needs_onnx, on_gpu, resolve_backend

    monkeypatch.setattr(kernels, "available", lambda: True)
    cpu_only = ["CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: cpu_only)
    assert not on_gpu(("auto",)) and resolve_backend("auto", ("auto",)) == "native"
    assert not needs_onnx(SessionConfig())
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *cpu_only])
    assert on_gpu(("auto",)) and resolve_backend("auto", ("auto",)) == "onnxruntime"
    assert needs_onnx(SessionConfig())
    assert not on_gpu(("CPUExecutionProvider",)) and resolve_backend("auto", ("CPUExecutionProvider",)) == "native"
    assert resolve_backend("native", ("auto",)) == "native"
    assert needs_onnx(SessionConfig(backend="native", providers=("CUDAExecutionProvider",)))  # a config error


def test_a_gguf_that_is_not_the_one_pulled_is_refused(model_store, tmp_path):
    """The store checks the GGUF against the sha256 its manifest recorded before the engine maps it."""
    from memspec.models.store import ModelStore

    home = tmp_path / "home"
    store = ModelStore(home)
    shutil.copytree(model_store.get("smollm2-135m").folder, home / "models" / "smollm2-135m")
    store.downloads_dir.mkdir(parents=True, exist_ok=True)
    m = store.get("smollm2-135m")
    with pytest.raises(ModelFormatError, match="its GGUF .* is not in the store; .* memspec pull smollm2-135m"):
        store.gguf_of(m)
    (store.downloads_dir / m.provenance["gguf_file"]).write_bytes(b"GGUF not really")
    with pytest.raises(ModelFormatError, match="is not the GGUF it was pulled from"):
        store.gguf_of(m)


def test_every_path_of_this_cpu_gives_the_same_logits(gguf_path, native):
    """The scalar reference and the SIMD path (kernels and attention) agree bit for bit on a whole
    forward pass: where a machine runs decides nothing."""
    from memspec.runtime.native_target import NativeTarget

    for isa in kernels.isas():
        other = NativeTarget(gguf_path, threads=2, max_context=128, isa=isa)
        assert np.array_equal(whole(other, IDS[:20]), whole(native, IDS[:20])), isa


def test_one_row_passes_are_the_same_whichever_way_the_weights_are_fetched(gguf_path, native):
    """Model.fetch_ahead (the loader times both ways and keeps the faster) moves how a one-row pass
    streams its weights, never a bit of it, on every path of this CPU."""
    from memspec.runtime.native_target import NativeTarget

    assert isinstance(native.fetch_ahead, bool) and native.model.fetch_ahead == native.fetch_ahead
    for isa in kernels.isas():
        t = NativeTarget(gguf_path, threads=2, max_context=128, isa=isa, check_rows=False)
        got = []
        for on in (True, False):
            t.model.fetch_ahead = on
            c = t.new_cache()
            got.append(np.concatenate([t.forward(c, [i]) for i in IDS[:12]]))
        assert np.array_equal(got[0], got[1]), isa
        assert np.array_equal(got[0], whole(native, IDS[:12])), isa


def test_a_cost_curve_is_kept_per_build_of_the_kernels(native):
    """A curve measured with one build of the extension is not reused after a rebuild (a faster
    kernel would otherwise keep the old costs for a day)."""
    key = json.loads(native.cost_key(4))
    assert kernels.build_id() in key and native.isa in key
    assert native.cost_key(4) != native.cost_key(5)


def test_loading_on_demand_plans_each_engine_at_its_own_footprint(model_store):
    """What the target set plans a load with (memspec.serving.backend): the mapped GGUF for the native
    engine, the graph's session (1.75x its file at the load's peak) for ONNX Runtime."""
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.memory import planned_target_footprint
    from memspec.runtime.plan import NATIVE_FOOTPRINT_PER_FILE_BYTE, plan

    m = model_store.get("smollm2-135m")
    gguf = model_store.gguf_of(m).stat().st_size
    native = plan(model_store, "smollm2-135m", "q4", SessionConfig(backend="native"))
    assert (native.engine, native.variant, native.asked) == ("native", "gguf", "q4")
    assert native.planned_bytes == int(gguf * NATIVE_FOOTPRINT_PER_FILE_BYTE)
    cpu = SessionConfig(backend="onnxruntime", providers=("CPUExecutionProvider",))
    onnx = plan(model_store, "smollm2-135m", "q4", cpu)
    assert (onnx.engine, onnx.variant) == ("onnxruntime", "q4")
    assert onnx.planned_bytes == planned_target_footprint(m.variant_bytes("q4")) > native.planned_bytes


def test_the_readme_quick_start_answers_right_on_the_default_target(native_engine):
    """Issue 45: the quick start's first line once asked "What is the capital of France?", which the
    default SmolLM2-135M Q4_1 answers in nonsense French. Every `generate` line of the README's
    "After setup" block is run here as the CLI runs it (greedy, chat template, 256 tokens) and its
    answer checked; setup.sh asks the first one."""
    import re
    import shlex
    from pathlib import Path

    from memspec.request import GenerationRequest

    repo = Path(__file__).resolve().parent.parent
    block = (repo / "README.md").read_text().split("After setup:", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line)[2:] for line in block.strip().splitlines() if " generate " in line]
    expected = [r"capital of France is Paris", r"(?s)red.*(blue.*yellow|yellow.*blue)", r"% 2 == 0"]
    assert len(lines) == len(expected), lines
    for args, pattern in zip(lines, expected):
        draft = args[args.index("--draft") + 1] if "--draft" in args else None
        answer = native_engine.generate(GenerationRequest(prompt=args[-1], max_tokens=256, draft=draft)).text
        assert re.search(pattern, answer, re.IGNORECASE), (args, answer)
    assert f'generate "{lines[0][-1]}"' in (repo / "setup.sh").read_text()


# -- INT8 KV ([runtime] kv = "q8") ------------------------------------------------------------------
@pytest.fixture(scope="module")
def native_q8(gguf_path):
    from memspec.runtime.native_target import NativeTarget

    return NativeTarget(gguf_path, threads=2, max_context=128, kv="q8")


@pytest.mark.parametrize("threads", [1, 3])
def test_q8_rows_are_the_same_fed_alone_in_chunks_or_among_other_sequences(gguf_path, native_q8, threads):
    """Each position's int8 key and value are quantized once, from that row alone, and every row (its
    own position included) attends them as read back: the same bits at any row count and threads."""
    from memspec.runtime.native_target import NativeTarget

    assert native_q8.rows.exact and native_q8.model.kv == "q8"
    assert_rows_exact(NativeTarget(gguf_path, threads=threads, max_context=128, kv="q8"), native_q8, threads)


@pytest.mark.parametrize("context", [0, 37])
def test_q8_tree_rows_are_their_chains_fed_alone(native_q8, context):
    rng = np.random.default_rng(context)
    ctx = list(map(int, rng.integers(0, 49152, context)))
    for parents in TREES[2:]:
        ids = list(map(int, rng.integers(0, 49152, len(parents))))
        c = native_q8.new_cache()
        if ctx:
            native_q8.forward(c, ctx)
        rows = native_q8.forward_tree(c, ids, parents)
        for i in range(len(ids)):
            chain, node = [], i
            while node >= 0:
                chain.insert(0, ids[node])
                node = parents[node]
            assert np.array_equal(rows[i], whole(native_q8, ctx + chain)[-1]), (parents, i)
    c = native_q8.new_cache()  # and a kept branch leaves that chain's cache
    native_q8.forward(c, IDS[:11])
    native_q8.forward_tree(c, [IDS[11], 101, 102, 201], [-1, 0, 1, 0])
    c.keep_path(11, [0, 3])
    assert np.array_equal(native_q8.forward(c, IDS[30:33], keep=3), whole(native_q8, IDS[:12] + [201] + IDS[30:33])[-3:])


def test_q8_every_path_of_this_cpu_gives_the_same_logits(gguf_path, native_q8):
    """The scalar reference and this CPU's SIMD paths on SmolLM2's real keys and values: the int8 tiles'
    conversion and the scales applied after the dot and before the mix, bit for bit, across tiles
    (64 positions of 64 dims) and groups of 8 keys."""
    from memspec.runtime.native_target import NativeTarget

    ids = IDS + IDS[:30]  # 78 positions: past one tile
    want = whole(native_q8, ids)
    for isa in kernels.isas():
        other = NativeTarget(gguf_path, threads=2, max_context=128, isa=isa, kv="q8")
        assert np.array_equal(whole(other, ids), want), isa


def test_q8_logits_stay_close_to_f16_and_its_prefixes_load(native, native_q8):
    """q8 changes the logits (it is another cache), a little: the top token of most rows of a real
    prompt is f16's; and a q8 prefix copied into another cache gives the whole prompt's logits."""
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 31581, 28, 3570, 16185, 198, 1, 4093, 198, 504, 314, 28, 216]
    f16, q8 = whole(native, ids), whole(native_q8, ids)
    assert not np.array_equal(f16, q8)
    assert (f16.argmax(1) == q8.argmax(1)).mean() >= 0.9
    other = native_q8.new_cache()
    native_q8.forward(other, ids[:12] + [42, 43], keep=1)
    c = native_q8.new_cache()
    c.load_prefix(other.prefix(12), 12)
    assert np.array_equal(native_q8.forward(c, ids[12:], keep=len(ids) - 12), q8[12:])


def test_a_large_key_bias_does_not_coarsen_the_q8_keys(tmp_path):
    """Issue 69: Qwen2.5-Coder-1.5B's key bias reaches 354 in a channel where a key's other values vary
    by about 1.4, so a key's int8 step (its largest value / 127) was a third of that spread: teacher-
    forced top-1 agreement with f16 KV was 0.919 and the KL reached 11.5 nats.  A key is quantized
    less its head's bias (the softmax cancels q . bias): a tiny qwen2 whose key biases are that large
    keeps q8's logits as close to f16's as the same model with small biases does.  As in Qwen's, the
    large biases are in the channels the rotation turns slowest (rope_theta 1e6), where a bias stays
    what it was added as."""
    import dataclasses

    from memspec.models.gguf_write import write_decoder
    from memspec.runtime.native_target import NativeTarget
    from tiny_models import tiny_config, tiny_weights

    cfg = dataclasses.replace(tiny_config(vocab=64, layers=2, arch="qwen2"), rope_theta=1e6)
    slowest = [cfg.head_dim // 2 - 1, cfg.head_dim - 1]  # neox pairs (i, i + hd/2): the last turns slowest
    ids = list(map(int, np.random.default_rng(7).integers(0, 64, 48)))
    gap = {}
    for big in (1.0, 300.0):
        w = tiny_weights(cfg, seed=5, scale=0.5)._tensors
        for i in range(cfg.n_layers):
            b = w[f"blk.{i}.attn_k.bias"].reshape(cfg.n_kv_heads, cfg.head_dim).copy()
            b[:, slowest] = big * np.array([1.0, -1.0])
            w[f"blk.{i}.attn_k.bias"] = b.reshape(-1)
        path = write_decoder(tmp_path / f"bias{big:g}.gguf", cfg, w, "Q8_0")
        f16, q8 = (whole(NativeTarget(path, threads=1, max_context=64, kv=kv, check_rows=False), ids)
                   for kv in ("f16", "q8"))
        gap[big] = float(np.abs(f16 - q8).max() / np.abs(f16).max())
    assert 0 < gap[300.0] < 3 * gap[1.0] + 1e-3, gap


def test_a_q8_cache_is_about_half_the_bytes_and_the_budget_counts_it(native, native_q8):
    """Measured on the allocated buffers: SmolLM2's q8 cache is (64 + 4) / 128 of the f16 one's bytes;
    the per-token figure and the resident bytes the budget reserves are those buffers'."""
    f16, q8 = native.new_cache(), native_q8.new_cache()
    assert q8.data.dtype == np.uint8 and f16.data.dtype == np.uint16
    assert q8.nbytes / f16.nbytes == (64 + 4) / 128 < 0.54
    for t, c in ((native, f16), (native_q8, q8)):
        assert t.kv_bytes_per_token() * c.capacity == c.nbytes == t.cache_nbytes(c.capacity)
        # a cache's rows as written: the bytes of a position within one (layer, K/V, head) row of the buffer
        assert c.data[0, 0, 0, 1:].ctypes.data - c.data[0, 0, 0, :].ctypes.data == t.kv_bytes_per_token() // (
            2 * t.n_layers * t.kv_heads)
    assert native_q8.cache_nbytes(100) < 0.6 * native.cache_nbytes(100)


def test_the_config_names_the_kv_format_and_refuses_another(tmp_path):
    from memspec.config import load_config
    from memspec.errors import ConfigError
    from memspec.runtime.config import SessionConfig

    (tmp_path / "q8.toml").write_text('[runtime]\nkv = "q8"\n')
    assert load_config(tmp_path / "q8.toml").runtime.kv == "q8" and SessionConfig().kv == "f16"
    with pytest.raises(ConfigError, match=r"\[runtime\] kv: 'q4' is not a KV cache format; choose one of f16, q8"):
        SessionConfig(kv="q4")


@pytest.fixture(scope="module")
def native_engine_q8(model_store):
    from memspec.runtime.config import SessionConfig
    from memspec.build import load_pool
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    config = SessionConfig(max_context=512, backend="native", intra_op_threads=2, kv="q8")
    target = load_target(model_store, "smollm2-135m", "q4", config)
    return Engine(target, drafts=DraftPool(load_pool(model_store, "smollm2-135m", 49152, config)))


def test_q8_speculative_output_is_q8_target_only_output_with_every_draft(native_engine, native_engine_q8):
    """Greedy under [runtime] kv = "q8": every shipped draft and prompt lookup give the q8 target's own
    answer token for token; and the engine reserves the q8 cache's bytes for a request."""
    from memspec.request import GenerationRequest

    assert native_engine_q8.target.session.kv == "q8" and native_engine_q8.target.session.rows.exact
    assert_every_draft_keeps_target_only_output(native_engine_q8, max_tokens=40)
    req = GenerationRequest(prompt="Name three colors.", max_tokens=100)
    prompt = list(range(1, 60))
    assert native_engine_q8.kv_bytes(req, prompt) < native_engine.kv_bytes(req, prompt)
