"""End to end: the real `memspec serve --http` process and model, through the official `openai`
SDK, curl and raw sockets, side by side with the gRPC client on the same daemon."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from urllib.request import urlopen

import pytest
from openai import BadRequestError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from test_daemon_e2e import Daemon, wait_for

from memspec.request import Completion, GenerationRequest, SamplingParams

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def daemon(model_store):
    with tempfile.TemporaryDirectory(prefix="ms-http-") as d:  # short: socket paths are limited
        dm = Daemon(Path(d), model_store.home, name="h")
        dm.args = ["--http", "127.0.0.1:0"]  # any free port; status tells which
        dm.start()
        yield dm
        dm.stop()


@pytest.fixture(scope="module")
def grpc_client(daemon):
    with daemon.client(timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def base(grpc_client):
    listen = grpc_client.status()["http_listen"]
    assert listen.startswith("127.0.0.1:")
    return f"http://{listen}"


@pytest.fixture(scope="module")
def sdk(base):
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_text(client, req: GenerationRequest) -> str:
    return "".join(i.text for i in client.stream(req) if not isinstance(i, Completion))


def metrics(base: str) -> dict:
    text = urlopen(f"{base}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_health_and_models(base, sdk):
    assert json.loads(urlopen(f"{base}/health", timeout=10).read()) == {"status": "serving"}
    models = {m.id: m for m in sdk.models.list().data}
    assert MODEL in models and models[MODEL].model_extra["memspec"]["resident"]
    assert sdk.models.retrieve(MODEL).id == MODEL


def test_sdk_chat_whole_and_streamed_agree_and_carry_usage(sdk, grpc_client):
    whole = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16)
    text = whole.choices[0].message.content
    req = GenerationRequest(messages=tuple((m["role"], m["content"]) for m in QUESTION), max_tokens=16)
    assert text and text == grpc_text(grpc_client, req) and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.model_extra["memspec"]["model"] == MODEL
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_sdk_completions(sdk, grpc_client):
    out = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    req = GenerationRequest(prompt="The capital of France is", raw=True, max_tokens=8)
    assert out.choices[0].text == grpc_text(grpc_client, req) and out.usage.completion_tokens == 8


def test_the_http_stream_equals_the_grpc_stream(sdk, grpc_client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.7, seed=11,
                                         stream=True)
    http_text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    req = GenerationRequest(messages=tuple((m["role"], m["content"]) for m in messages), max_tokens=24,
                            sampling=SamplingParams(temperature=0.7, seed=11))
    assert http_text == grpc_text(grpc_client, req) and http_text


def test_a_seeded_sampling_request_repeats_exactly(sdk):
    def ask():
        return sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=1.0,
                                           top_p=0.95, seed=1234).choices[0].message.content

    first = ask()
    assert ask() == first
    other = [sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=1.0,
                                         top_p=0.95, seed=s).choices[0].message.content for s in (1, 2, 3)]
    assert any(o != first for o in other)  # the seed matters


ASK = [{"role": "user", "content": "Write a Python function that checks whether a word is a palindrome."}]


def test_a_seed_gives_the_target_only_answer_whatever_the_draft_through_the_sdk_and_grpc(sdk, grpc_client):
    """Issue 68: the same seeded request with the daemon's defaults (the scheduler picks), a named
    draft or prompt lookup is the target-only answer for that seed, through HTTP (n = 1 and 3)
    and gRPC; the response reports the seed."""
    def ask(seed, draft, n=1):
        extra = {"memspec": {"draft": draft}} if draft else {}
        out = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0.9, top_p=0.95,
                                          seed=seed, n=n, extra_body=extra)
        return [c.message.content for c in out.choices], out.model_extra["memspec"]

    drafted = 0
    for seed in range(6):
        (alone,), ext = ask(seed, "none")
        assert ext["seed"] == seed
        for draft in (None, "draft-code", "prompt-lookup"):
            (got,), ext = ask(seed, draft)
            assert got == alone, (seed, draft)
            drafted += ext["num_draft_tokens"]
    assert drafted > 0
    three, ext = ask(40, "draft-code", n=3)
    assert three == [ask(40 + i, "none")[0][0] for i in range(3)] and len(set(three)) > 1
    assert ext["seed"] == 40 and [c["seed"] for c in ext["choices"]] == [40, 41, 42]
    req = GenerationRequest(messages=(("user", ASK[0]["content"]),), max_tokens=16, draft="draft-code",
                            sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=3))
    final = [i for i in grpc_client.stream(req) if isinstance(i, Completion)][0]
    assert final.text == ask(3, "none")[0][0] and final.seed == 3


def test_an_unseeded_sampled_request_reports_a_seed_that_replays_it(sdk, grpc_client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, temperature=1.0)
    out = sdk.chat.completions.create(**kw)
    seed = out.model_extra["memspec"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**53
    again = sdk.chat.completions.create(**kw, seed=seed, extra_body={"memspec": {"draft": "none"}})
    assert again.choices[0].message.content == out.choices[0].message.content
    many = sdk.chat.completions.create(**kw, n=3)
    s = many.model_extra["memspec"]["seed"]
    assert [c["seed"] for c in many.model_extra["memspec"]["choices"]] == [s, s + 1, s + 2]
    replay = sdk.chat.completions.create(**kw, n=3, seed=s)
    assert [c.message.content for c in replay.choices] == [c.message.content for c in many.choices]
    req = GenerationRequest(messages=(("user", ASK[0]["content"]),), max_tokens=16,
                            sampling=SamplingParams(temperature=1.0))
    final = [i for i in grpc_client.stream(req) if isinstance(i, Completion)][0]
    assert final.seed is not None
    replayed = [i for i in grpc_client.stream(dataclasses.replace(
        req, sampling=SamplingParams(temperature=1.0, seed=final.seed))) if isinstance(i, Completion)][0]
    assert replayed.token_ids == final.token_ids
    greedy = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert greedy.model_extra["memspec"]["seed"] is None


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_reads_the_sse_framing(base):
    body = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True})
    out = subprocess.run(["curl", "-sN", f"{base}/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=60, check=True).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["choices"][0]["finish_reason"]


def test_a_disconnect_mid_stream_frees_the_kv_cache(base, grpc_client):
    host, port = base[len("http://"):].split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 64, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    assert grpc_client.status()["kv_bytes"] > 0
    before = grpc_client.status()["requests"]["cancelled"]
    s.close()
    wait_for(lambda: grpc_client.status()["kv_bytes"] == 0 and grpc_client.status()["active_streams"] == 0)
    assert grpc_client.status()["requests"]["cancelled"] == before + 1


def test_metrics_move_by_exactly_one_request(base, sdk, grpc_client):
    wait_for(lambda: grpc_client.status()["active_streams"] == 0)
    before = metrics(base)
    out = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, extra_body={
        "memspec": {"draft": "prompt-lookup"}})
    after = metrics(base)

    def moved(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("memspec_requests_total", (("outcome", "completed"),)) == 1
    assert moved("memspec_prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("memspec_generation_tokens_total") == out.usage.completion_tokens
    assert moved("memspec_time_to_first_token_seconds_count") == 1
    assert moved("memspec_e2e_request_latency_seconds_count") == 1
    ms = out.model_extra["memspec"]
    if ms["draft"]:  # prompt lookup found something to propose
        label = (("draft", ms["draft"]),)
        assert moved("memspec_spec_decode_num_drafts_total", label) == ms["num_drafts"]
        assert moved("memspec_spec_decode_num_accepted_tokens_total", label) == ms["num_accepted_tokens"]
    st = grpc_client.status()
    assert after[("memspec_requests_total", (("outcome", "completed"),))] == st["requests"]["completed"]
    variant = next(m["variant"] for m in st["resident"] if m["role"] == "target")  # q4, or gguf on the native engine
    assert after[("memspec_model_resident_bytes", (("model", MODEL), ("role", "target"), ("variant", variant)))] > 0


def test_logprobs_are_the_targets_and_greedy_picks_the_top_one(sdk):
    out = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens or out.choices[0].finish_reason == "stop"
    assert "".join(e.token for e in entries) == out.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6
    streamed = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, logprobs=True,
                                           top_logprobs=3, stream=True)
    tokens = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in tokens] == [(e.token, round(e.logprob, 4)) for e in entries]
    text = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, logprobs=2)
    assert len(text.choices[0].logprobs.tokens) == 5 and len(text.choices[0].logprobs.top_logprobs[0]) == 2


def post(base: str, path: str, body) -> tuple[int, dict]:
    import urllib.error
    from urllib.request import Request

    req = Request(f"{base}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tokenize_and_detokenize_round_trip_and_refuse_bad_input(base, sdk):
    text = "Hello, world! <|im_end|> ünïcode"
    status, out = post(base, "/tokenize", {"content": text, "add_special": True})
    assert status == 200 and all(isinstance(t, int) for t in out["tokens"]) and 2 in out["tokens"]  # <|im_end|>
    assert post(base, "/detokenize", {"tokens": out["tokens"]}) == (200, {"content": text})
    assert post(base, "/tokenize", {"content": text, "model": MODEL}) == (200, out)
    status, err = post(base, "/detokenize", {"tokens": [1, 49152]})
    assert status == 400 and err["error"]["param"] == "tokens[1]"
    assert "outside the vocabulary" in err["error"]["message"]
    status, err = post(base, "/tokenize", {"content": "hi", "model": "gpt-4o"})
    assert status == 404 and err["error"]["param"] == "model"
    assert sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices  # still serving


def test_penalties_and_logit_bias_through_the_sdk_are_the_grpc_answer(base, sdk, grpc_client):
    plain = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24).choices[0].message.content
    first = post(base, "/tokenize", {"content": plain.split()[0]})[1]["tokens"][0]  # ban the answer's first token
    out = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, frequency_penalty=1.0,
                                      presence_penalty=0.5, logit_bias={str(first): -100},
                                      extra_body={"repetition_penalty": 1.2, "min_p": 0.05})
    text = out.choices[0].message.content
    req = GenerationRequest(messages=tuple((m["role"], m["content"]) for m in QUESTION), max_tokens=24,
                            sampling=SamplingParams(frequency_penalty=1.0, presence_penalty=0.5,
                                                    repetition_penalty=1.2, min_p=0.05,
                                                    logit_bias=((first, -100.0),)))
    assert text != plain and text == grpc_text(grpc_client, req)
    assert first not in post(base, "/tokenize", {"content": text})[1]["tokens"][:1]
    assert "num_accepted_tokens" in out.model_extra["memspec"]  # speculation still reported
    status, err = post(base, "/v1/chat/completions",
                       {"model": MODEL, "messages": QUESTION, "logit_bias": {"49152": 1}})
    assert status == 400 and err["error"]["param"] == "logit_bias"
    assert "outside the vocabulary" in err["error"]["message"]


# -- n choices ----------------------------------------------------------------------------------
def by_index(chunks) -> tuple[dict[int, str], dict[int, list[str]]]:
    """A streamed answer's text and finish reasons per choice index (chat or completions chunks)."""
    texts: dict[int, str] = {}
    finish: dict[int, list[str]] = {}
    for c in chunks:
        for ch in c.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (piece or "")
            if ch.finish_reason:
                finish.setdefault(ch.index, []).append(ch.finish_reason)
    return texts, finish


