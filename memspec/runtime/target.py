"""Loading a target: what the plan (memspec.runtime.plan) names, opened on its engine, with its
tokenizer and end-of-sequence ids.  The one entry point, used by memspec.build:

    from memspec.runtime import load_target
    target = load_target(store, "smollm2-135m", config=SessionConfig(backend="native"))
    c = target.session.new_cache()
    logits = target.session.forward(c, ids, keep=k)   # (k, vocab) float32, rows for the last k ids

The interface a target offers the layers above runtime/ is `Target` (memspec.runtime.contracts);
two engines implement it: memspec.runtime.native_target.NativeTarget (the GGUF's blocks as they
are, memspec's own exact kernels; CPU) and memspec.runtime.sessions.DecoderSession (a graph
converted for ONNX Runtime; CPU or CUDA).  This module alone opens them (targets, drafts and the
batched pass), so that nothing above runtime/ imports an engine.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from memspec.runtime.config import SessionConfig
from memspec.runtime.context import opening_context, setting_for, trained_context
from memspec.runtime.contracts import BatchedPass, Target, TargetModel
from memspec.runtime.plan import Plan, plan

log = logging.getLogger(__name__)


def open_batched(target: Target, rows: int) -> BatchedPass:
    """Passes of up to `rows` requests on `target`: the native engine batches by itself
    (NativeBatch); ONNX Runtime needs its ragged batched graph, a second copy of the weights
    (memspec.runtime.batch.BatchedTarget, CPU only)."""
    from memspec.runtime.native_target import NativeBatch, NativeTarget

    if isinstance(target, NativeTarget):
        return NativeBatch(target, rows)
    from memspec.runtime.batch import BatchedTarget

    return BatchedTarget(target, rows)


def load_target(store, name: str, variant: str | None = None, config: SessionConfig = SessionConfig(),
                preferred: str = "q4") -> TargetModel:
    """The target `name` of the store, loaded as plan() says (`variant`; None: `preferred` where it
    has it): its engine, tokenizer and end-of-sequence ids, its self-check at load said in the log."""
    from memspec.models.tokenizer import Tokenizer
    from memspec.runtime.memory import release_heap

    p = plan(store, name, variant, config, preferred)
    session = open_target(store, p, config)
    if session.rows.warning():  # the daemon's log, and stderr of `memspec generate`
        log.warning("%s (%s): %s", name, p.variant, session.rows.warning())
    elif session.rows.reason:
        log.info("%s (%s): %s", name, p.variant, session.rows.reason)
    m = p.manifest
    folder = Path(m.folder)
    tok = Tokenizer.from_file(folder / "tokenizer.json", folder / "tokenizer_config.json")
    eos = set(m.extra.get("eos_token_ids", [])) | tok.eos_token_ids  # Qwen2.5: <|im_end|> and <|endoftext|>
    # ONNX Runtime frees its load-time copies of the weights once it has packed them, and the
    # tokenizer its parse of tokenizer.json, but glibc keeps the freed pages (a q4 load left
    # 56 MiB), which would count against the memory budget and the device's shared memory.
    release_heap()
    return TargetModel(name, p.variant, session, tok, frozenset(eos), m, p)


def open_draft(path: Path, engine: str, config: SessionConfig, threads: int) -> Target:
    """A draft's model on `engine`: "native" runs its GGUF, "onnxruntime" its graph on the drafts'
    providers (config.draft_providers, else the target's), with threads that sleep as soon as a step
    ends (a spinning pool would steal the cores the target verifies on next).  A draft only
    proposes: its rows need no invariance check."""
    # a draft's cache is as long as its request's target cache (memspec.build passes the target's
    # context here); "auto" from a caller that resolved none is the former fixed default
    config = dataclasses.replace(config, max_context=opening_context(config.max_context, None))
    if engine == "native":
        from memspec.runtime.native_target import NativeTarget

        return NativeTarget(path, threads=threads, max_context=config.max_context, check_rows=False)
    from memspec.runtime.sessions import DecoderSession

    if config.draft_providers:
        config = dataclasses.replace(config, providers=config.draft_providers)
    return DecoderSession(path, config, spinning=False, threads=threads)


def open_target(store, planned: Plan, config: SessionConfig) -> Target:
    """The target engine the plan names (memspec.runtime.plan): its GGUF on the native engine, or
    its graph in ONNX Runtime.  Files are checked against the manifest before they are parsed.  Its
    context: the configured one for this target, "auto" its trained context (memspec.runtime.context;
    memspec.build then caps it to the memory)."""
    setting = setting_for(config.max_context, config.model_max_context, planned.name)
    config = dataclasses.replace(config, max_context=opening_context(
        setting, trained_context(planned.manifest.architecture)))
    if planned.engine == "native":
        from memspec.runtime.native_target import NativeTarget

        gguf = store.gguf_of(planned.manifest)  # ModelFormatError: missing or not the one pulled
        return NativeTarget(gguf, threads=config.intra_op_threads, max_context=config.max_context, kv=config.kv)
    from memspec.runtime.sessions import DecoderSession

    if planned.warning:
        log.warning("%s: %s", planned.name, planned.warning)
    path = planned.manifest.variant_path(planned.variant)
    store.check_files(planned.manifest, planned.variant)  # a tampered or truncated file is refused before it is parsed
    return DecoderSession(path, config, arena=True,  # pinned: never unloaded
                          min_rows=2 if config.batch_invariant else 1, check_rows=True)
