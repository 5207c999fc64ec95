"""The HTTP API in process, over the fake engine of test_server: routes, errors, streaming,
disconnects, auth, and /metrics.

The plumbing is real: uvicorn on a loopback port, the Api over the same Service the gRPC
servicer uses (so gRPC and HTTP share the queue and the counters), admission,
EngineBackend; only the engine is the fake that answers with the prompt's words reversed.
Clients are the standard library's http.client and raw sockets.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakes import wait_for
from test_server import CONTEXT, MiB, Harness

from memspec.config import HttpConfig, ServerConfig
from memspec.errors import STATUS, ConfigError
from memspec.request import Completion, Limits
from memspec.serving.http import Api, HttpAddress, HttpServer, body_limit, check_exposure, parse_listen

CHAT = "/v1/chat/completions"
KEY = "sk-test-key"


class Front:
    """A Harness (fake engine, gRPC server and client) with the HTTP API on its Service."""

    def __init__(self, tmp, http: HttpConfig | None = None, **kw):
        cfg = ServerConfig(**{k: kw.pop(k) for k in list(kw) if k in ServerConfig.__dataclass_fields__})
        self.h = Harness(tmp, cfg, **kw)
        self.api = Api(self.h.servicer.service, http or HttpConfig())
        self.server = HttpServer(self.api, HttpAddress("127.0.0.1", 0)).start()
        self.port = self.server.address.port

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 10.0):
        """(status, headers, decoded JSON or text)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        hdrs = {"Content-Type": "application/json"} if headers is None else headers
        data = json.dumps(body) if isinstance(body, (dict, list)) else body
        c.request(method, path, body=data, headers=hdrs)
        r = c.getresponse()
        raw = r.read().decode()
        c.close()
        try:
            return r.status, dict(r.getheaders()), json.loads(raw)
        except ValueError:
            return r.status, dict(r.getheaders()), raw

    def post(self, body, path: str = CHAT, **kw):
        return self.request("POST", path, body, **kw)

    def metrics(self) -> dict:
        """Every sample of /metrics, parsed by prometheus_client: {(name, labels): value}."""
        status, _, text = self.request("GET", "/metrics")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def close(self):
        self.server.stop()
        self.h.close()


@pytest.fixture
def make(tmp_path):
    made = []

    def factory(**kw):
        (tmp_path / str(len(made))).mkdir(exist_ok=True)
        f = Front(tmp_path / str(len(made)), **kw)
        made.append(f)
        return f

    for i in range(4):
        (tmp_path / str(i)).mkdir()
    yield factory
    for f in made:
        f.close()


@pytest.fixture
def f(make):
    return make()


def chat(content="one two three", **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}


