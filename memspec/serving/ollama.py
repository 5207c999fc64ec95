"""Ollama's API's wire types: its JSON bodies -> memspec requests, and what goes back.

Ollama's docs (ollama/ollama docs/api.md) are the spec and its clients the test.  A body is
translated into the OpenAI route's own fields and read by memspec.serving.openai's parsers, so
both routes share one reading of sampling, tools, keep_alive and the default of max_tokens;
what only Ollama has is read here:

    options      temperature, top_k, top_p, min_p, seed, stop, presence_penalty, frequency_penalty
                 as they are (seed -1: a fresh one, as Ollama's default); num_predict -> max_tokens
                 (-1, -2 or absent: the route's default);
                 repeat_penalty -> repetition_penalty; num_ctx and the runner's own knobs (num_thread,
                 num_gpu, mirostat, ...) are accepted and change nothing (listed as ignored)
    format       "json" (any JSON object) or a JSON schema: the request's Constraint
    stream       true unless false (Ollama streams by default), as NDJSON lines
    model        a store name, with or without a tag: "smollm2-135m", "smollm2-135m:latest", and
                 "NAME:TAG" for the store's "NAME-TAG" ("qwen2.5-coder:1.5b")

Fields memspec cannot honour (images, suffix, template, context, think) are refused naming the
field.  Answers carry Ollama's counts and durations (nanoseconds) and memspec's speculation
statistics in an extra field, "memspec", with the seed a sampled answer was drawn with (the
OpenAI route's object: sent back as options.seed, it gives the answer again).  Errors leave as
{"error": "..."}.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from memspec.errors import INTERNAL, InvalidRequestError, status_of
from memspec.models.tools import ToolCall
from memspec.request import Constraint, quote
from memspec.serving import openai

EXTENSION = openai.EXTENSION  # "memspec": the extra field of answers, and a request's own options
LATEST = "latest"  # the tag Ollama gives a name that has none
DONE_REASONS = {"stop": "stop", "eos": "stop", "length": "length", "cancelled": "stop"}  # memspec -> Ollama

# options: Ollama's name -> the OpenAI route's field
_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "repeat_penalty": "repetition_penalty", "num_predict": "max_tokens"}
_INTS = {"top_k", "seed", "num_predict", "num_ctx"}
# options that tune Ollama's runner (llama.cpp): accepted, as Ollama accepts them, and changing nothing here
_RUNNER = {"num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "low_vram", "f16_kv",
           "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only", "tfs_z", "typical_p",
           "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline"}
# request fields memspec cannot honour: refused, naming the field, when they are given
_REFUSED = {
    "images": "images are not supported: memspec's targets read text only",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "template": "a prompt template of the request's own is not supported; memspec applies the model's chat "
                "template (send \"raw\": true with the whole prompt instead)",
    "context": "context (the token ids of an earlier answer) is not supported; send the conversation to /api/chat",
}
# what validate() names, as the Ollama field the client sent
_RENAMED = {"max_tokens": "options.num_predict", "repetition_penalty": "options.repeat_penalty",
            **{k: f"options.{k}" for k in ("temperature", "top_k", "top_p", "min_p", "seed", "stop",
                                          "presence_penalty", "frequency_penalty")}}


@dataclass(frozen=True)
class OllamaRequest:
    """One /api/chat or /api/generate request (the interface of openai.ApiRequest the HTTP layer uses)."""

    kind: str  # "chat" or "generate"
    name: str  # the model as the client named it, which the answers echo
    api: openai.ApiRequest  # the request as the OpenAI route reads it (model mapped to a store name)
    stream: bool = True
    ignored: tuple[str, ...] = ()  # fields and options that change nothing here

    n = 1  # one answer

    @property
    def request(self):
        return self.api.request

    @property
    def tools(self) -> bool:
        return self.api.tools

    @property
    def tool_names(self) -> frozenset[str]:
        return self.api.tool_names

    def choice(self, index: int):
        return self.api.choice(index)


def _bad(name: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name}: {msg}")


_kind = openai._kind


def model_name(given: str, names: set[str]) -> str:
    """The store name a client's model name stands for: "NAME" or "NAME:latest" for NAME, and
    "NAME:TAG" for the store's "NAME-TAG" where `names` has it (else it stays as given, to be
    refused naming the models there are)."""
    base, colon, tag = given.partition(":")
    if not colon:
        return given
    if tag in ("", LATEST):
        return base
    return f"{base}-{tag}" if f"{base}-{tag}" in names else given


def tagged(name: str) -> str:
    """A store name as Ollama lists one: with its tag."""
    return name if ":" in name else f"{name}:{LATEST}"


def _options(options: Any) -> tuple[dict, list[str]]:
    """Ollama's options -> (the OpenAI route's fields, the options ignored)."""
    if options is None:
        return {}, []
    if not isinstance(options, dict):
        raise _bad("options", f"must be an object, got {_kind(options)}")
    out, ignored = {}, []
    for key, value in options.items():
        where = f"options.{key}"
        if value is None:
            continue
        if key in _INTS:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(where, f"must be an integer, got {_kind(value)} {quote(str(value), 32)}")
        elif key == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise _bad(where, f"must be an array of strings, got {_kind(value)}")
        elif key in _OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise _bad(where, f"must be a number, got {_kind(value)} {quote(str(value), 32)}")
        if key == "seed" and value < 0:  # Ollama's default, -1: a fresh seed each request
            continue
        if key == "num_predict":
            if value < 0:  # -1: until the end (the route's default); -2: until the context is full, the same here
                continue
            if value == 0:
                raise _bad(where, "0 tokens asked for; give at least 1, or -1 for the default")
        if key in _OPTIONS:
            out[_OPTIONS[key]] = value
        else:
            ignored.append(where)
    return out, ignored


def _format(value: Any) -> Constraint | None:
    """format: "json" (any JSON object) or a JSON schema (an object); "" or null: free text."""
    if value is None or value == "":
        return None
    if value == "json":
        return Constraint("json_object", field="format")
    if isinstance(value, dict):
        return Constraint("json_schema", json.dumps(value), field="format")
    shown = quote(value, 32) if isinstance(value, str) else _kind(value)
    raise _bad("format", f"{shown}: give \"json\" or a JSON schema (an object)")


def _common(body: Any, names: set[str]) -> tuple[str, dict, list[str]]:
    """(the model as named, the OpenAI route's fields shared by both endpoints, ignored names)."""
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_kind(body)}")
    name = body.get("model", body.get("name"))  # "name": older clients'
    if name is not None and (not isinstance(name, str) or not name):
        raise _bad("model", f"must be a model's name, got {_kind(name)}")
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, [], "", {}):
            raise _bad(key, why)
    if body.get("think") not in (None, False):
        raise _bad("think", "thinking is not supported by memspec's targets; drop it or send false")
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise _bad("stream", f"must be true or false, got {_kind(stream)}")
    fields, ignored = _options(body.get("options"))
    if name:
        fields["model"] = model_name(name, names)
    fields["stream"] = stream
    for key in ("keep_alive", EXTENSION):
        if body.get(key) is not None:
            fields[key] = body[key]
    return name or "", fields, ignored


