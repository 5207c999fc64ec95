"""Composition: the engine and its draft source, from a config.

The engine knows only the DraftSource interface (memspec.speculation.sources);
this module, above both, decides which source it gets, so that the speculation
layer never imports the scheduling layer.
"""

from __future__ import annotations

import dataclasses
import logging

from memspec.config import Config

DRAFT_SOURCES = ("scheduler", "pool", "none")
log = logging.getLogger("memspec.build")


def build_engine(config: Config, variant: str | None = None, drafts: str = "scheduler", serving: bool = False):
    """The target from the store named by the config, with its drafts, composed in order: the plan
    and the load (memspec.runtime.target.load_target: engine, variant, tokenizer, EOS ids), the
    batched pass, the draft source, the engine.

    drafts="scheduler": a Scheduler ([scheduler] in the config) owns the drafts and picks each
    request's draft; "pool": every draft made for the target is loaded up front and a request
    names the one it wants (the fixed-policy benchmark); "none": target only.  serving: the
    daemon's engine, whose concurrent requests share batched passes under [runtime] batching; a
    local command runs one request at a time and has no batch loop (nor its pass-cost table to
    measure on first use: 17 s of the 0.5B's 30 s load on 2 cores, before only one row and every
    row were timed).
    """
    from memspec.models.store import ModelStore
    from memspec.runtime.costs import COSTS, CostCache
    from memspec.runtime.plan import batching_on
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    if drafts not in DRAFT_SOURCES:
        raise ValueError(f"drafts must be one of {', '.join(DRAFT_SOURCES)}, got {drafts!r}")
    store = ModelStore(config.store_home)
    target = load_target(store, config.model.target, variant or config.model.variant, config.runtime)
    context = fit_context(config, store, target.name, target.manifest, target.session, with_drafts=drafts != "none")
    target.session.max_context = context.tokens  # before anything sizes a cache by it (drafts' too)
    log.info("%s: context of %d tokens (%s)", target.name, context.tokens, context.reason)
    runtime = dataclasses.replace(config.runtime, max_context=context.tokens)  # the drafts' caches follow it
    spec = config.speculative
    limits = spec.draft_limits()
    batched = None
    if serving and batching_on(config.runtime.batching, target.variant):  # before the scheduler pins the target
        batched = open_batched(target.session, config.server.max_concurrent)
    if drafts == "scheduler":
        from memspec.scheduling.scheduler import from_store

        source = from_store(config.scheduler, store, target, runtime, limits, suffix_bytes=spec.suffix_mb << 20,
                            batched_bytes=batched.weight_bytes if batched is not None else 0,
                            corpus=spec.suffix_corpus)
    elif drafts == "pool":
        source = DraftPool(load_pool(store, target.name, target.vocab_size, runtime, limits=limits,
                                     suffix_bytes=spec.suffix_mb << 20, tokenizer=target.tokenizer,
                                     corpus=spec.suffix_corpus))
    else:
        source = DraftPool()
    return Engine(target, config.limits, drafts=source, spec=spec, costs=CostCache(store.home / COSTS),
                  batched=batched, prefix_cache_bytes=config.runtime.prefix_cache_mb << 20,
                  prefill_chunk=config.runtime.prefill_chunk)


def fit_context(config: Config, store, name: str, manifest, session, with_drafts: bool = True, probe=None):
    """The context target `name` (its manifest, and `session`: its engine, loaded) gets
    (memspec.runtime.context.choose): the configured max_context for it, or for "auto" its trained
    context within the memory that [server] max_concurrent requests' KV caches (the target's, and
    the largest draft's beside it) may take: the memory budget less what the process holds with the
    target loaded and its largest draft, or with no budget the system's available memory less
    [server] memory_headroom_mb.  The engine reports its own KV bytes a token (an INT8 cache its own)."""
    from memspec.runtime.context import choose, setting_for, trained_context
    from memspec.runtime.memory import MiB, PsutilProbe, memory_budget, planned_draft_footprint
    from memspec.scheduling.scheduler import draft_kv_sizers
    from memspec.speculation.drafts import draft_variant, runnable_drafts, target_drafts

    setting = setting_for(config.runtime.max_context, config.runtime.model_max_context, name)
    trained = trained_context(manifest.architecture if manifest is not None else None)
    if isinstance(setting, int):
        return choose(setting, trained, 0, 1, 0)
    drafts = runnable_drafts(target_drafts(store, name), config.runtime)[0] if with_drafts else []
    n = 1 << 16  # tokens a draft's cache is sized at, to read its bytes per token (pages rounded off)
    draft_per_token = max((size(n) for size in draft_kv_sizers(drafts, n).values()), default=0) // n
    probe = probe or PsutilProbe()
    budget = memory_budget(config.scheduler.budget_mb, probe)
    if budget:
        largest = max((planned_draft_footprint(m.total_bytes, draft_variant(m)) for m in drafts), default=0)
        room = budget - probe.rss_bytes() - largest
        what = "the memory budget less the process and its largest draft"
    else:
        room = probe.available_bytes() - config.server.memory_headroom_mb * MiB
        what = "the available memory less [server] memory_headroom_mb"
    return choose(setting, trained, session.kv_bytes_per_token() + draft_per_token,
                  config.server.max_concurrent, room, what)


def load_pool(store, target_name: str, target_vocab: int, config=None, names: list[str] | None = None,
              limits=None, suffix_bytes: int = 0, tokenizer=None, corpus: bool = True) -> dict:
    """Prompt lookup, the suffix draft over an index of `suffix_bytes` (0: none), and every draft
    in the store made for `target_name` (or only `names`), loaded now: the fixed pool's proposers by
    name, made as the scheduler makes them (memspec.speculation.sources.DraftMaker).  `tokenizer`:
    the target's, which a draft with a tokenizer of its own needs (textdraft)."""
    from memspec.speculation.sources import DraftMaker

    return DraftMaker.for_target(store, target_name, target_vocab, config, limits, names, suffix_bytes,
                                 tokenizer, corpus).make_all()
