"""Constrained decoding (memspec.speculation.grammar): the grammar mask as a logits shaper, on a
tokenizer of 16 one-letter tokens built here, and on SmolLM2's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memspec.errors import InvalidRequestError
from memspec.request import Constraint
from memspec.speculation.grammar import Grammars

LETTERS = "abcdefghijklmno"  # ids 1..15; id 0 is the end token
V = 16


def letters_tokenizer():
    """A byte-level BPE of one token per letter and no merges: id 0 '<eos>', 'a' 1 .. 'o' 15."""
    from tokenizers import AddedToken, Tokenizer as HF, decoders, models, pre_tokenizers

    from memspec.models.tokenizer import Tokenizer

    hf = HF(models.BPE(vocab={"<eos>": 0, **{c: i + 1 for i, c in enumerate(LETTERS)}}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<eos>", special=True)])
    return Tokenizer(json.loads(hf.to_str()), {"eos_token_id": 0})


@pytest.fixture(scope="module")
def grammars():
    return Grammars(letters_tokenizer(), V, [0])


def allowed(mask) -> list[int]:
    return np.nonzero(mask.allowed())[0].tolist()


def test_the_mask_follows_the_grammar_and_rolls_back(grammars):
    g = grammars.mask(Constraint("grammar", 'start: "ab" "c"*', field="grammar"))
    assert allowed(g) == [1]  # 'a'
    g.push(1)
    assert allowed(g) == [2]  # 'b'
    g.push(2)
    assert allowed(g) == [0, 3] and not g.done  # the end token or 'c'
    g.push(3)
    g.pop(2)  # back to after 'a'
    assert allowed(g) == [2]


def test_end_tokens_a_draft_proposes_roll_back_with_the_rest(grammars):
    """A draft may propose the end token where the grammar is complete, and more after it; the
    verification rolls them back with the tokens before them."""
    g = grammars.mask(Constraint("grammar", 'start: "ab" "c"*', field="grammar"))
    for t in (1, 2, 0):
        g.push(t)
    assert allowed(g) == [0] and g.done  # after the end: only the end
    g.push(0)
    g.pop(3)
    assert allowed(g) == [2]  # after 'a' again
    g.push(2)
    g.push(3)
    assert allowed(g) == [0, 3] and not g.done


def test_a_complete_grammar_is_done(grammars):
    g = grammars.mask(Constraint("grammar", 'root ::= "ab" | "cd"', field="grammar"))  # GBNF, as llama.cpp's
    for t in (3, 4):  # 'c', 'd'
        g.push(t)
    assert g.done and allowed(g) == [0]


def test_shape_forbids_what_the_grammar_does_and_leaves_the_row_alone(grammars):
    g = grammars.mask(Constraint("grammar", 'start: "a" | "b"', field="grammar"))
    row = np.arange(V, dtype=np.float32)
    out = g.shape(row)
    assert out[1] == 1.0 and out[2] == 2.0 and np.isneginf(np.delete(out, [1, 2])).all()
    np.testing.assert_array_equal(row, np.arange(V))  # the raw row is kept (logprobs read it)


def test_a_token_the_mask_forbids_is_a_bug_not_a_silent_error(grammars):
    g = grammars.mask(Constraint("grammar", 'start: "a"', field="grammar"))
    with pytest.raises(RuntimeError, match="refused token 5"):
        g.push(5)


@pytest.mark.parametrize("constraint,match", [
    (Constraint("json_schema", "{not json", field="response_format.json_schema.schema"),
     r"^response_format\.json_schema\.schema: is not valid JSON"),
    (Constraint("json_schema", '{"type": "strin"}', field="json_schema"), r"^json_schema: Invalid type: strin"),
    (Constraint("json_schema", '{"not": {"type": "string"}}', field="json_schema"),
     r"^json_schema: Unimplemented keys: \[\"not\"\]"),
    (Constraint("json_schema", '[1, 2]', field="json_schema"), r"^json_schema: a JSON schema is an object"),
    (Constraint("grammar", "root ::= foo", field="grammar"), r"^grammar: .*Rule 'foo' not found"),
    (Constraint("grammar", "start: x", field="grammar"), r"^grammar: .*unknown name"),
])
def test_bad_schemas_and_grammars_name_their_field(grammars, constraint, match):
    with pytest.raises(InvalidRequestError, match=match):
        grammars.compile(constraint)


def test_a_json_answer_walks_through_the_schema_on_smollm(model_store):
    """Every token of a valid answer (as the tokenizer writes it) is allowed where it stands, and
    the grammar is done after its last: the schema's separators are the ones models write."""
    from memspec.models.tokenizer import Tokenizer

    m = model_store.get("smollm2-135m")
    tok = Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "enum": ["x", "y"]}, "minItems": 1}, "n": {"type": "number"}}, "required": ["name", "tags", "n"],
        "additionalProperties": False}
    g = Grammars(tok, 49152, tok.eos_token_ids).mask(Constraint("json_schema", json.dumps(schema)))
    answer = tok.encode(json.dumps({"name": "Ada", "tags": ["x", "y"], "n": -1.5}))
    for t in answer:
        assert g.allowed()[t], tok.decode([t])
        g.push(t)
    assert g.done
    g.pop(len(answer))
    assert not g.allowed()[tok.encode("[")[0]]  # an object, nothing else


