"""Composition: the engine and its draft source, from a config.

The engine knows only the DraftSource interface (memspec.speculation.sources);
this module, above both, decides which source it gets, so that the speculation
layer never imports the scheduling layer.
"""

from __future__ import annotations

from memspec.config import Config

DRAFT_SOURCES = ("scheduler", "pool", "none")


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
    spec = config.speculative
    limits = spec.draft_limits()
    batched = None
    if serving and batching_on(config.runtime.batching, target.variant):  # before the scheduler pins the target
        batched = open_batched(target.session, config.server.max_concurrent)
    if drafts == "scheduler":
        from memspec.scheduling.scheduler import from_store

        source = from_store(config.scheduler, store, target, config.runtime, limits, suffix_bytes=spec.suffix_mb << 20,
                            batched_bytes=batched.weight_bytes if batched is not None else 0)
    elif drafts == "pool":
        source = DraftPool(load_pool(store, target.name, target.vocab_size, config.runtime, limits=limits,
                                     suffix_bytes=spec.suffix_mb << 20, tokenizer=target.tokenizer))
    else:
        source = DraftPool()
    return Engine(target, config.limits, drafts=source, spec=spec, costs=CostCache(store.home / COSTS),
                  batched=batched, prefix_cache_bytes=config.runtime.prefix_cache_mb << 20)


def load_pool(store, target_name: str, target_vocab: int, config=None, names: list[str] | None = None,
              limits=None, suffix_bytes: int = 0, tokenizer=None) -> dict:
    """Prompt lookup, the suffix draft over an index of `suffix_bytes` (0: none), and every draft
    in the store made for `target_name` (or only `names`), loaded now: the fixed pool's proposers by
    name, made as the scheduler makes them (memspec.speculation.sources.DraftMaker).  `tokenizer`:
    the target's, which a draft with a tokenizer of its own needs (textdraft)."""
    from memspec.speculation.sources import DraftMaker

    return DraftMaker.for_target(store, target_name, target_vocab, config, limits, names, suffix_bytes,
                                 tokenizer).make_all()
