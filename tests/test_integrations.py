"""docs/integrations.md, run: every snippet on the page against a real `memspec serve --http`
(SmolLM2-135M), with the daemon's port in place of the page's 8080.

curl commands and the `ollama` and `openai` client snippets run as written.  The apps that cannot
run here are replayed from their settings on the page, as the requests those apps send: Open
WebUI (its Docker command's two base URLs), Continue (its config.yaml), Home Assistant (the
`ollama` client calls its Ollama integration makes), and LangChain's ChatOllama and ChatOpenAI
(run as written when langchain-ollama / langchain-openai are installed; otherwise the requests
they send, through the clients they send them with)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.request import Request, urlopen

import ollama
import pytest
import yaml
from openai import OpenAI

from test_daemon_e2e import http_daemon

from memspec.cli import build_parser
from memspec.config import load_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
PAGE = "http://localhost:8080"


def blocks(lang: str) -> list[str]:
    return re.findall(r"^```" + lang + r"\n(.*?)^```", DOC.read_text(), re.S | re.M)


@pytest.fixture(scope="module")
def base(model_store):
    with http_daemon(model_store.home, "ms-int-", "i") as url:
        yield url


def here(text: str, base: str) -> str:
    return text.replace(PAGE, base)


def lines_of(out: str) -> list[dict]:
    """A JSON answer, or an NDJSON stream, as its objects; none of them an error."""
    objs = [json.loads(line) for line in out.splitlines() if line.strip()] if "\n" in out.strip() else [json.loads(out)]
    assert objs and not any("error" in o for o in objs), out
    return objs


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_every_curl_command_answers(base):
    commands = [b for b in blocks("sh") if b.lstrip().startswith("curl")]
    assert len(commands) == 4
    for cmd in commands:
        out = subprocess.run(["bash", "-c", here(cmd, base)], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        objs = lines_of(out)
        if "/v1/" in cmd:
            assert objs[0]["choices"][0]["message"]["content"]
        elif '"format"' in cmd:
            assert set(json.loads(objs[0]["message"]["content"])) == {"country"}
        else:
            assert objs[-1]["done"] and "".join(o.get("response", o.get("message", {}).get("content", ""))
                                                for o in objs).strip()


def test_the_serve_commands_are_the_clis(base):
    parser = build_parser()
    [serve] = [b for b in blocks("sh") if "memspec serve" in b]
    for line in serve.splitlines():
        argv = shlex.split(line.split("#")[0])
        argv = argv[[i for i, a in enumerate(argv) if a == "memspec"][0] + 1:]
        assert parser.parse_args(argv).http.endswith("8080")


def test_the_cors_setting_is_a_config_the_daemon_reads(tmp_path):
    [toml] = [b for b in blocks("toml") if "cors_origins" in b]
    (tmp_path / "c.toml").write_text(toml)
    assert load_config(tmp_path / "c.toml").http.cors_origins == ("http://localhost:3000",)


def test_the_python_client_snippets_run(base):
    snippets = [b for b in blocks("python") if "langchain" not in b]
    assert [("import ollama" in s, "from openai" in s) for s in snippets] == [(True, False), (False, True)]
    for code in snippets:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(here(code, base), "integrations.md", "exec"), {})
        assert out.getvalue().strip()


def _call_kwargs(code: str, name: str) -> dict:
    """The literal keyword arguments of the call of `name` in a snippet."""
    call = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == name)
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def _langchain(name: str) -> str:
    [code] = [b for b in blocks("python") if f"import {name}" in b]
    return code


def test_chat_ollama_as_written_or_as_it_asks(base):
    code = here(_langchain("ChatOllama"), base)
    try:
        import langchain_ollama  # noqa: F401
    except ImportError:  # the request ChatOllama.invoke sends: a streamed /api/chat through the ollama client
        kw = _call_kwargs(code, "ChatOllama")
        client = ollama.Client(host=kw.pop("base_url"))
        model = kw.pop("model")
        parts = list(client.chat(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                 stream=True, options=kw))
        assert parts[-1].done and "".join(p.message.content for p in parts).strip()
        return
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "integrations.md", "exec"), {})
    assert out.getvalue().strip()


def test_chat_openai_as_written_or_as_it_asks(base):
    code = here(_langchain("ChatOpenAI"), base)
    try:
        import langchain_openai  # noqa: F401
    except ImportError:  # the request ChatOpenAI.invoke sends, through the openai client
        kw = _call_kwargs(code, "ChatOpenAI")
        sdk = OpenAI(base_url=kw["base_url"], api_key=kw["api_key"], max_retries=0, timeout=120)
        out = sdk.chat.completions.create(model=kw["model"], temperature=kw["temperature"], stream=False,
                                          max_completion_tokens=kw["max_tokens"],
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert out.choices[0].message.content
        return
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "integrations.md", "exec"), {})
    assert out.getvalue().strip()


def _post(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    req = Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})
    with urlopen(req, timeout=120) as r:
        return lines_of(r.read().decode())


def _get(url: str) -> dict:
    with urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_open_webui_through_both_connections(base):
    """Open WebUI's calls: the Ollama connection checks /api/version, lists /api/tags, chats on
    /api/chat (streamed) and shows /api/ps; the OpenAI one lists /models and chats streamed."""
    [docker] = [b for b in blocks("sh") if "open-webui" in b]
    env = dict(re.findall(r"-e (\w+)=(\S+)", docker))
    ollama_url = env["OLLAMA_BASE_URL"].replace("http://host.docker.internal:8080", base)
    openai_url = env["OPENAI_API_BASE_URL"].replace("http://host.docker.internal:8080", base)
    assert _get(f"{ollama_url}/api/version")["version"]
    names = [m["model"] for m in _get(f"{ollama_url}/api/tags")["models"]]
    assert "smollm2-135m:latest" in names
    parts = _post(f"{ollama_url}/api/chat", {"model": "smollm2-135m:latest", "stream": True, "options": {"num_predict": 8},
                                              "messages": [{"role": "user", "content": "Hello"}]})
    assert parts[-1]["done"] and len(parts) > 1
    assert "smollm2-135m:latest" in [m["model"] for m in _get(f"{ollama_url}/api/ps")["models"]]
    sdk = OpenAI(base_url=openai_url, api_key=env["OPENAI_API_KEY"], max_retries=0, timeout=120)
    assert "smollm2-135m" in [m.id for m in sdk.models.list().data]
    stream = sdk.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_continue_with_either_provider(base):
    """Continue's Ollama provider reads /api/show, then chats streamed on /api/chat with its options;
    its OpenAI provider chats on {apiBase}/chat/completions with the key."""
    [config] = [yaml.safe_load(b) for b in blocks("yaml") if "provider:" in b]
    models = {m["provider"]: m for m in config["models"]}
    o = models["ollama"]
    api = o["apiBase"].replace(PAGE, base)
    shown = _post(f"{api}/api/show", {"name": o["model"]})[0]
    assert shown["model_info"]["llama.context_length"] and shown["template"]
    parts = _post(f"{api}/api/chat", {"model": o["model"], "stream": True, "keep_alive": 1800,
                                      "options": {"num_ctx": 8192, "num_predict": 8, "temperature": 0.01},
                                      "messages": [{"role": "system", "content": "You are a coding assistant."},
                                                   {"role": "user", "content": "Write hello world in C."}]})
    assert parts[-1]["done"]
    oa = models["openai"]
    out = _post(f"{oa['apiBase'].replace(PAGE, base)}/chat/completions",
                {"model": oa["model"], "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
                {"Authorization": f"Bearer {oa['apiKey']}"})
    assert out[0]["choices"][0]["message"]["content"]


def test_home_assistants_calls(base):
    """Home Assistant's Ollama integration (homeassistant/components/ollama): the config flow lists the
    models; the agent chats streamed with the assistant's tools, keep_alive "-1s" (kept loaded),
    options {"num_ctx": 8192} and think unset."""
    async def run():
        client = ollama.AsyncClient(host=base)
        names = [m.model for m in (await client.list()).models]
        assert "smollm2-135m:latest" in names
        tool = {"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on a device",
                                                 "parameters": {"type": "object", "properties": {
                                                     "name": {"type": "string"}}, "required": ["name"]}}}
        parts = [p async for p in await client.chat(
            model="smollm2-135m:latest", stream=True, tools=[tool], keep_alive="-1s",
            options={"num_ctx": 8192, "num_predict": 16}, think=None,
            messages=[{"role": "system", "content": "You control a smart home."},
                      {"role": "user", "content": "Turn on the kitchen light."}])]
        assert parts[-1].done
        [loaded] = [m for m in (await client.ps()).models if m.model == "smollm2-135m:latest"]
        assert loaded.expires_at.year == 9999  # kept, as keep_alive -1 asks

    asyncio.run(run())