# -- the grammar in the speculative loop, on tiny ONNX models over the 16 letters ----------------
PROMPT = [3, 1, 4, 1, 5]
SMALL = 'start: /[a-e]/ /[c-h]/ /[a-o]*/'  # t1 in a..e (ids 1-5), t2 in c..h (ids 3-8), then anything


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("tiny"), V)


def run(tiny, grammars, params, draft: bool, rng, gamma=3, grammar=SMALL):
    """The loop under the grammar's mask: a generator of committed steps."""
    from memspec.speculation.config import SpecConfig
    from memspec.speculation.metrics import SpecMetrics
    from memspec.speculation.speculative import FixedDraft, NoDraft, speculative_steps

    target, d = tiny
    select = FixedDraft("d", d.begin(64)) if draft else NoDraft()
    mask = grammars.mask(Constraint("grammar", grammar, field="grammar"))
    cfg = SpecConfig(gamma=gamma, adaptive=False)
    return speculative_steps(target, target.new_cache(), PROMPT, select, params, rng, cfg, SpecMetrics(),
                             shaper=mask), mask


def masked_argmax(target, grammars, grammar: str, n: int) -> list[int]:
    """The reference: n tokens of the target's argmax under the grammar's mask, one position at a time."""
    want, c = [], target.new_cache(64)
    ref = grammars.mask(Constraint("grammar", grammar, field="grammar"))
    row = target.forward(c, PROMPT, keep=1)[-1]
    while len(want) < n:
        t = int(ref.shape(row).argmax())
        want.append(t)
        ref.push(t)
        row = target.forward(c, [t], keep=1)[-1]
    return want


def masked_after_first(target, grammars, grammar: str, then: tuple[int, ...] = (),
                       temperature: float = 1.0) -> np.ndarray:
    """(V,) the distribution of the token after the first and `then`, all sampled under the mask:
    sum over t1 of Pm(t1) Pm(t | t1, then), Pm the target's distribution masked and renormalised."""
    from memspec.speculation import sampling

    c = target.new_cache()
    m = grammars.mask(Constraint("grammar", grammar, field="grammar"))
    p1 = sampling.probabilities(m.shape(target.forward(c, PROMPT, keep=1)[-1]), temperature)
    out = np.zeros(V)
    for t1 in np.nonzero(p1)[0]:
        c.truncate(len(PROMPT))
        feed = [int(t1), *then]
        for t in feed:
            m.push(t)
        out += p1[t1] * sampling.probabilities(m.shape(target.forward(c, feed, keep=1)[-1]), temperature)
        m.pop(len(feed))
    return out


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_under_a_grammar_is_the_targets_own_under_it(tiny, grammars, gamma):
    """The draft proposes under the mask and a rejection rolls it back: the output is token for
    token the masked target's argmax, one position at a time."""
    from memspec.request import SamplingParams

    grammar = 'start: /[a-e]/ /[c-h]/ ("ab" | "cd" | /[f-o]/)*'
    got = []
    steps, _ = run(tiny, grammars, SamplingParams(), True, np.random.default_rng(0), gamma, grammar)
    for committed in steps:
        got.extend(committed)
        if len(got) >= 30:
            break
    steps.close()
    want = masked_argmax(tiny[0], grammars, grammar, len(got))
    assert got[:len(want)] == want
    assert want[0] in range(1, 6) and want[1] in range(3, 9)


