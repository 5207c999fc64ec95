"""The servicer in process, over a fake engine: codes, queueing, cancellation, status.

The daemon's plumbing is real (grpc server on a Unix socket, Client, wire,
admission, EngineBackend); only the engine is a fake that emits one word per
step, so every test runs in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from fakes import wait_for

from memspec import errors
from memspec.serving import wire
from memspec.serving.address import client_address, default_socket, parse
from memspec.serving.admission import Admission, AdmissionConfig, fits
from memspec.serving.backend import EngineBackend
from memspec.serving.client import Client
from memspec.config import Config, ServerConfig
from memspec.errors import (
    ContextOverflowError, DeadlineExceededError, InvalidRequestError, ModelNotFoundError, OverloadedError,
    RemoteError, UnavailableError,
)
from memspec.serving.notify import Notifier
from memspec.request import (Chunk, Completion, Constraint, GenerationRequest, Limits, SpecStats, Timings, Tool,
                             new_tokens, validate)
from memspec.serving.status import DraftStatus, Status
from memspec.serving.server import MemSpecServicer, create_server
from memspec.speculation.sources import DraftPool, DraftRow, SourceStatus
from memspec.runtime.invariance import WARNING, RowCheck
from memspec.speculation.engine import Engine

KV_PER_TOKEN = 1000
CONTEXT = 64
MiB = 1 << 20


# -- a fake engine ------------------------------------------------------------------------
class FakeEngine:
    """Answers with the prompt's words reversed, one per step, `step_s` apart; a sampled request
    starts at word (seed mod the word count) and reports its seed, drawn as the engine draws one."""

    def __init__(self, name: str, variant: str, limits: Limits, step_s: float = 0.0):
        session = SimpleNamespace(layout="gqa", max_context=CONTEXT, kv="q8", device="cpu",
                                  providers=["CPUExecutionProvider"],
                                  kv_bytes_per_token=lambda: KV_PER_TOKEN,
                                  cache_nbytes=lambda tokens: min(tokens, CONTEXT) * KV_PER_TOKEN,
                                  rows=RowCheck(exact=True, pad_rows=1, max_diff=0.0, reason=""))
        manifest = SimpleNamespace(variants={variant: {"bytes": 5 * MiB}})
        self.target = SimpleNamespace(name=name, variant=variant, session=session, manifest=manifest,
                                      file_bytes=5 * MiB)
        self.limits = limits
        self.step_s = step_s
        self.drafts = DraftPool()  # no drafts: "none" or nothing
        self.batch = None  # no batched passes
        self.prefixes = None  # no prompt prefixes kept
        self.open = 0  # streams whose "KV cache" is allocated
        self.requests: list[GenerationRequest] = []  # every request streamed, in order
        self.checks = 0  # requests validated and tokenized
        self.fail = False
        self.closed = 0  # close() calls: its background loading stopped

    def close(self):
        self.closed += 1

    def calibrate(self):
        return None

    def prompt_ids(self, req):
        text = req.prompt if req.prompt is not None else " ".join(c for _, c in req.messages)
        ids = list(range(len(text.split())))
        if len(ids) >= CONTEXT:
            raise ContextOverflowError(f"prompt: {len(ids)} tokens do not fit the context of {CONTEXT} tokens")
        return ids

    def check(self, req):
        validate(req, self.limits)
        self.drafts.check(req)
        self.checks += 1
        return self.prompt_ids(req)

    def max_new(self, req, prompt):
        return new_tokens(req.max_tokens, len(prompt), CONTEXT, self.limits.max_tokens)

    def kv_bytes(self, req, prompt):
        return self.target.session.cache_nbytes(len(prompt) + self.max_new(req, prompt))

    def stream(self, req, cancel=None, prompt=None, progress=None):
        if prompt is None:
            prompt = self.check(req)
        if self.fail:
            raise RuntimeError("boom")
        words = (req.prompt or req.messages[-1][1]).split()[::-1]
        req = dataclasses.replace(req, max_tokens=self.max_new(req, prompt))
        self.requests.append(req)
        seed = Engine.seed_of(req)
        start = seed % len(words) if seed is not None else 0
        self.open += 1
        out, finish = [], "length"
        try:
            for i in range(req.max_tokens):
                time.sleep(self.step_s)
                out.append(i)
                yield Chunk(words[(start + i) % len(words)] + " ", [i])
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
        finally:
            self.open -= 1
        yield Completion(prompt, out, "", finish, Timings(prompt_tokens=len(prompt), completion_tokens=len(out),
                                                          ttft_ms=1.0, tok_per_s=2.0, total_ms=3.0), seed=seed)


class FakeStore:
    def __init__(self):
        self.manifests = {n: SimpleNamespace(name=n, role=role, variants={"q4": {"bytes": 5 * MiB}},
                                             variant_bytes=lambda v: 5 * MiB,
                                             provenance={"source": "test"}, variant_path=self._variant(n),
                                             architecture={"context_length": 4 * CONTEXT})
                          for n, role in (("tiny", "target"), ("other", "target"), ("a-draft", "draft"))}

    @staticmethod
    def _variant(name):
        def variant_path(v):
            if v != "q4":
                raise ModelNotFoundError(f"model {name!r} has no variant {v!r} (has: q4)")
            return Path("/dev/null")
        return variant_path

    def get(self, name):
        if name not in self.manifests:
            raise ModelNotFoundError(f"model {name!r} is not in the store")
        return self.manifests[name]

    def list(self):
        return list(self.manifests.values())

    def gguf_path(self, manifest):
        return getattr(manifest, "gguf", None)  # None: pulled without a GGUF, "auto" runs it in ONNX Runtime

    def gguf_of(self, manifest):
        return manifest.gguf

    def runnable(self, manifest):
        gguf = self.gguf_path(manifest)
        return {**{v: 5 * MiB for v in manifest.variants}, **({"gguf": gguf.stat().st_size} if gguf else {})}


class Harness:
    def __init__(self, tmp: Path, server_cfg: ServerConfig, step_s: float = 0.0, memory: int = 8 << 30,
                 start: bool = True, max_workers: int = 16):
        self.engines: list[FakeEngine] = []
        config = Config(limits=Limits(max_tokens=50, max_prompt_chars=200), server=server_cfg)
        config = replace(config, model=replace(config.model, target="tiny"))

        def loader(cfg, variant):
            e = FakeEngine(cfg.model.target, variant, cfg.limits, step_s)
            self.engines.append(e)
            return e

        self.memory = memory
        # the fake engine offers no drafts (its DraftPool is empty): the store says so before a load
        self.backend = EngineBackend(config, loader, FakeStore(), drafts_of=lambda name: [])
        s = server_cfg
        self.admission = Admission(AdmissionConfig(s.max_concurrent, s.max_queue, s.memory_headroom_mb * MiB),
                                   lambda: self.memory)
        self.servicer = MemSpecServicer(self.backend, self.admission, listen="test")
        self.path = tmp / "t.sock"
        self.server, _ = create_server(self.servicer, f"unix://{self.path}", max_workers=max_workers)
        self.server.start()
        if start:
            self.start()
        self.client = Client(str(self.path), timeout=10)

    def start(self):
        self.backend.start()
        self.servicer.set_state("serving")

    @property
    def engine(self) -> FakeEngine:
        return self.engines[-1]

    def close(self):
        self.client.close()
        self.server.stop(0)


@pytest.fixture
def make(tmp_path):
    made = []

    def factory(**kw):
        cfg = ServerConfig(**{k: kw.pop(k) for k in list(kw) if k in ServerConfig.__dataclass_fields__})
        h = Harness(tmp_path, cfg, **kw)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()


@pytest.fixture
def h(make):
    return make()


def collect(items):
    chunks = []
    for item in items:
        if isinstance(item, Completion):
            return chunks, item
        chunks.append(item)
    raise AssertionError("no Completion")


# -- generation ------------------------------------------------------------------------------
def test_generate_streams_chunks_then_completion_with_stats(h):
    chunks, done = collect(h.client.generate("one two three", max_tokens=4, seed=7))
    assert [c.text for c in chunks] == ["three ", "two ", "one ", "three "]
    assert [c.token_ids for c in chunks] == [[0], [1], [2], [3]]
    assert done.text == "three two one three " and done.token_ids == [0, 1, 2, 3]
    assert done.finish_reason == "length" and done.prompt_token_ids == [0, 1, 2]
    assert done.timings.completion_tokens == 4 and isinstance(done.timings.prompt_tokens, int)
    assert done.stats == SpecStats() and done.stats.draft == ""
    assert (done.model, done.variant) == ("tiny", "q4")
    assert h.engines[-1].checks == 1  # validated and tokenized once, not again when it runs


def test_chat_takes_tuples_and_dicts(h):
    _, done = collect(h.client.chat([("system", "be brief"), {"role": "user", "content": "hello there"}],
                                    max_tokens=2))
    assert done.text == "there hello "


def test_request_fields_round_trip_through_the_wire():
    from memspec.request import PolicyName, SamplingParams

    req = GenerationRequest(prompt="hi", raw=True, max_tokens=9, stop=("a", "b"), draft="none",
                            policy=PolicyName("fixed", "p"),
                            sampling=SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**64 - 1))
    assert wire.request_from_pb(wire.request_to_pb(req)) == req
    chat = GenerationRequest(messages=(("user", "x"),))
    assert wire.request_from_pb(wire.request_to_pb(chat)) == chat
    tools = GenerationRequest(messages=(("user", "x"), ("assistant", "<tool_call>..."), ("tool", "{}")),
                              tools=(Tool("f", "does f", '{"type": "object"}'), Tool("g")), tool_choice="function:g",
                              constraint=None)
    assert wire.request_from_pb(wire.request_to_pb(tools)) == tools
    for c in (Constraint("json_schema", "{}", field="json_schema"), Constraint("json_object", field="json_object"),
              Constraint("grammar", 'root ::= "a"', field="grammar")):
        req = GenerationRequest(prompt="x", constraint=c)
        assert wire.request_from_pb(wire.request_to_pb(req)) == req
    assert wire.request_from_pb(wire.pb2.GenerateRequest(prompt="x")) == GenerationRequest(prompt="x")
    with pytest.raises(InvalidRequestError, match="policy: unknown policy 'fastest'; known: target-only, fixed:<draft>"):
        wire.request_from_pb(wire.pb2.GenerateRequest(prompt="x", policy="fastest"))  # parsed once, here


# -- bad input -------------------------------------------------------------------------------
BAD = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": "x" * 201}, "prompt"),
    ({"prompt": " ".join(["w"] * CONTEXT)}, "prompt"),
    ({"prompt": "hi", "messages": [wire.pb2.ChatMessage(role="user", content="x")]}, "prompt"),
    ({"messages": [wire.pb2.ChatMessage(role="robot", content="x")]}, "messages[0].role"),
    ({"messages": [wire.pb2.ChatMessage(role="user", content="")]}, "messages[0].content"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 51}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -3}, "top_k"),
    ({"prompt": "hi", "stop": [""]}, "stop[0]"),
    ({"prompt": "hi", "draft": "nope"}, "draft"),
    ({"prompt": "hi", "policy": "nope"}, "policy"),
    ({"prompt": "hi", "json_schema": "{}", "grammar": 'root ::= "a"'}, "grammar"),  # at most one
    ({"prompt": "hi", "tools": [wire.pb2.Tool(description="no name")]}, "tools[0].function.name"),
    ({"prompt": "hi", "tools": [wire.pb2.Tool(name="f")], "tool_choice": "function:g"}, "tool_choice.function.name"),
    ({"prompt": "hi", "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("fields,name", BAD, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD)])
def test_bad_field_is_invalid_argument_naming_it(h, fields, name):
    call = h.client._stub.Generate(wire.pb2.GenerateRequest(**fields), timeout=5)
    with pytest.raises(grpc.RpcError) as exc:
        list(call)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith(name + ":"), exc.value.details()


HUGE = "x" * (600 << 10)  # 600 kB: within the largest request, far more than an error's details can carry


@pytest.mark.parametrize("fields,name", [
    ({"prompt": "hi", "draft": HUGE}, "draft"),
    ({"prompt": "hi", "policy": HUGE}, "policy"),
    ({"prompt": "hi", "policy": "fixed:" + HUGE}, "policy"),
    ({"messages": [wire.pb2.ChatMessage(role=HUGE, content="x")]}, "messages[0].role"),
])
def test_a_huge_name_is_a_clean_invalid_argument_that_quotes_a_short_prefix(h, fields, name, caplog):
    call = h.client._stub.Generate(wire.pb2.GenerateRequest(**fields), timeout=10)
    with pytest.raises(grpc.RpcError) as exc:
        list(call)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED from the metadata
    details = exc.value.details()
    assert details.startswith(name + ":") and len(details) < 300, details[:300]
    assert all(len(r.getMessage()) + len(str(getattr(r, "fields", ""))) < 2000 for r in caplog.records)
    assert h.client.health() == "SERVING"


def test_requests_are_bounded_before_templating_and_a_larger_message_is_refused_by_grpc(h):
    many = [wire.pb2.ChatMessage(role="user", content="x")] * 257
    call = h.client._stub.Generate(wire.pb2.GenerateRequest(messages=many), timeout=10)
    with pytest.raises(grpc.RpcError) as exc:
        list(call)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == "messages: 257 messages; at most 256"
    long = [wire.pb2.ChatMessage(role="user", content="y" * 200), wire.pb2.ChatMessage(role="assistant",
                                                                                      content="z" * 262000)]
    with pytest.raises(grpc.RpcError) as exc:
        list(h.client._stub.Generate(wire.pb2.GenerateRequest(messages=long), timeout=10))
    assert exc.value.details() == "messages: 262200 characters in all; at most 262144"
    too_big = "w" * (Limits().request_bytes() + 1)
    with pytest.raises(grpc.RpcError) as exc:
        list(h.client._stub.Generate(wire.pb2.GenerateRequest(prompt=too_big), timeout=10))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # grpc refuses it before parsing
    assert h.client.health() == "SERVING" and collect(h.client.generate("still here", max_tokens=2))[1].text


def test_client_rebuilds_the_named_exception(h):
    with pytest.raises(ContextOverflowError, match="context of 64"):
        list(h.client.generate(" ".join(["w"] * 100)))
    with pytest.raises(InvalidRequestError, match=r"max_tokens: 0 is out of range; allowed 1\.\.50"):
        list(h.client.generate("hi", max_tokens=0))
    with pytest.raises(InvalidRequestError, match="prompt: is not valid UTF-8"):
        list(h.client.generate("\ud800"))


def _raw_generate(h, data: bytes):
    call = h.client._channel.unary_stream("/memspec.v1.MemSpec/Generate")(data, timeout=5)
    with pytest.raises(grpc.RpcError) as exc:
        list(call)
    return exc.value


@pytest.mark.parametrize("field", ["prompt", "messages[0].content", "stop[1]", "draft"])
def test_invalid_utf8_is_invalid_argument_naming_the_field(h, field):
    marker = "QQQQ"
    msg = {
        "prompt": wire.pb2.GenerateRequest(prompt=marker),
        "messages[0].content": wire.pb2.GenerateRequest(messages=[wire.pb2.ChatMessage(role="user", content=marker)]),
        "stop[1]": wire.pb2.GenerateRequest(prompt="hi", stop=["ok", marker]),
        "draft": wire.pb2.GenerateRequest(prompt="hi", draft=marker),
    }[field]
    err = _raw_generate(h, msg.SerializeToString().replace(marker.encode(), b"\xff\xfeQQ"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"{field}: is not valid UTF-8"
    assert dict(err.trailing_metadata())[wire.ERROR_KEY] == "InvalidRequestError"


def test_bytes_that_are_no_request_are_invalid_argument(h):
    err = _raw_generate(h, b"\xff\xff\xff\xff")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request:")
    collect(h.client.generate("still serving", max_tokens=1))


def test_an_internal_error_is_internal_and_the_daemon_keeps_serving(h):
    h.engine.fail = True
    with pytest.raises(RemoteError, match="INTERNAL.*boom"):
        list(h.client.generate("hi"))
    h.engine.fail = False
    collect(h.client.generate("hi", max_tokens=1))
    assert h.client.status()["requests"]["failed"] == 1


# -- queue, memory, deadlines, cancellation -----------------------------------------------------
def test_full_queue_is_resource_exhausted(make):
    h = make(max_concurrent=1, max_queue=0, step_s=0.05)
    first = h.client.generate("slow one", max_tokens=50)
    next(first)
    with pytest.raises(OverloadedError, match=r"queue is full.*max_concurrent=1.*max_queue=0"):
        list(h.client.generate("hi", max_tokens=1))
    first.close()


class Hints(DraftPool):
    """The scheduler's side of queue hints: the requests it was told will wait."""

    def __init__(self):
        super().__init__()
        self.queued = []

    def hint(self, reqs):
        self.queued += [r.prompt for r in reqs]