def load_only(kind: str, body: Any) -> bool:
    """A request with no messages (chat) or no prompt (generate): Ollama's way to load a model, or
    with keep_alive 0 to unload it.  It parses with a stand-in turn, and nothing is generated."""
    return isinstance(body, dict) and not body.get("messages" if kind == "chat" else "prompt")


_STAND_IN = "."  # the turn a load-only request parses with


def _request(kind: str, name: str, api: openai.ApiRequest, body: dict, fields: dict, ignored: list[str],
             known: set[str]) -> OllamaRequest:
    constraint = _format(body.get("format"))
    if constraint is not None:
        api = replace(api, request=replace(api.request, constraint=constraint))
    ignored = ignored + sorted(set(body) - known)
    return OllamaRequest(kind, name or api.request.model or "", api, fields["stream"], tuple(ignored))


_SHARED = {"model", "name", "stream", "options", "format", "keep_alive", "think", EXTENSION, *_REFUSED}


def parse_chat(body: Any, max_tokens_limit: int, names: set[str]) -> OllamaRequest:
    """A /api/chat body (InvalidRequestError naming a bad field); `names`: the store's models."""
    name, fields, ignored = _common(body, names)
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise _bad("messages", f"must be an array of {{\"role\", \"content\"}} objects, got {_kind(messages)}")
    turns = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            if m.get("images"):
                raise _bad(f"messages[{i}].images", _REFUSED["images"])
            if m.get("thinking"):
                m = {k: v for k, v in m.items() if k != "thinking"}  # an earlier answer's thoughts: not replayed
            m = {k: v for k, v in m.items() if k not in ("images", "tool_name")}
        turns.append(m)
    oa = dict(fields, messages=turns or [{"role": "user", "content": _STAND_IN}], tools=body.get("tools"))
    api = openai.parse_chat(oa, max_tokens_limit)
    return _request("chat", name, api, body, fields, ignored, _SHARED | {"messages", "tools"})


