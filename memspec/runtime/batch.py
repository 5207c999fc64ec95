"""One target pass over several requests' tokens: the ragged batched graph.

    bt = BatchedTarget(session, rows=4)            # session: the target's DecoderSession
    out = bt.forward([cache_a, cache_b], [ids_a, ids_b], keep=[len(ids_a), 1])
    # out[i]: (keep[i], V) logits of feed i's last positions; cache_i.length += len(ids_i)

Why a second graph.  ONNX Runtime's GroupQueryAttention refuses a batch of more than one row
when a row feeds more than one token after a past ("batch_size must be 1 when sequence_length >
1 and past context is given", group_query_attention_helper.h), which is every verification pass;
and a batch-0 slice crashes its CPU kernel (SIGFPE).  So at load time the target's graph is
rewritten, not re-converted:

* input_ids becomes one flat row (1, N) holding every request's tokens back to back, with no
  padding; every token-wise node (embedding, norms, MatMulNBits, MLP, LM head) runs once over all
  N tokens, which is where a batch saves: the weights are read once per pass, not once per request;
* per layer, one Gather (`qkv_index`) lays the packed QKV out row by row as attention wants it
  (a one-token row's token twice, as the solo graph pads a one-token pass's attention), one Split
  (`row_sizes`) cuts it into the rows, and each GroupQueryAttention becomes R of them, one per
  row, over its own past/present buffers (`past_key_values.{layer}.key.{row}`), each with batch 1,
  exactly as the one-request graph runs it, so a row attends to its own cache only; one Concat
  and one Gather (`out_index`) put the rows' outputs back in token order, without the copies;
* `row_seqlens` and `row_totals` (R,) give each row's lengths after the pass (committed + new,
  the copy counted), which replace the attention mask;
* `logits_to_keep` becomes `logits_index` (K,): the flat positions whose logits are returned.

The host (BatchedTarget.forward) computes these indices per pass, so the graph holds no per-row
bookkeeping nodes besides the attention itself (two lengths sliced per row, once per pass).

The graph has a fixed number R of row slots.  A pass with fewer requests leaves the rest empty:
they feed no token, so the token-wise nodes run over the real rows' tokens only; each spare
slot's attention (GroupQueryAttention cannot run an empty row) reads a copy of the pass's last
token over a small scratch cache, and its output is dropped.  Each row keeps the request's own
SharedBufferCache, so KV memory is counted per request exactly as before (pages touched), and a
request that leaves frees its cache as before.  CPU only (the binding uses host buffers as they
are).

Memory: the batched graph is a second ONNX Runtime session with its own copy of the target's
weights (`weight_bytes`), beside the target's session, which still serves prefill and lone
passes.  memspec.build loads it before the draft source so that the pinned target's bytes count
it (scheduling.scheduler.from_store: batched_bytes), and status lists it as the target's "batched" row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from memspec.errors import ConfigError, ModelFormatError
from memspec.runtime.sessions import DecoderSession, SharedBufferCache

MASK_NODES = "/model/mask/"  # the converter's seqlens/total from the attention mask (models.convert)
KEEP_NODES = "/model/keep/"  # its logits_to_keep slice
PAD_NODES = "/model/pad/"  # its one-token attention padding (pad = 1 when the pass feeds one token)
BATCHED_PREFIX = ".batched-"  # the folder beside the target that the batched graph is loaded from
STALE_S = 600  # such a folder older than this was left by a process that died loading (loading takes < 1 min)
DUMMY_TOKENS = 2  # the scratch cache's capacity: a spare row's attention writes one token after none


def ragged_graph(model: onnx.ModelProto, rows: int) -> onnx.ModelProto:
    """Rewrite one of our decoder graphs (models.convert) into the ragged batched graph (above).

    A graph that pads attention for a one-token pass (memspec.attention_pad: `/model/pad/*`, and
    per layer PadRow + PadConcat before GroupQueryAttention and Unpad after it) loses those nodes:
    the host's `qkv_index` pads each one-token row instead (its query row twice, the copy's K/V
    one slot past the token, in the cache's slack slot; the lengths count it) and `out_index`
    drops the copy's output, exactly as its solo pass does; a longer row is not padded."""
    g = model.graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    keep_slice = [n for n in g.node if n.name == KEEP_NODES + "Slice"]
    if not gqa or not keep_slice or not any(n.name.startswith(MASK_NODES) for n in g.node):
        raise ModelFormatError("the batched graph needs a memspec-converted decoder (GroupQueryAttention, "
                               "the attention-mask lengths and the logits_to_keep slice)")
    pads = any(n.name.startswith(PAD_NODES) for n in g.node)
    # the per-layer padding nodes, by the tensor each one makes: PadConcat's output (what GQA reads)
    # stands for its unpadded input; Unpad's output (what o_proj reads) for the rows' joined outputs
    pad_concat = {n.output[0]: n for n in g.node if n.op_type == "Concat" and n.name.endswith("/PadConcat")}
    pad_row = {n.output[0] for n in g.node if n.op_type == "Slice" and n.name.endswith("/PadRow")}
    unpad = {n.input[0]: n for n in g.node if n.op_type == "Slice" and n.name.endswith("/Unpad")}
    if pads != bool(pad_concat) or len(pad_concat) != len(unpad) or (pads and len(pad_concat) != len(gqa)):
        raise ModelFormatError("the batched graph cannot read this graph's attention padding "
                               "(/model/pad/*, PadRow/PadConcat/Unpad per layer)")
    strip = {n.name for n in pad_concat.values()} | {n.name for n in unpad.values()}  # by name: protobuf
    strip |= {n.name for n in g.node if n.output and n.output[0] in pad_row}  # wrappers have no stable id
    ins = {i.name: i for i in g.input}
    outs = {o.name: o for o in g.output}

    def const(name: str, value) -> str:
        g.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=np.int64), name))
        return name

    axis0 = const("/batch/axis0", [0])
    nodes: list[onnx.NodeProto] = []
    per_row: list[tuple[str, str]] = []  # each row's seqlens_k and total_sequence_length (int32)
    for b in range(rows):
        p = f"/batch/row{b}"
        i0, i1 = const(f"{p}/i0", [b]), const(f"{p}/i1", [b + 1])
        nodes += [
            helper.make_node("Slice", ["row_seqlens", i0, i1, axis0], [f"{p}/seqlens"], name=f"{p}/seqlens"),
            helper.make_node("Slice", ["row_totals", i0, i1, axis0], [f"{p}/total"], name=f"{p}/total"),
        ]
        per_row.append((f"{p}/seqlens", f"{p}/total"))
    past_inputs, present_outputs = [], []
    ks = keep_slice[0]
    for n in g.node:
        if n.name == ks.name:  # the LM head reads the kept positions: Gather(h, logits_index), not the last-k slice
            nodes.append(helper.make_node("Gather", [ks.input[0], "logits_index"], [ks.output[0]],
                                          name="/batch/keep/Gather", axis=1))
        if n.name.startswith((MASK_NODES, KEEP_NODES, PAD_NODES)) or n.name in strip:
            continue
        if n.op_type != "GroupQueryAttention":
            nodes.append(n)
            continue
        qkv, _, _, pk, pv, _, _, cos, sin = n.input
        out, prk, prv = n.output
        if qkv in pad_concat:  # the solo graph's padding goes: qkv_index pads every row at once
            qkv = pad_concat[qkv].input[0]
        if out in unpad:
            out = unpad[out].output[0]
        # (1, N, D) -> (1, P, D): each row's tokens, a one-token row's twice, a spare row's one copy;
        # then one piece per row, one attention per row over its own cache, and back to (1, N, D)
        padded, joined = f"{n.name}/qkv_rows", f"{n.name}/out_rows"
        pieces = [f"{n.name}/row{b}/qkv" for b in range(rows)]
        nodes += [
            helper.make_node("Gather", [qkv, "qkv_index"], [padded], name=padded, axis=1),
            helper.make_node("Split", [padded, "row_sizes"], pieces, name=f"{n.name}/rows", axis=1),
        ]
        parts = []
        for b, ((seqlens, total), q) in enumerate(zip(per_row, pieces)):
            o = f"{n.name}/row{b}/out"
            node = helper.make_node("GroupQueryAttention", [q, "", "", f"{pk}.{b}", f"{pv}.{b}", seqlens, total,
                                                            cos, sin],
                                    [o, f"{prk}.{b}", f"{prv}.{b}"], name=f"{n.name}/row{b}", domain=n.domain)
            node.attribute.extend(n.attribute)
            nodes.append(node)
            parts.append(o)
            for src, dst in ((pk, f"{pk}.{b}"), (pv, f"{pv}.{b}")):
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(ins[src])
                vi.name = dst
                past_inputs.append(vi)
            for src, dst in ((prk, f"{prk}.{b}"), (prv, f"{prv}.{b}")):
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(outs[src])
                vi.name = dst
                present_outputs.append(vi)
        nodes += [
            helper.make_node("Concat", parts, [joined], name=joined, axis=1),
            helper.make_node("Gather", [joined, "out_index"], [out], name=f"{n.name}/unpad", axis=1),
        ]
    del g.node[:]
    g.node.extend(nodes)  # still in the original's order: each row's nodes sit where its layer's GQA was
    kept = [i for i in g.input if i.name in ("input_ids",)]
    extra = [
        helper.make_tensor_value_info("qkv_index", TensorProto.INT64, ["padded_length"]),
        helper.make_tensor_value_info("row_sizes", TensorProto.INT64, [rows]),
        helper.make_tensor_value_info("row_seqlens", TensorProto.INT32, [rows]),
        helper.make_tensor_value_info("row_totals", TensorProto.INT32, [rows]),
        helper.make_tensor_value_info("out_index", TensorProto.INT64, ["sequence_length"]),
        helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["logits_length"]),
    ]
    del g.input[:]
    g.input.extend(kept + extra + past_inputs)
    logits = [o for o in g.output if o.name == "logits"]
    del g.output[:]
    g.output.extend(logits + present_outputs)
    return model


