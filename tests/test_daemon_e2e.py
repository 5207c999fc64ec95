"""End to end: the real `memspec serve` process, the real model (q4), real sockets.

One daemon serves the whole module (started once, ~3 s); the lifecycle test
starts its own to kill -9, restart and SIGTERM it.  Requests are kept small
(raw prompts, a few tokens) so the module runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

import fakes
from memspec.serving import wire
from memspec.cli import load_engine, main
from memspec.serving.client import Client
from memspec.config import load_config
from memspec.errors import CancelledError, UnavailableError
from memspec.request import Completion, GenerationRequest, SamplingParams

pb2 = wire.pb2
MAX_TOKENS = 64  # [limits] max_tokens of the test config
MAX_CHARS = 4000  # [limits] max_prompt_chars
CONTEXT = 512  # [runtime] max_context

CONFIG = """\
home = "{home}"
[model]
target = "smollm2-135m"
variant = "q4"
[runtime]
max_context = {context}
# these tests pin ONNX Runtime's session (its padded rows, the q4 graph's bytes); the default engine's
# daemon is tested end to end by test_http_e2e, test_targets_e2e and test_qwen
backend = "onnxruntime"
[limits]
max_tokens = {max_tokens}
max_prompt_chars = {max_chars}
[server]
max_concurrent = 4
max_queue = {max_queue}
grace_seconds = {grace}
[scheduler]
# Equality with local generation needs the same draft at every step: the memspec policy
# picks drafts by timing (what has loaded), and on the 4-bit target a different draft can
# flip a near-tie.  Drafts are exercised by name (test_a_named_draft_is_lossless_and_counted).
policy = "target-only"
"""


class Daemon:
    """A `memspec serve` child process, its socket and its sd_notify messages."""

    def __init__(self, folder: Path, home: Path, name: str = "d", max_queue: int = 32):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.home, self.max_queue = folder, home, max_queue
        self.config = folder / f"{name}.toml"
        self.write_config(max_queue)
        self.sock = folder / f"{name}.sock"
        self.log = folder / f"{name}.log"
        self.notify_path = folder / f"{name}.notify"
        self.notes: list[str] = []
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self.notify_path))
        self._notify.settimeout(0.2)
        self._stop = threading.Event()
        threading.Thread(target=self._listen, daemon=True).start()
        self.proc: subprocess.Popen | None = None
        self.args: list[str] = []  # more `memspec serve` options (tests/test_http_e2e.py: --http)

    def write_config(self, max_queue: int = 32, grace: float = 20.0) -> None:
        self.config.write_text(CONFIG.format(home=self.home, context=CONTEXT, max_tokens=MAX_TOKENS,
                                             max_chars=MAX_CHARS, max_queue=max_queue, grace=grace))

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                self.notes.append(self._notify.recv(4096).decode())
            except (socket.timeout, OSError):
                continue

    def start(self, timeout: float = 90.0) -> "Daemon":
        env = dict(os.environ, MEMSPEC_HOME=str(self.home), NOTIFY_SOCKET=str(self.notify_path),
                   WATCHDOG_USEC="1000000")
        self.notes.clear()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "memspec.cli", "--config", str(self.config), "serve", "--listen", str(self.sock),
                 *self.args],
                env=env, stdout=subprocess.DEVNULL, stderr=log)
        t0 = time.monotonic()
        while not any(n.startswith("READY=1") for n in self.notes):
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise AssertionError(f"daemon did not get ready (rc {self.proc.poll()}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def client(self, **kw) -> Client:
        return Client(str(self.sock), **kw)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self._stop.set()
        self._notify.close()


@contextlib.contextmanager
def http_daemon(home: Path, prefix: str, name: str):
    """A daemon serving HTTP on a free loopback port, in a short-named folder (socket paths are
    limited); yields its base URL, `http://HOST:PORT`."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        dm = Daemon(Path(d), home, name=name)
        dm.args = ["--http", "127.0.0.1:0"]
        dm.start()
        try:
            with dm.client(timeout=60) as c:
                listen = c.status()["http_listen"]
            yield f"http://{listen}"
        finally:
            dm.stop()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # a short path: Unix socket paths are limited to 108 bytes
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ms-e2e-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def daemon(model_store, folder):
    d = Daemon(folder, model_store.home).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    with daemon.client(timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine(daemon):
    return load_engine(load_config(daemon.config))


def run_local(engine, req):
    return next(i for i in engine.stream(req) if isinstance(i, Completion))


def run_remote(client, req):
    chunks, done = [], None
    for item in client.stream(req):
        if isinstance(item, Completion):
            done = item
        else:
            chunks.append(item)
    return chunks, done


wait_for = functools.partial(fakes.wait_for, timeout=20.0, interval=0.05)  # a real daemon: slower polls


# -- serving ------------------------------------------------------------------------------------
def test_systemd_notify_ready_status_and_watchdog(daemon):
    ready = next(i for i, n in enumerate(daemon.notes) if n.startswith("READY=1"))
    assert any(n.startswith("STATUS=loading smollm2-135m") for n in daemon.notes[:ready])
    assert "STATUS=serving smollm2-135m (q4)" in daemon.notes[ready]
    wait_for(lambda: daemon.notes.count("WATCHDOG=1") >= 2, timeout=5)  # every 0.5 s for WATCHDOG_USEC=1 s


def test_socket_mode_is_0660(daemon):
    assert daemon.sock.is_socket() and daemon.sock.stat().st_mode & 0o777 == 0o660


@pytest.mark.parametrize("req", [
    GenerationRequest(prompt="What is the capital of France?", max_tokens=12),
    GenerationRequest(prompt="Once upon a time", raw=True, max_tokens=12,
                      sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)),
    GenerationRequest(messages=(("system", "Be brief."), ("user", "Name a color.")), max_tokens=8,
                      sampling=SamplingParams(temperature=0.7, seed=7), stop=("\n",)),
], ids=["greedy-chat-template", "seeded-sampling-raw", "seeded-chat-stop"])
def test_stream_equals_local_generation(client, engine, req):
    local = run_local(engine, req)
    chunks, remote = run_remote(client, req)
    assert remote.token_ids == local.token_ids
    assert remote.prompt_token_ids == local.prompt_token_ids
    assert remote.text == local.text == "".join(c.text for c in chunks)
    assert remote.finish_reason == local.finish_reason
    assert type(remote.timings) is type(local.timings) and type(remote.stats) is type(local.stats)  # typed both ways
    assert remote.timings.completion_tokens == len(local.token_ids)
    assert remote.timings.prompt_tokens == len(local.prompt_token_ids)