def sse_events(raw: bytes) -> list[str]:
    """The data of each server-sent event (blank-line separated `data: ...` lines)."""
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def raw_stream(port: int, body: dict, path: str = CHAT, headers: str = "") -> socket.socket:
    """An HTTP/1.0 request on a raw socket: the response comes back unchunked, as sent."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


# -- answers --------------------------------------------------------------------------------------
def test_chat_answers_in_openai_shape_with_usage_and_memspec_stats(f):
    status, headers, body = f.post(chat(max_tokens=4))
    assert status == 200 and headers["content-type"] == "application/json"
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "three two one three "},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    ms = body["memspec"]
    assert ms["model"] == "tiny" and ms["variant"] == "q4" and ms["draft"] == ""
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "ttft_ms"} <= set(ms)


def test_content_may_be_an_array_of_text_parts_and_developer_is_a_system_turn(f):
    parts = [{"type": "text", "text": "one two "}, {"type": "text", "text": "three"}]
    body = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
            "max_tokens": 3}
    status, _, out = f.post(body)
    assert status == 200 and out["choices"][0]["message"]["content"] == "three two one "


def test_completions_answer_a_raw_prompt(f):
    status, _, body = f.post({"model": "tiny", "prompt": "a b", "max_tokens": 3, "stop": None},
                             path="/v1/completions")
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "b a b " and body["choices"][0]["finish_reason"] == "length"


def test_stream_is_sse_framed_with_role_chunks_finish_usage_and_done(f):
    s = raw_stream(f.port, chat(max_tokens=3, stream=True, stream_options={"include_usage": True}))
    raw = read_all(s)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-type: text/event-stream" in head.lower()
    events = sse_events(rest)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["model"] == "tiny" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "three two one "
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["memspec"]["model"] == "tiny"


def test_a_call_the_answer_makes_is_read_out_whole_and_streamed(f):
    """tool_choice auto: the fake engine answers the words reversed, here "Sure, <tool_call> {...}
    </tool_call>"; the call comes back as tool_calls, whole and as streamed deltas."""
    call = json.dumps({"name": "f", "arguments": {"a": 1}}, separators=(",", ":"))
    ask = chat(f"</tool_call> {call} <tool_call> Sure,", max_tokens=4,
               tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    status, _, out = f.post(ask)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure,"
    [whole] = choice["message"]["tool_calls"]
    assert whole["type"] == "function" and whole["function"] == {"name": "f", "arguments": '{"a": 1}'}
    events = sse_events(read_all(raw_stream(f.port, {**ask, "stream": True})).partition(b"\r\n\r\n")[2])
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    ids = [d["id"] for d in deltas if "id" in d]  # one id, given once (each answer names its own calls)
    assert {d["index"] for d in deltas} == {0} and len(ids) == 1 and ids[0].startswith("call_")
    assert "".join(d["function"].get("name", "") for d in deltas) == "f"
    assert "".join(d["function"]["arguments"] for d in deltas) == whole["function"]["arguments"]
    assert "".join(c["delta"].get("content") or "" for c in chunks).strip() == "Sure,"
    assert chunks[-1]["finish_reason"] == "tool_calls"
    status, _, out = f.post({**ask, "tool_choice": "none"})  # no tools: the text as it is
    assert out["choices"][0]["message"]["content"].startswith("Sure, <tool_call>")
    assert out["choices"][0]["finish_reason"] == "length"


def test_an_answer_that_is_one_bare_json_call_is_a_call_whole_and_streamed(f):
    """An answer that is nothing but {"name": ..., "arguments": ...} naming an offered tool (as
    Qwen2.5-Coder writes a call it is not forced to make) comes back as tool_calls."""
    ask = chat(json.dumps({"name": "f", "arguments": {"a": 1}}, separators=(",", ":")), max_tokens=1,
               tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    status, _, out = f.post(ask)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    events = sse_events(read_all(raw_stream(f.port, {**ask, "stream": True})).partition(b"\r\n\r\n")[2])
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    deltas = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert "".join(d["function"].get("name", "") for d in deltas) == "f"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"a": 1}'
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ""
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_a_stream_without_include_usage_has_no_usage_chunk(f):
    events = sse_events(read_all(raw_stream(f.port, {"prompt": "a b", "max_tokens": 2, "stream": True},
                                            path="/v1/completions")).partition(b"\r\n\r\n")[2])
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "b a "


def test_the_http_stream_equals_the_grpc_stream_for_the_same_request(f):
    grpc_text = "".join(i.text for i in f.h.client.generate("five four three two one", max_tokens=7, seed=3)
                        if not isinstance(i, Completion))
    events = sse_events(read_all(raw_stream(f.port, {"prompt": "five four three two one", "max_tokens": 7,
                                                     "seed": 3, "stream": True}, path="/v1/completions"))
                        .partition(b"\r\n\r\n")[2])
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == grpc_text


def test_models_list_the_store_targets_and_say_which_is_resident(f):
    status, _, body = f.request("GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    rows = {m["id"]: m for m in body["data"]}
    assert set(rows) == {"tiny", "other"}  # the draft is not a model to ask for
    assert rows["tiny"]["memspec"]["resident"] and not rows["other"]["memspec"]["resident"]
    assert rows["tiny"]["loaded"] is True and rows["other"]["loaded"] is False
    # the context a loaded target has (its engine's), and the one each was trained for (the manifest's)
    assert rows["tiny"]["memspec"]["max_context"] == CONTEXT and rows["other"]["memspec"]["max_context"] == 0
    assert rows["other"]["memspec"]["trained_context"] == 4 * CONTEXT
    assert (rows["tiny"]["memspec"]["kv"], rows["other"]["memspec"]["kv"]) == ("q8", "")  # its KV's format, loaded
    assert f.request("GET", "/v1/models/tiny")[2]["id"] == "tiny"
    status, _, body = f.request("GET", "/v1/models/a-draft")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_every_listed_model_answers_loaded_on_demand_and_keep_alive_0_unloads_it(f):
    """The listing-then-asking flow of a chat front end: the model the list offers answers, loaded
    first; the list puts loaded targets first; keep_alive 0 unloads it after its answer."""
    listed = [m["id"] for m in f.request("GET", "/v1/models")[2]["data"]]
    for name in listed:
        status, _, out = f.post({**GOOD, "model": name})
        assert status == 200 and out["model"] == name and out["memspec"]["model"] == name
    f.h.client.unload("tiny")
    body = f.request("GET", "/v1/models")[2]
    assert [(m["id"], m["loaded"]) for m in body["data"]] == [("other", True), ("tiny", False)]
    status, _, out = f.post({**GOOD, "model": "other", "keep_alive": 0})
    assert status == 200 and out["model"] == "other"
    wait_for(lambda: f.metrics()[("memspec_target_unloads_total", (("model", "other"),))] == 1)
    assert not {m["id"]: m for m in f.request("GET", "/v1/models")[2]["data"]}["other"]["loaded"]
    m = f.metrics()
    assert m[("memspec_target_loads_total", (("model", "other"),))] == 1
    assert m[("memspec_target_unloads_total", (("model", "other"),))] == 1
    assert m[("memspec_target_unloads_total", (("model", "tiny"),))] == 1
    assert m[("memspec_target_load_seconds_total", (("model", "other"),))] >= 0
    assert m[("memspec_target_loaded", (("model", "other"),))] == 0


def test_health_follows_the_daemon_state(make):
    f = make(start=False)
    assert f.request("GET", "/health")[:3:2] == (503, {"status": "starting"})
    status, _, body = f.post(chat())
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    f.h.start()
    assert f.request("GET", "/health")[:3:2] == (200, {"status": "serving"})
    f.h.servicer.set_state("draining")
    assert f.request("GET", "/health")[:3:2] == (503, {"status": "draining"})
    status, _, body = f.post(chat())
    assert status == 503 and "shutting down" in body["error"]["message"]


# -- n choices ------------------------------------------------------------------------------------
def by_index(events: list[str]) -> dict[int, list[dict]]:
    """A stream's choice chunks, grouped by their choices[0].index (the usage chunk has none)."""
    out: dict[int, list[dict]] = {}
    for e in events[:-1]:
        for c in json.loads(e)["choices"]:
            out.setdefault(c["index"], []).append(c)
    return out


def test_n_choices_each_answer_the_request_in_openai_shape_with_usage_added_up(f):
    status, _, body = f.post(chat(max_tokens=4, n=3))
    assert status == 200
    assert body["choices"] == [{"index": i, "message": {"role": "assistant", "content": "three two one three "},
                                "logprobs": None, "finish_reason": "length"} for i in range(3)]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    ms = body["memspec"]  # the choices' stats added up, and each choice's own
    assert [c["model"] for c in ms["choices"]] == ["tiny"] * 3 and ms["model"] == "tiny"
    assert ms["tok_per_s"] == sum(c["tok_per_s"] for c in ms["choices"]) and ms["num_drafts"] == 0
    assert f.h.servicer.counters.to_dict()["completed"] == 3  # admission and the counters saw 3 requests
    assert len(f.h.engine.requests) == 3
    status, _, body = f.post({"prompt": "a b", "max_tokens": 3, "n": 2}, path="/v1/completions")
    assert status == 200 and [(c["index"], c["text"]) for c in body["choices"]] == [(0, "b a b "), (1, "b a b ")]
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == 2
    assert "choices" not in f.post(chat(max_tokens=2))[2]["memspec"]  # n = 1: the object as it was


def test_seeded_choices_sample_with_the_seed_plus_their_index():
    from memspec.serving import openai

    api = openai.parse_chat(chat(n=3, seed=7, temperature=0.8), 50)
    assert [api.choice(i).sampling.seed for i in range(3)] == [7, 8, 9] and api.choice(0) == api.request
    assert api.choice(2) == replace(api.request, sampling=replace(api.request.sampling, seed=9))
    top = openai.parse_completion({"prompt": "a", "n": 2, "seed": 2**64 - 1}, 50)
    assert top.choice(1).sampling.seed == 0  # mod 2^64: still a valid seed
    unseeded = openai.parse_chat(chat(n=2, temperature=1), 50)  # no seed: given one, so that the response replays
    s = unseeded.request.sampling.seed
    assert s is not None and 0 <= s < 2**53 and unseeded.choice(1).sampling.seed == s + 1
    assert openai.parse_chat(chat(n=2, temperature=1), 50).request.sampling.seed != s  # a fresh one each time
    assert openai.parse_chat(chat(n=1, temperature=1), 50).request.sampling.seed is None  # the engine draws it
    assert openai.parse_chat(chat(n=2), 50).request.sampling.seed is None  # greedy: no randomness


def test_each_choice_reaches_the_engine_with_its_own_seed(f):
    assert f.post(chat(max_tokens=2, n=3, seed=41, temperature=0.7))[0] == 200
    assert sorted(r.sampling.seed for r in f.h.engine.requests) == [41, 42, 43]


def test_n_streamed_choices_carry_their_index_and_finish_and_one_usage_chunk(make):
    f = make(step_s=0.02)
    raw = read_all(raw_stream(f.port, chat(max_tokens=6, n=3, stream=True, stream_options={"include_usage": True})))
    events = sse_events(raw.partition(b"\r\n\r\n")[2])
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 18
    assert usage["usage"]["prompt_tokens"] == 3 and len(usage["memspec"]["choices"]) == 3
    chunks = by_index(events[:-1])
    assert sorted(chunks) == [0, 1, 2]
    for i, cs in chunks.items():
        assert cs[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in cs) == "three two one three two one "
        assert [c["finish_reason"] for c in cs] == [None] * (len(cs) - 1) + ["length"]
    order = [json.loads(e)["choices"][0]["index"] for e in events[:-2]]
    assert order != sorted(order)  # generated at once: the choices' chunks interleave


def test_n_streamed_tool_calls_are_read_out_per_choice_with_ids_of_their_own(f):
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}, separators=(",", ":"))  # one word
    ask = chat(f"</tool_call> {call} <tool_call> Sure,", max_tokens=4, n=2,
               tools=[{"type": "function", "function": {"name": "get_weather"}}])
    out = f.post(ask)[2]
    ids = [c["message"]["tool_calls"][0]["id"] for c in out["choices"]]
    assert [c["finish_reason"] for c in out["choices"]] == ["tool_calls"] * 2 and len(set(ids)) == 2
    events = sse_events(read_all(raw_stream(f.port, {**ask, "stream": True})).partition(b"\r\n\r\n")[2])
    chunks = by_index(events)
    for i, cs in chunks.items():
        deltas = [d for c in cs for d in c["delta"].get("tool_calls", [])]
        assert deltas[0]["function"]["name"] == "get_weather" and cs[-1]["finish_reason"] == "tool_calls"
    assert sorted(chunks) == [0, 1]


