"""Never slower than no draft: the cost controller (memspec.speculation.speculative.CostController)
stops drafting where drafting does not pay and probes again later, less often each time a probe
fails (as Ollama's adaptive draft controller falls back to plain decoding).

A request's speed is counted here in target passes, each priced by the verification curve the
controller reads (a row beside the first at 0.2 of a step: SmolLM2 and the 1.5B on 2 cores), plus
the draft's seconds priced in target steps by the controller's own clock: not wall time, which on
a shared machine moves by more than what is measured.
"""

from __future__ import annotations

import numpy as np
import pytest

from memspec.request import SamplingParams
from memspec.runtime import kernels
from memspec.runtime.costs import LiveCosts
from memspec.speculation.config import SpecConfig
from memspec.speculation.drafts import FEED_MIN_TOKENS, Proposal
from memspec.speculation.logits import IDENTITY
from memspec.speculation.metrics import SpecMetrics
from memspec.speculation.speculative import CostController, FixedDraft, NoDraft, speculative_steps

STEP_S = 0.02  # a target step on the controller's clock
CURVE = [0.0] + [1.0 + 0.2 * (k - 1) for k in range(1, 12)]  # a pass over k tokens, in steps
DRAFT_COST = 0.15  # a draft token, in steps (SmolLM2 drafting text for the 1.5B: 0.11)
FEED_COST = 0.03  # a token of a draft's catch-up, in steps (the 0.5B's on the 1.5B: 1.5 against 5 ms of prefill)
TOKENS = 256


class NeverAgrees:
    """A draft (the DraftState interface) whose every token is `wrong`, one the target never
    outputs on this prompt.  On `clock` each token it proposes takes DRAFT_COST of a step, and first
    it catches up on the tokens committed since it last proposed at FEED_COST a token, reported as
    a one-time cost (Proposal.setup_s) where they are FEED_MIN_TOKENS or more, as a model draft
    does: a probe after idle steps pays that catch-up too."""

    def __init__(self, wrong: int, clock: list[float]):
        self.wrong, self.clock, self.seen = wrong, clock, 0

    def propose(self, context, k, params, rng, shaper=IDENTITY, alternatives=False) -> Proposal:
        if k <= 0:
            return Proposal([], None, [])
        feed, self.seen = len(context) - self.seen, len(context)
        setup = FEED_COST * STEP_S * feed
        self.clock[0] += setup + DRAFT_COST * STEP_S * k
        return Proposal([self.wrong] * k, None, [0.0] * k, setup if feed >= FEED_MIN_TOKENS else 0.0)

    def close(self) -> None:
        pass


def priced_run(target, prompt: list[int], select, clock: list[float]) -> tuple[list[int], float, SpecMetrics]:
    """(tokens, the request's cost in target steps, metrics) for TOKENS tokens after the first (the
    prefill's, alike for every draft): each pass at CURVE[rows], the draft's seconds over a step."""
    metrics, rows = SpecMetrics(), []
    steps = speculative_steps(target, target.new_cache(len(prompt) + TOKENS + 16), prompt, select, SamplingParams(),
                              np.random.default_rng(0), SpecConfig(), metrics, clock=lambda: clock[0],
                              verify_cost_s=LiveCosts([c * STEP_S for c in CURVE]),
                              on_pass=lambda n, s: rows.append(n))
    out = list(next(steps))
    while len(out) < TOKENS + 1:
        out.extend(next(steps))
    steps.close()
    return out[:TOKENS + 1], sum(CURVE[n] for n in rows) + metrics.draft_s / STEP_S, metrics


@pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)
def test_a_draft_that_never_agrees_leaves_the_request_within_a_few_percent_of_target_only(gguf_path, monkeypatch):
    """SmolLM2 verifies a draft that is never right: its cost counted in passes and priced draft
    time is within 3% of target-only's (2.5%: the prior's first steps, four probes and the draft's
    catch-ups before them).  The controller that probed every 8 steps however often the probes
    failed, as it did before the backoff, is 7% slower than no draft on the same request."""
    from memspec.runtime.native_target import NativeTarget

    target = NativeTarget(gguf_path, threads=1, max_context=TOKENS + 64)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19161, 260, 8297, 282]
    alone, alone_cost, _ = priced_run(target, prompt, NoDraft(), [0.0])
    assert alone_cost == TOKENS  # one pass of one row a token
    wrong = next(t for t in range(1000, target.vocab_size) if t not in alone)

    def with_draft():
        clock = [0.0]
        return priced_run(target, prompt, FixedDraft("never", NeverAgrees(wrong, clock)), clock)

    got, cost, metrics = with_draft()
    assert got == alone and metrics.num_accepted_tokens == 0 and metrics.num_draft_tokens > 0
    assert alone_cost / cost > 0.97, (cost, metrics.to_dict())

    class EveryEight(CostController):  # the probe schedule before the backoff
        def observe(self, *args, **kwargs):
            super().observe(*args, **kwargs)
            self.probe_every = self.PROBE_EVERY

    monkeypatch.setattr("memspec.speculation.speculative.CostController", EveryEight)
    _, cost_every_8, flat = with_draft()
    assert flat.num_drafts > 4 * metrics.num_drafts and alone_cost / cost_every_8 < 0.95, (cost_every_8, cost)


def test_failed_probes_back_off_then_stop_and_a_paying_draft_starts_the_waits_again():
    ctl = CostController(SpecConfig(gamma_max=8), CURVE, target_step_s=STEP_S)
    asked = []
    for _ in range(300):  # nothing is ever accepted
        g = ctl.next()
        asked.append(g)
        ctl.observe(g, 0, DRAFT_COST * STEP_S * g, verify_s=CURVE[g + 1] * STEP_S)
    stop = asked.index(0)
    assert stop <= 4 and all(g > 0 for g in asked[:stop])  # the prior's steps, then it stops
    probes = [i - stop for i, g in enumerate(asked) if i > stop and g > 0]
    assert np.diff([0, *probes]).tolist() == [7, 16, 32, 64], probes  # one step in 8, 16, 32, 64; then none
    for _ in range(10):  # verifying gets cheap (the machine's other work ended): drafting pays at once ...
        ctl.verify_cost = [0.0] + [1.0] * 11
        ctl.observe(4, 4, DRAFT_COST * STEP_S * 4)
    assert ctl.next() >= 2 and ctl.probe_every == CostController.PROBE_EVERY  # ... and the waits start over


def test_a_draft_that_agrees_again_is_probed_at_the_shortest_wait_until_it_drafts_again():
    """After a spell of rejections (the waits at 32 steps) the draft starts to agree: each accepted
    probe starts the waits over, and once its acceptance pays it drafts every step again."""
    ctl = CostController(SpecConfig(gamma_max=8), CURVE, target_step_s=STEP_S)
    for _ in range(40):
        g = ctl.next()
        ctl.observe(g, 0, DRAFT_COST * STEP_S * g)
    assert ctl.probe_every == 4 * CostController.PROBE_EVERY
    asked = []
    for _ in range(120):  # from here every token it drafts is right
        g = ctl.next()
        asked.append(g)
        ctl.observe(g, g, DRAFT_COST * STEP_S * g)
    probes = [i for i, g in enumerate(asked) if g > 0]
    assert probes and ctl.probe_every == CostController.PROBE_EVERY
    again = next(i for i in range(len(asked)) if all(g > 0 for g in asked[i:]))  # drafting every step from here
    assert again <= probes[0] + 4 * CostController.PROBE_EVERY, asked


def test_a_probes_catch_up_is_counted_as_its_cost_and_the_prompts_prefill_is_not():
    """Regression: the loop left every long catch-up (Proposal.setup_s) out of the draft's cost,
    the probe's too, which pays it because the draft sat idle: a probe after 64 plain steps looked
    as cheap as a token of a draft that runs every step.  The first proposal's prefill stays out."""
    prefill, catch_up = 2.0 * STEP_S, FEED_COST * STEP_S * 65  # 65 tokens committed while it sat idle
    ctl = CostController(SpecConfig(gamma_max=8), CURVE, target_step_s=STEP_S)
    g = ctl.next()
    ctl.observe(g, 0, prefill + DRAFT_COST * STEP_S * g, setup_s=prefill)
    assert ctl.draft_cost == pytest.approx(0.7 * 0.05 + 0.3 * DRAFT_COST)  # the prefill: no cost of its tokens
    while ctl.next() > 0:  # drafting stops paying
        ctl.observe(1, 0, DRAFT_COST * STEP_S)
    before = ctl.draft_cost
    while ctl.next() == 0:
        ctl.observe(0, 0, 0.0)
    assert ctl.probing
    ctl.observe(1, 0, catch_up + DRAFT_COST * STEP_S, setup_s=catch_up)
    assert ctl.draft_cost == pytest.approx(0.7 * before + 0.3 * (DRAFT_COST + FEED_COST * 65))


@pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)
def test_the_loop_hands_the_controller_each_catch_up_and_a_probe_pays_its_own(gguf_path, monkeypatch):
    """The decode loop (under live costs, as the batched path runs it) passes each proposal's
    setup_s to CostController.observe: SmolLM2 and a draft that never agrees, each step's draft
    cost as the controller took it.  The prefill of the 18-token prompt is left out of the first
    step's; every probe's is its catch-up (FEED_MIN_TOKENS or more tokens) and its token."""
    from memspec.runtime.native_target import NativeTarget

    seen = []

    class Recording(CostController):
        def observe(self, n_drafted, *args, **kwargs):
            before, probing = self.draft_cost, self.probing
            super().observe(n_drafted, *args, **kwargs)
            if n_drafted:  # the cost of a drafted token this step counted, in target steps
                seen.append((probing, (self.draft_cost - 0.7 * before) / 0.3))

    monkeypatch.setattr("memspec.speculation.speculative.CostController", Recording)
    target = NativeTarget(gguf_path, threads=1, max_context=TOKENS + 64)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19161, 260, 8297, 282]
    clock = [0.0]
    _, _, metrics = priced_run(target, prompt, FixedDraft("never", NeverAgrees(10_000, clock)), clock)
    assert metrics.num_accepted_tokens == 0 and seen[0] == (False, pytest.approx(DRAFT_COST))
    probes = [cost for probing, cost in seen if probing]
    assert len(probes) == 4, seen
    assert all(cost >= DRAFT_COST + FEED_COST * FEED_MIN_TOKENS - 1e-9 for cost in probes), probes


@pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)
def test_a_draft_taken_again_gets_a_new_controller(gguf_path):
    """The scheduler's switcher may leave a draft and take it again later in the request (a new
    state: memspec.scheduling.selector); its cost controller starts over, as in a new request.
    Regression: the loop kept one controller per draft name, so a draft whose probes had stopped
    (about 120 plain steps) was never asked for a token again: the retry ran target-only."""
    from memspec.runtime.native_target import NativeTarget

    target = NativeTarget(gguf_path, threads=1, max_context=TOKENS + 64)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19161, 260, 8297, 282]
    clock, asked, step = [0.0], [], [0]

    class Asked(NeverAgrees):  # the loop asks a state for a proposal only where it drafts
        def propose(self, context, k, params, rng, shaper=IDENTITY, alternatives=False):
            asked.append((self, step[0]))
            return super().propose(context, k, params, rng, shaper, alternatives)

    first, again = Asked(10_000, clock), Asked(10_000, clock)

    class TakenAgain(NoDraft):  # the first state for 200 steps, then a new one of the same draft
        def __call__(self, context, metrics):
            step[0] += 1
            return "never", first if step[0] <= 200 else again

    priced_run(target, prompt, TakenAgain(), clock)
    assert max(at for s, at in asked if s is first) < 140  # its probes had stopped
    assert min((at for s, at in asked if s is again), default=None) == 201  # the new state drafts at once


@pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)
def test_a_request_the_switcher_leaves_a_draft_in_stays_near_target_only(gguf_path):
    """The scheduler's switcher (memspec) over a draft that never agrees, on SmolLM2, priced in
    passes and draft time.  Its prediction steady, the request leaves the draft after 16 steps and
    does not take it again: within 3% of target-only, as with the cost controller alone.  With a
    predictor that keeps raising it (the worst case), the request tries it again after 8, 16, 32
    and 64 steps without it, each time a new state that catches up on the whole context (most of
    what a retry costs) and a new controller that drafts at its prior, then no more: within 8%."""
    from memspec.runtime.native_target import NativeTarget
    from test_scheduler import Rising, StandInPredictor, make, req

    target = NativeTarget(gguf_path, threads=1, max_context=TOKENS + 64)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19161, 260, 8297, 282]
    alone, alone_cost, _ = priced_run(target, prompt, NoDraft(), [0.0])
    wrong = next(t for t in range(1000, target.vocab_size) if t not in alone)
    rates = {"draft-chat": 32.0, "draft-code": 5.0, "draft-math": 5.0, "prompt-lookup": 5.0, "none": 30.0}
    for predictor, taken, bound in ((StandInPredictor(rates), 1, 0.97), (Rising(rates), 5, 0.92)):
        sched, loader, *_ = make("memspec", budget_mb=0, predictor=predictor)
        sched.ws.lease("draft-chat").release()
        clock, states = [0.0], []
        loader.proposers["draft-chat"].begin = lambda capacity: states.append(NeverAgrees(wrong, clock)) or states[-1]
        sel = sched.selector(req("tell me about cats", max_tokens=1024), prompt, TOKENS + 64)
        got, cost, metrics = priced_run(target, prompt, sel, clock)
        sel.close()
        assert got == alone and len(states) == taken, (len(states), cost)
        assert alone_cost / cost > bound, (cost, metrics.num_drafts)


ADVICE = "I've been offered a promotion to team lead but I really like writing code. How should I think about the decision?"


@pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)
def test_a_request_no_draft_pays_in_stays_near_target_only_under_smollm2s_predictor(gguf_path):
    """Issue 67's advice prompts on SmolLM2: the shipped predictor expects every draft at 1.15-1.5x
    target-only (more as the answer grows) and each accepts a quarter.  Here, on the first advice
    prompt and its real answer, every draft never agrees, priced in passes and draft time: within 5%
    of target-only (0.957x), two drafts run.  Before, 0.74x with 12 draft states: the predictor
    priced a draft its cost controller had stopped at its fitted line run down to no draft token,
    below target-only's step (draft-code: 1.31x target-only, drafting nothing), so the switcher went
    back to drafts that had failed, and on to every draft it had not run, each a catch-up over the
    whole context and steps at the controller's prior."""
    from fakes import FakeClock, FakeLoader, FakeProbe, MiB
    from test_scheduler import req

    from memspec.models.tokenizer import Tokenizer

    from memspec.models.store import SHIPPED_MODELS
    from memspec.runtime.native_target import NativeTarget
    from memspec.scheduling.config import SchedulerConfig
    from memspec.scheduling.predictor import Predictor
    from memspec.scheduling.scheduler import Scheduler

    target = NativeTarget(gguf_path, threads=1, max_context=TOKENS + 128)
    tok = Tokenizer.from_gguf(gguf_path)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ADVICE}]))
    alone, alone_cost, _ = priced_run(target, prompt, NoDraft(), [0.0])
    wrong = next(t for t in range(1000, target.vocab_size) if t not in alone)
    predictor = Predictor.load(SHIPPED_MODELS / "predictor-smollm2-135m-gguf.json")
    sizes = {d: 6 * MiB for d in predictor.drafts if d != "none"}
    fake_clock, clock, states = FakeClock(), [0.0], []
    loader = FakeLoader(sizes, fake_clock)
    sched = Scheduler(SchedulerConfig(policy="memspec", budget_mb=0, pressure_floor_mb=0), loader, sizes,
                      FakeProbe(), target=("target", 100 * MiB), clock=fake_clock, predictor=predictor, decode=tok.decode)
    for d in sizes:  # every draft resident, each state one that never agrees
        sched.ws.lease(d).release()
        loader.proposers[d].begin = lambda capacity: states.append(NeverAgrees(wrong, clock)) or states[-1]
    sel = sched.selector(req(ADVICE, max_tokens=1024), prompt, TOKENS + 128)
    got, cost, metrics = priced_run(target, prompt, sel, clock)
    sel.close()
    assert got == alone and metrics.num_accepted_tokens == 0
    assert len(states) <= 3 and alone_cost / cost > 0.95, (len(states), cost, metrics.drafts_used)
