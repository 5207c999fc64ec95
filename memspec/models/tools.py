"""Tool calls in Qwen2.5's chat convention (the Hermes format its template writes).

The tools are listed in the system turn, one JSON object a line inside <tools></tools>; the
model calls one by answering

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a tool's result comes back as a user turn inside <tool_response></tool_response>.  A template
that knows tools (Qwen2.5's) renders them itself (`prompt_turns` leaves them to it); for one that
does not (SmolLM2's) `prompt_turns` writes the same text into plain system and user turns.

`call_grammar` is the Lark grammar (llguidance's, with %json) of a forced call: one call block,
its name one of the tools and its arguments valid against that tool's parameters schema.
`parse_calls` and `CallStream` read calls back out of an answer, whole or as it streams.  Given the
offered tools' names, they also read an answer that is nothing but a call written as bare JSON,
fenced or not (```json {"name": ..., "arguments": {...}} ```): Qwen2.5-Coder writes calls so when
it is not forced, and Ollama reads such an answer as a call too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from memspec.request import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}}\n</tool_call>")  # the double braces are Qwen2.5's own
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


def tool_json(t: Tool) -> dict:
    """A tool as OpenAI writes it, which is how Qwen2.5's template lists it."""
    function = {"name": t.name}
    if t.description:
        function["description"] = t.description
    function["parameters"] = json.loads(t.parameters)
    return {"type": "function", "function": function}


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (an assistant turn of the history carries its calls so)."""
    args = json.dumps(json.loads(arguments), ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def prompt_turns(turns: list[dict], tools: list[dict] | None, template_knows_tools: bool) -> list[dict]:
    """The chat turns for the template: as they are where the template renders tools and tool
    turns itself; else the tools appended to the system turn (one made if there is none) and
    each run of tool turns made one user turn of <tool_response> blocks, as Qwen2.5's does."""
    if template_knows_tools:
        return turns
    out: list[dict] = []
    if tools:
        listing = _TOOLS_INTRO + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + _TOOLS_OUTRO
        if turns and turns[0]["role"] == "system":
            out.append({"role": "system", "content": turns[0]["content"] + "\n\n" + listing})
            turns = turns[1:]
        else:
            out.append({"role": "system", "content": listing})
    for t in turns:
        if t["role"] != "tool":
            out.append(t)
            continue
        block = f"<tool_response>\n{t['content']}\n</tool_response>"
        if out and out[-1].get("tool_responses"):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
        else:
            out.append({"role": "user", "content": block, "tool_responses": True})
    return [{"role": t["role"], "content": t["content"]} for t in out]


def call_grammar(tools: tuple[Tool, ...], name: str | None = None) -> str:
    """The Lark grammar of exactly one call of tool `name` (any of `tools` when None), its
    arguments valid against the tool's parameters."""
    chosen = [t for t in tools if name is None or t.name == name]
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = {"anyOf": options} if len(options) > 1 else options[0]
    # the JSON as the model writes it (memspec.speculation.grammar.JSON_OPTIONS)
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}\n"


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n(.*?)\n?```\Z", re.DOTALL)


def bare_call(text: str, names: frozenset[str] | set[str]) -> ToolCall | None:
    """The call an answer makes when the whole answer is one JSON object, fenced or not, naming
    one of the offered tools (`names`); None otherwise."""
    body = text.strip()
    fenced = _FENCE.match(body)
    call = _call(fenced.group(1).strip() if fenced else body) if body else None
    return call if call is not None and call.name in names else None


def parse_calls(text: str, names: frozenset[str] | set[str] = frozenset()) -> tuple[str, list[ToolCall]]:
    """(the text outside the call blocks, the calls) of an answer; a block that is not a call
    (no JSON object with a name) stays in the text.  names: the offered tools, for an answer that
    is one bare call (bare_call)."""
    call = bare_call(text, names) if OPEN not in text else None
    if call is not None:
        return "", [call]
    calls, kept, pos = [], [], 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


class CallStream:
    """Splits streamed text into content and calls: text that may begin a call block is held
    back until the block closes (a call) or proves not to be one (content).  Given the offered
    tools' names, an answer that begins as bare JSON ("{", or a fence of ```json or ```) is held
    whole until the end, where finish() reads it as one call (bare_call) or gives it back."""

    def __init__(self, names: frozenset[str] | set[str] = frozenset()):
        self.pending = ""
        self.calls = 0  # calls found so far
        self.names = names
        self.holding = bool(names)  # still at the answer's start: it may be one bare call

    def _may_be_bare(self) -> bool:
        if OPEN in self.pending:
            return False
        head = self.pending.lstrip()
        if not head or head.startswith("{"):
            return True
        first, newline, _ = head.partition("\n")
        first = first.rstrip()
        # a fence's first line not whole yet may still become ```json; a whole one must be it
        return first in ("```", "```json") if newline else "```json".startswith(first)

    def feed(self, text: str) -> list[str | ToolCall]:
        self.pending += text
        if self.holding:
            if self._may_be_bare():
                return []
            self.holding = False
        out: list[str | ToolCall] = []
        while self.pending:
            start = self.pending.find(OPEN)
            if start < 0:  # keep a tail that could be the start of OPEN
                keep = next((n for n in range(min(len(OPEN) - 1, len(self.pending)), 0, -1)
                             if OPEN.startswith(self.pending[-n:])), 0)
                cut = len(self.pending) - keep
                if cut:
                    out.append(self.pending[:cut])
                self.pending = self.pending[cut:]
                break
            if start:
                out.append(self.pending[:start])
                self.pending = self.pending[start:]
            end = self.pending.find(CLOSE)
            if end < 0:
                break  # an open block: wait for the rest
            block, self.pending = self.pending[:end + len(CLOSE)], self.pending[end + len(CLOSE):]
            call = _call(block[len(OPEN):-len(CLOSE)].strip())
            if call is None:
                out.append(block)
            else:
                self.calls += 1
                out.append(call)
        return out

    def flush(self) -> str:
        """What is still held back at the end (an unclosed block): content after all."""
        rest, self.pending = self.pending, ""
        return rest

    def finish(self) -> list[str | ToolCall]:
        """At the end: an answer held whole that is one bare call, as that call; else what is
        still held back, as content."""
        if self.holding:
            self.holding = False
            call = bare_call(self.pending, self.names)
            if call is not None:
                self.pending = ""
                self.calls += 1
                return [call]
            return [p for p in self.feed("") + [self.flush()] if p]
        rest = self.flush()
        return [rest] if rest else []
