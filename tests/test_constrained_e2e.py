"""Constrained decoding end to end: JSON schemas, JSON mode, grammars and tool calls through the
real daemon and model (`memspec serve --http`), with the official `openai` SDK and gRPC."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import grpc
import openai
import pytest

from test_daemon_e2e import Daemon
from test_http_e2e import MODEL, grpc_text

from memspec.request import Constraint, GenerationRequest
from memspec.serving import wire

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "address"], "additionalProperties": False}
COLORS = {"type": "object", "properties": {
    "colors": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 3}},
    "required": ["colors"], "additionalProperties": False}
MOOD = {"type": "object", "properties": {
    "mood": {"enum": ["happy", "sad", "calm"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["mood", "score", "ratio"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid(schema: dict, value) -> bool:
    """The schema keywords these tests use, checked by hand (jsonschema is not a dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", ())) <= set(value)
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(valid(props[k], v) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
                and all(valid(schema["items"], v) for v in value))
    if kind == "string":
        return (isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
                and re.search(schema.get("pattern", ""), value) is not None)
    if kind in ("integer", "number"):
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and (kind == "number" or isinstance(value, int))
                and schema.get("minimum", -1e308) <= value <= schema.get("maximum", 1e308))
    return False


@pytest.fixture(scope="module")
def daemon(model_store):
    with tempfile.TemporaryDirectory(prefix="ms-cd-") as d:
        dm = Daemon(Path(d), model_store.home, name="c")
        dm.args = ["--http", "127.0.0.1:0"]
        dm.start()
        yield dm
        dm.stop()


@pytest.fixture(scope="module")
def grpc_client(daemon):
    with daemon.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(grpc_client):
    return openai.OpenAI(base_url=f"http://{grpc_client.status()['http_listen']}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("name,schema,question", [
    ("person", PERSON, "Invent a person and their address as JSON."),
    ("colors", COLORS, "Name some colors as JSON."),
    ("mood", MOOD, "How do you feel today? Answer as JSON."),
])
def test_answers_validate_against_the_schema_and_drafts_change_nothing(sdk, name, schema, question):
    answers = {}
    for draft in ("none", "draft-chat", "prompt-lookup"):
        out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          max_tokens=64, response_format=schema_format(name, schema),
                                          extra_body={"memspec": {"draft": draft}})
        answers[draft] = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", answers[draft]  # the grammar completed
        assert valid(schema, json.loads(answers[draft])), answers[draft]
        ms = out.model_extra["memspec"]  # an object's keys are forced: proposed without a draft, accepted
        assert 0 < ms["forced_accepted"] <= ms["forced_tokens"] < out.usage.completion_tokens, ms
    assert len(set(answers.values())) == 1, answers  # greedy: the target's own answer under the schema


def test_json_mode_streams_what_it_answers_and_grpc_agrees(sdk, grpc_client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
               max_tokens=64, response_format={"type": "json_object"})
    whole = sdk.chat.completions.create(**ask).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(**ask, stream=True)
                       if c.choices)
    assert whole.finish_reason == "stop" and isinstance(json.loads(whole.message.content), dict)
    assert streamed == whole.message.content
    req = GenerationRequest(messages=(("user", "Give a JSON object with a name and an age."),), max_tokens=64,
                            constraint=Constraint("json_object", field="json_object"))
    assert grpc_text(grpc_client, req) == whole.message.content


def test_a_gbnf_grammar_holds_the_answer_to_its_words(sdk):
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                      max_tokens=16, extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert out.choices[0].message.content in ("yes.", "no.") and out.choices[0].finish_reason == "stop"


def test_a_forced_call_parses_whole_and_streamed_alike(sdk):
    ask = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=64, tools=[WEATHER, TIME],
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = sdk.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert valid(WEATHER["function"]["parameters"], json.loads(call.function.arguments))

    chunks = list(sdk.chat.completions.create(**ask, stream=True))
    name, args, ids = "", "", set()
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            assert d.index == 0
            ids.add(d.id) if d.id else None
            name += d.function.name or ""
            args += d.function.arguments or ""
    assert (name, args) == (call.function.name, call.function.arguments) and len(ids) == 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools(sdk):
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What time is it?"}],
                                      max_tokens=64, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    call = out.message.tool_calls[0].function
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.name]
    assert out.finish_reason == "tool_calls" and valid(tool["function"]["parameters"], json.loads(call.arguments))


def test_a_history_of_calls_and_results_is_answered(sdk):
    history = [*ASK_WEATHER,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    out = sdk.chat.completions.create(model=MODEL, messages=history, max_tokens=24, tools=[WEATHER]).choices[0]
    assert out.finish_reason in ("stop", "length", "tool_calls")
    assert out.message.content or out.message.tool_calls


BAD = [  # (what, extra request fields, the param the 400 names, a word of its message)
    ("an invalid schema", dict(response_format=schema_format("x", {"type": "strin"})),
     "response_format.json_schema.schema", "strin"),
    ("a keyword llguidance does not implement", dict(response_format=schema_format("x", {"not": {"type": "string"}})),
     "response_format.json_schema.schema", "Unimplemented"),
    ("a grammar that does not parse", dict(extra_body={"grammar": "root ::= undefined_rule"}), "grammar",
     "undefined_rule"),
    ("a tool without a name", dict(tools=[{"type": "function", "function": {"parameters": {}}}]),
     "tools[0].function.name", "required"),
    ("a tool with an invalid schema", dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]),
     "tools[0].function.parameters", "nope"),
]


@pytest.mark.parametrize("what,fields,param,word", BAD, ids=[b[0] for b in BAD])
def test_bad_schemas_grammars_and_tools_are_400s_naming_the_field(sdk, what, fields, param, word):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4, **fields)
    assert info.value.param == param and word in info.value.message, info.value.body
    assert sdk.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2).choices  # still serving


@pytest.mark.parametrize("field,value", [("json_schema", '{"type": "strin"}'), ("grammar", "start: nothing_here")])
def test_bad_schemas_and_grammars_are_invalid_argument_on_grpc(grpc_client, field, value):
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_client._stub.Generate(wire.pb2.GenerateRequest(prompt="hi", max_tokens=4, **{field: value}),
                                        timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(f"{field}: ")
    assert grpc_text(grpc_client, GenerationRequest(prompt="hi", max_tokens=2))  # still serving


def test_a_forced_call_over_grpc_is_the_http_call(sdk, grpc_client):
    """gRPC carries tools and tool_choice too; the answer's text is the call as the model writes it."""
    from memspec.models.tools import parse_calls
    from memspec.request import Tool

    fn = WEATHER["function"]
    req = GenerationRequest(messages=(("user", ASK_WEATHER[0]["content"]),), max_tokens=64,
                            tools=(Tool(fn["name"], fn["description"], json.dumps(fn["parameters"])),),
                            tool_choice="function:get_weather")
    content, calls = parse_calls(grpc_text(grpc_client, req))
    http = sdk.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=64, tools=[WEATHER],
                                       tool_choice="required").choices[0].message.tool_calls[0].function
    assert content == "" and [(c.name, c.arguments) for c in calls] == [(http.name, http.arguments)]
