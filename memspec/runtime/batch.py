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
  padding; `row_offsets` (R + 1,) says where each row's tokens start and `row_lengths` (R,) how
  many tokens each row holds after the pass (committed + new), which replaces the attention mask;
* every token-wise node (embedding, norms, MatMulNBits, MLP, LM head) runs once over all N tokens,
  which is where a batch saves: the weights are read once per pass, not once per request;
* each GroupQueryAttention becomes R of them, one per row, over that row's slice of the packed
  QKV and its own past/present buffers (`past_key_values.{layer}.key.{row}`), each with batch 1,
  exactly as the one-request graph runs it, so a row attends to its own cache only;
* `logits_to_keep` becomes `logits_index` (K,): the flat positions whose logits are returned.

The graph has a fixed number R of row slots.  A pass with fewer requests leaves the rest empty:
they feed no token, so the token-wise nodes run over the real rows' tokens only; each spare
slot's attention (GroupQueryAttention cannot run an empty row) reads a copy of the pass's last
token over a small scratch cache, and its output is dropped.  Each row keeps the request's own SharedBufferCache, so KV
memory is counted per request exactly as before (pages touched), and a request that leaves
frees its cache as before.  CPU only (the binding uses host buffers as they are).

Memory: the batched graph is a second ONNX Runtime session with its own copy of the target's
weights (`weight_bytes`), beside the target's session, which still serves prefill and lone
passes.  memspec.build loads it before the draft source so that the pinned target's bytes count
it (TargetModel.batched_bytes), and status lists it as the target's "batched" row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from memspec.errors import ContextOverflowError, ModelFormatError
from memspec.runtime.sessions import DecoderSession, SharedBufferCache

MASK_NODES = "/model/mask/"  # the converter's seqlens/total from the attention mask (models.convert)
KEEP_NODES = "/model/keep/"  # its logits_to_keep slice
PAD_NODES = "/model/pad/"  # its one-token attention padding (pad = 1 when the pass feeds one token)
DUMMY_TOKENS = 2  # the scratch cache's capacity: a dummy row feeds one token after none