def parse_generate(body: Any, max_tokens_limit: int, names: set[str]) -> OllamaRequest:
    """A /api/generate body: the prompt under the chat template (with `system` as its system turn),
    or as it is with "raw": true."""
    name, fields, ignored = _common(body, names)
    prompt = body.get("prompt")
    prompt = "" if prompt is None else openai._text(prompt, "prompt")
    system = body.get("system")
    system = "" if system is None else openai._text(system, "system")
    raw = openai._bool(body, "raw")
    prompt = prompt or _STAND_IN  # none: a load (load_only)
    if raw:
        if system:
            raise _bad("system", "a raw prompt has no chat template to put a system turn in")
        api = openai.parse_completion(dict(fields, prompt=prompt), max_tokens_limit)
    else:
        turns = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": prompt}]
        api = openai.parse_chat(dict(fields, messages=turns), max_tokens_limit)
    return _request("generate", name, api, body, fields, ignored, _SHARED | {"prompt", "system", "raw"})


def parse_model(body: Any, names: set[str]) -> tuple[str, str]:
    """/api/show's and /api/pull's {"model": NAME} (or "name"): (as named, the store's name)."""
    if not isinstance(body, dict):
        raise _bad("body", f"must be a JSON object, got {_kind(body)}")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise _bad("model", f"must be a model's name, got {_kind(name)}")
    return name, model_name(name, names)


# -- errors ------------------------------------------------------------------------------------
def error(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and Ollama's error body, {"error": message}, for an exception; a field the
    request's checks name by the OpenAI route's name is named as the client sent it."""
    st = status_of(exc)
    message = str(exc) if st is not INTERNAL else f"internal error: {type(exc).__name__}: {exc}"
    head, colon, rest = message.partition(": ")
    field, bracket, index = head.partition("[")  # stop[1]: options.stop[1]
    if colon and field in _RENAMED:
        message = f"{_RENAMED[field]}{bracket}{index}: {rest}"
    elif colon and head.startswith("response_format"):
        message = f"format: {rest}"
    return st.http, {"error": message}


# -- answers ------------------------------------------------------------------------------------
def now() -> str:
    """created_at: UTC, as Ollama writes it."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(ms: float) -> int:
    return int(round(ms * 1e6))


def chunk(req: OllamaRequest, text: str, calls: list[ToolCall] = ()) -> dict:
    """One streamed line: a piece of the answer (and the calls it completes)."""
    out = {"model": req.name, "created_at": now()}
    if req.kind == "generate":
        out["response"] = text
    else:
        out["message"] = {"role": "assistant", "content": text}
        if calls:
            out["message"]["tool_calls"] = [tool_call(c) for c in calls]
    out["done"] = False
    return out


def tool_call(call: ToolCall) -> dict:
    """A call as Ollama gives one: its arguments an object, not JSON text."""
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments)}}


def final(req: OllamaRequest, item, total_s: float, load_s: float, text: str = "",
          calls: list[ToolCall] = ()) -> dict:
    """The last line (streamed), or the whole answer with its text: done, why, counts and durations.

    total_duration: the request's arrival to its end; load_duration: the time it waited for its
    target to be loaded (and its prompt checked); prompt_eval_*: the prompt and its prefill (which
    also gives the first token); eval_*: the tokens generated and the decode steps after the first."""
    c = item.completion
    out = chunk(req, text, calls)
    out.update(done=True, done_reason=DONE_REASONS.get(c.finish_reason, c.finish_reason),
               total_duration=int(total_s * 1e9), load_duration=int(load_s * 1e9),
               prompt_eval_count=len(c.prompt_token_ids), prompt_eval_duration=_ns(c.timings.ttft_ms),
               eval_count=len(c.token_ids), eval_duration=_ns(c.timings.decode_ms))
    out[EXTENSION] = dict(openai.memspec_stats([item]), cached_prompt_tokens=c.timings.cached_prompt_tokens)
    return out


def loaded(req: OllamaRequest, unloaded: bool, total_s: float) -> dict:
    """The answer to a request with no prompt: its model was loaded (or unloaded)."""
    out = chunk(req, "")
    out.update(done=True, done_reason="unload" if unloaded else "load", total_duration=int(total_s * 1e9))
    return out


# -- the store and the loaded set ------------------------------------------------------------------
def _quantization(row: dict) -> str:
    """The GGUF's quantization as its file name says it (SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1)."""
    stem = row.get("provenance", {}).get("gguf_file", "").rsplit(".gguf", 1)[0]
    tail = stem.replace("-", ".").rsplit(".", 1)[-1] if stem else ""
    return tail.upper() if tail[:1].upper() in ("Q", "F", "B", "I") and any(ch.isdigit() for ch in tail) else ""