def test_queued_request_waits_for_a_slot_and_its_draft_is_preloaded_meanwhile(make):
    h = make(max_concurrent=1, max_queue=4, step_s=0.02)
    h.engine.drafts = hints = Hints()
    first = h.client.generate("a b", max_tokens=10)
    next(first)
    result = {}
    t = threading.Thread(target=lambda: result.update(done=collect(h.client.generate("c d", max_tokens=2))[1]))
    t.start()
    wait_for(lambda: h.client.status()["queue_depth"] == 1)
    collect(first)
    t.join(5)
    assert result["done"].text == "d c " and result["done"].finish_reason == "length"
    assert hints.queued == ["c d"]  # the one that had to wait, not the one that started at once


def test_a_failing_queue_hint_does_not_fail_the_request(make):
    class Failing(DraftPool):
        def hint(self, reqs):
            raise RuntimeError("predictor broke")

    h = make(max_concurrent=1, max_queue=4, step_s=0.02)
    h.engine.drafts = Failing()
    first = h.client.generate("a b", max_tokens=10)
    next(first)
    result = {}
    t = threading.Thread(target=lambda: result.update(done=collect(h.client.generate("c d", max_tokens=2))[1]))
    t.start()
    collect(first)
    t.join(5)
    assert result["done"].text == "d c "