def ragged_graph(model: onnx.ModelProto, rows: int) -> onnx.ModelProto:
    """Rewrite one of our decoder graphs (models.convert) into the ragged batched graph (above).

    A graph that pads attention for a one-token pass (memspec.attention_pad: `/model/pad/*`, and
    per layer PadRow + PadConcat before GroupQueryAttention and Unpad after it) gets the same
    padding per row: a row that holds one token gives its attention a copy of that token's query
    row (its K/V one slot past the token, in the cache's slack slot), seqlens/total count it, and
    the copy's output is dropped, exactly as its solo pass does; a longer row is not padded."""
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

    axis0, axis1, one = const("/batch/axis0", [0]), const("/batch/axis1", [1]), const("/batch/one", [1])
    zero = const("/batch/zero", [0])
    nodes: list[onnx.NodeProto] = []
    # a spare row slot holds no token (row_offsets[b] == row_offsets[b + 1]); its attention still
    # runs (an empty row crashes GroupQueryAttention), over a copy of the pass's last token
    # (start..end widened to one token), into the scratch cache, and its output is dropped
    n_total, last_tok = "/batch/n_total", "/batch/last_tok"
    nodes += [
        helper.make_node("Slice", ["row_offsets", const("/batch/iR", [rows]), const("/batch/iR1", [rows + 1]),
                                   axis0], [n_total], name=n_total),
        helper.make_node("Sub", [n_total, one], [last_tok], name=last_tok),
    ]
    per_row: list[tuple[str, str, str, str, str | None, str | None]] = []  # start, end, seqlens_k, total, pad, m
    for b in range(rows):
        p = f"/batch/row{b}"
        i0, i1 = const(f"{p}/i0", [b]), const(f"{p}/i1", [b + 1])
        start, end, length = f"{p}/start", f"{p}/end", f"{p}/length"
        nodes += [
            helper.make_node("Slice", ["row_offsets", i0, i1, axis0], [start], name=start),
            helper.make_node("Slice", ["row_offsets", i1, const(f"{p}/i2", [b + 2]), axis0], [end], name=end),
            helper.make_node("Slice", ["row_lengths", i0, i1, axis0], [length], name=length),
        ]
        # what the row's attention reads: its own tokens, or (a spare row) one token, the pass's last
        nodes += [
            helper.make_node("Min", [start, last_tok], [f"{p}/q_start"], name=f"{p}/q_start"),
            helper.make_node("Add", [start, one], [f"{p}/start1"], name=f"{p}/start1"),
            helper.make_node("Max", [end, f"{p}/start1"], [f"{p}/q_end"], name=f"{p}/q_end"),
        ]
        pad = m = None
        if pads:  # pad = 1 for a one-token row, as the solo graph's /model/pad/Pad; length counts it
            m, pad = f"{p}/m", f"{p}/pad"
            nodes += [
                helper.make_node("Sub", [end, start], [m], name=m),
                helper.make_node("Equal", [m, one], [f"{p}/one_token"], name=f"{p}/one_token"),
                helper.make_node("Cast", [f"{p}/one_token"], [pad], name=pad, to=TensorProto.INT64),
                helper.make_node("Add", [length, pad], [f"{p}/padded"], name=f"{p}/padded"),
            ]
            length = f"{p}/padded"
        nodes += [
            helper.make_node("Sub", [length, one], [f"{p}/sub"], name=f"{p}/sub"),
            helper.make_node("Cast", [f"{p}/sub"], [f"{p}/seqlens"], name=f"{p}/seqlens", to=TensorProto.INT32),
            helper.make_node("Cast", [length], [f"{p}/total"], name=f"{p}/total", to=TensorProto.INT32),
        ]
        per_row.append((f"{p}/q_start", f"{p}/q_end", f"{p}/seqlens", f"{p}/total", pad, m))
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
        if qkv in pad_concat:  # the solo graph's padding goes: each row pads itself below
            qkv = pad_concat[qkv].input[0]
        if out in unpad:
            out = unpad[out].output[0]
        parts = []
        for b, (start, end, seqlens, total, pad, m) in enumerate(per_row):
            q, o = f"{n.name}/row{b}/qkv", f"{n.name}/row{b}/out"
            nodes.append(helper.make_node("Slice", [qkv, start, end, axis1], [q], name=q))
            if pad is not None:  # (1, m, D) -> (1, m + pad, D): a one-token row's query, twice
                nodes += [
                    helper.make_node("Slice", [q, zero, pad, axis1], [f"{q}/copy"], name=f"{q}/copy"),
                    helper.make_node("Concat", [q, f"{q}/copy"], [f"{q}/padded"], name=f"{q}/padded", axis=1),
                ]
                q, o = f"{q}/padded", f"{o}/padded"
            node = helper.make_node("GroupQueryAttention", [q, "", "", f"{pk}.{b}", f"{pv}.{b}", seqlens, total,
                                                            cos, sin],
                                    [o, f"{prk}.{b}", f"{prv}.{b}"], name=f"{n.name}/row{b}", domain=n.domain)
            node.attribute.extend(n.attribute)
            nodes.append(node)
            if pad is not None:  # the copy row's output goes
                unpadded = f"{n.name}/row{b}/out"
                nodes.append(helper.make_node("Slice", [o, zero, m, axis1], [unpadded], name=unpadded))
                o = unpadded
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
        if pads:  # each row's output is cut to its own tokens above: a spare row's to none
            nodes.append(helper.make_node("Concat", parts, [out], name=f"{n.name}/concat", axis=1))
        else:  # spare rows sit after every real one: cut the joined rows to the pass's tokens
            joined = f"{n.name}/joined"
            nodes += [
                helper.make_node("Concat", parts, [joined], name=joined, axis=1),
                helper.make_node("Slice", [joined, zero, n_total, axis1], [out], name=f"{n.name}/concat"),
            ]
    del g.node[:]
    g.node.extend(nodes)  # still in the original's order: each row's nodes sit where its layer's GQA was
    kept = [i for i in g.input if i.name in ("input_ids",)]
    extra = [
        helper.make_tensor_value_info("row_offsets", TensorProto.INT64, [rows + 1]),
        helper.make_tensor_value_info("row_lengths", TensorProto.INT64, [rows]),
        helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["logits_length"]),
    ]
    del g.input[:]
    g.input.extend(kept + extra + past_inputs)
    logits = [o for o in g.output if o.name == "logits"]
    del g.output[:]
    g.output.extend(logits + present_outputs)
    return model


