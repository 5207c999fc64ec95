"""Constrained decoding's cost and its effect on drafts: the same requests with and without a
JSON schema, per draft: acceptance (vLLM's words, as the engine's stats count them), tok/s, and
the grammar mask's time per shaped row.  Under the schema, drafts run twice: proposing under the
mask (as memspec does), and proposing blind to it ("unmasked"), their proposal then cut before
its first forbidden token, which the target would reject for certain: the cut tokens count as
drafted and rejected.

    python bench/constrained.py [--model smollm2-135m] [--drafts draft-chat,prompt-lookup] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from memspec.build import load_pool
from memspec.models.store import ModelStore
from memspec.request import Constraint, GenerationRequest
from memspec.runtime.config import SessionConfig
from memspec.runtime.target import load_target
from memspec.speculation import grammar
from memspec.speculation import drafts as drafts_mod
from memspec.speculation.logits import IDENTITY, allowed_prefix
from memspec.speculation.engine import Engine
from memspec.speculation.sources import DraftPool

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                  "minItems": 1, "maxItems": 3},
                                         "rating": {"enum": [1, 2, 3, 4, 5]}},
        "required": ["title", "tags", "rating"], "additionalProperties": False}
CASES = [("Describe a person as JSON with name, age and city.", PERSON),
         ("Give me a book recommendation as JSON.", BOOK),
         ("Invent a character for a story. Answer in JSON.", PERSON),
         ("Rate the book 'Dune' as JSON.", BOOK)]


def timed_masks() -> list[float]:
    """Wrap GrammarMask.shape to record each call's seconds."""
    seconds: list[float] = []
    shape = grammar.GrammarMask.shape

    def timed(self, row):
        t0 = time.perf_counter()
        out = shape(self, row)
        seconds.append(time.perf_counter() - t0)
        return out

    grammar.GrammarMask.shape = timed
    return seconds


def unmasked_drafts(cut: list[int]):
    """Make model drafts propose without the shaper; their proposal is cut where the mask forbids
    (the loop may only push allowed tokens), the cut tokens counted in cut[0]."""
    propose = drafts_mod.ModelDraftState.propose

    def blind(self, context, k, params, rng, shaper=IDENTITY):
        p = propose(self, context, k, params, rng)
        kept = allowed_prefix(shaper, p.tokens, self.d.target_vocab)
        if len(kept) < len(p.tokens):
            cut[0] += len(p.tokens) - len(kept)
            p = p.prefix(len(kept))
        return p

    drafts_mod.ModelDraftState.propose = blind
    return lambda: setattr(drafts_mod.ModelDraftState, "propose", propose)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variant", default="q4")
    ap.add_argument("--drafts", default="draft-chat,prompt-lookup")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cases", type=int, default=len(CASES))
    args = ap.parse_args()
    store = ModelStore()
    cfg = SessionConfig(max_context=512)
    target = load_target(store, args.model, args.variant, cfg)
    pool = load_pool(store, args.model, target.session.vocab_size, cfg, names=[d for d in args.drafts.split(",")])
    engine = Engine(target, drafts=DraftPool(pool))
    seconds = timed_masks()
    engine.grammars.ll_tokenizer()  # built once per target: not a cost of the first request
    for draft in ["none", *args.drafts.split(",")]:
        for constrained, masked in ((False, True), (True, True), (True, False)):
            if not masked and draft in ("none", "prompt-lookup"):
                continue  # no model rows to mask
            cut = [0]
            restore = unmasked_drafts(cut) if not masked else (lambda: None)
            drafted = accepted = tokens = 0
            decode_s = 0.0
            for prompt, schema in CASES[:args.cases]:
                c = Constraint("json_schema", json.dumps(schema)) if constrained else None
                r = engine.generate(GenerationRequest(prompt=prompt, max_tokens=args.max_tokens, draft=draft,
                                                      constraint=c))
                drafted += r.stats.num_draft_tokens
                accepted += r.stats.num_accepted_tokens
                tokens += len(r.token_ids) - 1
                decode_s += r.timings.decode_ms / 1e3
            restore()
            drafted += cut[0]
            rate = f"{accepted}/{drafted} = {accepted / drafted:.2f}" if drafted else "-"
            mode = "no" if not constrained else ("yes, draft masked" if masked else "yes, draft unmasked")
            print(f"{args.model} draft={draft:<14} schema={mode:<19}  accepted/drafted "
                  f"{rate:<18} decode {tokens / decode_s:6.1f} tok/s", flush=True)
    if seconds:
        print(f"mask per shaped row ({target.session.vocab_size} logits): "
              f"median {statistics.median(seconds) * 1e6:.0f} us, "
              f"p90 {sorted(seconds)[int(0.9 * len(seconds))] * 1e6:.0f} us over {len(seconds)} rows")
    engine.close()


if __name__ == "__main__":
    main()