def test_request_over_free_memory_is_resource_exhausted(make):
    h = make(memory=300 * MiB, memory_headroom_mb=300)
    # no max_tokens: to the end of the context (64 tokens) within [limits] max_tokens (50), whose KV does not
    # fit: RESOURCE_EXHAUSTED (HTTP 507), naming what it asked for beside the memory's figures
    with pytest.raises(errors.InsufficientMemoryError, match=r"prompt 1 tokens \+ max_tokens 50\): its KV cache "
                                                             r"needs 0 MiB but the system has 300 MiB available"):
        list(h.client.generate("hi"))
    h.memory = 8 << 30  # the daemon keeps serving
    collect(h.client.generate("hi", max_tokens=1))


def test_deadline_while_generating(make):
    h = make(step_s=0.05)
    with pytest.raises(DeadlineExceededError):
        list(h.client.generate("hi", max_tokens=50, timeout=0.3))
    wait_for(lambda: h.engine.open == 0)
    st = h.client.status()
    assert st["active_streams"] == 0 and st["kv_bytes"] == 0


def test_deadline_while_queued(make):
    h = make(max_concurrent=1, step_s=0.05)
    first = h.client.generate("slow", max_tokens=50)
    next(first)
    with pytest.raises(DeadlineExceededError):
        list(h.client.generate("hi", max_tokens=1, timeout=0.3))
    first.close()


def test_cancel_mid_stream_frees_the_stream_at_once(make):
    h = make(step_s=0.02)
    items = h.client.generate("a b c", max_tokens=50)
    next(items)
    st = h.client.status()
    assert st["active_streams"] == 1 and st["kv_bytes"] == (3 + 50) * KV_PER_TOKEN  # prompt + max_tokens
    items.close()  # cancels the call
    wait_for(lambda: h.engine.open == 0 and h.client.status()["active_streams"] == 0)
    st = h.client.status()
    assert st["kv_bytes"] == 0 and st["requests"]["cancelled"] == 1


