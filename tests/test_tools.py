"""Tool calls in Qwen2.5's convention (memspec.models.tools): the prompt, the grammar of a forced
call, and reading calls back, whole and streamed."""

from __future__ import annotations

import json

import pytest

from memspec.errors import InvalidRequestError
from memspec.models import tools
from memspec.request import Constraint, GenerationRequest, Tool, validate

WEATHER = Tool("get_weather", "The weather in a city", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}))
TIME = Tool("get_time", "", json.dumps({"type": "object", "properties": {"zone": {"type": "string"}},
                                        "required": ["zone"], "additionalProperties": False}))
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": tools.call_text("get_weather", '{"city": "Paris", "unit": "C"}')},
         {"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": '{"temp": 22}'}]


def tokenizer(store, name):
    from memspec.models.tokenizer import Tokenizer

    m = store.get(name)
    return Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")


def test_written_out_tools_read_as_qwens_template_writes_them(qwen_store):
    """For a template that does not know tools, prompt_turns writes the very text Qwen2.5's writes."""
    tok = tokenizer(qwen_store, "qwen2.5-coder-1.5b")
    listed = [tools.tool_json(t) for t in (WEATHER, TIME)]
    assert tok.template_knows_tools
    native = tok.apply_chat_template(tools.prompt_turns(TURNS, listed, True), tools=listed)
    written = tok.apply_chat_template(tools.prompt_turns(TURNS, listed, False))
    assert written == native
    assert "<tools>\n" + json.dumps(listed[0]) in native and "<tool_response>\n{\"temp\": 22}" in native


def test_a_template_without_tools_gets_them_in_the_system_turn(model_store):
    tok = tokenizer(model_store, "smollm2-135m")
    assert not tok.template_knows_tools
    text = tok.apply_chat_template(tools.prompt_turns(TURNS[1:], [tools.tool_json(WEATHER)], False))
    assert text.startswith("<|im_start|>system\n# Tools\n") and "<|im_start|>tool" not in text
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 2


def test_calls_are_read_out_of_an_answer():
    weather = tools.call_text("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
    as_string = json.dumps({"name": "get_time", "arguments": json.dumps({"zone": "CET"})})
    answer = (f"Let me check.\n{weather}\n<tool_call>\nnot json\n</tool_call>\n"
              f"<tool_call>\n{as_string}\n</tool_call>")
    content, calls = tools.parse_calls(answer)
    assert calls == [tools.ToolCall("get_weather", '{"city": "Paris", "unit": "C"}'),
                     tools.ToolCall("get_time", '{"zone": "CET"}')]  # arguments given as a string, too
    assert content == "Let me check.\n\n<tool_call>\nnot json\n</tool_call>"
    assert tools.parse_calls("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_text_splits_into_the_same_content_and_calls(size):
    call = tools.call_text("get_time", json.dumps({"zone": "UTC"}))
    answer = f"Sure <tool_ <{call} done <tool_call> unclosed"
    stream = tools.CallStream()
    items = [x for i in range(0, len(answer), size) for x in stream.feed(answer[i:i + size])]
    text = "".join(x for x in items if isinstance(x, str)) + stream.flush()
    assert [x for x in items if isinstance(x, tools.ToolCall)] == tools.parse_calls(answer)[1]
    assert text == answer.replace(call, "")


def test_a_forced_call_walks_through_its_grammar(model_store):
    """A call of the named tool with valid arguments is what the grammar allows, token by token;
    another tool's name is not."""
    from memspec.speculation.grammar import Grammars

    tok = tokenizer(model_store, "smollm2-135m")
    grammars = Grammars(tok, 49152, tok.eos_token_ids)
    call = tok.encode(tools.call_text("get_weather", '{"city": "Oslo", "unit": "F"}'))
    g = grammars.mask(Constraint("grammar", tools.call_grammar((WEATHER, TIME), "get_weather"), field="tool_choice"))
    for t in call:
        assert g.allowed()[t], tok.decode([t])
        g.push(t)
    assert g.done
    other = grammars.mask(Constraint("grammar", tools.call_grammar((WEATHER, TIME), "get_time"), field="tool_choice"))
    pushed = 0
    for t in call:
        if not other.allowed()[t]:
            break
        other.push(t)
        pushed += 1
    assert pushed < len(call) and "get_" in tok.decode(call[:pushed + 1])  # refused at the name


def test_tool_requests_are_checked_at_the_boundary():
    ask = dict(messages=(("user", "hi"),), tools=(WEATHER,))
    validate(GenerationRequest(**ask, tool_choice="function:get_weather"))
    for bad, field in [(dict(tools=(Tool(""),)), r"tools\[0\]\.function\.name"),
                       (dict(tools=(WEATHER, WEATHER)), r"tools\[1\]\.function\.name: 'get_weather' is given twice"),
                       (dict(tool_choice="function:nope"), r"tool_choice\.function\.name: 'nope' is not one of"),
                       (dict(tool_choice="sometimes"), "tool_choice"),
                       (dict(tool_choice="required", constraint=Constraint("json_object")),
                        "tool_choice: .*response_format")]:
        with pytest.raises(InvalidRequestError, match=f"^{field}"):
            validate(GenerationRequest(**{**ask, **bad}))
    with pytest.raises(InvalidRequestError, match="^tool_choice: 'required' needs tools"):
        validate(GenerationRequest(messages=(("user", "hi"),), tool_choice="required"))


BARE = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


@pytest.mark.parametrize("answer", [BARE, '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                    '  ```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'])
def test_an_answer_that_is_one_bare_call_of_an_offered_tool_is_that_call(answer):
    """Qwen2.5-Coder, not forced, writes a call as bare or fenced JSON (as Ollama reads it too)."""
    call = tools.ToolCall("get_weather", '{"city": "Paris"}')
    assert tools.parse_calls(answer, {"get_weather"}) == ("", [call])
    assert tools.parse_calls(answer) == (answer, [])  # no tools offered: text
    assert tools.parse_calls(answer, {"get_time"}) == (answer, [])  # a tool not offered: text
    for size in (1, 4, 1000):
        stream = tools.CallStream({"get_weather"})
        held = [x for i in range(0, len(answer), size) for x in stream.feed(answer[i:i + size])]
        assert held == [] and stream.finish() == [call] and stream.calls == 1


@pytest.mark.parametrize("answer", ['```python\nprint("hi")\n```', '{"city": "Paris"} is the JSON.',
                                    BARE + "\nThat is the call.", "Sure: " + BARE, "```\nls -l\n```"])
def test_other_answers_stream_as_they_are_with_tools_offered(answer):
    """Text that is not one bare call comes back whole; a code fence of another language is not
    held back past its first line."""
    for size in (1, 3, 1000):
        stream = tools.CallStream({"get_weather"})
        items = [x for i in range(0, len(answer), size) for x in stream.feed(answer[i:i + size])]
        items += stream.finish()
        assert "".join(items) == answer and stream.calls == 0
        assert tools.parse_calls(answer, {"get_weather"}) == (answer, [])
    stream = tools.CallStream({"get_weather"})
    assert stream.feed('```python\nprint("hi")\n')  # released once the fence's first line shows it is code