def test_cli_json_has_the_same_keys_local_and_daemon(daemon, capsys):
    args = ["--config", str(daemon.config), "generate", "Hello", "--raw", "--max-tokens", "4", "--json"]
    assert main([*args, "--address", str(daemon.sock)]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main([*args, "--local"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert list(remote) == list(local) == ["prompt_token_ids", "token_ids", "text", "finish_reason", "timings",
                                           "stats", "model", "variant", "seed"]
    assert remote["timings"].keys() == local["timings"].keys() and remote["stats"].keys() == local["stats"].keys()
    assert (remote["token_ids"], remote["text"]) == (local["token_ids"], local["text"])


def test_sixteen_concurrent_clients_all_complete(daemon, client):
    before = client.status()["requests"]["completed"]
    results, errors = {}, []

    def one(i):
        try:
            with daemon.client(timeout=120) as c:
                results[i] = run_remote(c, GenerationRequest(prompt=f"Item {i}:", raw=True, max_tokens=4))[1]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(results) == 16
    assert all(r.finish_reason in ("length", "eos") and 1 <= len(r.token_ids) <= 4 for r in results.values())
    st = client.status()
    assert st["requests"]["completed"] - before == 16
    assert (st["active_streams"], st["queue_depth"], st["kv_bytes"]) == (0, 0, 0)


def test_cancel_mid_stream_frees_its_resources(client, engine):
    before = client.status()
    items = client.generate("Count from one to one hundred:", raw=True, max_tokens=MAX_TOKENS)
    next(items)
    during = client.status()
    assert during["active_streams"] == 1
    # the pages its cache can touch: prompt + max_tokens + a verification pass's slots in each of the
    # target's 30 layers x K,V x 3 heads (the policy is target-only: no draft cache)
    req = GenerationRequest(prompt="Count from one to one hundred:", raw=True, max_tokens=MAX_TOKENS)
    prompt = engine.prompt_ids(req)
    n = len(prompt) + MAX_TOKENS + engine.spec.gamma_max + 1
    target = engine.target.session.cache_nbytes(n)
    n += engine.target.session.min_rows - 1  # a padded one-token pass writes one slot more
    assert target == 2 * 30 * 3 * (-(-n * 64 * 4 // 4096) + 1) * 4096
    assert during["kv_bytes"] == engine.kv_bytes(req, prompt) == target  # admission's and the budget's number
    items.close()  # cancels the call
    wait_for(lambda: client.status()["active_streams"] == 0)
    after = client.status()
    assert after["kv_bytes"] == 0 and after["queue_depth"] == 0
    assert after["requests"]["cancelled"] == before["requests"]["cancelled"] + 1
    assert after["resident"] == before["resident"]  # the target stays; only the stream's state went


def test_status_reports_what_is_resident(client, engine, model_store):
    st = client.status()
    target = st["resident"][0]
    assert (target["name"], target["role"], target["variant"]) == ("smollm2-135m", "target", "q4")
    assert target["bytes"] == model_store.get("smollm2-135m").variants["q4"]["bytes"]
    assert st["resident_bytes"] == sum(m["bytes"] for m in st["resident"]) and st["budget_bytes"] == 0
    # the scheduler owns the drafts: every draft it may use is listed, with its counters
    assert [d["name"] for d in st["drafts"]] == sorted(engine.drafts.drafts)
    assert "prompt-lookup" in engine.drafts.drafts
    assert {"hits", "misses", "evictions"} <= set(st["scheduler"])
    assert 0 < st["system_memory"]["available_bytes"] <= st["system_memory"]["total_bytes"]
    assert st["system_memory"]["process_rss_bytes"] > target["bytes"] // 2
    assert client.health() == "SERVING"
    assert {m["name"]: m["resident_variant"] for m in client.models()}["smollm2-135m"] == "q4"


def test_a_named_draft_is_lossless_and_counted(client, engine):
    req = GenerationRequest(prompt="1, 2, 3, 4, 5, 6,", raw=True, max_tokens=16)
    plain = run_local(engine, req)
    _, spec = run_remote(client, GenerationRequest(prompt=req.prompt, raw=True, max_tokens=16, draft="prompt-lookup"))
    assert spec.token_ids == plain.token_ids  # greedy verification is lossless
    assert list(spec.stats.drafts_used) == ["prompt-lookup"] and spec.stats.num_drafts > 0
    d = next(d for d in client.status()["drafts"] if d["name"] == "prompt-lookup")
    assert d["requests"] >= 1 and d["num_draft_tokens"] >= spec.stats.num_draft_tokens


def test_sighup_reloads_the_config(daemon, client):
    daemon.write_config(max_queue=7)
    daemon.proc.send_signal(signal.SIGHUP)
    try:
        wait_for(lambda: client.status()["max_queue"] == 7, timeout=10)
        # the note is sent before the reload, but the test's listener thread may read it later on a busy machine
        wait_for(lambda: any(n.startswith("RELOADING=1") for n in daemon.notes), timeout=5)
    finally:
        daemon.write_config(max_queue=32)
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: client.status()["max_queue"] == 32, timeout=10)


# -- bad input --------------------------------------------------------------------------------
def _req(**kw):
    return pb2.GenerateRequest(**kw).SerializeToString()


def _utf8(**kw):
    return _req(**kw).replace(b"QQQQ", b"\xc3\x28\xa0\xa1")


def _msg(role="user", content="hi"):
    return [pb2.ChatMessage(role=role, content=content)]


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD = [  # (id, method, serialized request, expected code, field the message names)
    ("no-input", "Generate", _req(), INVALID, "prompt"),
    ("empty-prompt", "Generate", _req(prompt=""), INVALID, "prompt"),
    ("blank-prompt", "Generate", _req(prompt=" \n\t"), INVALID, "prompt"),
    ("long-prompt", "Generate", _req(prompt="x" * (MAX_CHARS + 1)), INVALID, "prompt"),
    ("context-overflow", "Generate", _req(prompt="hello " * 600, raw=True), INVALID, "prompt"),
    ("prompt-and-messages", "Generate", _req(prompt="hi", messages=_msg()), INVALID, "prompt"),
    ("bad-role", "Generate", _req(messages=_msg(role="robot")), INVALID, "messages[0].role"),
    ("empty-role", "Generate", _req(messages=_msg(role="")), INVALID, "messages[0].role"),
    ("empty-user-turn", "Generate", _req(messages=_msg(content="")), INVALID, "messages[0].content"),
    ("long-turn", "Generate", _req(messages=_msg(content="y" * (MAX_CHARS + 1))), INVALID, "messages[0].content"),
    ("raw-chat", "Generate", _req(messages=_msg(), raw=True), INVALID, "raw"),
    ("max-tokens-0", "Generate", _req(prompt="hi", max_tokens=0), INVALID, "max_tokens"),
    ("max-tokens-negative", "Generate", _req(prompt="hi", max_tokens=-1), INVALID, "max_tokens"),
    ("max-tokens-over", "Generate", _req(prompt="hi", max_tokens=MAX_TOKENS + 1), INVALID, "max_tokens"),
    ("temperature-negative", "Generate", _req(prompt="hi", temperature=-0.5), INVALID, "temperature"),
    ("temperature-high", "Generate", _req(prompt="hi", temperature=2.01), INVALID, "temperature"),
    ("temperature-nan", "Generate", _req(prompt="hi", temperature=float("nan")), INVALID, "temperature"),
    ("temperature-inf", "Generate", _req(prompt="hi", temperature=float("inf")), INVALID, "temperature"),
    ("top-p-0", "Generate", _req(prompt="hi", top_p=0.0), INVALID, "top_p"),
    ("top-p-high", "Generate", _req(prompt="hi", top_p=1.01), INVALID, "top_p"),
    ("top-p-nan", "Generate", _req(prompt="hi", top_p=float("nan")), INVALID, "top_p"),
    ("top-k-negative", "Generate", _req(prompt="hi", top_k=-1), INVALID, "top_k"),
    ("top-k-huge", "Generate", _req(prompt="hi", top_k=2_000_000), INVALID, "top_k"),
    ("too-many-stops", "Generate", _req(prompt="hi", stop=[str(i) for i in range(9)]), INVALID, "stop"),
    ("empty-stop", "Generate", _req(prompt="hi", stop=[""]), INVALID, "stop[0]"),
    ("long-stop", "Generate", _req(prompt="hi", stop=["s" * 65]), INVALID, "stop[0]"),
    ("frequency-penalty-high", "Generate", _req(prompt="hi", frequency_penalty=2.5), INVALID, "frequency_penalty"),
    ("presence-penalty-nan", "Generate", _req(prompt="hi", presence_penalty=float("nan")), INVALID,
     "presence_penalty"),
    ("repetition-penalty-0", "Generate", _req(prompt="hi", repetition_penalty=0.0), INVALID, "repetition_penalty"),
    ("min-p-negative", "Generate", _req(prompt="hi", min_p=-0.5), INVALID, "min_p"),
    ("logit-bias-out-of-vocab", "Generate", _req(prompt="hi", logit_bias={49152: 1.0}), INVALID, "logit_bias"),
    ("logit-bias-negative-id", "Generate", _req(prompt="hi", logit_bias={-3: 1.0}), INVALID, "logit_bias"),
    ("logit-bias-high", "Generate", _req(prompt="hi", logit_bias={5: 200.0}), INVALID, "logit_bias"),
    ("unknown-draft", "Generate", _req(prompt="hi", draft="no-such-draft"), INVALID, "draft"),
    ("unknown-policy", "Generate", _req(prompt="hi", policy="no-such-policy"), INVALID, "policy"),
    ("utf8-prompt", "Generate", _utf8(prompt="QQQQ"), INVALID, "prompt"),
    ("utf8-content", "Generate", _utf8(messages=_msg(content="QQQQ")), INVALID, "messages[0].content"),
    ("utf8-role", "Generate", _utf8(messages=_msg(role="QQQQ")), INVALID, "messages[0].role"),
    ("utf8-stop", "Generate", _utf8(prompt="hi", stop=["ok", "QQQQ"]), INVALID, "stop[1]"),
    ("utf8-policy", "Generate", _utf8(prompt="hi", policy="QQQQ"), INVALID, "policy"),
    ("garbage-bytes", "Generate", b"\xff\xff\xff\xff\x0f", INVALID, "request"),
    ("truncated", "Generate", _req(prompt="hello there")[:-3], INVALID, "request"),
    ("load-no-name", "LoadModel", pb2.LoadModelRequest().SerializeToString(), INVALID, "name"),
    ("load-unknown", "LoadModel", pb2.LoadModelRequest(name="no-such-model").SerializeToString(),
     grpc.StatusCode.NOT_FOUND, "model 'no-such-model'"),
    ("load-bad-variant", "LoadModel", pb2.LoadModelRequest(name="smollm2-135m", variant="fp16").SerializeToString(),
     grpc.StatusCode.NOT_FOUND, "model 'smollm2-135m' has no variant 'fp16'"),
    ("unload-unknown", "UnloadModel", pb2.UnloadModelRequest(name="no-such-model").SerializeToString(),
     grpc.StatusCode.NOT_FOUND, "name"),
    # model control stays inside the store: no path is a model name
    ("load-absolute", "LoadModel", pb2.LoadModelRequest(name="/dev/shm/x").SerializeToString(), INVALID, "name"),
    ("load-dotdot", "LoadModel", pb2.LoadModelRequest(name="../x").SerializeToString(), INVALID, "name"),
    ("load-escape", "LoadModel", pb2.LoadModelRequest(name="smollm2-135m/../../..").SerializeToString(), INVALID,
     "name"),
]


def test_bad_inputs_get_the_right_code_and_the_daemon_keeps_serving(daemon, client):
    assert len(BAD) >= 30
    channel = grpc.insecure_channel(f"unix://{daemon.sock}")
    invalid_before = client.status()["requests"]["invalid"]
    wrong = []
    for name, method, data, code, field in BAD:
        path = f"/memspec.v1.MemSpec/{method}"
        try:
            if method == "Generate":
                list(channel.unary_stream(path)(data, timeout=30))
            else:
                channel.unary_unary(path)(data, timeout=30)
            wrong.append(f"{name}: no error")
        except grpc.RpcError as err:
            if err.code() != code or not err.details().startswith(field):
                wrong.append(f"{name}: {err.code().name} {err.details()!r}")
    # a deadline that passes mid-generation
    try:
        list(channel.unary_stream("/memspec.v1.MemSpec/Generate")(
            _req(prompt="Write a long story.", max_tokens=MAX_TOKENS), timeout=0.3))
        wrong.append("deadline: no error")
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            wrong.append(f"deadline: {err.code().name}")
    channel.close()
    assert not wrong, "\n".join(wrong)
    n_generate = sum(1 for b in BAD if b[1] == "Generate")
    wait_for(lambda: client.status()["active_streams"] == 0)
    st = client.status()
    assert st["requests"]["invalid"] - invalid_before == n_generate
    assert client.health() == "SERVING" and daemon.proc.poll() is None
    _, done = run_remote(client, GenerationRequest(prompt="Hi", raw=True, max_tokens=2))
    assert done.finish_reason in ("length", "eos")


# -- reflection -------------------------------------------------------------------------------
REFLECTION_CLIENT = r"""
import json, sys
import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

channel = grpc.insecure_channel(sys.argv[1])
db = ProtoReflectionDescriptorDatabase(channel)
services = db.get_services()
pool = DescriptorPool(db)
service = pool.FindServiceByName("memspec.v1.MemSpec")

def method(name, stream):
    m = service.methods_by_name[name]
    req, resp = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
    call = (channel.unary_stream if stream else channel.unary_unary)(
        f"/{service.full_name}/{name}", request_serializer=req.SerializeToString, response_deserializer=resp.FromString)
    return req, call

Req, generate = method("Generate", True)
text, final = "", None
for r in generate(Req(prompt="Hello", raw=True, max_tokens=4), timeout=60):
    text += r.text
    final = r if r.finish_reason else final
StatusReq, get_status = method("GetStatus", False)
status = get_status(StatusReq(), timeout=10)
print(json.dumps({
    "services": sorted(services), "text": text, "finish_reason": final.finish_reason,
    "completion_tokens": final.stats.completion_tokens, "ids": list(final.completion_token_ids),
    "resident": [m.name for m in status.resident], "state": status.state,
    "memspec_imported": sorted(k for k in sys.modules if k.split(".")[0] == "memspec"),
}))
"""


def test_reflection_only_client_calls_generate_and_status(daemon, engine):
    out = subprocess.run([sys.executable, "-c", REFLECTION_CLIENT, f"unix://{daemon.sock}"], capture_output=True,
                         text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["memspec_imported"] == []
    assert {"memspec.v1.MemSpec", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        got["services"])
    local = run_local(engine, GenerationRequest(prompt="Hello", raw=True, max_tokens=4))
    assert (got["text"], got["ids"], got["finish_reason"]) == (local.text, local.token_ids, local.finish_reason)
    assert got["completion_tokens"] == len(local.token_ids)
    assert (got["resident"][0], got["state"]) == ("smollm2-135m", "serving")


# -- lifecycle ------------------------------------------------------------------------------------
def test_kill9_restart_then_sigterm_drains_in_flight_stream(model_store, folder):
    d = Daemon(folder / "life", model_store.home, name="life").start()
    try:
        d.proc.kill()  # SIGKILL: the socket file stays behind
        d.proc.wait(10)
        assert d.sock.is_socket()
        d.start()  # the stale socket is detected and replaced
        with d.client(timeout=60) as c:
            assert c.health() == "SERVING"
            items = c.generate("1, 2, 3, 4, 5,", raw=True, max_tokens=40)  # counts on: no early EOS
            first = next(items)
            assert not isinstance(first, Completion)
            d.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: any(n.startswith("STOPPING=1") for n in d.notes), timeout=10)
            with Client(str(d.sock), timeout=5) as late:  # while the stream drains
                assert late.health() == "NOT_SERVING"
                with pytest.raises(UnavailableError, match="shutting down"):
                    list(late.generate("Hi", max_tokens=1))
                st = late.status()
                assert st["state"] == "draining" and st["active_streams"] == 1
            rest = list(items)
        done = rest[-1]
        assert isinstance(done, Completion) and done.finish_reason == "length" and len(done.token_ids) == 40
        assert done.text == first.text + "".join(i.text for i in rest[:-1])
        assert d.proc.wait(30) == 0
        assert not d.sock.exists()
        log = [json.loads(line) for line in d.log.read_text().splitlines() if line.startswith("{")]
        assert [e["msg"] for e in log if e["msg"] in ("draining", "stopped")][-2:] == ["draining", "stopped"]
        assert any(e["msg"] == "request" and e["code"] == "OK" and e["completion_tokens"] == len(done.token_ids)
                   for e in log)

        # past the grace, a stream still running is cancelled, and the exit is still clean.  Target only
        # and a short grace: with prompt lookup a fast CPU finished the 64 tokens within a 0.5 s grace
        # (a fresh-clone CI run on an AVX-512 Xeon)
        d.write_config(grace=0.05)
        d.start()
        with d.client(timeout=60) as c:
            items = c.generate("1, 2, 3, 4, 5,", raw=True, max_tokens=MAX_TOKENS, draft="none")
            next(items)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            with pytest.raises((CancelledError, UnavailableError)):
                list(items)
        assert d.proc.wait(30) == 0 and time.monotonic() - t0 < 10
    finally:
        d.stop()


def test_under_a_cgroup_memory_limit_a_request_too_big_is_refused_not_oom_killed(model_store, tmp_path):
    """systemd's MemoryMax= on the daemon: a request whose KV caches would pass the cgroup's limit
    is refused with RESOURCE_EXHAUSTED, the daemon is not OOM-killed, and it goes on serving."""
    import shutil

    from memspec.errors import OverloadedError

    run = shutil.which("systemd-run")
    probe = subprocess.run([run, "--scope", "--quiet", "-p", "MemoryMax=1G", "true"], capture_output=True,
                           text=True, timeout=30) if run else None
    if probe is None or probe.returncode != 0:
        why = "not installed" if probe is None else probe.stderr.strip().splitlines()[0]
        pytest.skip(f"systemd-run --scope is not usable here ({why}): it needs systemd as PID 1")
    sock, conf = tmp_path / "cg.sock", tmp_path / "cg.toml"
    conf.write_text(f'home = "{model_store.home}"\n[runtime]\nmax_context = 8192\n[limits]\nmax_tokens = 8000\n'
                    '[server]\nmemory_headroom_mb = 0\n[scheduler]\npolicy = "target-only"\n')
    # about 400 MiB for the process with the target, so some 300 MiB for KV caches: 8000 tokens need ~370
    proc = subprocess.Popen([run, "--scope", "--quiet", "-p", "MemoryMax=700M", "-p", "MemorySwapMax=0",
                             sys.executable, "-m", "memspec.cli", "--config", str(conf), "serve", "--listen",
                             str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with Client(str(sock), timeout=60) as c:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:
                try:
                    if c.health() == "SERVING":
                        break
                except UnavailableError:
                    pass
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                time.sleep(0.5)
            with pytest.raises(OverloadedError, match="not enough memory"):
                list(c.generate("Count from one to ten thousand.", max_tokens=8000))
            assert proc.poll() is None and c.health() == "SERVING"
            done = [x for x in c.generate("Say hi.", max_tokens=4)][-1]
            assert done.finish_reason in ("length", "eos")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