# -- lifecycle, admin, status ------------------------------------------------------------------
def test_starting_and_draining_are_unavailable_and_not_serving(make):
    h = make(start=False)
    assert h.client.health() == "NOT_SERVING"
    with pytest.raises(UnavailableError, match="starting: loading tiny"):
        list(h.client.generate("hi"))
    h.start()
    assert h.client.health() == "SERVING"
    h.servicer.set_state("draining")
    assert h.client.health() == "NOT_SERVING"
    with pytest.raises(UnavailableError, match="shutting down"):
        list(h.client.generate("hi"))
    assert h.client.status()["state"] == "draining"


def test_load_and_unload(h):
    first = h.engine
    assert h.client.unload("tiny") == 5 * MiB
    assert first.closed == 1  # an unloaded engine stops its loader thread
    assert h.client.status()["resident"] == []
    with pytest.raises(ModelNotFoundError):
        h.client.unload("tiny")
    _, done = collect(h.client.generate("hi", max_tokens=1))  # the default target loads again on demand
    assert done.model == "tiny" and h.engine is not first
    with pytest.raises(ModelNotFoundError, match="model 'nope' is not in the store"):  # the store's own words
        h.client.load("nope")
    with pytest.raises(ModelNotFoundError, match="no variant 'fp16'"):
        h.client.load("other", "fp16")
    with pytest.raises(InvalidRequestError, match="is a draft"):
        h.client.load("a-draft")
    # "gguf" (what status lists a native target as) where this target has no GGUF for the native engine
    with pytest.raises(InvalidRequestError, match="'gguf' is the native engine's, which does not run 'other'"):
        h.client.load("other", "gguf")
    out = h.client.load("other")
    assert out["model"]["name"] == "other" and out["model"]["bytes"] == 5 * MiB
    _, done = collect(h.client.generate("x y", max_tokens=1))
    assert done.model == "other"  # LoadModel made it the default target
    models = {m["name"]: m for m in h.client.models()}
    assert models["other"]["resident"] and models["other"]["resident_variant"] == "q4"
    assert models["tiny"]["resident"] and models["tiny"]["variants"] == {"q4": 5 * MiB}  # no budget: both stay
    tiny, other = h.engines[-2:]
    h.backend.close()  # daemon shutdown
    assert (tiny.closed, other.closed) == (1, 1) and h.backend.engine is None


def test_a_target_pulled_with_its_gguf_alone_loads_on_the_native_engine(h, tmp_path):
    """No ONNX graph, only the GGUF (a pull where the native engine runs targets): it loads as q4, planned
    at the mapped file's footprint, and is listed with its GGUF."""
    from memspec.runtime import kernels
    from memspec.runtime.plan import NATIVE_FOOTPRINT_PER_FILE_BYTE

    if not kernels.available():
        pytest.skip(kernels.NOT_BUILT)
    gguf = tmp_path / "bare.gguf"
    gguf.write_bytes(b"GGUF" + bytes(4 * MiB))
    bare = SimpleNamespace(name="bare", role="target", variants={}, provenance={"source": "test"}, gguf=gguf,
                           architecture={},
                           variant_path=FakeStore._variant("bare"))
    h.backend.store.manifests["bare"] = bare
    assert h.backend._plan("bare", None) == ("q4", int(gguf.stat().st_size * NATIVE_FOOTPRINT_PER_FILE_BYTE))
    assert h.backend._plan("bare", "gguf")[0] == "q4"
    with pytest.raises(ModelNotFoundError, match="no variant 'fp32'"):
        h.backend._plan("bare", "fp32")
    out = h.client.load("bare")
    assert out["model"]["name"] == "bare" and h.engine.target.variant == "q4"
    assert {m["name"]: m for m in h.client.models()}["bare"]["variants"] == {"gguf": gguf.stat().st_size}


def test_status_reports_what_exists(h):
    collect(h.client.generate("hi", max_tokens=1))
    st = h.client.status()
    assert st["state"] == "serving" and st["listen"] == "test"
    assert st["resident"] == [{"name": "tiny", "role": "target", "variant": "q4", "bytes": 5 * MiB,
                               "device": "cpu", "providers": ["CPUExecutionProvider"], "row_invariant": True,
                               "exactness": ""}]
    assert st["resident_bytes"] == 5 * MiB and st["budget_bytes"] == 0 and st["warnings"] == []
    assert st["drafts"] == [] and st["predictor"] == {} and st["scheduler"] == {}
    assert st["system_memory"]["total_bytes"] > 0 and st["system_memory"]["process_rss_bytes"] > 0
    assert st["requests"]["started"] == 1 and st["requests"]["completed"] == 1
    assert (st["max_concurrent"], st["max_queue"], st["queue_depth"], st["active_streams"]) == (4, 32, 0, 0)


def test_a_target_whose_rows_round_apart_says_so_in_status(h, capsys):
    """The self-check at load found that a row's logits depend on the pass's row count: GetStatus
    and `memspec status` say that speculative output may differ, and why."""
    from memspec.cli import main

    reason = "a row's logits differ by up to 0.19 between passes of 1 and 5 rows"
    h.engine.target.session.rows = RowCheck(exact=False, pad_rows=1, max_diff=0.19, reason=reason)
    st = h.client.status()
    assert st["warnings"] == [f"{WARNING}: {reason}"]
    assert st["resident"][0]["row_invariant"] is False and st["resident"][0]["exactness"] == reason
    assert main(["status", "--address", str(h.path)]) == 0
    assert f"warning   {WARNING}: {reason}\n" in capsys.readouterr().out


def test_status_takes_scheduler_and_predictor_counters_from_their_objects(h):
    class Reporting(DraftPool):
        def report(self):
            return SourceStatus([DraftRow("d", True, 7)], None, {"evictions": 2.0}, {"predictions": 5.0})

    h.engine.drafts = Reporting()
    h.backend.record(Completion([], [], "", "length", stats=SpecStats(drafts_used={"d": 3}, num_drafts=3,
                                                                      num_draft_tokens=12, num_accepted_tokens=9)))
    st = h.client.status()
    assert st["scheduler"] == {"evictions": 2.0} and st["predictor"] == {"predictions": 5.0}
    (d,) = st["drafts"]
    assert (d["name"], d["bytes"], d["requests"], d["num_draft_tokens"]) == ("d", 7, 1, 12)
    assert d["acceptance_rate"] == 0.75 and d["mean_acceptance_length"] == 4.0

    # the same tree typed on both sides of the wire: what the daemon built is what the CLI reads
    local, remote = h.servicer.status(), Status.from_dict(st)
    assert isinstance(local, Status) and isinstance(remote.drafts[0], DraftStatus)
    moving = ("uptime_s", "system_memory")  # read again for each call
    assert dataclasses.replace(remote, **{k: getattr(local, k) for k in moving}) == local
    assert remote.drafts[0].acceptance_rate == 0.75 and remote.requests.completed == local.requests.completed