class BatchedTarget:
    """The target's ragged batched graph (R row slots) and one pass over several caches."""

    def __init__(self, session: DecoderSession, rows: int):
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
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), session.session.get_session_options(),
                                                providers=session.session.get_providers())
        except Exception as exc:
            raise ModelFormatError(f"onnxruntime cannot load the batched graph of {session.path}: {exc}") from None
        del model
        self.pad_rows = session.pad_rows  # tokens a feed is padded to here (1 when the graph pads)
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
        graph that pads attention, the graph pads a one-token row itself (ragged_graph); on an
        older graph a feed shorter than the session's pad_rows (min_rows) is padded here with
        copies of its last token, which are dropped (as DecoderSession.forward does)."""
        n = len(feeds)
        if not 1 <= n <= self.rows or len(caches) != n or len(keep) != n:
            raise ValueError(f"a pass takes 1..{self.rows} rows with one cache and one keep each "
                             f"(got {n} feeds, {len(caches)} caches, {len(keep)} keeps)")
        ids: list[int] = []
        offsets, lengths, index, spans = [0], [], [], []
        for cache, feed, k in zip(caches, feeds, keep):
            m = len(feed)
            if m == 0:
                raise ValueError("forward needs at least one token per row")
            if cache.length + m > cache.capacity:
                raise ContextOverflowError(
                    f"context overflow: {cache.length} cached + {m} new tokens > capacity {cache.capacity}")
            pad = min(max(self.pad_rows - m, 0), cache.capacity - cache.length - m)
            k = min(max(k, 1), m)
            row = [*feed, *[feed[-1]] * pad]
            spans.append((len(index), k))
            index.extend(range(len(ids) + m - k, len(ids) + m))
            ids.extend(row)
            offsets.append(len(ids))
            lengths.append(cache.length + len(row))
        for _ in range(n, self.rows):  # spare rows: no token of their own, the scratch cache (ragged_graph)
            offsets.append(len(ids))
            lengths.append(1)
        bd = self._binding
        for b, cache in enumerate(caches):
            self._bind_row(b, cache)
        for b in range(n, self.rows):
            self._bind_row(b, self._dummy)
        bd.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        bd.bind_cpu_input("row_offsets", np.asarray(offsets, dtype=np.int64))
        bd.bind_cpu_input("row_lengths", np.asarray(lengths, dtype=np.int64))
        bd.bind_cpu_input("logits_index", np.asarray(index, dtype=np.int64))
        bd.bind_output("logits", "cpu")
        self.session.run_with_iobinding(bd)
        logits = bd.get_outputs()[0].numpy()[0]  # (K, V)
        for cache, feed in zip(caches, feeds):
            cache.length += len(feed)  # padding is not committed
        return [logits[s: s + k].copy() for s, k in spans]

    def measure_pass_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> dict[int, list[float]]:
        """Median seconds of one pass over b rows of k tokens each after `context` cached tokens,
        for b = 1..rows and k = 1..max_k: {b: [unused, k=1, ..., k=max_k]}.  The batched cost
        controller reads it (what a request's k tokens cost inside a pass of b rows)."""
        import statistics
        import time

        vocab = self.target.vocab_size or 1000
        caches = [self.target.new_cache(context + max_k + 1) for _ in range(self.rows)]
        ctx = [(17 * i + 3) % vocab for i in range(context)]
        for c in caches:
            self.target.forward(c, ctx, keep=1)
        out: dict[int, list[float]] = {}
        for b in range(1, self.rows + 1):
            row = [0.0]
            for k in range(1, max_k + 1):
                times = []
                for _ in range(repeats):
                    for c in caches[:b]:
                        c.truncate(context)
                    t = time.perf_counter()
                    self.forward(caches[:b], [[(5 * j + 11) % vocab for j in range(k)]] * b, [k] * b)
                    times.append(time.perf_counter() - t)
                row.append(statistics.median(times))
            out[b] = row
        for c in caches:
            self.release(c)
        return out