def test_sampling_under_a_grammar_keeps_the_masked_distribution(tiny, grammars):
    """The second token, drafted and verified under the mask, is distributed as
    P(t2) = sum_t1 Pm(t1) Pm(t2 | t1), Pm the target's distribution masked and renormalised."""
    from test_sampling import chi_square_p

    from memspec.request import SamplingParams

    params = SamplingParams(temperature=1.0)
    p2 = masked_after_first(tiny[0], grammars, SMALL)
    rng = np.random.default_rng(7)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(1500):
        steps, _ = run(tiny, grammars, params, True, rng)
        next(steps)
        counts[next(steps)[0]] += 1  # the first token the draft-and-verify step commits
        steps.close()
    assert set(np.nonzero(p2)[0]) == set(range(3, 9))
    assert chi_square_p(counts, p2) > 1e-3


def test_batched_requests_under_schemas_get_their_solo_answers(model_store):
    """Continuous batching shares only the target pass: each request's loop runs its own mask, so
    constrained requests batched together (a free one beside them) answer as they do alone."""
    import threading

    from memspec.request import GenerationRequest
    from memspec.runtime.config import SessionConfig
    from memspec.build import load_pool
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    cfg = SessionConfig(max_context=256, backend="onnxruntime")  # the batched graph
    target = load_target(model_store, "smollm2-135m", "q4", cfg)
    pool = DraftPool(load_pool(model_store, "smollm2-135m", target.session.vocab_size, cfg))
    solo, batched = Engine(target, drafts=pool), Engine(target, drafts=pool, batched=open_batched(target.session, 3))
    colors = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                          "minItems": 1, "maxItems": 3}}, "required": ["colors"]}
    reqs = [GenerationRequest(prompt="Name some colors as JSON.", max_tokens=24, draft="draft-chat",
                              constraint=Constraint("json_schema", json.dumps(colors))),
            GenerationRequest(prompt="Is water wet?", max_tokens=8, draft="prompt-lookup",
                              constraint=Constraint("grammar", 'root ::= ("yes" | "no") "!"', field="grammar")),
            GenerationRequest(prompt="A person as JSON.", max_tokens=24, draft="none",
                              constraint=Constraint("json_object")),
            GenerationRequest(prompt="Name three colors.", max_tokens=16, draft="draft-chat")]
    expected = [solo.generate(r) for r in reqs]
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, batched.generate(reqs[i])))
               for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i].token_ids for i in range(len(reqs))] == [e.token_ids for e in expected]
    assert json.loads(expected[0].text)["colors"] and expected[1].text in ("yes!", "no!")
    assert batched.batch.report()["passes"] > 0
    batched.close()
    # a grammar complete on the last token max_tokens allows is a finished answer, not a cut one
    short = solo.generate(GenerationRequest(prompt="Is water wet?", max_tokens=1, constraint=Constraint(
        "grammar", 'root ::= "yes" | "no"', field="grammar")))
    assert short.text in ("yes", "no") and short.finish_reason == "stop"


# -- tokens the grammar forces: proposed without a draft -------------------------------------------
FORCING = 'start: /[a-e]/ "fgh" /[a-o]/ "ij" /[a-o]*/'  # after t1: f g h forced; after t5: i j forced


def test_the_mask_says_which_tokens_the_grammar_forces(grammars):
    m = grammars.mask(Constraint("grammar", FORCING, field="grammar"))
    assert m.forced_tokens(8) == []  # the first letter is free
    m.push(2)
    assert m.forced_tokens(8) == [6, 7, 8] and m.forced_tokens(2) == [6, 7]
    for t in (6, 7, 8, 1):
        m.push(t)
    assert m.forced_tokens(8) == [9, 10]
    m.pop(4)
    assert m.forced_tokens(8) == [6, 7, 8]  # rolled back with the rest