def test_n_greedy_choices_are_all_the_target_only_answer_whole_and_streamed(sdk):
    one = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16)  # target-only (the policy)
    text = one.choices[0].message.content
    many = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, n=3, logprobs=True,
                                       extra_body={"memspec": {"draft": "prompt-lookup"}})  # lossless per choice
    assert [(c.index, c.message.content) for c in many.choices] == [(i, text) for i in range(3)]
    assert all("".join(e.token for e in c.logprobs.content) == text for c in many.choices)  # each its own
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens
    assert len(many.model_extra["memspec"]["choices"]) == 3
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, n=3, stream=True,
                                              stream_options={"include_usage": True}))
    texts, finish = by_index(chunks)
    assert texts == {i: text for i in range(3)} and finish == {i: [one.choices[0].finish_reason] for i in range(3)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == many.usage.completion_tokens


def test_n_seeded_choices_repeat_differ_and_are_each_the_answer_of_seed_plus_index(sdk):
    def ask(n: int, seed: int) -> list[str]:
        out = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=1.0,
                                          top_p=0.95, seed=seed, n=n)
        return [c.message.content for c in out.choices]

    first = ask(3, 1234)
    assert ask(3, 1234) == first  # reproducible
    assert len(set(first)) > 1  # each choice draws for itself
    assert first == [ask(1, 1234 + i)[0] for i in range(3)]  # choice i: the single request with seed s + i