def test_n_choices_generate_at_once_and_a_disconnect_cancels_them_all(make):
    f = make(step_s=0.05)
    s = raw_stream(f.port, chat(max_tokens=50, n=3, stream=True))
    got = b""
    while got.count(b"data: ") < 6:
        got += s.recv(4096)
    assert f.h.engine.open == 3 and f.h.admission.snapshot()["active"] == 3
    s.close()
    wait_for(lambda: f.h.engine.open == 0, timeout=2.0)
    status = f.h.client.status()
    assert status["kv_bytes"] == 0 and status["active_streams"] == 0 and status["requests"]["cancelled"] == 3


def test_n_choices_admission_cannot_take_are_refused_whole_and_the_daemon_keeps_serving(make):
    f = make(max_concurrent=2, max_queue=0, step_s=0.05)
    s = raw_stream(f.port, chat(max_tokens=40, stream=True))
    wait_for(lambda: f.h.admission.snapshot()["active"] == 1)
    status, hdrs, body = f.post(chat(max_tokens=4, n=2))  # one slot is free: the second choice has none
    assert status == 429 and hdrs["retry-after"] == "1" and "queue is full" in body["error"]["message"]
    wait_for(lambda: f.h.engine.open == 1 and f.h.admission.snapshot()["active"] == 1)  # no choice left behind
    status, _, body = f.post(chat(max_tokens=4, n=3))
    assert status == 400 and body["error"]["param"] == "n"
    assert "at most 2" in body["error"]["message"] and "max_concurrent" in body["error"]["message"]
    s.close()
    wait_for(lambda: f.h.admission.snapshot()["active"] == 0)
    status, _, body = f.post(chat(max_tokens=4, n=2))
    assert status == 200 and len(body["choices"]) == 2


def test_n_choices_past_their_deadline_are_504_and_all_end(make):
    f = make(http=HttpConfig(timeout_seconds=0.3), step_s=0.05)
    status, _, body = f.post(chat(max_tokens=40, n=2))
    assert status == 504 and body["error"]["type"] == "timeout"
    wait_for(lambda: f.h.engine.open == 0)
    assert f.h.servicer.counters.to_dict()["cancelled"] == 2


