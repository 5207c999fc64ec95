"""Request values parsed at the boundary: policy names and the one message for each unknown name."""

from __future__ import annotations

import pytest

from memspec.errors import InvalidRequestError
from memspec.request import KEEP_FOREVER, PolicyName, parse_keep_alive, unknown_draft, unknown_policy


@pytest.mark.parametrize("text,kind,draft", [
    ("target-only", "target-only", None), ("bandit", "bandit", None), ("memspec", "memspec", None),
    ("oracle", "oracle", None), ("fixed:draft-code", "fixed", "draft-code"), ("fixed:a:b", "fixed", "a:b"),
])
def test_a_policy_is_parsed_once_into_its_kind_and_draft(text, kind, draft):
    name = PolicyName.parse(text)
    assert (name.kind, name.draft) == (kind, draft)
    assert str(name) == text and PolicyName.parse(str(name)) == name


@pytest.mark.parametrize("text", ["", "fastest", "fixed", "fixed:", "bandit:x", "Memspec", "target-only:d"])
def test_a_policy_nobody_runs_is_refused_with_what_may_be_asked_for(text):
    with pytest.raises(InvalidRequestError) as e:
        PolicyName.parse(text, "policies")
    assert str(e.value) == (f"policies: unknown policy {text!r}; "
                            "known: target-only, fixed:<draft>, bandit, memspec, oracle")


def test_a_named_draft_is_its_fixed_policy():
    assert PolicyName.of_draft("none") == PolicyName("target-only")
    assert PolicyName.of_draft("draft-code") == PolicyName.parse("fixed:draft-code")


def test_the_unknown_messages_name_the_field_and_what_there_is():
    assert str(unknown_draft("x", {"b": 1, "a": 2})) == "draft: unknown draft 'x'; available: none, a, b"
    assert str(unknown_draft("x", [], "policy")) == "policy: unknown draft 'x'; available: none"
    assert str(unknown_policy("memspec", ["target-only", "fixed:a"])) == \
        "policy: unknown policy 'memspec'; known: target-only, fixed:a"


def test_a_client_string_is_quoted_short_in_messages():
    from memspec.request import quote

    assert quote("draft-code") == "'draft-code'"
    long = quote("y" * 5000)
    assert long.startswith("'" + "y" * 64 + "'") and long.endswith("(5000 characters)") and len(long) < 100
    assert len(str(unknown_draft("z" * 10**6, ["a"]))) < 200


def test_draft_and_policy_names_have_a_length_limit():
    from memspec.request import GenerationRequest, Limits, validate

    validate(GenerationRequest(prompt="hi", draft="d" * 128))
    with pytest.raises(InvalidRequestError, match=r"^draft: a name of 129 characters; at most 128$"):
        validate(GenerationRequest(prompt="hi", draft="d" * 129))
    with pytest.raises(InvalidRequestError, match=r"^policy: a name of 20 characters; at most 10$"):
        validate(GenerationRequest(prompt="hi", policy=PolicyName("fixed", "p" * 20)), Limits(max_name_chars=10))


@pytest.mark.parametrize("value,seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), ("300ms", 0.3), ("1.5h", 5400.0), (0, 0.0), ("0", 0.0),
    (30, 30.0), (2.5, 2.5), ("45", 45.0), (-1, KEEP_FOREVER), ("-1m", KEEP_FOREVER), ("-1", KEEP_FOREVER),
])
def test_keep_alive_reads_as_ollama_reads_it(value, seconds):
    """A number is seconds, a string a Go duration (a bare number too); negative keeps it loaded."""
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "5 m", "m", "", "5x", "nan", True, None, [1]])
def test_a_keep_alive_that_is_no_duration_names_the_field(value):
    with pytest.raises(InvalidRequestError, match=r"^keep_alive: "):
        parse_keep_alive(value)


# -- output controls ------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling,field", [
    (dict(frequency_penalty=2.01), "frequency_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=1e9), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.01), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(logit_bias=((5, 100.5),)), "logit_bias"), (dict(logit_bias=((5, float("nan")),)), "logit_bias"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias"), (dict(logit_bias=(("5", 1.0),)), "logit_bias"),
    (dict(logit_bias=((5, 1.0), (5, 2.0))), "logit_bias"), (dict(logit_bias=((5, "big"),)), "logit_bias"),
])
def test_an_output_control_out_of_range_names_its_field(sampling, field):
    from memspec.request import GenerationRequest, SamplingParams, validate

    with pytest.raises(InvalidRequestError, match=rf"^{field}: "):
        validate(GenerationRequest(prompt="hi", sampling=SamplingParams(**sampling)))


def test_output_controls_in_range_pass_and_logit_bias_ids_are_checked_against_the_vocabulary():
    from memspec.request import GenerationRequest, SamplingParams, check_logit_bias, validate

    ok = SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1.3, min_p=1.0,
                        logit_bias=((0, -100.0), (49151, 100)))
    validate(GenerationRequest(prompt="hi", sampling=ok))
    check_logit_bias(ok.logit_bias, 49152)
    with pytest.raises(InvalidRequestError, match=r"logit_bias: token id 49151 is outside the vocabulary \(0..49150\)"):
        check_logit_bias(ok.logit_bias, 49151)