def _parameter_size(arch: dict) -> str:
    """An estimate of the parameter count from the hyper-parameters (Ollama shows "135M", "1.5B")."""
    h, layers, ffn, vocab = (arch.get(k, 0) for k in ("hidden", "n_layers", "ffn", "vocab"))
    if not (h and layers and vocab):
        return ""
    heads, kv, hd = arch.get("n_heads", 0), arch.get("n_kv_heads", 0), arch.get("head_dim", 0)
    attn = h * (heads * hd) * 2 + h * (kv * hd) * 2 if heads and hd else 4 * h * h
    n = layers * (attn + 3 * h * ffn) + vocab * h * (1 if arch.get("tied_embeddings") else 2)
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def details(row: dict) -> dict:
    arch = row.get("architecture", {})
    family = arch.get("arch", "")
    return {"parent_model": "", "format": "gguf" if "gguf" in row.get("variants", {}) else "onnx",
            "family": family, "families": [family] if family else None,
            "parameter_size": _parameter_size(arch), "quantization_level": _quantization(row)}


def _digest(row: dict) -> str:
    """A stable digest of what the store holds for the model: its GGUF's sha256 where it has one."""
    sha = row.get("provenance", {}).get("gguf_sha256")
    return sha or hashlib.sha256(json.dumps([row["name"], sorted(row["variants"].items())]).encode()).hexdigest()


def _modified(row: dict) -> str:
    created = row.get("provenance", {}).get("created", "")
    return created or "1970-01-01T00:00:00Z"


def tags(rows: list[dict]) -> dict:
    """GET /api/tags: every pulled target (drafts are loaded with their target, not asked for)."""
    out = []
    for r in rows:
        if r["role"] != "target":
            continue
        name = tagged(r["name"])
        out.append({"name": name, "model": name, "modified_at": _modified(r), "size": sum(r["variants"].values()),
                    "digest": _digest(r), "details": details(r)})
    return {"models": out}


def ps(rows: list[dict], targets, resident) -> dict:
    """GET /api/ps: the loaded targets, with when each is unloaded (far away for one kept)."""
    by_name = {r["name"]: r for r in rows}
    device = {m.name: m.device for m in resident if m.role == "target"}
    out = []
    for t in targets:
        if t.state not in ("loaded", "draining") or t.name not in by_name:
            continue
        r, name = by_name[t.name], tagged(t.name)
        expires = (datetime(9999, 12, 31, tzinfo=timezone.utc) if t.expires_in_s < 0
                   else datetime.fromtimestamp(time.time() + t.expires_in_s, timezone.utc))
        on_gpu = device.get(t.name, "cpu") not in ("", "cpu")
        out.append({"name": name, "model": name, "size": t.bytes, "digest": _digest(r), "details": details(r),
                    "expires_at": expires.isoformat().replace("+00:00", "Z"), "size_vram": t.bytes if on_gpu else 0,
                    "context_length": r.get("architecture", {}).get("context_length", 0),
                    EXTENSION: {"variant": t.variant, "active": t.active, "drafts": list(t.drafts),
                                "keep_alive_s": t.keep_alive_s}})
    return {"models": out}


def show(row: dict, template: str) -> dict:
    """POST /api/show: what the store knows of a target (its chat template, its hyper-parameters)."""
    arch = row.get("architecture", {})
    family = arch.get("arch", "")
    info = {"general.architecture": family, "general.basename": row["name"],
            **{f"{family}.{k}": v for k, v in (("context_length", arch.get("context_length")),
                                               ("embedding_length", arch.get("hidden")),
                                               ("block_count", arch.get("n_layers")),
                                               ("attention.head_count", arch.get("n_heads")),
                                               ("attention.head_count_kv", arch.get("n_kv_heads")),
                                               ("vocab_size", arch.get("vocab"))) if v is not None}}
    return {"modelfile": f"# memspec model {row['name']} ({row.get('source', '')})\nFROM {row['name']}\n",
            "parameters": "", "template": template, "details": details(row), "model_info": info,
            "capabilities": ["completion", "tools"], "modified_at": _modified(row),
            EXTENSION: {"variants": sorted(row["variants"]), "resident": row["resident"],
                        "source": row.get("source", "")}}


def unloads(req: OllamaRequest) -> bool:
    """Whether the request asks for its model to be unloaded once it has answered (keep_alive 0)."""
    return req.request.keep_alive == 0