# -- bad inputs ------------------------------------------------------------------------------
GOOD = chat(max_tokens=2)
BAD = [  # (name, path, body or raw text, headers, status, param, code)
    ("malformed JSON", CHAT, '{"messages": [', None, 400, None, None),
    ("not UTF-8", CHAT, b'{"prompt": "\xff"}', None, 400, None, None),
    ("a JSON array", CHAT, [1, 2], None, 400, None, None),
    ("wrong content type", CHAT, json.dumps(GOOD), {"Content-Type": "text/plain"}, 400, None, None),
    ("no content type", CHAT, json.dumps(GOOD), {}, 400, None, None),
    ("no messages", CHAT, {"model": "tiny"}, None, 400, "messages", None),
    ("messages not an array", CHAT, {"messages": "hi"}, None, 400, "messages", None),
    ("a message not an object", CHAT, {"messages": ["hi"]}, None, 400, "messages[0]", None),
    ("an unknown role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages[0].role", None),
    ("an image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     None, 400, "messages[0].content[0].type", None),
    ("content a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages[0].content",
     None),
    ("empty user turn", CHAT, chat(content="  "), None, 400, "messages[0].content", None),
    ("max_tokens 0", CHAT, chat(max_tokens=0), None, 400, "max_tokens", None),
    ("max_tokens over the limit", CHAT, chat(max_tokens=51), None, 400, "max_tokens", None),
    ("max_tokens a string", CHAT, chat(max_tokens="ten"), None, 400, "max_tokens", None),
    ("temperature too high", CHAT, chat(temperature=3), None, 400, "temperature", None),
    ("temperature a boolean", CHAT, chat(temperature=True), None, 400, "temperature", None),
    ("top_p 0", CHAT, chat(top_p=0), None, 400, "top_p", None),
    ("negative seed", CHAT, chat(seed=-1), None, 400, "seed", None),
    ("stop a number", CHAT, chat(stop=5), None, 400, "stop", None),
    ("too many stops", CHAT, chat(stop=list("abcdefghi")), None, 400, "stop", None),
    ("n = 0", CHAT, chat(n=0), None, 400, "n", None),
    ("n negative", "/v1/completions", {"prompt": "a b", "n": -2}, None, 400, "n", None),
    ("n a fraction", CHAT, chat(n=1.5), None, 400, "n", None),
    ("n a string", CHAT, chat(n="2"), None, 400, "n", None),
    ("n a boolean", CHAT, chat(n=True), None, 400, "n", None),
    ("n over max_concurrent", CHAT, chat(n=5), None, 400, "n", None),
    ("n over OpenAI's 128", "/v1/completions", {"prompt": "a b", "n": 129}, None, 400, "n", None),
    ("best_of 2", "/v1/completions", {"prompt": "a b", "n": 2, "best_of": 2}, None, 400, "best_of", None),
    ("a tool without a name", CHAT, chat(tools=[{"type": "function", "function": {"description": "f"}}]), None, 400,
     "tools[0].function.name", None),
    ("a tool name with a space", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), None, 400,
     "tools[0].function.name", None),
    ("a forced call of no such tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
     tool_choice={"type": "function", "function": {"name": "g"}}), None, 400, "tool_choice.function.name", None),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), None, 400, "tool_choice", None),
    ("a tool call from a user", CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None, 400,
     "messages[0].tool_calls", None),
    ("tool call arguments that are no JSON", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{"}}]}, {"role": "user", "content": "x"}]},
     None, 400, "messages[0].tool_calls[0].function.arguments", None),
    ("tools on /v1/completions", "/v1/completions", {"prompt": "a", "tools": [{"type": "function",
     "function": {"name": "f"}}]}, None, 400, "tools", None),
    ("an unknown response format", CHAT, chat(response_format={"type": "yaml"}), None, 400, "response_format.type",
     None),
    ("a JSON schema without a name", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}), None, 400, "response_format.json_schema.name", None),
    ("a JSON schema that is a string", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": "object"}}), None, 400, "response_format.json_schema.schema", None),
    ("a grammar and JSON mode", CHAT, chat(grammar='root ::= "a"', response_format={"type": "json_object"}), None,
     400, "grammar", None),
    ("a grammar that is not text", CHAT, chat(grammar=5), None, 400, "grammar", None),
    ("a penalty out of range", CHAT, chat(frequency_penalty=2.5), None, 400, "frequency_penalty", None),
    ("a penalty a string", CHAT, chat(presence_penalty="high"), None, 400, "presence_penalty", None),
    ("repetition_penalty 0", CHAT, chat(repetition_penalty=0), None, 400, "repetition_penalty", None),
    ("min_p over 1", "/v1/completions", {"prompt": "a b", "min_p": 1.5}, None, 400, "min_p", None),
    ("logit_bias not an object", CHAT, chat(logit_bias=[5, 1]), None, 400, "logit_bias", None),
    ("logit_bias a word as key", CHAT, chat(logit_bias={"hello": 1}), None, 400, "logit_bias", None),
    ("logit_bias a negative id", CHAT, chat(logit_bias={"-5": 1}), None, 400, "logit_bias", None),
    ("logit_bias over 100", CHAT, chat(logit_bias={"5": 101}), None, 400, "logit_bias", None),
    ("logit_bias a string bias", CHAT, chat(logit_bias={"5": "1"}), None, 400, "logit_bias", None),
    ("tokenize without content", "/tokenize", {"text": "hi"}, None, 400, "content", None),
    ("tokenize a number", "/tokenize", {"content": 5}, None, 400, "content", None),
    ("tokenize add_special a string", "/tokenize", {"content": "hi", "add_special": "yes"}, None, 400,
     "add_special", None),
    ("tokenize malformed JSON", "/tokenize", '{"content": ', None, 400, None, None),
    ("detokenize without tokens", "/detokenize", {"content": "hi"}, None, 400, "tokens", None),
    ("detokenize a string id", "/detokenize", {"tokens": [1, "2"]}, None, 400, "tokens[1]", None),
    ("detokenize an unknown model", "/detokenize", {"tokens": [1], "model": "gpt-4o"}, None, 404, "model",
     "model_not_found"),
    ("stream not a boolean", CHAT, chat(stream="yes"), None, 400, "stream", None),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), None, 400,
     "stream_options", None),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs", None),
    ("top_logprobs over 20", CHAT, chat(logprobs=True, top_logprobs=21), None, 400, "top_logprobs", None),
    ("logprobs not a boolean", CHAT, chat(logprobs="yes"), None, 400, "logprobs", None),
    ("an unknown model", CHAT, {**GOOD, "model": "gpt-4o"}, None, 404, "model", "model_not_found"),
    ("a keep_alive that is no duration", CHAT, {**GOOD, "keep_alive": "soon"}, None, 400, "keep_alive", None),
    ("a keep_alive of the wrong type", CHAT, {**GOOD, "keep_alive": [5]}, None, 400, "keep_alive", None),
    ("a draft as the model", CHAT, {**GOOD, "model": "a-draft"}, None, 400, "model", None),
    ("an unknown draft", CHAT, {**GOOD, "memspec": {"draft": "nope"}}, None, 400, "memspec.draft", None),
    ("a fixed policy's unknown draft", CHAT, {**GOOD, "memspec": {"policy": "fixed:nope"}}, None, 400,
     "memspec.policy", None),
    ("an unknown draft of a target not loaded", CHAT, {**GOOD, "model": "other", "memspec": {"draft": "nope"}},
     None, 400, "memspec.draft", None),
    ("an unknown policy", CHAT, {**GOOD, "memspec": {"policy": "fastest"}}, None, 400, "memspec.policy", None),
    ("an unknown memspec option", CHAT, {**GOOD, "memspec": {"gamma": 3}}, None, 400, "memspec.gamma", None),
    ("a prompt of token ids", "/v1/completions", {"prompt": [1, 2, 3]}, None, 400, "prompt", None),
    ("a prompt too long", "/v1/completions", {"prompt": "x " * 150}, None, 400, "prompt", None),
    ("echo", "/v1/completions", {"prompt": "a", "echo": True}, None, 400, "echo", None),
    ("a prompt over the context", "/v1/completions", {"prompt": "a " * 80, "max_tokens": 1}, None, 400, "prompt",
     "context_length_exceeded"),
    ("a prompt and max_tokens over the context", "/v1/completions", {"prompt": "a " * 20, "max_tokens": 50}, None,
     400, "max_tokens", "context_length_exceeded"),
    ("a body over the limit", CHAT, "x" * (body_limit(Limits(max_tokens=50, max_prompt_chars=200)) + 1), None, 413, None, "request_too_large"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_a_bad_input_gets_its_status_and_an_openai_error_and_the_daemon_keeps_serving(
        f, name, path, body, headers, status, param, code):
    got, hdrs, out = f.post(body, path=path, headers=headers)
    assert got == status, out
    assert hdrs["content-type"] == "application/json" and set(out) == {"error"}
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert (err["param"], err["code"]) == (param, code), err
    assert f.post(GOOD)[0] == 200  # still serving
    assert f.h.engine.open == 0 and f.h.admission.snapshot() == {"active": 0, "waiting": 0, "kv_bytes": 0}


def test_what_does_not_fit_the_context_or_the_memory_names_its_figures_and_the_daemon_keeps_serving(make):
    """Issue 69: a 400 names the prompt's tokens, max_tokens and the context; a request whose KV
    cannot fit the memory now is a 507 with the figures; then the daemon answers again."""
    f = make(memory=300 * MiB, memory_headroom_mb=300)
    status, _, out = f.post({"prompt": "a " * 20, "max_tokens": 50}, path="/v1/completions")
    assert status == 400 and out["error"]["message"] == (
        f"max_tokens: the prompt's 20 tokens + max_tokens 50 = 70 tokens do not fit the context of {CONTEXT} "
        f"tokens; ask for at most {CONTEXT - 20} new tokens, or leave max_tokens out to generate to the end of "
        f"the context")
    status, _, out = f.post({"prompt": "a b", "max_tokens": 5}, path="/v1/completions")
    assert status == 507 and out["error"]["code"] == "insufficient_memory"
    assert "(prompt 2 tokens + max_tokens 5): its KV cache needs" in out["error"]["message"]
    assert "the system has 300 MiB available and 300 MiB must stay free" in out["error"]["message"]
    f.h.memory = 8 << 30
    status, _, out = f.post({"prompt": "a b", "max_tokens": 5}, path="/v1/completions")
    assert status == 200 and out["choices"][0]["text"]


def test_no_max_tokens_runs_to_the_end_of_the_context_within_the_limit(f):
    """A request that names no max_tokens is not cut at 256 (nor any fixed number): it runs to the
    end of sequence or of the context, within [limits] max_tokens (50 in this harness)."""
    status, _, out = f.post({"prompt": "a " * 10}, path="/v1/completions")  # the context leaves 54
    assert status == 200 and out["usage"]["completion_tokens"] == 50 and out["choices"][0]["finish_reason"] == "length"
    status, _, out = f.post({"prompt": "a " * 40}, path="/v1/completions")  # the context leaves 24
    assert status == 200 and out["usage"]["completion_tokens"] == CONTEXT - 40
    assert f.h.engine.requests[-1].max_tokens == CONTEXT - 40


def test_bad_inputs_are_counted_as_invalid_and_logged_like_grpc_ones(f, caplog):
    with caplog.at_level(logging.INFO, logger="memspec.server"):
        assert f.post('{"oops"')[0] == 400
    assert f.h.servicer.counters.to_dict()["invalid"] == 1
    line = [r for r in caplog.records if r.getMessage() == "request"][-1].fields
    assert line["method"] == "POST /v1/chat/completions" and line["code"] == "INVALID_ARGUMENT"
    assert "not valid JSON" in line["error"]


def test_unknown_fields_are_ignored_and_logged_at_debug(f, caplog):
    with caplog.at_level(logging.DEBUG, logger="memspec.http"):
        status, _, body = f.post({**GOOD, "frobnicate": 1, "user": "me"})
    assert status == 200 and body["choices"][0]["message"]["content"]
    assert any(getattr(r, "fields", {}).get("fields") == ["frobnicate"] for r in caplog.records)


def test_unknown_routes_and_methods_get_openai_errors(f):
    status, _, body = f.post(GOOD, path="/v1/embeddings")
    assert status == 404 and body["error"]["code"] == "not_found" and "/v1/chat/completions" in body["error"]["message"]
    status, hdrs, body = f.request("GET", CHAT)
    assert status == 405 and hdrs["allow"] == "POST" and body["error"]["code"] == "method_not_allowed"


def test_an_internal_error_is_500_and_the_daemon_keeps_serving(f):
    f.h.engine.fail = True
    status, _, body = f.post(GOOD)
    assert status == 500 and body["error"]["type"] == "server_error" and "boom" in body["error"]["message"]
    f.h.engine.fail = False
    assert f.post(GOOD)[0] == 200
    assert f.h.servicer.counters.to_dict()["failed"] == 1


def test_every_status_has_an_http_status():
    assert {s.http for s in STATUS.values()} >= {400, 401, 404, 413, 429, 503, 504}


# -- keys and exposure ---------------------------------------------------------------------------
def test_a_key_is_needed_on_v1_but_not_on_health_and_metrics(make):
    f = make(http=HttpConfig(api_key=KEY, api_key_env=""))
    for headers in ({"Content-Type": "application/json"},
                    {"Content-Type": "application/json", "Authorization": "Bearer wrong"},
                    {"Content-Type": "application/json", "Authorization": KEY}):
        status, hdrs, body = f.post(GOOD, headers=headers)
        assert status == 401 and hdrs["www-authenticate"] == "Bearer", body
        assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert f.request("GET", "/v1/models", headers={})[0] == 401
    ok = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    assert f.post(GOOD, headers=ok)[0] == 200
    assert f.request("GET", "/v1/models", headers=ok)[0] == 200
    assert f.request("GET", "/health", headers={})[0] == 200 and f.request("GET", "/metrics", headers={})[0] == 200
    assert f.h.servicer.counters.to_dict()["rejected"] == 3


def test_the_environment_key_wins_over_the_file(monkeypatch):
    monkeypatch.setenv("MEMSPEC_API_KEY", "from-env")
    assert HttpConfig(api_key="from-file").key() == "from-env"
    monkeypatch.delenv("MEMSPEC_API_KEY")
    assert HttpConfig(api_key="from-file").key() == "from-file"


def test_listen_addresses_and_exposure(caplog, monkeypatch):
    monkeypatch.delenv("MEMSPEC_API_KEY", raising=False)
    assert parse_listen("8080") == HttpAddress("127.0.0.1", 8080)
    assert parse_listen(":8080") == HttpAddress("127.0.0.1", 8080)
    assert parse_listen("[::1]:80").is_loopback and not parse_listen("0.0.0.0:80").is_loopback
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_listen("localhost:http")
    check_exposure(parse_listen("127.0.0.1:8080"), HttpConfig())  # loopback: no key needed
    with pytest.raises(ConfigError, match="beyond loopback and no API key"):
        check_exposure(parse_listen("0.0.0.0:8080"), HttpConfig())
    check_exposure(parse_listen("0.0.0.0:8080"), HttpConfig(api_key=KEY))
    with caplog.at_level(logging.WARNING, logger="memspec.http"):
        check_exposure(parse_listen("0.0.0.0:8080"), HttpConfig(allow_unauthenticated=True))
    assert "without an API key" in caplog.text


def test_status_names_the_http_address(f, capsys):
    from memspec.cli import main

    f.h.servicer.service.listen["http"] = str(f.server.address)  # as the daemon sets it
    assert main(["status", "--address", str(f.h.path)]) == 0
    assert f"and http://127.0.0.1:{f.port}," in capsys.readouterr().out
    assert f.h.client.status()["http_listen"] == f"127.0.0.1:{f.port}"


def test_a_port_in_use_is_a_config_error(f):
    with pytest.raises(ConfigError, match="cannot listen"):
        HttpServer(f.api, HttpAddress("127.0.0.1", f.port))


# -- queue, deadlines, disconnects -------------------------------------------------------------
def test_a_full_queue_is_429_with_retry_after(make):
    f = make(max_concurrent=1, max_queue=0, step_s=0.05)
    s = raw_stream(f.port, chat(max_tokens=40, stream=True))
    wait_for(lambda: f.h.admission.snapshot()["active"] == 1)
    status, hdrs, body = f.post(GOOD)
    assert status == 429 and hdrs["retry-after"] == "1" and body["error"]["type"] == "rate_limit_error"
    s.close()


def test_a_request_past_its_deadline_is_504(make):
    f = make(http=HttpConfig(timeout_seconds=0.3), step_s=0.05)
    t0 = time.monotonic()
    status, _, body = f.post(chat(max_tokens=40))
    assert status == 504 and body["error"]["type"] == "timeout" and time.monotonic() - t0 < 2.0
    wait_for(lambda: f.h.engine.open == 0)
    assert f.h.servicer.counters.to_dict()["cancelled"] == 1


def test_a_queued_request_past_its_deadline_is_504(make):
    f = make(http=HttpConfig(timeout_seconds=0.3), max_concurrent=1, step_s=0.05)
    s = raw_stream(f.port, chat(max_tokens=40, stream=True))
    wait_for(lambda: f.h.admission.snapshot()["active"] == 1)
    status, _, body = f.post(GOOD)
    assert status == 504 and "deadline" in body["error"]["message"]
    s.close()


def test_a_disconnect_mid_stream_cancels_at_once_and_frees_the_kv_cache(make):
    f = make(step_s=0.05)
    s = raw_stream(f.port, chat(max_tokens=50, stream=True))
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    assert f.h.client.status()["kv_bytes"] > 0 and f.h.engine.open == 1
    s.close()
    t0 = time.monotonic()
    wait_for(lambda: f.h.engine.open == 0, timeout=2.0)
    assert time.monotonic() - t0 < 0.5  # within a step or two, not at max_tokens (2.5 s)
    status = f.h.client.status()  # what `memspec status` shows
    assert status["kv_bytes"] == 0 and status["active_streams"] == 0
    assert status["requests"]["cancelled"] == 1 and status["requests"]["completed"] == 0


def test_a_disconnect_while_queued_leaves_the_queue(make):
    f = make(max_concurrent=1, step_s=0.05)
    first = raw_stream(f.port, chat(max_tokens=40, stream=True))
    wait_for(lambda: f.h.admission.snapshot()["active"] == 1)
    queued = raw_stream(f.port, chat(max_tokens=40))
    wait_for(lambda: f.h.admission.snapshot()["waiting"] == 1)
    queued.close()
    wait_for(lambda: f.h.admission.snapshot()["waiting"] == 0, timeout=2.0)
    first.close()
    wait_for(lambda: f.h.engine.open == 0 and f.h.admission.snapshot()["active"] == 0)
    assert f.h.servicer.counters.to_dict()["cancelled"] == 2 and f.h.servicer.counters.to_dict()["started"] == 1


def test_grpc_and_http_share_one_queue(make):
    f = make(max_concurrent=1, max_queue=0, step_s=0.05)
    items = f.h.client.generate("a b c", max_tokens=40)
    next(items)  # the gRPC stream holds the one slot
    assert f.post(GOOD)[0] == 429
    items.close()


# -- /metrics ----------------------------------------------------------------------------------
def test_metrics_parse_and_move_by_exactly_what_a_request_adds(f):
    before = f.metrics()
    assert f.post(chat("one two three", max_tokens=4))[0] == 200
    after = f.metrics()

    def moved(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("memspec_requests_total", (("outcome", "completed"),)) == 1
    assert moved("memspec_requests_total", (("outcome", "invalid"),)) == 0
    assert moved("memspec_requests_started_total") == 1
    assert moved("memspec_prompt_tokens_total") == 3 and moved("memspec_generation_tokens_total") == 4
    assert moved("memspec_time_to_first_token_seconds_count") == 1
    assert moved("memspec_inter_token_latency_seconds_count") == 3  # 4 tokens, one step each
    assert moved("memspec_e2e_request_latency_seconds_count") == 1
    assert moved("memspec_request_queue_time_seconds_count") == 1
    assert after[("memspec_num_requests_running", ())] == 0 and after[("memspec_kv_cache_bytes", ())] == 0
    assert after[("memspec_model_resident_bytes", (("model", "tiny"), ("role", "target"), ("variant", "q4")))] > 0
    assert after[("memspec_process_resident_memory_bytes", ())] > 0 and after[("memspec_serving", ())] == 1
    assert after[("memspec_target_row_invariant", (("model", "tiny"), ("variant", "q4")))] == 1


def test_a_target_whose_rows_round_apart_is_a_zero_gauge(f):
    from memspec.runtime.invariance import RowCheck

    f.h.engine.target.session.rows = RowCheck(exact=False, pad_rows=1, max_diff=0.2, reason="differs")
    assert f.metrics()[("memspec_target_row_invariant", (("model", "tiny"), ("variant", "q4")))] == 0


def test_metrics_show_batch_slots_and_histograms_of_rows_and_tokens_per_pass():
    """GetStatus's batch map as /metrics: slots, slots in use, rows and tokens per pass."""
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from memspec.serving.prometheus import Exporter
    from memspec.speculation.batching import BatchStats

    stats = BatchStats()
    for rows, tokens in ((1, 1), (3, 9), (3, 3), (4, 20)):
        stats.count(rows, tokens, 0.5)

    class Batch:  # Exporter's batch families alone, over that map
        def collect(self):
            return Exporter(None)._batch(stats.to_dict(slots=4, in_use=2))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Batch())
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    assert got[("memspec_batch_slots", ())] == 4 and got[("memspec_batch_slots_in_use", ())] == 2
    assert got[("memspec_batch_busy_seconds_total", ())] == 2.0
    rows = {le: got[("memspec_batch_rows_per_pass_bucket", (("le", le),))] for le in ("1.0", "2.0", "3.0", "4.0", "+Inf")}
    assert rows == {"1.0": 1, "2.0": 1, "3.0": 3, "4.0": 4, "+Inf": 4}
    assert got[("memspec_batch_rows_per_pass_count", ())] == 4 and got[("memspec_batch_rows_per_pass_sum", ())] == 11
    assert got[("memspec_batch_tokens_per_pass_bucket", (("le", "4.0"),))] == 2  # 1 and 3 tokens
    assert got[("memspec_batch_tokens_per_pass_bucket", (("le", "32.0"),))] == 4
    assert list(Exporter(None)._batch({})) == []  # batching off: no batch families


def test_metrics_show_the_prompt_prefix_cache():
    from memspec.serving.prometheus import Exporter

    fams = {f.name: f for f in Exporter(None)._prefixes(
        {"lookups": 5.0, "hits": 4.0, "reused_tokens": 96.0, "entries": 2.0, "bytes": 4096.0})}
    value = {name: f.samples[0].value for name, f in fams.items()}
    assert value == {"memspec_prefix_cache_lookups": 5, "memspec_prefix_cache_hits": 4,
                     "memspec_prefix_cache_reused_tokens": 96, "memspec_prefix_cache_entries": 2,
                     "memspec_prefix_cache_bytes": 4096}
    assert list(Exporter(None)._prefixes({})) == []  # none kept: no families


def test_metrics_show_each_resident_drafts_prompt_prefixes():
    """The scheduler's "draft_prefix.<draft>.<key>" counters become families labelled by draft."""
    from memspec.serving.prometheus import Exporter

    counters = {"loads": 2.0, "suffix.hits": 3.0,
                "draft_prefix.qwen2.5-coder-0.5b-draft.lookups": 6.0, "draft_prefix.qwen2.5-coder-0.5b-draft.hits": 5.0,
                "draft_prefix.qwen2.5-coder-0.5b-draft.reused_tokens": 120.0,
                "draft_prefix.qwen2.5-coder-0.5b-draft.entries": 2.0, "draft_prefix.qwen2.5-coder-0.5b-draft.bytes": 8192.0,
                "draft_prefix.draft-chat.lookups": 1.0}
    got = {(f.name, s.labels["draft"]): s.value for f in Exporter(None)._draft_prefixes(counters) for s in f.samples}
    sib = "qwen2.5-coder-0.5b-draft"
    assert {k: v for k, v in got.items() if k[1] == sib} == {
        ("memspec_draft_prefix_cache_lookups", sib): 6, ("memspec_draft_prefix_cache_hits", sib): 5,
        ("memspec_draft_prefix_cache_reused_tokens", sib): 120, ("memspec_draft_prefix_cache_entries", sib): 2,
        ("memspec_draft_prefix_cache_bytes", sib): 8192}
    assert got[("memspec_draft_prefix_cache_lookups", "draft-chat")] == 1
    assert got[("memspec_draft_prefix_cache_hits", "draft-chat")] == 0  # a key it did not report: 0
    assert list(Exporter(None)._draft_prefixes({"loads": 1.0})) == []  # no draft keeps prompts: no families


def test_grpc_status_and_metrics_read_the_same_counters(f):
    f.h.client.generate("a b", max_tokens=3)  # one by gRPC (a generator: run it)
    list(f.h.client.generate("a b", max_tokens=3))
    f.post(chat(max_tokens=2))
    f.post(chat(max_tokens=0))
    st, m = f.h.client.status()["requests"], f.metrics()
    for outcome in ("completed", "invalid", "cancelled", "rejected", "failed"):
        assert m[("memspec_requests_total", (("outcome", outcome),))] == st[outcome], outcome
    assert m[("memspec_generation_tokens_total", ())] == st["generation_tokens"] == 5
    assert m[("memspec_prompt_tokens_total", ())] == st["prompt_tokens"]


def test_a_streamed_and_a_whole_answer_are_counted_alike(f):
    read_all(raw_stream(f.port, chat(max_tokens=3, stream=True)))
    f.post(chat(max_tokens=3))
    wait_for(lambda: f.h.servicer.counters.to_dict()["completed"] == 2)
    assert f.h.servicer.counters.to_dict()["generation_tokens"] == 6


def test_concurrent_http_streams_all_complete(make):
    f = make(step_s=0.01)
    results = []

    def one(i):
        events = sse_events(read_all(raw_stream(f.port, chat(f"w{i} x y", max_tokens=5, stream=True)))
                            .partition(b"\r\n\r\n")[2])
        results.append("".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(results) == sorted(f"y x w{i} y x " for i in range(8))


def test_a_stream_hears_how_the_load_of_its_target_goes_in_sse_comments(f, monkeypatch, caplog):
    """Issue 45: a request for a pulled target that is not loaded waited half a minute with nothing
    sent. A stream gets its 200 at once and an SSE comment as the load begins and every
    PROGRESS_S after (clients skip comments), then its chunks; the log says it waits; an answer
    that is not streamed gets no comment, only its JSON."""
    import memspec.scheduling.targets as targets

    monkeypatch.setattr(targets, "PROGRESS_S", 0.05)
    gate = threading.Event()
    real = f.h.backend.loader

    def slow(cfg, variant):
        gate.wait(10)
        return real(cfg, variant)

    f.h.backend.loader = slow
    caplog.set_level(logging.INFO, logger="memspec.server")
    s = raw_stream(f.port, {**chat("a b", max_tokens=2, stream=True), "model": "other"})
    got = b""
    while got.count(b": loading other (q4): ") < 2:  # before the load ends: the gate is shut
        got += s.recv(65536)
    assert got.startswith(b"HTTP/1.1 200")
    gate.set()
    raw = got + read_all(s)
    body = raw.partition(b"\r\n\r\n")[2].decode()
    comments = [e for e in body.split("\n\n") if e.startswith(":")]
    assert comments and all(e.startswith(": loading other (q4): ") and e.endswith(" s") for e in comments)
    events = sse_events("\n\n".join(e for e in body.split("\n\n") if e and not e.startswith(":")).encode() + b"\n\n")
    assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                                              for e in events[:-1]) == "b a "
    assert any(r.getMessage() == "request waits for a load" and r.fields["progress"].startswith("loading other")
               for r in caplog.records)
    f.h.client.unload("other")
    gate.clear()
    threading.Timer(0.3, gate.set).start()
    status, _, out = f.post({**chat("a b", max_tokens=2), "model": "other"})
    assert status == 200 and out["choices"][0]["message"]["content"] == "b a "


def test_output_controls_reach_the_request_from_both_endpoints():
    from memspec.request import SamplingParams
    from memspec.serving import openai

    controls = dict(frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.2, min_p=0.05,
                    logit_bias={"5": -100, "7": 3})
    want = SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2, min_p=0.05,
                          logit_bias=((5, -100.0), (7, 3.0)))
    api = openai.parse_chat(chat(**controls), 50)
    assert api.request.sampling == want and api.ignored == ()  # min_p is no longer ignored
    api = openai.parse_completion({"prompt": "a", **controls}, 50)
    assert api.request.sampling == want and api.ignored == ()