def test_status_shows_the_prompt_prefix_cache_where_the_engine_keeps_one(h):
    from memspec.runtime.prefixes import PrefixCache

    assert h.client.status()["prefix_cache"] == {}  # none kept: an empty map
    h.engine.prefixes = PrefixCache(1 << 20)
    h.engine.prefixes.stats.lookups, h.engine.prefixes.stats.hits, h.engine.prefixes.stats.reused_tokens = 4, 3, 60
    st = h.client.status()["prefix_cache"]
    assert (st["lookups"], st["hits"], st["reused_tokens"], st["entries"], st["bytes"]) == (4, 3, 60, 0, 0)


def test_no_daemon_is_unavailable_and_says_how_to_start_one(tmp_path):
    """Issue 45: with no daemon, `memspec status` printed gRPC's internals (FAILED_PRECONDITION ...);
    it says what is wrong in words, and how to start a daemon or generate without one."""
    with Client(str(tmp_path / "none.sock"), timeout=2) as c:
        with pytest.raises(UnavailableError, match=r"no memspec daemon answers at .*none.sock \(no socket there\); "
                                                   r"start one with `memspec serve`") as err:
            c.status()
    assert "memspec generate --local" in str(err.value) and "FAILED_PRECONDITION" not in str(err.value)


# -- pure pieces -------------------------------------------------------------------------------
def test_fits_checks_free_memory_minus_headroom():
    assert fits(10, 1000, 100) is None
    assert fits(10, 110, 100) is None
    assert "the system has 105 MiB available" in fits(10 * MiB, 105 * MiB, 100 * MiB)
    # a running request's KV pages are not written yet: what it reserved is not free for another
    assert fits(10, 1000, 100, reserved=880) is None
    assert "35 MiB are reserved by running requests" in fits(10 * MiB, 140 * MiB, 100 * MiB, reserved=35 * MiB)


def test_the_old_server_budget_option_says_where_the_budget_went(tmp_path):
    from memspec.config import load_config
    from memspec.errors import ConfigError

    cfg = tmp_path / "m.toml"
    cfg.write_text("[server]\nmemory_budget_mb = 512\n")
    with pytest.raises(ConfigError, match=r"\[server\] memory_budget_mb is gone: .*\[scheduler\] budget_mb"):
        load_config(cfg)


def test_a_fraction_for_a_whole_number_option_is_refused(tmp_path):
    from memspec.config import load_config
    from memspec.errors import ConfigError

    cfg = tmp_path / "m.toml"
    cfg.write_text("[speculative]\nlookup_ngram = 2.5\n")
    with pytest.raises(ConfigError, match=r"\[speculative\] lookup_ngram must be int, got 2.5"):
        load_config(cfg)
    cfg.write_text("[speculative]\nlookup_ngram = 3\np_min = 1\n")  # a whole number is a fine float
    assert load_config(cfg).speculative.draft_limits().lookup_ngram == 3


def test_batching_is_auto_by_default_takes_a_bool_and_refuses_anything_else(tmp_path):
    """[runtime] batching: "auto" (on for the native engine, off for ONNX Runtime's second graph),
    or true/false as said."""
    from memspec.config import load_config
    from memspec.errors import ConfigError
    from memspec.runtime.config import NATIVE_VARIANT
    from memspec.runtime.plan import batching_on

    cfg = tmp_path / "m.toml"
    assert load_config(None).runtime.batching == "auto"
    assert batching_on("auto", NATIVE_VARIANT) and not batching_on("auto", "q4")
    for text, want in (("true", True), ("false", False), ('"auto"', "auto")):
        cfg.write_text(f"[runtime]\nbatching = {text}\n")
        assert load_config(cfg).runtime.batching == want
        assert batching_on(want, "q4") == (want is True) and batching_on(want, NATIVE_VARIANT) == (want is not False)
    cfg.write_text("[runtime]\nbatching = 2\n")
    with pytest.raises(ConfigError, match=r"\[runtime\] batching must be str, got 2"):
        load_config(cfg)
    cfg.write_text('[runtime]\nbatching = "sometimes"\n')
    with pytest.raises(ConfigError, match=r"batching: 'sometimes' is not a choice; use true, false or \"auto\""):
        batching_on(load_config(cfg).runtime.batching, NATIVE_VARIANT)


def test_a_provider_list_holds_names(tmp_path):
    """A number in a provider list was let through and failed at load time with a TypeError."""
    from memspec.config import load_config
    from memspec.errors import ConfigError

    cfg = tmp_path / "m.toml"
    for line in ('providers = [1]', 'draft_providers = ["CPUExecutionProvider", 2]', 'providers = "auto"'):
        cfg.write_text(f"[runtime]\n{line}\n")
        with pytest.raises(ConfigError, match=r"\[runtime\] \w*providers must be a list of strings"):
            load_config(cfg)
    cfg.write_text('[runtime]\ndraft_providers = ["CPUExecutionProvider"]\n')
    assert load_config(cfg).runtime.draft_providers == ("CPUExecutionProvider",)


def test_admission_is_fifo_and_releases():
    adm = Admission(AdmissionConfig(max_concurrent=1, max_queue=1), lambda: 1 << 40)
    a = adm.enter(5)
    assert adm.snapshot() == {"active": 1, "waiting": 0, "kv_bytes": 5}
    got = []
    t = threading.Thread(target=lambda: got.append(adm.enter(7, timeout=5)))
    t.start()
    wait_for(lambda: adm.snapshot()["waiting"] == 1)
    with pytest.raises(OverloadedError):
        adm.enter(1)
    a.release()
    a.release()  # idempotent
    t.join(5)
    assert adm.snapshot() == {"active": 1, "waiting": 0, "kv_bytes": 7}
    adm.close()
    with pytest.raises(UnavailableError):
        adm.enter(1)


def test_error_table_covers_every_named_exception():
    for name, cls in wire.NAMED.items():
        if cls not in (errors.MemspecError, errors.RemoteError) and name != "CLIError":
            assert wire.code_for(cls("x")) != grpc.StatusCode.INTERNAL, name
    assert wire.code_for(ContextOverflowError("x")) == grpc.StatusCode.INVALID_ARGUMENT


