"""The generation engine: prompt in, committed tokens and text out.

`Engine.stream()` turns a checked request into a stream of `Chunk`s and one
final `Completion`.  The decode loop underneath yields lists of committed token
ids: one per step for target-only decoding, several per step once a draft
proposes and the target verifies (memspec.speculation.speculative).  Everything about
stopping (EOS, stop strings, max tokens, context end, cancellation), text and
timing lives here, once, for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterator

import numpy as np

from memspec.errors import InsufficientMemoryError, InvalidRequestError
from memspec.models import tools
from memspec.request import (Chunk, Completion, Constraint, GenerationRequest, Limits, Timings, TokenLogprob,
                             check_logit_bias, fresh_seed, new_tokens, validate)
from memspec.runtime.contracts import BatchedPass, TargetModel  # noqa: F401 (TargetModel: re-exported)
from memspec.runtime.costs import CostCache, LiveCosts, pass_costs
from memspec.runtime.memory import request_kv_bytes
from memspec.runtime.kvcache import KVCache
from memspec.runtime.prefixes import PrefixCache
from memspec.speculation import sampling
from memspec.speculation.config import SpecConfig
from memspec.speculation.confidence import AcceptanceByEntropy
from memspec.speculation.grammar import GrammarMask, Grammars
from memspec.speculation.logits import IDENTITY, LogitsShaper, compose, for_sampling
from memspec.speculation.metrics import SpecMetrics
from memspec.speculation.sources import DraftPool, DraftSource
from memspec.speculation.speculative import NoDraft, speculative_steps
from memspec.speculation.stopping import StopMatcher

Clock = Callable[[], float]
TREE_ROWS = 4  # rows a token tree may add to the longest chain: the cost curve is measured that far
PREFILL_LOG_S = 2.0  # how often the log says how far a prompt fed in chunks has come
log = logging.getLogger(__name__)


class Engine:
    """Runs requests against one target, each with the draft its `drafts` source gives it: a
    fixed pool (DraftPool), or the scheduler (memspec.build makes either from a config)."""

    def __init__(self, target: TargetModel, limits: Limits = Limits(), clock: Clock = time.perf_counter,
                 drafts: DraftSource | None = None, spec: SpecConfig = SpecConfig(),
                 costs: CostCache | None = None, batched: BatchedPass | None = None, prefix_cache_bytes: int = 0,
                 prefill_chunk: int = 512):
        """batched: one target pass over several requests' rows (memspec.runtime.target.open_batched;
        memspec.build opens it, before the draft source, so that the budget counts any copy of the
        weights it holds): concurrent requests share it; None: each request runs its own passes.
        prefix_cache_bytes > 0: keep recent prompts' K/V up to that many bytes, for prompts that
        start the same way (memspec.runtime.prefixes), where the target's rows allow it.
        prefill_chunk: most prompt tokens per batched pass ([runtime] prefill_chunk; chunks beside
        other requests are sized by time: memspec.speculation.batching.PrefillPace)."""
        self.target = target
        self.batch = None
        if batched is not None:
            from memspec.speculation.batching import BatchLoop

            self.batch = BatchLoop(batched, prefill_chunk=prefill_chunk)
        self.pass_cost_s: dict[int, list[float]] | None = None  # batched: [b][k] = a pass of b rows x k
        self.limits = limits
        self.clock = clock
        self.drafts: DraftSource = drafts if drafts is not None else DraftPool()  # default: target only
        self.spec = spec
        self.verify_cost_s: list[float] | None = None  # [k] = seconds of a k-token target pass (measured once)
        self.live: LiveCosts | None = None  # ... corrected by the passes timed since (requests' own passes)
        self._pinned = False  # pin_costs: the curve as given, never corrected
        self.acceptance = AcceptanceByEntropy()  # the target's acceptance by draft and entropy, across requests
        self.costs = costs  # where measured curves outlive the process (the store's costs.json), or None
        self._calibrate_lock = threading.Lock()
        # compiles requests' constraints (memspec.speculation.grammar); its tokenizer is built on first use
        self.grammars = Grammars(target.tokenizer, target.session.vocab_size or target.tokenizer.vocab_size,
                                 target.eos_ids)
        self.prefixes: PrefixCache | None = None  # recent prompts' K/V (None: off, or the target is not exact)
        if prefix_cache_bytes > 0 and getattr(target.session, "prefix_reuse", False):
            self.prefixes = PrefixCache(prefix_cache_bytes)
            self.drafts.add_spare(self.prefixes.clear)  # given up before any draft under memory pressure

    def calibrate(self) -> list[float] | None:
        """Measure what a target pass over 1..gamma_max+1 tokens costs (once; the cost controller uses it)."""
        if not (self.spec.adaptive and self.spec.controller == "cost"):
            return None
        with self._calibrate_lock:
            if self.verify_cost_s is None:
                session = self.target.session
                # a token tree's branches add rows to the longest chain (memspec.speculation.tree)
                max_k = self.spec.gamma_max + 1 + (TREE_ROWS if self.spec.trees and getattr(session, "trees", False)
                                                   else 0)
                self.verify_cost_s = self._measured(session.cost_key(max_k),
                                                    lambda: session.measure_step_costs(max_k), "one-request pass costs")
            if self.batch is not None and self.pass_cost_s is None:
                self.pass_cost_s = self._batched_pass_costs(self.spec.gamma_max + 1)
        return self.verify_cost_s

    def _batched_pass_costs(self, max_k: int) -> dict[int, list[float]]:
        """{b: [unused, k=1..max_k]} seconds of a batched pass of b rows, kept in the store's cost
        file as the one-request curve is (rows x (max_k + 1) values, one row after another)."""
        bt = self.batch.target
        width = max_k + 1

        def measure() -> list[float]:
            if bt.target is self.target.session:  # its one-row pass is the target's own forward, measured
                table = pass_costs(bt, max_k, one_row=self.verify_cost_s)
            else:  # a graph of its own (ONNX Runtime's batched graph)
                table = bt.measure_pass_costs(max_k)
            return [c for b in range(1, bt.rows + 1) for c in table[b]]

        key = f"{self.target.session.cost_key(max_k)} batched rows={bt.rows}"
        flat = self._measured(key, measure, f"batched pass costs (a pass of {bt.rows} rows; fewer interpolated)")
        if len(flat) != bt.rows * width:  # a hand-edited file: measure again
            flat = measure()
            self.costs.put(key, flat)
        return {b: flat[(b - 1) * width: b * width] for b in range(1, bt.rows + 1)}

    def _measured(self, key: str, measure: Callable[[], list[float]], what: str = "pass costs") -> list[float]:
        """measure(), through the store's cost file where the engine has one; a measurement is
        logged (seconds of a load that would otherwise pass in silence)."""
        def logged() -> list[float]:
            t0 = time.perf_counter()
            log.info("%s: measuring the target's %s (once per model and machine, kept in the store's costs.json)",
                     self.target.name, what)
            out = measure()
            log.info("%s: %s measured in %.1f s", self.target.name, what, time.perf_counter() - t0)
            return out

        return logged() if self.costs is None else self.costs.measured(key, logged)

    def pin_costs(self, verify_cost_s: list[float]) -> None:
        """Use this pass-cost curve as it is: neither measured nor corrected by the passes timed
        (benchmarks that run policies under one curve, so that they differ by the policy alone)."""
        self.verify_cost_s, self.live, self._pinned = list(verify_cost_s), None, True

    def _verify_costs(self) -> list[float] | Callable[[], list[float]] | None:
        """What the cost controller reads: the one-request costs as the passes timed so far correct
        them (LiveCosts), or under batching the cost of a pass with as many rows as there are
        requests now (what a request's k tokens cost it)."""
        costs = self.calibrate()
        if costs is None or self._pinned:
            return costs
        with self._calibrate_lock:
            if self.live is None:
                self.live = LiveCosts(costs)
                if self.batch is not None:  # a request alone runs the one-request pass: it corrects the curve
                    self.batch.on_alone = self.live.observe
            live = self.live
        if self.batch is None or not self.pass_cost_s:
            return live
        table, batch = self.pass_cost_s, self.batch
        return lambda: live() if batch.in_use() <= 1 else table[min(batch.in_use(), batch.slots)]

    def close(self) -> None:
        """Stop the draft source's background loading and drop its drafts (idempotent).  A process
        must call it before it exits: a loader thread still inside ONNX Runtime at interpreter
        shutdown aborts the process ("terminate called without an active exception")."""
        self.drafts.close()
        if self.batch is not None:
            self.batch.close()

    # -- prompt ---------------------------------------------------------------
    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        tok = self.target.tokenizer
        if req.raw:
            text = req.prompt
        else:
            turns = [{"role": r, "content": c} for r, c in req.messages or (("user", req.prompt),)]
            listed = [tools.tool_json(t) for t in req.tools] if req.tool_choice != "none" else []
            knows = tok.template_knows_tools
            text = tok.apply_chat_template(tools.prompt_turns(turns, listed, knows), tools=listed if knows else None)
        ids = tok.encode(text)
        if not ids:
            raise InvalidRequestError("prompt: encodes to no tokens")
        self.max_new(req, ids)  # ContextOverflowError: the prompt, or it and max_tokens, do not fit the context
        return ids

    def max_new(self, req: GenerationRequest, prompt: list[int]) -> int:
        """The most new tokens `req` gets after `prompt` (memspec.request.new_tokens): its max_tokens,
        or with none, to the end of the context within [limits] max_tokens."""
        return new_tokens(req.max_tokens, len(prompt), self.target.session.max_context, self.limits.max_tokens)

    @staticmethod
    def constraint(req: GenerationRequest) -> Constraint | None:
        """What the answer must match: the request's schema or grammar, or a forced tool call's shape."""
        forced = req.forced_tool
        if forced is not None:
            return Constraint("grammar", tools.call_grammar(req.tools, forced or None), field="tool_choice")
        return req.constraint

    # -- decode loops ------------------------------------------------------------
    def steps(self, cache: KVCache, prompt: list[int], req: GenerationRequest, rng: sampling.Randomness,
              metrics: SpecMetrics, cancelled: Callable[[], bool] = lambda: False,
              on_rows: Callable[[np.ndarray], None] | None = None,
              grammar: GrammarMask | None = None,
              progress: Callable[[str], None] | None = None) -> Iterator[list[int]]:
        """The decode loop for this request: speculative when a draft is chosen, else target only.
        grammar: the mask of the request's constraint (self.grammars.mask), which the caller reads
        to end the answer once the grammar is complete.  progress: told how far a prompt fed in
        chunks (the batch loop's prefill_chunk) has come, as the log is (prefill_progress)."""
        select = self.drafts.selector(req, prompt, cache.capacity, cancelled)
        costs = self._verify_costs() if select is not None else None
        select = select or NoDraft()
        slot = self.batch.join() if self.batch is not None else None
        if slot is not None:
            slot.progress = self.prefill_progress(progress)
        context = list(prompt)  # what the cache holds at each yield: context[:cache.length]
        # a shaped request runs the same loop on a batch slot: only the target pass is shared
        # a request's own passes correct the pass costs; a batched pass's rows are other requests' too
        on_pass = self.live.observe if costs is not None and self.batch is None and self.live is not None else None
        steps = speculative_steps(slot or self.target.session, cache, prompt, select, req.sampling, rng,
                                  self.spec, metrics, self.clock, costs, on_rows, self.shaper(req, prompt, grammar),
                                  on_pass, self.acceptance if self.spec.gate else None)
        try:
            for committed in steps:
                if self.prefixes is not None and len(context) == len(prompt):
                    self.prefixes.store(prompt, cache)  # the prompt's K/V, for the requests after this one
                context.extend(committed)
                yield committed
            self._keep(context, cache)
        except GeneratorExit:  # the caller stopped at a yield (finished, stopped, cancelled): the cache is whole
            self._keep(context, cache)
            raise
        finally:
            steps.close()
            select.close()
            if slot is not None:  # the slot is free for the next pass, and the cache for the OS
                slot.leave()
                self.batch.release(cache)

    def prefill_progress(self, progress: Callable[[str], None] | None = None,
                         every_s: float = PREFILL_LOG_S) -> Callable[[int, int], None]:
        """What a slot tells after each chunk of a prompt fed in several passes: the log (at most
        every `every_s`) and `progress` (an HTTP stream's comments) hear how far it is."""
        t0, told = self.clock(), [-every_s]

        def tell(done: int, total: int) -> None:
            now = self.clock()
            message = (f"prefill: {done:,} of {total:,} prompt tokens ({done / total:.0%}), "
                       f"{now - t0:.1f} s, {done / max(now - t0, 1e-9):.0f} tok/s")
            if now - told[0] >= every_s:
                told[0] = now
                log.info("%s: %s", self.target.name, message)
            if progress is not None:
                progress(message)

        return tell

    def shaper(self, req: GenerationRequest, prompt: list[int], grammar: GrammarMask | None = None) -> LogitsShaper:
        """The request's logits shaper (memspec.speculation.logits): its sampling controls, then its
        grammar's mask (last, so that nothing raises a forbidden token again); IDENTITY when it asks
        for none.  Batched requests run the same loop on a slot, so the mask holds there too."""
        return compose(for_sampling(req.sampling, prompt), grammar if grammar is not None else IDENTITY)

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name (logit_bias): the tokenizer's, within the target's logits."""
        n = self.target.tokenizer.vocab_size
        return min(n, self.target.session.vocab_size or n)

    def _keep(self, context: list[int], cache: KVCache) -> None:
        """The finished request's prompt and answer, for the next turn of its conversation, and its
        committed tokens for the drafts that learn from what the daemon saw (the suffix draft)."""
        if self.prefixes is not None:
            self.prefixes.store(context, cache)
        try:
            self.drafts.learn(context)
        except Exception as exc:  # a draft that cannot learn must not fail a request that is done
            log.warning("drafts could not learn from a finished request (%s: %s)", type(exc).__name__, exc)

    # -- streaming ---------------------------------------------------------------
    def check(self, req: GenerationRequest) -> list[int]:
        """Validate `req` fully (limits, draft, policy, context) and return its prompt ids."""
        validate(req, self.limits)
        check_logit_bias(req.sampling.logit_bias, self.vocab_size)
        self.drafts.check(req)  # an unknown draft or policy is refused before any work
        for i, t in enumerate(req.tools):  # a schema llguidance refuses is the client's error, forced or not
            self.grammars.compile(Constraint("json_schema", t.parameters, field=f"tools[{i}].function.parameters"))
        constraint = self.constraint(req)
        if constraint is not None:
            self.grammars.compile(constraint)
        return self.prompt_ids(req)

    def kv_bytes(self, req: GenerationRequest, prompt: list[int]) -> int:
        """The KV memory this request may touch (memory.request_kv_bytes): what admission checks
        against free memory and what the draft source reserves in its budget while it runs."""
        return request_kv_bytes(len(prompt) + self.max_new(req, prompt), self.target.session.cache_nbytes,
                                self.drafts.draft_kv_sizers(req),
                                slack=self.spec.gamma_max + 1 + (TREE_ROWS if self.spec.trees else 0))

    def stream(self, req: GenerationRequest, cancel: threading.Event | None = None,
               prompt: list[int] | None = None,
               progress: Callable[[str], None] | None = None) -> Iterator[Chunk | Completion]:
        """Yield Chunks as tokens are committed, then one Completion.  `prompt`: the ids
        check() returned for this request, when the caller checked it already.  progress: told how
        far a long prompt's prefill has come, chunk by chunk (batched engines: steps)."""
        t0 = self.clock()
        if prompt is None:
            prompt = self.check(req)
        cancelled = cancel.is_set if cancel is not None else (lambda: False)
        req = dataclasses.replace(req, max_tokens=self.max_new(req, prompt))  # None: to the context's end
        with contextlib.ExitStack() as held:  # its KV caches, held in the budget while it runs
            try:
                held.enter_context(self.drafts.reserve_kv(self.kv_bytes(req, prompt), cancelled))
            except InsufficientMemoryError as exc:  # the figures of what it asked for, beside the memory's
                raise InsufficientMemoryError(f"prompt {len(prompt)} tokens + max_tokens {req.max_tokens}: "
                                              f"{exc}") from None
            yield from self._stream(req, cancel, t0, prompt, progress)

    def _stream(self, req: GenerationRequest, cancel: threading.Event | None, t0: float,
                prompt: list[int], progress: Callable[[str], None] | None = None) -> Iterator[Chunk | Completion]:
        cache = self.target.session.new_cache()
        cached = self.prefixes.fill(cache, prompt) if self.prefixes is not None else 0  # only the rest is computed
        seed = self.seed_of(req)
        rng = self.randomness(seed, len(prompt))
        detok = self.target.tokenizer.detokenizer()
        stops = StopMatcher(req.stop)
        out: list[int] = []
        text: list[str] = []
        metrics = SpecMetrics()
        t_first = None
        finish = "length"
        rows: list[np.ndarray] = []  # logits rows of the step just committed (only when logprobs are asked)
        on_rows = (lambda r: rows.append(r.copy())) if req.logprobs is not None else None
        constraint = self.constraint(req)
        grammar = self.grammars.mask(constraint) if constraint is not None else None
        steps = self.steps(cache, prompt, req, rng, metrics, cancel.is_set if cancel is not None else lambda: False,
                           on_rows, grammar, progress)
        try:
            for committed in steps:
                if t_first is None:
                    t_first = self.clock()
                new, finish_now = self._accept(committed, out, req)
                if finish_now == "eos" and grammar is not None and grammar.complete:
                    # the step that completed the grammar also committed the end token it then admits
                    # (the bonus after a forced or drafted run): the answer ended with the grammar
                    out.pop()
                    finish_now = "stop"
                piece = stops.feed(detok.add(new)) if new else ""
                if stops.hit or (finish_now in (None, "length") and grammar is not None and grammar.done):
                    finish_now = "stop"  # a stop string, or a complete grammar (it admits only an end token)
                text.append(piece)
                logprobs = self._logprobs(rows.pop(), new, req.logprobs) if rows else None
                yield Chunk(piece, new, logprobs)
                if finish_now:
                    finish = finish_now
                    break
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
        finally:
            steps.close()
        tail = stops.feed(detok.flush()) + stops.flush()
        if tail:
            text.append(tail)
            yield Chunk(tail, [])
        t_end = self.clock()
        yield Completion(
            prompt_token_ids=prompt, token_ids=out, text="".join(text), finish_reason=finish,
            timings=self._timings(t0, t_first, t_end, len(prompt), len(out), cached), stats=metrics.freeze(),
            seed=seed,
        )

    @staticmethod
    def seed_of(req: GenerationRequest) -> int | None:
        """The seed a request samples with: its own, else a fresh one (memspec.request.fresh_seed),
        reported on its Completion; None for a greedy request."""
        if req.sampling.greedy:
            return None
        return req.sampling.seed if req.sampling.seed is not None else fresh_seed()

    def randomness(self, seed: int | None, prompt_len: int) -> sampling.Randomness:
        """What a request's sampled tokens are drawn with (memspec.speculation.sampling): noise keyed
        by (seed, answer position, token), or, under `[speculative] sampling = "standard"`, one stream."""
        if self.spec.sampling == "coupled" and seed is not None:
            return sampling.Coupled(seed, prompt_len)
        return np.random.default_rng(seed)

    def _logprobs(self, rows: np.ndarray, tokens: list[int], k: int) -> list[TokenLogprob]:
        """Each shown token's log-probability and the k most likely at its position."""
        tok = self.target.tokenizer
        out = []
        for row, t in zip(rows, tokens):
            lp, top = sampling.log_probs(row, t, k)
            out.append(TokenLogprob(t, tok.token_bytes(t), lp, tuple((i, tok.token_bytes(i), v) for i, v in top)))
        return out

    def _accept(self, committed: list[int], out: list[int], req: GenerationRequest) -> tuple[list[int], str | None]:
        """Append committed ids up to EOS / max_tokens; return (ids to show, finish reason or None)."""
        new: list[int] = []
        for tok in committed:
            if tok in self.target.eos_ids:
                out.append(tok)
                return new, "eos"
            out.append(tok)
            new.append(tok)
            if len(out) >= req.max_tokens:
                return new, "length"
        return new, None

    def _timings(self, t0: float, t_first: float | None, t_end: float, n_prompt: int, n_out: int,
                 cached: int = 0) -> Timings:
        t_first = t_first if t_first is not None else t_end
        decode_s = max(t_end - t_first, 1e-9)
        return Timings(
            prompt_tokens=n_prompt,
            cached_prompt_tokens=cached,
            completion_tokens=n_out,
            ttft_ms=(t_first - t0) * 1e3,
            prefill_tok_per_s=n_prompt / max(t_first - t0, 1e-9),
            decode_ms=decode_s * 1e3,
            total_ms=(t_end - t0) * 1e3,
            # the first token comes from the prefill; the rest from decode steps
            tok_per_s=(n_out - 1) / decode_s if n_out > 1 else 0.0,
        )

    def generate(self, req: GenerationRequest, cancel: threading.Event | None = None) -> Completion:
        """Run a request to the end and return its Completion."""
        result = None
        for item in self.stream(req, cancel):
            if isinstance(item, Completion):
                result = item
        return result
