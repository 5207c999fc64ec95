"""Issue 69, items 1 and 2: the context a model has within the memory it may use, and answers that
end where the model ends them (memspec.runtime.context, memspec.request.new_tokens, memspec.build)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fakes import FakeProbe

from memspec.build import build_engine, fit_context
from memspec.config import Config, load_config
from memspec.errors import STATUS, ConfigError, ContextOverflowError, InsufficientMemoryError
from memspec.request import GenerationRequest, Limits, new_tokens
from memspec.runtime.context import FLOOR, ROUND, choose
from memspec.runtime.memory import MiB

TARGET = "smollm2-135m"
SMOL_TRAINED = 8192  # SmolLM2-135M's GGUF: llama.context_length
SMOL_KV_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # layers x K/V x kv heads x head_dim x float16: 23,040 bytes


# -- the choice, as a pure function ----------------------------------------------------------
def test_auto_is_the_trained_context_where_the_slots_kv_fit_and_less_where_they_do_not():
    fits = SMOL_TRAINED * SMOL_KV_PER_TOKEN * 4
    assert choose("auto", SMOL_TRAINED, SMOL_KV_PER_TOKEN, 4, fits).tokens == SMOL_TRAINED
    capped = choose("auto", SMOL_TRAINED, SMOL_KV_PER_TOKEN, 4, fits - 1)
    assert capped.tokens == SMOL_TRAINED - ROUND and "capped" in capped.reason and "4 slot(s)" in capped.reason
    small = choose("auto", SMOL_TRAINED, SMOL_KV_PER_TOKEN, 4, 100 * MiB)
    assert small.tokens % ROUND == 0 and small.tokens * SMOL_KV_PER_TOKEN * 4 <= 100 * MiB
    assert small.tokens + ROUND > 100 * MiB // (SMOL_KV_PER_TOKEN * 4)  # no more than a ROUND below what fits
    assert choose("auto", SMOL_TRAINED, SMOL_KV_PER_TOKEN, 4, -5).tokens == FLOOR  # requests then get a 507
    assert choose("auto", None, SMOL_KV_PER_TOKEN, 4, fits).tokens == 2048  # not recorded: the former default
    fixed = choose(3000, SMOL_TRAINED, SMOL_KV_PER_TOKEN, 4, 0)
    assert fixed.tokens == 3000 and fixed.reason == "max_context = 3000"  # a number is never capped


def test_the_config_takes_auto_a_number_or_a_table_per_model_and_names_a_bad_value(tmp_path):
    assert Config().runtime.max_context == "auto" and Config().limits.max_tokens == 0
    p = tmp_path / "c.toml"
    p.write_text('[runtime]\nmax_context = 4096\nmodel_max_context = { "qwen2.5-coder-1.5b" = 8192, smol = "auto" }\n')
    rt = load_config(p).runtime
    assert rt.max_context == 4096 and rt.model_max_context == (("qwen2.5-coder-1.5b", 8192), ("smol", "auto"))
    for bad, where in (('max_context = "big"', "[runtime] max_context"), ("max_context = 8", "[runtime] max_context"),
                       ('model_max_context = { a = "x" }', "[runtime] model_max_context.a"),
                       ("model_max_context = 5", "[runtime] model_max_context")):
        p.write_text(f"[runtime]\n{bad}\n")
        with pytest.raises(ConfigError, match="^" + re.escape(where) + " must be"):
            load_config(p)


def test_new_tokens_runs_to_the_context_end_within_the_limit_and_names_the_figures_of_what_cannot_fit():
    assert new_tokens(None, 100, 2048) == 1948  # no max_tokens: to the end of the context
    assert new_tokens(None, 100, 2048, limit=500) == 500  # ... within [limits] max_tokens
    assert new_tokens(64, 100, 2048, limit=500) == 64
    assert new_tokens(1948, 100, 2048) == 1948  # exactly the room left
    with pytest.raises(ContextOverflowError) as err:
        new_tokens(1949, 100, 2048)
    assert str(err.value) == ("max_tokens: the prompt's 100 tokens + max_tokens 1949 = 2049 tokens do not fit the "
                              "context of 2048 tokens; ask for at most 1948 new tokens, or leave max_tokens out to "
                              "generate to the end of the context")
    with pytest.raises(ContextOverflowError, match="prompt: 2048 tokens do not fit the context of 2048 tokens"):
        new_tokens(None, 2048, 2048)
    status = STATUS[ContextOverflowError]
    assert (status.http, status.grpc) == (400, "INVALID_ARGUMENT")
    status = STATUS[InsufficientMemoryError]
    assert (status.http, status.grpc) == (507, "RESOURCE_EXHAUSTED")


# -- the real model -----------------------------------------------------------------------
def _config(model_store, **runtime) -> Config:
    c = dataclasses.replace(Config(), home=str(model_store.home))
    return dataclasses.replace(c, runtime=dataclasses.replace(c.runtime, backend="native", **runtime))


@pytest.fixture(scope="module")
def loaded(model_store):
    """SmolLM2 on the native engine, opened as "auto" opens it: at its trained context."""
    from memspec.runtime.target import load_target

    config = _config(model_store)
    return load_target(model_store, TARGET, None, config.runtime)


def test_auto_context_is_smollm2s_trained_8192_within_a_budget_that_holds_it_and_less_within_a_small_one(
        model_store, loaded):
    assert loaded.max_context == SMOL_TRAINED  # opened at its GGUF's trained context
    assert loaded.session.kv_bytes_per_token() == SMOL_KV_PER_TOKEN
    config = _config(model_store)
    rss = 300 * MiB
    for budget_mb, capped in ((8192, False), (400, True)):
        cfg = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, budget_mb=budget_mb))
        got = fit_context(cfg, model_store, TARGET, loaded.manifest, loaded.session, with_drafts=False,
                          probe=FakeProbe(rss=rss))
        room = budget_mb * MiB - rss
        assert (got.tokens < SMOL_TRAINED) == capped, got
        assert got.tokens * SMOL_KV_PER_TOKEN * cfg.server.max_concurrent <= room
        assert "the memory budget" in got.reason and (("capped" in got.reason) == capped)
    # the drafts' caches count too: with them the same budget holds fewer tokens
    cfg = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, budget_mb=400))
    alone = fit_context(cfg, model_store, TARGET, loaded.manifest, loaded.session, False, FakeProbe(rss=rss))
    with_drafts = fit_context(cfg, model_store, TARGET, loaded.manifest, loaded.session, True, FakeProbe(rss=rss))
    assert with_drafts.tokens < alone.tokens
    # no budget: the available memory less the headroom
    got = fit_context(config, model_store, TARGET, loaded.manifest, loaded.session, False,
                      FakeProbe(available=256 * MiB + 4 * 1024 * SMOL_KV_PER_TOKEN))
    assert got.tokens == 1024 and "available memory" in got.reason
    # a per-model setting wins over the default, a number is never capped
    cfg = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, model_max_context=((TARGET, 3000),)))
    assert fit_context(cfg, model_store, TARGET, loaded.manifest, loaded.session, True, FakeProbe(available=0)).tokens \
        == 3000


def _engine(model_store, context: int, **kw):
    return build_engine(_config(model_store, max_context=context), drafts="none", **kw)


def test_no_max_tokens_ends_with_eos_or_at_the_context_end_and_a_request_over_it_names_the_figures(model_store):
    engine = _engine(model_store, 80)
    assert engine.target.max_context == 80
    done = engine.generate(GenerationRequest(prompt="Answer with one word: what color is the sky?"))
    assert done.finish_reason == "eos" and len(done.prompt_token_ids) + len(done.token_ids) < 80
    counting = GenerationRequest(prompt="1, 2, 3, 4, 5,", raw=True)  # counts on, past any length we allow it
    done = engine.generate(counting)
    assert done.finish_reason == "length" and len(done.prompt_token_ids) + len(done.token_ids) == 80
    prompt = len(done.prompt_token_ids)
    with pytest.raises(ContextOverflowError, match=f"the prompt's {prompt} tokens \\+ max_tokens 80 = {prompt + 80} "
                                                   f"tokens do not fit the context of 80 tokens"):
        engine.check(dataclasses.replace(counting, max_tokens=80))
    engine.limits = Limits(max_tokens=5)  # [limits] max_tokens bounds what no max_tokens runs to
    done = engine.generate(counting)
    assert done.finish_reason == "length" and len(done.token_ids) == 5
    engine.close()


def test_a_request_whose_kv_cannot_fit_the_budget_is_a_507_with_figures_and_the_next_one_runs(model_store):
    from memspec.scheduling.config import SchedulerConfig
    from memspec.scheduling.scheduler import from_store
    from memspec.speculation.config import DraftLimits
    from memspec.speculation.engine import Engine

    engine = _engine(model_store, 256)
    process = 500 * MiB
    # a budget that holds the process and 3 MiB of KV: a short answer's caches (2.1 MiB), not the whole context's
    sched = from_store(SchedulerConfig(budget_mb=process // MiB + 3, policy="target-only"), model_store,
                       engine.target, _config(model_store, max_context=256).runtime, DraftLimits(),
                       probe=FakeProbe(rss=process), names=[], process_bytes=process)
    eng = Engine(engine.target, Limits(), drafts=sched)
    req = GenerationRequest(prompt="Say hello.")
    prompt = eng.check(req)
    with pytest.raises(InsufficientMemoryError) as err:
        eng.generate(req)
    assert str(err.value).startswith(f"prompt {len(prompt)} tokens + max_tokens {256 - len(prompt)}: not enough "
                                     f"memory for this request: its KV caches need ")
    assert "the budget of 503 MiB holds 500.0 MiB of models" in str(err.value)
    done = eng.generate(dataclasses.replace(req, max_tokens=4))
    assert done.finish_reason in ("length", "eos") and done.token_ids
    eng.close()
    engine.close()