def test_addresses():
    assert default_socket({}, 0) == Path("/run/memspec/memspec.sock")
    assert default_socket({"XDG_RUNTIME_DIR": "/run/user/5"}, 5) == Path("/run/user/5/memspec/memspec.sock")
    assert default_socket({}, 5) == Path("/tmp/memspec-5/memspec.sock")
    assert default_socket({"RUNTIME_DIRECTORY": "/run/memspec"}, 99) == Path("/run/memspec/memspec.sock")
    assert parse("unix:///a/b.sock").target == "unix:///a/b.sock"
    assert parse("/a/b.sock").path == Path("/a/b.sock")
    assert parse("50051").target == "127.0.0.1:50051" and parse(":7").is_loopback
    assert parse("0.0.0.0:80").target == "0.0.0.0:80" and not parse("0.0.0.0:80").is_loopback
    with pytest.raises(errors.ConfigError):
        parse("nonsense")
    assert client_address(None, {"MEMSPEC_ADDRESS": "/x.sock"}).path == Path("/x.sock")


def test_a_client_refuses_a_tmp_socket_folder_another_user_made_first():
    """/tmp/memspec-$UID made by someone else: a client would send its prompts to their daemon."""
    import os
    import shutil

    if os.geteuid() != 0:
        pytest.skip("makes a folder owned by another user: needs root (CI and the dev machines are)")
    uid = 4_000_000 + os.getpid() % 1000  # nobody's: the folder below is root's, so not this user's
    folder = Path(f"/tmp/memspec-{uid}")
    folder.mkdir(mode=0o700)
    try:
        with pytest.raises(errors.ConfigError, match=f"/tmp/memspec-{uid} is a link, not yours, or open to others"):
            client_address(None, {}, uid=uid)
        os.chown(folder, uid, -1)  # now it is that user's, and private: fine
        assert client_address(None, {}, uid=uid).path == folder / "memspec.sock"
        folder.chmod(0o777)  # open to others: refused
        with pytest.raises(errors.ConfigError):
            client_address(None, {}, uid=uid)
    finally:
        shutil.rmtree(folder)
    assert client_address(None, {}, uid=uid).path == folder / "memspec.sock"  # none yet: fine


def test_notifier_sends_datagrams(tmp_path):
    import socket

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "3000000"})
        assert n.watchdog_interval == 1.5
        assert n.ready("up") and n.watchdog()
        assert s.recv(256).decode().startswith("READY=1\nSTATUS=up\nMAINPID=")
        assert s.recv(256) == b"WATCHDOG=1"
    assert not Notifier({}).ready("x") and Notifier({}).watchdog_interval is None
    assert Notifier({"WATCHDOG_USEC": "5", "WATCHDOG_PID": "1"}).watchdog_interval is None


def test_a_long_load_keeps_extending_systemds_timeout_and_pinging_its_watchdog(tmp_path):
    import socket

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(2)
        n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})  # pings every 0.1 s
        with n.busy(every_s=10.0):
            time.sleep(0.35)
        got = []
        s.settimeout(0.2)
        try:
            while True:
                got.append(s.recv(256).decode())
        except socket.timeout:
            pass
    assert got[0] == "EXTEND_TIMEOUT_USEC=30000000" and got.count("WATCHDOG=1") >= 3, got


# -- the CLI's choice between the daemon and local generation ----------------------------------
def _args(**kw):
    return SimpleNamespace(**{"local": False, "variant": None, "address": None, **kw})


def test_cli_falls_back_to_local_with_a_note_when_no_daemon_serves(tmp_path, monkeypatch, capsys):
    from memspec.cli import _daemon

    monkeypatch.delenv("MEMSPEC_ADDRESS", raising=False)
    monkeypatch.setattr("memspec.serving.address.default_socket", lambda env=None, uid=None: tmp_path / "none.sock")
    monkeypatch.setattr("memspec.serving.address.SYSTEM_SOCKET", tmp_path / "system.sock")
    assert _daemon(_args()) is None
    assert "no daemon at" in capsys.readouterr().err
    assert _daemon(_args(local=True)) is None and _daemon(_args(variant="fp32")) is None


def test_cli_uses_the_daemon_it_finds_or_is_told(h, monkeypatch):
    from memspec.cli import CLIError, _daemon

    monkeypatch.delenv("MEMSPEC_ADDRESS", raising=False)
    monkeypatch.setattr("memspec.serving.address.default_socket", lambda env=None, uid=None: h.path)
    with _daemon(_args()) as found:
        assert found.address.path == h.path
    with _daemon(_args(address=str(h.path))) as told:
        assert told.health() == "SERVING"
    with pytest.raises(CLIError, match="--variant picks the local engine"):
        _daemon(_args(address=str(h.path), variant="fp32"))
    with _daemon(_args(address=str(h.path), target="other")) as named:  # --model asks the daemon
        assert named.health() == "SERVING"
    h.servicer.set_state("draining")
    assert _daemon(_args()) is None  # not serving: local, with a note


def test_a_call_that_ended_while_it_was_checked_is_not_queued_or_run(h):
    """context.add_callback returns False once the RPC has terminated: the request must stop
    there, not queue and prefill for a client that has gone."""
    class Gone:
        def peer(self):
            return "test"

        def add_callback(self, fn):
            return False

        def time_remaining(self):
            return None

        def abort(self, code, details):
            raise AssertionError("not aborted here: the error propagates to the guard")

    with pytest.raises(errors.CancelledError, match="cancelled before it started"):
        list(h.servicer.Generate(wire.pb2.GenerateRequest(prompt="a b", max_tokens=5), Gone()))
    assert h.engine.open == 0 and h.admission.snapshot()["active"] == 0
    assert h.servicer.counters.to_dict()["cancelled"] == 1 and h.servicer.counters.to_dict()["started"] == 0


def test_a_reconfigure_during_a_load_model_is_not_lost(make):
    """SIGHUP while LoadModel runs: the new limits hold for the engine that was loading."""
    import dataclasses

    h = make()
    loading, go = threading.Event(), threading.Event()
    load_engine = h.backend.loader

    def slow_loader(cfg, variant):
        loading.set()
        go.wait(5)
        return load_engine(cfg, variant)

    h.backend.loader = slow_loader
    t = threading.Thread(target=h.backend.load, args=("other", None))
    t.start()
    assert loading.wait(5)
    new = dataclasses.replace(h.backend.config, limits=Limits(max_tokens=7))
    h.backend.reconfigure(new)  # what the daemon's SIGHUP does, while the load runs
    go.set()
    t.join(5)
    assert h.backend.config.model.target == "other"
    assert h.backend.config.limits.max_tokens == 7 and h.engine.limits.max_tokens == 7


def test_sighup_with_the_socket_gone_keeps_the_daemon(tmp_path):
    from memspec.serving.daemon import Daemon

    sock, conf = tmp_path / "d.sock", tmp_path / "d.toml"
    conf.write_text("[server]\nsocket_mode = 0o600\n")
    d = Daemon(Config(), str(conf), f"unix://{sock}", loader=lambda cfg, variant: None)
    d.reload()  # the socket file does not exist: the chmod fails, the reload does not
    assert d.config.server.socket_mode == 0o600


