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