@pytest.mark.parametrize("draft", [False, True])
def test_forced_tokens_are_verified_in_one_pass_and_the_answer_is_the_targets_own(tiny, grammars, draft):
    """With a draft and without one, the grammar's forced runs go to the target as one proposal
    each; the output is still the masked target's argmax one position at a time."""
    from memspec.request import SamplingParams
    from memspec.speculation.config import SpecConfig
    from memspec.speculation.metrics import SpecMetrics
    from memspec.speculation.speculative import FixedDraft, NoDraft, speculative_steps

    target, d = tiny
    metrics = SpecMetrics()
    mask = grammars.mask(Constraint("grammar", FORCING, field="grammar"))
    select = FixedDraft("d", d.begin(64)) if draft else NoDraft()
    steps = speculative_steps(target, target.new_cache(), PROMPT, select, SamplingParams(), np.random.default_rng(0),
                              SpecConfig(gamma=3, adaptive=False), metrics, shaper=mask)
    got, counts = [], []
    for committed in steps:
        got.extend(committed)
        counts.append(len(committed))
        if len(got) >= 20:
            break
    steps.close()
    want = masked_argmax(target, grammars, FORCING, len(got))
    assert got == want and got[1:4] == [6, 7, 8] and got[5:7] == [9, 10]
    assert counts[1] == 4  # f g h and the token after them: one pass
    assert metrics.forced_steps == 2 and metrics.forced_tokens == metrics.forced_accepted == 5
    if not draft:
        assert metrics.num_drafts == 0  # the forced runs are not counted as a draft's
    stats = metrics.freeze()
    assert (stats.forced_steps, stats.forced_tokens, stats.forced_accepted) == (2, 5, 5)


def test_sampling_after_a_forced_run_keeps_the_masked_distribution(tiny, grammars):
    """The token after a forced run, sampled in the pass that verifies the run, is distributed as
    P(t5) = sum_t1 Pm(t1) Pm(t5 | t1 f g h)."""
    from test_sampling import chi_square_p

    from memspec.request import SamplingParams
    from memspec.speculation.config import SpecConfig
    from memspec.speculation.metrics import SpecMetrics
    from memspec.speculation.speculative import NoDraft, speculative_steps

    target = tiny[0]
    want = masked_after_first(target, grammars, FORCING, then=(6, 7, 8))
    rng = np.random.default_rng(11)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(1500):
        mask = grammars.mask(Constraint("grammar", FORCING, field="grammar"))
        steps = speculative_steps(target, target.new_cache(), PROMPT, NoDraft(), SamplingParams(temperature=1.0), rng,
                                  SpecConfig(gamma=3, adaptive=False), SpecMetrics(), shaper=mask)
        next(steps)
        run = next(steps)  # f g h and the token after them
        assert run[:3] == [6, 7, 8]
        counts[run[3]] += 1
        steps.close()
    assert chi_square_p(counts, want) > 1e-3


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_coupled_sampling_after_a_forced_run_keeps_the_masked_distribution_and_the_target_only_answer(
        tiny, grammars, temperature):
    """Coupled noise over 1500 seeds: the token after a forced run is distributed as the masked
    target's, and for each seed the answer with the draft is the target-only answer.  (Seeds
    0..1499 give p = 1e-4 at 0.7 here; the same draws from the exact distributions, outside the
    loop, give p = 0.7 over seeds 0..39999 and 0.06 over 10^6..10^6+39999: a low draw of a fixed
    set of seeds, not a bias, which is why these start at 20000.)"""
    from test_sampling import chi_square_p

    from memspec.request import SamplingParams
    from memspec.speculation import sampling

    params = SamplingParams(temperature=temperature)
    want = masked_after_first(tiny[0], grammars, FORCING, then=(6, 7, 8), temperature=temperature)
    counts = np.zeros(V, dtype=np.int64)
    for seed in range(20_000, 21_500):
        answers = []
        for draft in ((False, True) if seed < 20_100 else (False,)):
            steps, _ = run(tiny, grammars, params, draft, sampling.Coupled(seed, len(PROMPT)), grammar=FORCING)
            got = []
            for committed in steps:
                got.extend(committed)
                if len(got) >= 8:
                    break
            steps.close()
            answers.append(got[:8])
        assert answers[0][1:4] == [6, 7, 8] and all(a == answers[0] for a in answers), (seed, answers)
        counts[answers[0][4]] += 1
    assert chi_square_p(counts, want) > 1e-3
