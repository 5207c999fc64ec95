"""End to end: the official `ollama` Python client against the real `memspec serve --http` process
and model (SmolLM2-135M), beside the `openai` SDK on the same daemon: greedy answers through
Ollama's /api/chat are those of /v1/chat/completions.  One daemon for the module, short answers.

The daemon's policy is target-only (tests/test_daemon_e2e.py's config), so a seeded sampled
answer does not depend on which draft ran."""

from __future__ import annotations

import json
from urllib.request import urlopen

import ollama
import pytest
from openai import OpenAI

from test_daemon_e2e import http_daemon
from test_http_e2e import metrics, post

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SHORT = {"num_predict": 12}
# in the key order the ollama client sends a tool in (its pydantic model puts "required" first): the
# prompt lists the tool as it came, so the OpenAI route gets the same text
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def base(model_store):
    with http_daemon(model_store.home, "ms-oll-", "o") as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return ollama.Client(host=base, timeout=120)


@pytest.fixture(scope="module")
def sdk(base):
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_chat_whole_and_streamed_is_the_openai_routes_answer(client, sdk):
    whole = client.chat(model=f"{MODEL}:latest", messages=QUESTION, options=SHORT)
    text = whole.message.content
    oa = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12)
    assert text and text == oa.choices[0].message.content
    assert whole.eval_count == oa.usage.completion_tokens and whole.prompt_eval_count == oa.usage.prompt_tokens
    assert whole.model == f"{MODEL}:latest" and whole.done_reason in ("stop", "length")
    assert whole.total_duration > whole.eval_duration > 0 and whole.prompt_eval_duration > 0
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=SHORT, stream=True))
    assert "".join(p.message.content for p in parts) == text and parts[-1].done and len(parts) > 2


def test_generate_whole_and_streamed_agree(client):
    whole = client.generate(model=MODEL, prompt="Name a color.", options=SHORT)
    streamed = list(client.generate(model=MODEL, prompt="Name a color.", options=SHORT, stream=True))
    assert whole.response and "".join(p.response for p in streamed) == whole.response
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options={"num_predict": 4})
    assert raw.eval_count == 4


def test_a_seeded_sampled_answer_repeats_and_is_the_openai_routes(client, sdk):
    opts = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "num_predict": 12}
    first = client.chat(model=MODEL, messages=QUESTION, options=opts).message.content
    assert client.chat(model=MODEL, messages=QUESTION, options=opts).message.content == first
    oa = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0.9, top_p=0.95,
                                     seed=1234)
    assert oa.choices[0].message.content == first


def test_an_unseeded_sampled_answer_reports_a_seed_that_replays_it(client, base):
    """Issue 68: options.seed unset (or -1) draws a fresh seed, reported in the `memspec` object;
    sent back through the ollama client, it gives the same answer, on /api/chat and /api/generate."""
    opts = {"temperature": 0.9, "top_p": 0.95, "num_predict": 12}
    status, out = post(base, "/api/chat", {"model": MODEL, "messages": QUESTION, "stream": False,
                                           "options": dict(opts, seed=-1)})
    seed = out["memspec"]["seed"]
    assert status == 200 and isinstance(seed, int) and 0 <= seed < 2**53
    again = client.chat(model=MODEL, messages=QUESTION, options=dict(opts, seed=seed))
    assert again.message.content == out["message"]["content"]
    status, out = post(base, "/api/generate", {"model": MODEL, "prompt": "Name a color.", "stream": False,
                                               "options": opts})
    again = client.generate(model=MODEL, prompt="Name a color.", options=dict(opts, seed=out["memspec"]["seed"]))
    assert status == 200 and again.response == out["response"]


def test_format_with_a_schema_gives_json_that_matches_it(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    out = client.chat(model=MODEL, messages=[{"role": "user", "content": "Paris is in which country? Answer in JSON."}],
                      format=schema, options={"num_predict": 40})
    answer = json.loads(out.message.content)
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
    out = client.generate(model=MODEL, prompt="Give a JSON object with a cat's name.", format="json",
                          options={"num_predict": 24})
    assert out.response.startswith("{")  # JSON mode: an object, cut short here or whole
    if out.done_reason == "stop":
        assert isinstance(json.loads(out.response), dict)


def test_tools_answer_as_the_openai_route_does(client, sdk):
    """The model decides whether to call (a 135M model may not): whatever it answers greedily, the
    content and the calls are those of the OpenAI route, with the arguments as an object."""
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    out = client.chat(model=MODEL, messages=messages, tools=[WEATHER], options={"num_predict": 40})
    oa = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40).choices[0]
    assert (out.message.content or None) == (oa.message.content or None)
    calls = [(c.function.name, dict(c.function.arguments)) for c in out.message.tool_calls or []]
    assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in oa.message.tool_calls or []]
    streamed = list(client.chat(model=MODEL, messages=messages, tools=[WEATHER], options={"num_predict": 40},
                                stream=True))
    assert [(c.function.name, dict(c.function.arguments)) for p in streamed for c in p.message.tool_calls or []] == calls


def test_list_ps_show_and_pull_from_the_store(client):
    listed = {m.model: m for m in client.list().models}
    assert f"{MODEL}:latest" in listed and listed[f"{MODEL}:latest"].details.family == "llama"
    assert listed[f"{MODEL}:latest"].size > 0
    loaded = {m.model: m for m in client.ps().models}
    assert f"{MODEL}:latest" in loaded and loaded[f"{MODEL}:latest"].size > 0
    shown = client.show(MODEL)
    assert "im_start" in shown.template and shown.modelinfo["llama.context_length"] == 8192
    assert shown.details.parameter_size.endswith("M") and "tools" in shown.capabilities
    assert client.pull(f"{MODEL}:latest").status == "success"


def test_bad_inputs_get_ollama_errors_and_the_daemon_keeps_serving(client, base):
    for call, status, words in [
        (dict(model="no-such-model", messages=QUESTION), 404, "not in the store"),
        (dict(model=MODEL, messages=QUESTION, options={"top_k": "many"}), 400, "options.top_k: must be an integer"),
        (dict(model=MODEL, messages=QUESTION, format={"type": "no-such-type"}), 400, "format"),
    ]:
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(**call)
        assert e.value.status_code == status and words in e.value.error, e.value.error
    assert post(base, "/api/generate", {"model": MODEL, "prompt": "hi", "format": 3}) == (
        400, {"error": "format: an integer: give \"json\" or a JSON schema (an object)"})
    assert client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 2}).eval_count == 2


def test_an_ollama_request_is_counted_in_the_metrics(client, base):
    before = metrics(base)
    out = client.chat(model=MODEL, messages=QUESTION, options={"num_predict": 3})
    after = metrics(base)
    key = ("memspec_requests_total", (("outcome", "completed"),))
    assert after[key] - before.get(key, 0.0) == 1
    gen = ("memspec_generation_tokens_total", ())
    assert after[gen] - before.get(gen, 0.0) == out.eval_count
    assert json.loads(urlopen(f"{base}/api/version", timeout=10).read())["version"]
