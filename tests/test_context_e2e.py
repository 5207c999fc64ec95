"""Issue 69 end to end: the real `memspec serve --http` on SmolLM2 with a context set for it
([runtime] model_max_context) and prompts fed 16 tokens a pass: the context shown by ps, status
and /v1/models, a 400 with the figures after which the daemon answers on, an answer that ends at the
end of sequence with no max_tokens, and a long streamed prompt that hears its prefill."""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_daemon_e2e import Daemon

from memspec.errors import ContextOverflowError

MODEL = "smollm2-135m"
CONTEXT = 320  # its context in this daemon
CHUNK = 16
LONG = ("Here are the notes of a long meeting about the garden. " * 12 +
        "In one sentence, what was the meeting about?")  # about 160 tokens: 10 chunks of 16

CONFIG = """\
home = "{home}"
[model]
target = "{model}"
[runtime]
backend = "native"
model_max_context = {{ "{model}" = {context} }}
prefill_chunk = {chunk}
prefix_cache_mb = 0
[server]
max_concurrent = 2
[scheduler]
policy = "target-only"
"""


@pytest.fixture(scope="module")
def daemon(model_store):
    with tempfile.TemporaryDirectory(prefix="ms-ctx-") as d:  # short: socket paths are limited
        dm = Daemon(Path(d), model_store.home, name="c")
        dm.config.write_text(CONFIG.format(home=model_store.home, model=MODEL, context=CONTEXT, chunk=CHUNK))
        dm.args = ["--http", "127.0.0.1:0"]
        dm.start()
        yield dm
        dm.stop()


@pytest.fixture(scope="module")
def client(daemon):
    with daemon.client(timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def base(client):
    return f"http://{client.status()['http_listen']}"


def post(base: str, body: dict, path: str = "/v1/completions") -> tuple[int, str]:
    req = urllib.request.Request(f"{base}{path}", json.dumps({"model": MODEL, **body}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_ps_status_and_models_show_the_context_the_target_has(daemon, client, base, capsys):
    from memspec.cli import main

    row = next(t for t in client.status()["targets"] if t["name"] == MODEL)
    assert row["context"] == CONTEXT and row["kv"] == "f16"  # [runtime] kv's default
    assert main(["ps", "--address", str(daemon.sock)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(MODEL))
    assert line.split()[4:7] == [str(CONTEXT), "f16", "loaded"]
    with urllib.request.urlopen(f"{base}/v1/models/{MODEL}", timeout=30) as r:
        ext = json.loads(r.read())["memspec"]
    assert (ext["max_context"], ext["trained_context"], ext["kv"]) == (CONTEXT, 8192, "f16")
    assert f"context of {CONTEXT} tokens (max_context = {CONTEXT})" in daemon.log.read_text()  # logged at load


def test_what_cannot_fit_the_context_is_a_400_with_the_figures_and_the_daemon_answers_on(client, base):
    status, body = post(base, {"prompt": LONG, "max_tokens": 300})
    err = json.loads(body)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "tokens + max_tokens 300 = " in err["message"] and f"the context of {CONTEXT} tokens" in err["message"]
    with pytest.raises(ContextOverflowError, match=f"do not fit the context of {CONTEXT} tokens"):  # gRPC alike
        list(client.generate(LONG, raw=True, max_tokens=300))
    # no max_tokens: the answer runs until the model ends it (finish_reason stop), not cut at a fixed count
    status, body = post(base, {"messages": [{"role": "user", "content": "Answer with one word: what color is the "
                                                                        "sky?"}]}, "/v1/chat/completions")
    out = json.loads(body)
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
    assert 0 < out["usage"]["completion_tokens"] < CONTEXT - out["usage"]["prompt_tokens"]


def test_a_long_streamed_prompt_hears_its_prefill_and_answers_as_a_whole_request_does(daemon, base):
    status, whole = post(base, {"prompt": LONG, "max_tokens": 6})
    assert status == 200
    status, raw = post(base, {"prompt": LONG, "max_tokens": 6, "stream": True})
    events = [e for e in raw.split("\n\n") if e]
    comments = [e for e in events if e.startswith(": prefill: ")]
    assert len(comments) >= 5 and comments[0].startswith(f": prefill: {CHUNK} of ")
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert events.index(comments[-1]) < first_data  # they came while it prefilled, before its first token
    text = "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in events
                   if e.startswith("data: {"))
    assert text == json.loads(whole)["choices"][0]["text"]
    assert "prefill: " in daemon.log.read_text()  # the log says how far it is
