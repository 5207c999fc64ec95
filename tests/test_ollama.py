"""Ollama's API in process, through the official `ollama` Python client, over the fake engine of
test_server (it answers with the prompt's words reversed): chat and generate whole and streamed,
options, format, tools, the model routes, loads and unloads, errors in Ollama's shape, the key,
and CORS.  tests/test_ollama_e2e.py runs the same client against the real daemon and model."""

from __future__ import annotations

import json

import ollama
import pytest

from test_http import f, make  # noqa: F401 (fixtures: the in-process front of test_http)

from memspec.config import HttpConfig, load_config
from memspec.errors import ConfigError
from memspec.serving.ollama import model_name

KEY = "sk-test-key"


@pytest.fixture
def client(f):
    return ollama.Client(host=f"http://127.0.0.1:{f.port}", timeout=10)


def ask(content="one two three"):
    return [{"role": "user", "content": content}]


def test_chat_whole_and_streamed_agree_with_counts_durations_and_memspec_stats(client, f):
    whole = client.chat(model="tiny:latest", messages=ask(), options={"num_predict": 4})
    assert whole.model == "tiny:latest" and whole.done and whole.done_reason == "length"
    assert whole.message.role == "assistant" and whole.message.content == "three two one three "
    assert whole.prompt_eval_count == 3 and whole.eval_count == 4
    assert whole.total_duration >= whole.load_duration >= 0 and whole.prompt_eval_duration == 1_000_000
    raw = f.post({"model": "tiny", "messages": ask(), "stream": False, "options": {"num_predict": 4}},
                 path="/api/chat")[2]  # the client's types drop fields Ollama does not have
    assert raw["memspec"]["model"] == "tiny" and raw["memspec"]["draft"] == "" and "num_drafts" in raw["memspec"]
    parts = list(client.chat(model="tiny", messages=ask(), options={"num_predict": 4}, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 4
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert len(parts) >= 5


def test_generate_whole_streamed_with_a_system_turn_and_raw(client, f):
    whole = client.generate(model="tiny", prompt="a b", options={"num_predict": 3})
    assert whole.response == "b a b " and whole.done and whole.eval_count == 3
    assert f.h.engine.requests[-1].messages == (("user", "a b"),)
    streamed = list(client.generate(model="tiny", prompt="a b", system="be brief", options={"num_predict": 3},
                                    stream=True))
    assert "".join(p.response for p in streamed) == "b a b " and streamed[-1].done
    assert f.h.engine.requests[-1].messages == (("system", "be brief"), ("user", "a b"))
    client.generate(model="tiny", prompt="x y", raw=True, options={"num_predict": 1})
    req = f.h.engine.requests[-1]
    assert req.raw and req.prompt == "x y"


def test_options_reach_the_request_under_memspec_names(client, f):
    client.chat(model="tiny", messages=ask(), options={
        "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "seed": 42, "num_predict": 2, "stop": ["zz"],
        "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_ctx": 4096,
        "num_thread": 2, "mirostat": 0})
    req = f.h.engine.requests[-1]
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (0.7, 5, 0.9, 0.05, 42)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.5, 0.25)
    assert req.max_tokens == 2 and req.stop == ("zz",)
    client.chat(model="tiny", messages=ask(), options={"num_predict": -1, "seed": -1})  # Ollama's defaults
    req = f.h.engine.requests[-1]
    assert req.max_tokens == f.h.backend.config.limits.max_tokens and req.sampling.seed is None


def test_a_sampled_answer_reports_its_seed_and_that_seed_replays_it_whole_and_streamed(f):
    """Issue 68: options.seed unset or -1 draws a fresh seed, reported in the `memspec` object (the
    last line, streamed); sent back as options.seed it gives the same answer.  Greedy: null."""
    def piece(line):
        return line["message"]["content"] if "message" in line else line["response"]

    def answer(path, options, stream):
        """(the answer, the seed its memspec object reports), over raw HTTP: the client drops `memspec`."""
        asked = {"messages": ask("a b c d e f g")} if path == "/api/chat" else {"prompt": "a b c d e f g"}
        body = {"model": "tiny", "stream": stream, "options": {"num_predict": 5, **options}, **asked}
        if not stream:
            out = f.post(body, path=path)[2]
            return piece(out), out["memspec"]["seed"]
        lines = [json.loads(line) for line in f.request("POST", path, body)[2].splitlines()]
        return "".join(piece(x) for x in lines), lines[-1]["memspec"]["seed"]

    for path in ("/api/chat", "/api/generate"):
        for stream in (False, True):
            for unset in ({}, {"seed": -1}):
                text, seed = answer(path, {"temperature": 0.8, **unset}, stream)
                assert isinstance(seed, int) and 0 <= seed < 2**53, seed
                assert answer(path, {"temperature": 0.8, "seed": seed}, stream) == (text, seed)
                assert f.h.engine.requests[-1].sampling.seed == seed
            assert answer(path, {"temperature": 0.8, "seed": 42}, stream)[1] == 42
            assert answer(path, {}, stream)[1] is None  # greedy: no randomness


def test_format_json_and_a_schema_constrain_the_answer(client, f):
    client.chat(model="tiny", messages=ask(), format="json", options={"num_predict": 1})
    c = f.h.engine.requests[-1].constraint
    assert (c.kind, c.field) == ("json_object", "format")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    client.generate(model="tiny", prompt="a", format=schema, options={"num_predict": 1})
    c = f.h.engine.requests[-1].constraint
    assert (c.kind, json.loads(c.text), c.field) == ("json_schema", schema, "format")


TOOL = {"type": "function", "function": {"name": "f", "description": "a tool",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


def test_a_call_comes_back_as_tool_calls_with_arguments_as_an_object_whole_and_streamed(client, f):
    call = json.dumps({"name": "f", "arguments": {"a": 1}}, separators=(",", ":"))
    messages = ask(f"</tool_call> {call} <tool_call> Sure,")
    whole = client.chat(model="tiny", messages=messages, tools=[TOOL], options={"num_predict": 4})
    assert whole.message.content == "Sure,"
    [c] = whole.message.tool_calls
    assert c.function.name == "f" and c.function.arguments == {"a": 1}
    parts = list(client.chat(model="tiny", messages=messages, tools=[TOOL], options={"num_predict": 4}, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", {"a": 1})]
    assert "".join(p.message.content for p in parts).strip() == "Sure,"
    # the call and its result in the history, as Ollama's clients send them back
    history = [*messages, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                            "arguments": {"a": 1}}}]},
               {"role": "tool", "content": "2", "tool_name": "f"}]
    client.chat(model="tiny", messages=history, tools=[TOOL], options={"num_predict": 1})
    turns = f.h.engine.requests[-1].messages
    assert turns[-2][0] == "assistant" and '"arguments": {"a": 1}' in turns[-2][1] and turns[-1] == ("tool", "2")


def test_an_answer_that_is_one_bare_json_call_is_a_call_whole_and_streamed(client, f):
    """Qwen2.5-Coder, not forced, answers a call as bare JSON: Ollama reads that as a call, and so
    does memspec (the fake engine echoes the one word)."""
    messages = ask(json.dumps({"name": "f", "arguments": {"a": 1}}, separators=(",", ":")))
    whole = client.chat(model="tiny", messages=messages, tools=[TOOL], options={"num_predict": 1})
    assert whole.message.content == "" and [(c.function.name, c.function.arguments)
                                            for c in whole.message.tool_calls] == [("f", {"a": 1})]
    parts = list(client.chat(model="tiny", messages=messages, tools=[TOOL], options={"num_predict": 1}, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", {"a": 1})]
    assert "".join(p.message.content for p in parts) == "" and parts[-1].done
    plain = client.chat(model="tiny", messages=messages, options={"num_predict": 1})  # no tools: text
    assert plain.message.content.startswith('{"name"') and not plain.message.tool_calls


def test_list_ps_version_and_pull_answer_from_the_store_and_the_loaded_set(client, f):
    names = {m.model for m in client.list().models}
    assert names == {"tiny:latest", "other:latest"}  # targets only, tagged as Ollama lists them
    [loaded] = client.ps().models
    assert loaded.model == "tiny:latest" and loaded.size > 0 and loaded.expires_at.year == 9999  # kept
    assert f.request("GET", "/api/ps")[2]["models"][0]["memspec"]["variant"] == "q4"
    assert f.request("GET", "/api/version")[2] == {"version": __import__("memspec").__version__}
    assert client.pull("tiny:latest").status == "success"
    assert [p.status for p in client.pull("tiny", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("nobody-knows-this")
    assert e.value.status_code == 404 and "known:" in e.value.error


def test_a_request_without_messages_loads_and_keep_alive_0_unloads(client, f):
    out = client.chat(model="other", messages=[], keep_alive="1m")
    assert out.done and out.done_reason == "load"
    assert {m.model for m in client.ps().models} == {"tiny:latest", "other:latest"}
    out = client.generate(model="other:latest", keep_alive=0)
    assert out.done_reason == "unload"
    assert {m.model for m in client.ps().models} == {"tiny:latest"}
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="missing")
    assert e.value.status_code == 404


@pytest.mark.parametrize("call, status, words", [
    (dict(model="missing", messages=ask()), 404, "is not in the store"),
    (dict(model="tiny", messages=ask(), options={"temperature": "hot"}), 400, "options.temperature: must be a number"),
    (dict(model="tiny", messages=ask(), options={"temperature": 9.0}), 400, "options.temperature: 9.0 is out of range"),
    (dict(model="tiny", messages=ask(), options={"num_predict": 0}), 400, "options.num_predict"),
    (dict(model="tiny", messages=ask(), options={"num_ctx": "big"}), 400, "options.num_ctx: must be an integer"),
    (dict(model="tiny", messages=ask(), options={"stop": ["a", ""]}), 400, "options.stop[1]: length 0"),
    (dict(model="tiny", messages=[{"role": "user", "content": "hi", "images": ["aGk="]}]), 400, "images"),
    (dict(model="tiny", messages=ask(), think=True), 400, "think"),
    (dict(model="tiny", messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
])
def test_bad_input_gets_an_ollama_error_and_the_daemon_keeps_serving(client, call, status, words):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(**call, stream=False)
    assert e.value.status_code == status and words in e.value.error, e.value.error
    with pytest.raises(ollama.ResponseError):  # streamed: refused before the first line, with the same status
        list(client.chat(**call, stream=True))
    assert client.chat(model="tiny", messages=ask(), options={"num_predict": 1}).done


def test_errors_are_ollama_shaped_and_counted_like_any_request(f):
    status, _, body = f.post({"model": "tiny", "messages": "no"}, path="/api/chat")
    assert status == 400 and set(body) == {"error"} and body["error"].startswith("messages: must be an array")
    status, _, body = f.post({"model": "tiny", "prompt": "a", "format": "yaml"}, path="/api/generate")
    assert status == 400 and body["error"].startswith("format: 'yaml': give \"json\" or a JSON schema")
    status, _, body = f.post(b"{not json", path="/api/generate")
    assert status == 400 and "not valid JSON" in body["error"]
    status, _, body = f.post({"model": "tiny", "input": "x"}, path="/api/embed")
    assert status == 404 and "not embeddings" in body["error"]
    assert f.request("GET", "/api/chat")[0] == 405
    assert f.h.servicer.service.counters.to_dict()["invalid"] >= 1


def test_streamed_lines_are_ndjson(f):
    status, headers, raw = f.request("POST", "/api/generate", {"model": "tiny", "prompt": "a b",
                                                               "options": {"num_predict": 2}})
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.splitlines()]
    assert [line["done"] for line in lines] == [False, False, True] and raw.endswith("\n")


def test_the_key_is_needed_on_api_as_on_v1(make):
    f = make(http=HttpConfig(api_key=KEY))
    bare = ollama.Client(host=f"http://127.0.0.1:{f.port}", timeout=10)
    with pytest.raises(ollama.ResponseError) as e:
        bare.list()
    assert e.value.status_code == 401 and "API key" in e.value.error
    with pytest.raises(ollama.ResponseError):
        bare.chat(model="tiny", messages=ask())
    keyed = ollama.Client(host=f"http://127.0.0.1:{f.port}", timeout=10, headers={"Authorization": f"Bearer {KEY}"})
    assert keyed.chat(model="tiny", messages=ask(), options={"num_predict": 1}).done
    assert f.request("GET", "/api/version")[0] == 200  # as /health: no key


def test_model_names_with_tags_map_to_store_names():
    names = {"smollm2-135m", "qwen2.5-coder-1.5b"}
    assert model_name("smollm2-135m:latest", names) == "smollm2-135m"
    assert model_name("smollm2-135m", names) == "smollm2-135m"
    assert model_name("qwen2.5-coder:1.5b", names) == "qwen2.5-coder-1.5b"
    assert model_name("llama3:8b", names) == "llama3:8b"  # left to be refused, naming what there is


# -- CORS ---------------------------------------------------------------------------------------
def test_cors_is_off_unless_origins_are_configured(make):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    off = make()
    status, headers, _ = off.request("OPTIONS", "/api/chat", headers=preflight)
    assert "access-control-allow-origin" not in {k.lower() for k in headers}
    on = make(http=HttpConfig(cors_origins=("http://localhost:3000",)))
    status, headers, _ = on.request("OPTIONS", "/v1/chat/completions", headers=preflight)
    lower = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and lower["access-control-allow-origin"] == "http://localhost:3000"
    status, headers, _ = on.request("GET", "/api/version", headers={"Origin": "http://localhost:3000"})
    assert {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == "http://localhost:3000"
    status, headers, _ = on.request("OPTIONS", "/api/chat", headers={**preflight, "Origin": "http://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in {k.lower() for k in headers}


def test_cors_origins_are_read_from_the_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[http]\ncors_origins = ["http://localhost:3000", "https://webui.example"]\n')
    assert load_config(path).http.cors_origins == ("http://localhost:3000", "https://webui.example")
    assert load_config(None).http.cors_origins == ()
    path.write_text('[http]\ncors_origins = "http://localhost:3000"\n')
    with pytest.raises(ConfigError, match="cors_origins must be a list of strings"):
        load_config(path)


def test_a_pull_streams_its_progress_as_status_lines_and_a_failure_as_an_error_line():
    import asyncio

    from memspec.errors import ModelNotFoundError
    from memspec.serving.http import _pull_lines

    async def lines(run):
        return [json.loads(b) async for b in _pull_lines(asyncio.get_running_loop(), run)]

    def fine(say):
        say("pulling x")
        say("converting x")

    def broken(say):
        say("pulling x")
        raise ModelNotFoundError("the wheel is gone")

    assert asyncio.run(lines(fine)) == [{"status": "pulling x"}, {"status": "converting x"}, {"status": "success"}]
    assert asyncio.run(lines(broken)) == [{"status": "pulling x"}, {"error": "the wheel is gone"}]


def test_the_root_says_a_server_runs_as_ollamas_clients_probe_it(f):
    status, headers, text = f.request("GET", "/")
    assert status == 200 and text.startswith("memspec is running")
    assert f.request("HEAD", "/")[0] == 200