def test_sigterm_while_the_target_loads_stops_the_daemon_at_once(tmp_path, model_store):
    """A first start measures the pass costs during the load (a minute or more on a small board):
    `systemctl stop` then must not wait for it.  The main thread keeps answering signals while the
    load runs on its own thread; SIGTERM stops listening, removes the socket and returns 0."""
    import os
    import signal

    from memspec.serving.daemon import Daemon

    entered, release, killed = threading.Event(), threading.Event(), []

    def stuck_loader(cfg, variant):  # a load that takes as long as the test wants
        entered.set()
        release.wait(30)
        raise RuntimeError("released after the test")

    sock = tmp_path / "d.sock"
    d = Daemon(Config(home=str(model_store.home)), None, f"unix://{sock}", loader=stuck_loader)

    def stop_once_loading():
        assert entered.wait(30)
        killed.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=stop_once_loading)
    killer.start()
    try:
        assert d.run() == 0  # in the main thread, where signals arrive
        took = time.monotonic() - killed[0]
    finally:
        release.set()
        killer.join(5)
    assert entered.is_set() and d.load_abandoned
    assert not sock.exists()
    assert took < 10, f"stopping took {took:.1f} s: it waited for the load"


def test_admission_counts_what_running_requests_reserved_but_have_not_written():
    """Free memory does not yet show a running request's KV pages: a second request that would
    fit only if the first never wrote its cache waits for it."""
    free = 160 * MiB  # stays the same: the first request has not written its cache yet
    adm = Admission(AdmissionConfig(max_concurrent=4, max_queue=4, headroom_bytes=0), lambda: free)
    first = adm.enter(100 * MiB)
    started = threading.Event()

    def second():
        with adm.enter(100 * MiB, timeout=5):
            started.set()

    t = threading.Thread(target=second)
    t.start()
    assert not started.wait(0.3)  # 160 free, but 100 of it is the first one's
    first.release()
    assert started.wait(5)
    t.join(5)


def test_a_jetson_is_recognised_by_its_release_file_or_its_gpu_nodes(tmp_path):
    from memspec.serving.daemon import is_jetson

    (tmp_path / "dev").mkdir()
    assert not is_jetson(tmp_path)
    (tmp_path / "dev" / "nvhost-ctrl-gpu").touch()
    assert is_jetson(tmp_path)
    other = tmp_path / "other"
    (other / "etc").mkdir(parents=True)
    (other / "etc" / "nv_tegra_release").write_text("# R36 (release), REVISION: 4.0\n")
    assert is_jetson(other)