def test_a_streamed_n2_reassembles_per_index_to_the_whole_answer(sdk):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=5, n=2)
    whole = sdk.completions.create(**kw)
    chunks = list(sdk.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finish = by_index(chunks)
    assert texts == {c.index: c.text for c in whole.choices} and sorted(texts) == [0, 1]
    assert finish == {c.index: [c.finish_reason] for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("n", [0, -1, 5, 129, 1.5, "2"])
def test_a_bad_n_is_a_400_naming_n_and_the_daemon_keeps_serving(sdk, n):
    with pytest.raises(BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"n": n})
    assert err.value.param == "n" and "n:" in err.value.message
    assert len(sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, n=2).choices) == 2


@pytest.fixture(scope="module")
def batching_sdk(model_store):
    """A daemon on the native engine, whose batch loop runs concurrent requests' passes together."""
    with tempfile.TemporaryDirectory(prefix="ms-hb-") as d:
        dm = Daemon(Path(d), model_store.home, name="b")
        dm.config.write_text(dm.config.read_text().replace('backend = "onnxruntime"', 'backend = "native"'))
        dm.args = ["--http", "127.0.0.1:0"]
        dm.start()
        with dm.client(timeout=60) as c:
            yield OpenAI(base_url=f"http://{c.status()['http_listen']}/v1", api_key="unused", max_retries=0,
                         timeout=120), c
        dm.stop()


def test_n_choices_share_batched_passes_and_stay_the_target_only_answer(batching_sdk):
    sdk, client = batching_sdk
    one = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24).choices[0].message.content
    before = client.status()["batch"]
    assert before["slots"] == 4  # [server] max_concurrent rows
    many = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, n=3,
                                       extra_body={"memspec": {"draft": "prompt-lookup"}})
    after = client.status()["batch"]
    assert [c.message.content for c in many.choices] == [one] * 3
    shared = sum(after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("rows_") and k != "rows_1")
    assert shared > 0  # the choices' target passes ran together