def _load(model: onnx.ModelProto, session: DecoderSession) -> ort.InferenceSession:
    """A session of the rewritten graph, loaded from a file with its weights beside it.

    Handing ONNX Runtime the serialized bytes instead costs a third copy of the weights while it
    parses them, and what it keeps afterwards is larger: for the 1.5B the batched session took
    3.4 GiB of RSS from bytes against 1.7 GiB from a file with external data (the weights are
    1.5 GiB).  The file is written beside the target's (the store's disk, not a tmpfs /tmp) and
    removed once the session has it."""
    import shutil
    import tempfile
    import time

    for stale in session.path.parent.glob(BATCHED_PREFIX + "*"):  # left by a process killed while loading
        try:
            if time.time() - stale.stat().st_mtime > STALE_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    try:
        folder = tempfile.mkdtemp(prefix=BATCHED_PREFIX, dir=session.path.parent)
    except OSError as exc:
        raise ModelFormatError(f"cannot write the batched graph beside {session.path}: {exc}") from None
    try:
        path = f"{folder}/graph.onnx"
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin")
        model.Clear()  # the Python copy of the weights goes before the session makes its own
        _return_freed_memory()
        return ort.InferenceSession(path, session.session.get_session_options(),
                                    providers=session.session.get_providers())
    except OSError as exc:
        raise ModelFormatError(f"cannot write the batched graph beside {session.path}: {exc}") from None
    except Exception as exc:
        raise ModelFormatError(f"onnxruntime cannot load the batched graph of {session.path}: {exc}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): the graph rewrite frees
    gigabytes of protobuf at once, which glibc would otherwise keep as the process's RSS."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to give back
        pass


class BatchedTarget:
    """The target's ragged batched graph (R row slots) and one pass over several caches."""

    def __init__(self, session: DecoderSession, rows: int):
        if not isinstance(session, DecoderSession):
            raise ConfigError("BatchedTarget batches an ONNX Runtime session; the native target batches its own "
                              "passes (memspec.runtime.target.open_batched)")
        if session.layout != "gqa" or not session.has_keep:
            raise ModelFormatError(f"{session.path.name}: batched passes need a memspec-converted graph "
                                   f"(shared-buffer KV and logits_to_keep)")
        if session.device != "cpu":
            raise ModelFormatError(f"batched passes run on the CPU provider only (the target runs on "
                                   f"{session.session.get_providers()[0]})")
        if not 1 <= rows <= 64:
            raise ValueError(f"rows: {rows} is out of range; allowed 1..64")
        self.target = session
        self.rows = rows
        model = ragged_graph(onnx.load(str(session.path)), rows)
        # The batched session holds its own copy of the target's weights (ONNX Runtime cannot share
        # initializers between two sessions here): what the working set's budget must count for it.
        self.weight_bytes = sum(len(t.raw_data) or numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
        self.session = _load(model, session)
        del model
        _return_freed_memory()
        self._dummy = session.new_cache(DUMMY_TOKENS)
        self._binding = self.session.io_binding()
        self._binding.bind_output("logits", "cpu")  # first: a rebound name keeps its place, get_outputs()[0]
        self._bound: list[object] = [None] * rows  # the cache bound to each row slot last time

    def release(self, cache: SharedBufferCache) -> None:
        """Unbind a cache whose request has left, so that the binding keeps none of its memory."""
        for b, bound in enumerate(self._bound):
            if bound is cache:
                self._bind_row(b, self._dummy)

    def _bind_row(self, b: int, cache: SharedBufferCache) -> None:
        if self._bound[b] is cache:
            return
        for name, present, buf in zip(self.target.past_names, self.target.present_names, cache.buffers):
            self._binding.bind_ortvalue_input(f"{name}.{b}", buf)
            self._binding.bind_ortvalue_output(f"{present}.{b}", buf)
        self._bound[b] = cache

    def forward(self, caches: Sequence[SharedBufferCache], feeds: Sequence[Sequence[int]],
                keep: Sequence[int]) -> list[np.ndarray]:
        """One pass: feeds[i] after caches[i]'s committed tokens.  Returns, per row, the logits of
        its last keep[i] fed positions, (keep[i], V) float32 (a copy).  Each cache's length
        advances by len(feeds[i]).  A row takes the same attention kernels as it would alone: on a
        graph that pads attention, `qkv_index` gives a one-token row's attention its token twice
        (ragged_graph), as the solo graph pads itself; on an older graph a feed shorter than the
        session's pad_rows (min_rows) is padded here with copies of its last token, which are
        dropped (as DecoderSession.forward does)."""
        n = len(feeds)
        if not 1 <= n <= self.rows or len(caches) != n or len(keep) != n:
            raise ValueError(f"a pass takes 1..{self.rows} rows with one cache and one keep each "
                             f"(got {n} feeds, {len(caches)} caches, {len(keep)} keeps)")
        ids: list[int] = []
        qkv_index: list[int] = []  # per row: its tokens' flat positions, a one-token row's twice
        sizes, seqlens, totals, out_index, index, spans = [], [], [], [], [], []
        for cache, feed, k in zip(caches, feeds, keep):
            m = len(feed)
            cache.check_room(m)
            pad = min(max(self.target.pad_rows - m, 0), cache.capacity + cache.slack - cache.length - m)
            k = min(max(k, 1), m)
            row = [*feed, *[feed[-1]] * pad]
            copy = int(self.target.graph_pads and len(row) == 1)  # the solo graph's one-token attention padding
            spans.append((len(index), k))
            index.extend(range(len(ids) + m - k, len(ids) + m))
            out_index.extend(range(len(qkv_index), len(qkv_index) + len(row)))
            qkv_index.extend(range(len(ids), len(ids) + len(row)))
            qkv_index.extend([len(ids)] * copy)
            ids.extend(row)
            sizes.append(len(row) + copy)
            totals.append(cache.length + len(row) + copy)
            seqlens.append(totals[-1] - 1)
        for _ in range(n, self.rows):  # spare rows: no token of their own; one copy of the last for attention
            qkv_index.append(len(ids) - 1)
            sizes.append(1)
            totals.append(1)
            seqlens.append(0)
        bd = self._binding
        for b, cache in enumerate(caches):
            self._bind_row(b, cache)
        for b in range(n, self.rows):
            self._bind_row(b, self._dummy)
        bd.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        bd.bind_cpu_input("qkv_index", np.asarray(qkv_index, dtype=np.int64))
        bd.bind_cpu_input("row_sizes", np.asarray(sizes, dtype=np.int64))
        bd.bind_cpu_input("row_seqlens", np.asarray(seqlens, dtype=np.int32))
        bd.bind_cpu_input("row_totals", np.asarray(totals, dtype=np.int32))
        bd.bind_cpu_input("out_index", np.asarray(out_index, dtype=np.int64))
        bd.bind_cpu_input("logits_index", np.asarray(index, dtype=np.int64))
        bd.bind_output("logits", "cpu")
        self.session.run_with_iobinding(bd)
        logits = bd.get_outputs()[0].numpy()[0]  # (K, V)
        for cache, feed in zip(caches, feeds):
            cache.length += len(feed)  # padding is not committed
        return [logits[s: s + k].copy() for s, k in spans]

    def measure_pass_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> dict[int, list[float]]:
        """{b: [unused, k=1..max_k]} seconds of a pass of b rows x k tokens (costs.pass_costs)."""
        from memspec.runtime.costs import pass_costs

        return pass_costs(self, max_k, context, repeats)