def test_a_tokenizer_error_is_a_named_status_not_internal():
    assert wire.code_for(errors.TokenizerError("bad merges")) == grpc.StatusCode.FAILED_PRECONDITION
    assert wire.code_for(errors.ChatTemplateError("bad turn")) == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_status_stay_answerable_under_a_flood_of_streams(make):
    """200 streams at once against 1 slot and a queue of 1: the streams beyond them are refused
    at once (RESOURCE_EXHAUSTED), and health and GetStatus keep answering meanwhile."""
    from collections import Counter

    from memspec.serving.daemon import SPARE_WORKERS

    h = make(max_concurrent=1, max_queue=1, step_s=0.05, max_workers=1 + 1 + SPARE_WORKERS)  # as the daemon sizes it
    codes, answered = Counter(), []

    def stream():
        try:
            list(h.client._stub.Generate(wire.pb2.GenerateRequest(prompt="a b c", max_tokens=20), timeout=30))
            codes["OK"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1

    threads = [threading.Thread(target=stream) for _ in range(200)]
    for t in threads:
        t.start()
    for _ in range(20):
        t0 = time.perf_counter()
        assert h.client.health(timeout=5) == "SERVING"
        assert h.client.status(timeout=5)["max_queue"] == 1
        answered.append(time.perf_counter() - t0)
    for t in threads:
        t.join(30)
    assert codes["OK"] >= 2 and codes["OK"] + codes["RESOURCE_EXHAUSTED"] == 200, codes
    assert max(answered) < 2.0, max(answered)


def test_a_request_runs_on_the_engine_that_checked_it_even_across_a_load_model(h):
    """Its prompt ids come from that engine's tokenizer: they must not run on another one."""
    req = GenerationRequest(prompt="a b c", max_tokens=3)
    first = h.engine
    checked = h.backend.check(req)
    h.backend.load("other", None)  # LoadModel between check and open
    assert h.engine is not first and h.backend.engine is h.engine
    run = h.backend.open(req, threading.Event(), checked)
    assert run.model == "tiny"
    items = list(run.items)
    assert first.checks == 1 and h.engine.checks == 0 and items[-1].finish_reason == "length"


def test_wait_until_serving_stops_for_a_dead_process_and_at_its_timeout(tmp_path):
    """The benchmarks' start-up wait (serving.client.wait_until_serving): False at once when the
    process is gone, False after the timeout when nothing answers, never an exception."""
    import time

    from memspec.serving.client import wait_until_serving

    sock = str(tmp_path / "nobody.sock")
    t0 = time.monotonic()
    assert wait_until_serving(sock, lambda: False, 30) is False and time.monotonic() - t0 < 1
    t0 = time.monotonic()
    assert wait_until_serving(sock, lambda: True, 0.5, poll=0.1) is False and 0.4 < time.monotonic() - t0 < 5


def test_a_request_names_its_target_and_keep_alive_and_ps_shows_them(h, capsys):
    """gRPC's model and keep_alive: another pulled target answers, loaded on demand; GetStatus and
    `memspec ps` show what is loaded, for how long, and what its loads cost."""
    from memspec.cli import main

    _, done = collect(h.client.generate("a b", max_tokens=1, model="other", keep_alive="10m"))
    assert done.model == "other"
    rows = {t["name"]: t for t in h.client.status()["targets"]}
    assert rows["other"]["keep_alive_s"] == 600 and rows["tiny"]["keep_alive_s"] == -1  # the default is kept
    assert (rows["other"]["state"], rows["other"]["loads"], rows["other"]["active"]) == ("loaded", 1, 0)
    assert main(["ps", "--address", str(h.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "VAR", "SIZE", "CONTEXT", "KV", "STATE", "UNLOADS", "RESIDENT", "DRAFTS"]
    assert out[1].split()[0] == "other" and "in 600 s" in out[1] and "resident drafts: none yet" in out[1]
    assert out[1].split()[4:7] == [str(CONTEXT), "q8", "loaded"]  # the context the engine has, in tokens, and its KV
    assert rows["other"]["context"] == CONTEXT and rows["other"]["kv"] == "q8"
    assert out[2].split()[0] == "tiny" and "never (kept)" in out[2]
    with pytest.raises(ModelNotFoundError, match="model: 'nope' is not in the store; the pulled targets are ") as err:
        list(h.client.generate("a", model="nope"))
    assert "GET /v1/models" not in str(err.value)  # gRPC's answer names no HTTP route (issue 45)
    with pytest.raises(InvalidRequestError, match="model: 'a-draft' is a draft; name a target"):
        list(h.client.generate("a", model="a-draft"))
    with pytest.raises(InvalidRequestError, match="keep_alive: 'soon' is not a duration"):
        wire.request_from_pb(wire.pb2.GenerateRequest(prompt="a", keep_alive="soon"))


def test_the_cli_asks_the_daemon_for_the_model_it_names(h, capsys, monkeypatch, tmp_path):
    """Issue 45: `memspec generate --address SOCK --model NAME` was refused although HTTP and the
    Python client load a pulled model on demand; the CLI asks the daemon for it too, and its own
    store (empty here) is not consulted: the daemon answers from its store."""
    from memspec.cli import main

    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path / "empty-store"))
    assert main(["generate", "--address", str(h.path), "--model", "other", "--json", "--max-tokens", "2", "a b"]) == 0
    got = capsys.readouterr()
    out = json.loads(got.out)
    assert out["model"] == "other" and out["text"] == "b a "
    assert "memspec: other is not loaded; the daemon loads it first" in got.err  # gRPC streams nothing meanwhile
    assert main(["generate", "--address", str(h.path), "--model", "other", "--max-tokens", "1", "a b"]) == 0
    assert "not loaded" not in capsys.readouterr().err
    assert {t["name"]: t["state"] for t in h.client.status()["targets"]}["other"] == "loaded"
    assert main(["chat", "--address", str(h.path), "--model", "nope", "hi"]) == 2
    assert "model: 'nope' is not in the store" in capsys.readouterr().err


def test_an_unknown_draft_is_refused_before_its_target_loads(h):
    """Issue 45: a request naming a pulled target that is not loaded and an unknown draft loaded the
    target first (perhaps unloading others to make room), then got INVALID_ARGUMENT. Every check
    that needs no weights comes first: an unknown model before its draft, then the draft."""
    loads = len(h.engines)
    with pytest.raises(InvalidRequestError, match="draft: unknown draft 'nope'; available: none"):
        list(h.client.generate("a", model="other", draft="nope"))
    with pytest.raises(InvalidRequestError, match="policy: unknown draft 'nope'"):
        list(h.client.generate("a", model="other", policy="fixed:nope"))
    with pytest.raises(ModelNotFoundError, match="model: 'gone' is not in the store"):
        list(h.client.generate("a", model="gone", draft="nope"))
    assert len(h.engines) == loads and "other" not in {t["name"] for t in h.client.status()["targets"]}
    _, done = collect(h.client.generate("a b", max_tokens=1, model="other", draft="none"))
    assert done.model == "other" and len(h.engines) == loads + 1


def test_what_status_ps_and_unload_say_agrees(h, capsys, tmp_path):
    """Issue 45's small inconsistencies: `unload nosuch` listed a target twice (its batched row too);
    `ps` showed the variant asked for (q4) where status showed the one running (gguf); `status`
    listed drafts that `ps` said were none, without saying which were loaded."""
    from memspec.cli import main

    e = h.engine
    e.batch = SimpleNamespace(target=SimpleNamespace(weight_bytes=0), report=lambda: {})  # a batched row
    e.target.variant = "gguf"  # the native engine runs the GGUF for a request of q4
    e.drafts = DraftPool({"d": SimpleNamespace(name="d", nbytes=MiB, session=None)})
    with pytest.raises(ModelNotFoundError, match=r"'nosuch' is not resident \(resident: tiny\)$"):
        h.client.unload("nosuch")
    st = h.client.status()
    assert [t["variant"] for t in st["targets"]] == [m["variant"] for m in st["resident"] if m["role"] == "target"]
    assert main(["ps", "--address", str(h.path)]) == 0
    assert "tiny" in (row := capsys.readouterr().out.splitlines()[1]) and " gguf " in row
    assert main(["status", "--address", str(h.path)]) == 0
    drafts = [line for line in capsys.readouterr().out.splitlines() if line.startswith("draft ")]
    assert drafts and all(" resident: " in line or " not loaded: " in line for line in drafts), drafts


def test_status_and_models_into_a_closed_pipe_end_quietly(h, tmp_path):
    """`memspec status | head -1` and `memspec models | head -1` ended in a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    for argv in (["status", "--address", str(h.path)], ["models"]):
        r, w = os.pipe()
        os.close(r)  # the reader has gone before a byte is written
        try:
            p = subprocess.run([sys.executable, "-m", "memspec.cli", *argv], stdout=w, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "MEMSPEC_HOME": str(tmp_path)}, timeout=60)
        finally:
            os.close(w)
        assert p.returncode == 141 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_output_controls_cross_the_wire_and_unset_ones_stay_unset():
    from memspec.request import SamplingParams

    s = SamplingParams(temperature=0.5, min_p=0.1, frequency_penalty=1.0, presence_penalty=-0.5,
                       repetition_penalty=1.1, logit_bias=((3, -100.0), (9, 2.5)))
    m = wire.request_to_pb(GenerationRequest(prompt="hi", sampling=s))
    assert wire.request_from_pb(wire.pb2.GenerateRequest.FromString(m.SerializeToString())).sampling == s
    plain = wire.request_to_pb(GenerationRequest(prompt="hi"))
    assert not any(plain.HasField(f) for f in ("min_p", "frequency_penalty", "presence_penalty",
                                               "repetition_penalty")) and not plain.logit_bias
    with pytest.raises(InvalidRequestError, match="^logit_bias: token id 3 is given twice"):
        wire.request_to_pb(GenerationRequest(prompt="hi", sampling=SamplingParams(logit_bias=((3, 1.0), (3, 2.0)))))


def test_out_of_range_controls_are_invalid_argument_and_the_daemon_keeps_serving(h):
    from memspec.request import SamplingParams

    for bad, field in ((SamplingParams(presence_penalty=3.0), "presence_penalty"),
                       (SamplingParams(min_p=-1.0), "min_p"),
                       (SamplingParams(logit_bias=((2, -101.0),)), "logit_bias")):
        with pytest.raises(InvalidRequestError, match=f"^{field}: "):
            list(h.client.stream(GenerationRequest(prompt="a b", max_tokens=2, sampling=bad)))
    done = list(h.client.generate("a b", max_tokens=2, frequency_penalty=1.0, logit_bias={1: 5.0}))[-1]
    assert done.finish_reason == "length"
