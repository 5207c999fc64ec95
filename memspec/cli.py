"""The `memspec` command line.

It imports only what the command given needs: --help, --version, `status` and
`models` never load NumPy or ONNX Runtime (tests/test_cli.py checks), so every
heavy import is inside the function that runs a command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

from memspec import __version__
from memspec.errors import MemspecError
from memspec.serving.status import ResidentModel, Status, TargetStatus


class CLIError(MemspecError):
    """A user-facing command-line error: printed without a traceback, exit 2."""


def _store(args):
    from memspec.models.store import ModelStore

    return ModelStore(args.config.store_home)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- pull / models ---------------------------------------------------------------
def cmd_pull(args) -> int:
    from pathlib import Path

    from memspec.models.pull import import_gguf, pull

    store = _store(args)
    # None: the model's defaults where ONNX Runtime runs targets here, else the GGUF alone (pull.graphs_here)
    variants = tuple(args.variant) if args.variant else None
    if args.gguf:
        name = args.name or Path(args.gguf).stem.lower().replace(" ", "-")
        import_gguf(store, Path(args.gguf), name, variants, progress=_progress, force=args.force,
                    runtime=args.config.runtime)
    else:
        if not args.model:
            raise CLIError("give a model name (e.g. `memspec pull smollm2-135m`) or --gguf PATH")
        pull(store, args.model, variants, progress=_progress, force=args.force, runtime=args.config.runtime)
    return 0


def cmd_models(args) -> int:
    if args.address:
        return _daemon_models(args)
    store = _store(args)
    models = store.list()
    if args.json:
        print(json.dumps([dict(m.to_json(), folder=str(m.folder)) for m in models], indent=2))
        return 0
    if not models:
        print(f"no models in {store.models_dir}; run `memspec pull smollm2-135m`")
        return 0
    print(f"{'NAME':<24} {'ROLE':<7} {'VARIANTS':<12} {'SIZE':>9}  SOURCE")
    for m in models:
        have = store.runnable(m)  # its graphs, and its GGUF where the store has it
        size = sum(have.values())  # what its variants hold, as a daemon's ListModels counts it
        print(f"{m.name:<24} {m.role:<7} {','.join(have) or '-':<12} "
              f"{size / 1e6:>7.1f}MB  {m.provenance.get('source', '?')}")
    return 0


def _daemon_models(args) -> int:
    from memspec.serving.client import Client

    with Client(args.address) as c:
        models = c.models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    print(f"{'NAME':<24} {'ROLE':<7} {'VARIANTS':<12} {'SIZE':>9}  RESIDENT")
    for m in models:
        size = sum(m["variants"].values())
        print(f"{m['name']:<24} {m['role']:<7} {','.join(sorted(m['variants'])):<12} {size / 1e6:>7.1f}MB  "
              f"{m['resident_variant'] or '-'}")
    return 0


# -- generate ----------------------------------------------------------------------
def _request(args, messages=None):
    from memspec.request import GenerationRequest, PolicyName, SamplingParams

    if args.max_tokens is not None and args.max_tokens <= 0:
        raise CLIError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return GenerationRequest(
        prompt=None if messages else args.prompt,
        messages=tuple(messages) if messages else None,
        raw=getattr(args, "raw", False),
        max_tokens=args.max_tokens,  # None: until the end of sequence or of the context
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                min_p=args.min_p, frequency_penalty=args.frequency_penalty,
                                presence_penalty=args.presence_penalty, repetition_penalty=args.repetition_penalty,
                                logit_bias=_logit_bias(args.logit_bias or ())),
        stop=tuple(args.stop or ()),
        draft=getattr(args, "draft", None),
        policy=PolicyName.parse(args.policy) if getattr(args, "policy", None) else None,
        constraint=_constraint(args),
    )


def _constraint(args):
    """--json-schema FILE or --grammar FILE (Lark or GBNF) as the request's Constraint."""
    from pathlib import Path

    from memspec.request import Constraint

    given = [(flag, path) for flag, path in (("--json-schema", getattr(args, "json_schema", None)),
                                             ("--grammar", getattr(args, "grammar", None))) if path]
    if len(given) > 1:
        raise CLIError("give --json-schema or --grammar, not both")
    if not given:
        return None
    flag, path = given[0]
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"{flag}: cannot read {path}: {exc}") from None
    if flag == "--json-schema":
        try:
            json.loads(text)
        except ValueError as exc:
            raise CLIError(f"--json-schema: {path} is not JSON: {exc}") from None
        return Constraint("json_schema", text, field="--json-schema")
    return Constraint("grammar", text, field="--grammar")


def _logit_bias(items) -> tuple[tuple[int, float], ...]:
    """--logit-bias TOKEN=BIAS, repeated, as ((id, bias), ...); ranges and ids are checked with the request."""
    out = []
    for item in items:
        token, eq, bias = item.partition("=")
        try:
            if not eq:
                raise ValueError
            out.append((int(token), float(bias)))
        except ValueError:
            raise CLIError(f"--logit-bias takes TOKEN=BIAS (a token id and a number, e.g. 198=-100), got {item!r}; "
                           f"the HTTP API's POST /tokenize gives a text's ids") from None
    return tuple(out)


def load_engine(config, variant: str | None = None, serving: bool = False):
    """Build the engine from the config: the target and its drafts from the store (serving: the
    daemon's, which batches concurrent requests; memspec.build.build_engine)."""
    from memspec.build import build_engine

    return build_engine(config, variant, serving=serving)


def serving_engine(config, variant: str | None = None):
    """The daemon's engine loader (memspec.serving.backend.EngineLoader)."""
    return load_engine(config, variant, serving=True)


# -- daemon or local ---------------------------------------------------------------------
def _daemon(args):
    """The daemon client `generate`/`chat` use, or None to generate locally.

    --local, --variant or --backend (a choice of local engine): local.  --address or
    $MEMSPEC_ADDRESS: that daemon, or an error.  Otherwise the default socket's
    daemon when one is serving there, else local generation with a note on stderr.
    --model goes wherever the request goes: a daemon loads the named target on demand,
    as it does for HTTP and the Python client.
    """
    import os

    from memspec.serving.address import client_address
    from memspec.errors import UnavailableError

    explicit = bool(args.address or os.environ.get("MEMSPEC_ADDRESS"))
    flag = "--variant" if args.variant else "--backend" if getattr(args, "backend", None) else None
    if flag and args.address and not args.local:
        raise CLIError(f"{flag} picks the local engine; a daemon runs each target in the variant and engine it "
                       f"is configured for (`memspec load NAME --variant V` changes it). Drop {flag} to ask the "
                       "daemon, or --address to generate locally.")
    if args.local or flag:
        return None
    address = client_address(args.address)
    if not explicit and address.is_unix and not address.path.exists():
        _progress(f"memspec: no daemon at {address}; generating locally (--local skips this check)")
        return None
    from memspec.serving.client import Client

    client = Client(args.address)
    if explicit:
        _wait_while_starting(client, address)
        return client
    try:
        state = client.health()
    except UnavailableError:
        state = "UNAVAILABLE"
    if state == "NOT_SERVING" and _wait_while_starting(client, address):
        state = "SERVING"
    if state != "SERVING":
        client.close()
        _progress(f"memspec: the daemon at {address} is {state.lower()}; generating locally")
        return None
    return client


START_WAIT_S = 600.0  # how long generate and chat wait for a daemon still loading its default target
START_POLL_S = 0.5


def _wait_while_starting(client, address, timeout: float | None = None) -> bool:
    """Wait, saying so on stderr, while the daemon is starting (loading its default target), as
    a request waits for a target the daemon loads on demand; True once it serves.  False at once
    when it is not starting (draining, or not answering: the request says what is wrong);
    CLIError when it is still starting after `timeout` seconds."""
    import time

    timeout = START_WAIT_S if timeout is None else timeout
    t0, told = time.monotonic(), False
    while True:
        try:
            st = Status.from_dict(client.status())
        except MemspecError:
            return False
        if st.state != "starting":
            return st.state == "serving"
        if not told:
            loading = [t.name for t in st.targets if t.state == "loading"]
            what = f"loading {', '.join(loading)}" if loading else "loading its target"
            _progress(f"memspec: the daemon at {address} is starting ({what}); waiting for it, up to "
                      f"{timeout:g} s (`memspec status` shows it)")
            told = True
        if time.monotonic() - t0 >= timeout:
            raise CLIError(f"the daemon at {address} is still starting after {timeout:g} s; `memspec status` "
                           f"shows what it loads, its log (journalctl -u memspec) why it takes long")
        time.sleep(START_POLL_S)


def _run(args, req, engine=None):
    """Stream one request (daemon or local engine) to stdout; return its Completion."""
    import dataclasses

    from memspec.request import Completion

    if engine is not None:
        items, model, variant = engine.stream(req), engine.target.name, engine.target.variant
    else:
        if getattr(args, "target", None):  # --model: the daemon loads it if it is not resident
            req = dataclasses.replace(req, model=args.target)
        items, model, variant = args.client.stream(req, default_max_tokens=args.max_tokens is None), None, None
    result = None
    for item in items:
        if isinstance(item, Completion):
            result = item
        elif not args.json:
            sys.stdout.write(item.text)
            sys.stdout.flush()
    model, variant = model or getattr(result, "model", ""), variant or getattr(result, "variant", "")
    if args.json:
        # the same keys in local and daemon mode
        print(json.dumps({
            "prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids, "text": result.text,
            "finish_reason": result.finish_reason, "timings": result.timings.to_dict(), "stats": result.stats.to_dict(),
            "model": model, "variant": variant, "seed": result.seed,  # --seed SEED gives a sampled answer again
        }), flush=True)
    else:
        sys.stdout.write("\n")
        t = result.timings
        _progress(f"[{result.finish_reason}] {t.completion_tokens} tokens, {t.tok_per_s:.1f} tok/s, "
                  f"ttft {t.ttft_ms:.0f} ms")
    return result


def _with_target(args, fn) -> int:
    """Run fn(engine) locally, or fn(None) with args.client set to the daemon's client."""
    args.client = _daemon(args)
    if args.client is None:
        if getattr(args, "target", None):  # an unknown name: what the store has and what `memspec pull` knows
            _store(args).get(args.target)
        engine = load_engine(args.config, args.variant)
        try:
            return fn(engine)
        finally:
            engine.close()
    with args.client:
        if getattr(args, "target", None):
            _note_a_load(args.client, args.target)
        return fn(None)


def _note_a_load(client, name: str) -> None:
    """Say on stderr when the daemon must load `name` first: gRPC's stream is silent until the first
    token, and a first load on a machine takes tens of seconds (HTTP streams say it in SSE comments)."""
    try:
        loaded = {t.name for t in Status.from_dict(client.status()).targets if t.state == "loaded"}
    except MemspecError:
        return  # the request itself will say what is wrong
    if name not in loaded:
        _progress(f"memspec: {name} is not loaded; the daemon loads it first (seconds, tens of seconds the "
                  "first time on a machine; `memspec ps` shows it loading)")


def cmd_generate(args) -> int:
    if not args.prompt or not args.prompt.strip():
        raise CLIError("the prompt is empty; give the text to answer, e.g. memspec generate \"What is 2+2?\"")
    req = _request(args)

    def answer(engine) -> int:
        _run(args, req, engine)
        return 0

    return _with_target(args, answer)


def cmd_chat(args) -> int:
    """One answer to MESSAGE, or a conversation read line by line from stdin."""
    history = [("system", args.system)] if args.system else []

    def talk(engine) -> int:
        turns = [args.message] if args.message else _stdin_turns()
        for text in turns:
            history.append(("user", text))
            result = _run(args, _request(args, history), engine)
            history.append(("assistant", result.text))
        return 0

    return _with_target(args, talk)


def _stdin_turns():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            _progress("> ")
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


# -- daemon ----------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from memspec.serving.daemon import serve

    return serve(args.config, args.config_path, args.listen, serving_engine, http=args.http)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_status(args) -> int:
    from memspec.serving.client import Client

    with Client(args.address) as c:
        raw = c.status()
    if args.json:
        print(json.dumps(raw, indent=2))
        return 0
    st = Status.from_dict(raw)
    mem = st.system_memory
    http = f" and http://{st.http_listen}" if st.http_listen else ""
    print(f"memspec {st.version} {st.state} on {st.listen}{http}, up {st.uptime_s:.0f} s")
    for w in st.warnings:
        print(f"warning   {w}")
    for m in st.resident or [ResidentModel("(none)", "", "", 0, device="")]:
        print(f"resident  {m.name} {m.role} {m.variant} {_mib(m.bytes)} {m.device} {','.join(m.providers)}".rstrip())
    for line in _targets(st):
        print(f"target    {line}")
    budget = _mib(st.budget_bytes) if st.budget_bytes else "none"
    print(f"memory    budget {budget}, weights {_mib(st.resident_bytes)}, KV {_mib(st.kv_bytes)}; "
          f"system {_mib(mem.available_bytes)} available of {_mib(mem.total_bytes)}, "
          f"daemon RSS {_mib(mem.process_rss_bytes)}")
    print(f"streams   {st.active_streams}/{st.max_concurrent} generating, {st.queue_depth}/{st.max_queue} queued")
    print("requests  " + ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(st.requests).items()))
    for d in st.drafts:  # every draft of the loaded targets; `ps` lists the resident ones
        print(f"draft     {d.name} {_mib(d.bytes)} {'resident' if d.resident else 'not loaded'}: "
              f"{d.requests} requests, {d.num_drafts} drafts, "
              f"acceptance {d.acceptance_rate:.2f}, mean length {d.mean_acceptance_length:.2f}")
    for name in ("predictor", "scheduler", "batch", "prefix_cache"):
        if getattr(st, name):
            counters = sorted(getattr(st, name).items())
            print(f"{name.replace('_cache', 'es'):<9} " + ", ".join(f"{k} {v:g}" for k, v in counters))
    return 0


def _until(t: TargetStatus) -> str:
    """When a loaded target is unloaded, in words."""
    if t.active:
        return f"in use by {t.active}"
    if t.expires_in_s < 0:
        return "never (kept)"
    return f"in {t.expires_in_s:.0f} s"


def _targets(st: Status) -> list[str]:
    """One line per loaded (or loading) target: name, variant, size, drafts, when it unloads."""
    out = []
    for t in st.targets:
        if t.state != "unloaded":
            drafts = ", ".join(t.drafts) or "none yet (a draft loads when a request first wants it)"
            context = f"{t.context:,}" if t.context else "-"
            out.append(f"{t.name:<24} {t.variant:<6} {_mib(t.bytes):>11}  {context:>8}  {t.kv or '-':<4} {t.state:<9} "
                       f"{_until(t) if t.state == 'loaded' else '':<16} resident drafts: {drafts}")
    return out


def cmd_ps(args) -> int:
    from memspec.serving.client import Client

    with Client(args.address) as c:
        raw = c.status()
    if args.json:
        print(json.dumps([t for t in raw.get("targets", []) if t["state"] != "unloaded"], indent=2))
        return 0
    st = Status.from_dict(raw)
    print(f"{'NAME':<24} {'VAR':<6} {'SIZE':>11}  {'CONTEXT':>8}  {'KV':<4} {'STATE':<9} {'UNLOADS':<16} "
          "RESIDENT DRAFTS")
    for line in _targets(st):
        print(line)
    budget = _mib(st.budget_bytes) if st.budget_bytes else "none"
    print(f"memory budget {budget}; daemon RSS {_mib(st.system_memory.process_rss_bytes)}")
    return 0


def cmd_load(args) -> int:
    from memspec.serving.client import Client

    with Client(args.address) as c:
        out = c.load(args.name, args.variant)
    m = out["model"]
    print(f"loaded {m['name']} ({m['variant']}, {_mib(m['bytes'])}) in {out['load_ms']:.0f} ms")
    return 0


def cmd_unload(args) -> int:
    from memspec.serving.client import Client

    with Client(args.address) as c:
        freed = c.unload(args.name)
    print(f"unloaded {args.name} ({_mib(freed)})")
    return 0


def cmd_doctor(args) -> int:
    from memspec import doctor

    return doctor.main(args.config, speed=args.speed, as_json=args.json)


def cmd_bench(args) -> int:
    from memspec.bench import policies as bench

    return bench.run_bench(args)


# -- parser --------------------------------------------------------------------------
def _sampling_options(g: argparse.ArgumentParser) -> None:
    g.add_argument("--max-tokens", type=int, default=None,
                   help="most new tokens (default: until the answer or the context ends, within [limits] max_tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this times the top probability, after temperature (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtract this per time a token was generated (OpenAI's; 0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="[-2, 2]: subtract this once a token was generated (OpenAI's; 0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: divide a positive logit (multiply a negative one) of every prompt or generated "
                        "token by this (1 = off)")
    g.add_argument("--logit-bias", action="append", metavar="TOKEN=BIAS",
                   help="add BIAS in [-100, 100] to token id TOKEN's logit (repeatable)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--draft", help='force a draft: a draft model, "prompt-lookup" or "suffix" ("none" = target only)')
    g.add_argument("--policy", help="draft-selection policy")
    _model_option(g, "; a daemon loads it if it is not resident")
    g.add_argument("--variant", choices=("fp32", "q4"),
                   help="target variant; generates locally (default from config: q4)")
    _backend_option(g, "; generates locally")
    g.add_argument("--json", action="store_true", help="print one JSON object per answer with ids, text and timings")
    g.add_argument("--address", help="the daemon's socket or HOST:PORT (default: the default socket)")
    g.add_argument("--local", action="store_true", help="generate in this process, without the daemon")


def _backend_option(p: argparse.ArgumentParser, note: str = "") -> None:
    p.add_argument("--backend", choices=("auto", "native", "onnxruntime"),
                   help=f"the target's engine: memspec's native kernels on the GGUF as it is, or ONNX Runtime on "
                        f"a converted graph{note} (default from config: [runtime] backend, auto)")


def _choose_backend(args) -> None:
    """--backend NAME: make it the config's [runtime] backend."""
    import dataclasses

    if getattr(args, "backend", None):
        args.config = dataclasses.replace(args.config, runtime=dataclasses.replace(args.config.runtime,
                                                                                      backend=args.backend))


def _model_option(p: argparse.ArgumentParser, note: str = "") -> None:
    p.add_argument("--model", dest="target", metavar="NAME",
                   help=f"target model from the store{note} (default from config: [model] target)")


def _choose_model(args) -> None:
    """--model NAME: make it the config's target, after checking that the store has it."""
    import dataclasses

    if getattr(args, "target", None):
        if args.func not in (cmd_generate, cmd_chat):  # those check it where they generate locally: a
            _store(args).get(args.target)              # daemon answers from its own store
        args.config = dataclasses.replace(args.config, model=dataclasses.replace(args.config.model,
                                                                                  target=args.target))


def build_parser(dev_command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; of the developer commands only `dev_command` gets its real
    options (importing its module), the others stand-ins that list them in --help."""
    from memspec.models.catalog import KNOWN_DRAFTS, KNOWN_MODELS  # plain dataclasses

    p = argparse.ArgumentParser(prog="memspec", description="memory-aware speculative decoding runtime")
    p.add_argument("--version", action="version", version=f"memspec {__version__}")
    p.add_argument("--config", metavar="FILE", help="TOML config file (see memspec.example.toml)")
    sub = p.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND",
                           help="`memspec COMMAND --help` shows its options")
    # --config is accepted after the command too (`memspec serve --config FILE`)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="TOML config file")
    address = argparse.ArgumentParser(add_help=False)
    address.add_argument("--address", help="the daemon's socket or HOST:PORT (default: the default socket)")

    pl = sub.add_parser("pull", parents=[common], help="fetch and convert a model into the store")
    pl.add_argument("model", nargs="?", help=f"a known model: {', '.join(KNOWN_MODELS)}; or a draft built from "
                                             f"one: {', '.join(KNOWN_DRAFTS)}")
    pl.add_argument("--gguf", metavar="PATH", help="convert a local GGUF instead")
    pl.add_argument("--name", help="store name for --gguf (default: the file's stem)")
    pl.add_argument("--variant", action="append", choices=("fp32", "q4", "q4f16"),  # convert.VARIANTS + ON_REQUEST
                    help="only these variants (repeatable; default: fp32 and q4, q4 only for the Qwen models; "
                         "q4f16, for CUDA, only when asked for)")
    pl.add_argument("--force", action="store_true", help="convert again even if up to date")
    pl.set_defaults(func=cmd_pull)

    ml = sub.add_parser("models", parents=[common], help="list the model store (or a daemon's, with --address)")
    ml.add_argument("--json", action="store_true")
    ml.add_argument("--address", help="ask this daemon instead (shows which models are resident)")
    ml.set_defaults(func=cmd_models)

    g = sub.add_parser("generate", parents=[common], help="generate text for a prompt",
                       description="Uses the daemon serving at the default socket when there is one, else "
                                   "generates locally (with a note on stderr). --address insists on a daemon; "
                                   "--local skips it.")
    g.add_argument("prompt", help="the prompt (chat template applied unless --raw)")
    g.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    g.add_argument("--json-schema", metavar="FILE",
                   help="the answer is JSON valid against this JSON schema (constrained decoding)")
    g.add_argument("--grammar", metavar="FILE", help="the answer matches this Lark or GBNF (llama.cpp) grammar")
    _sampling_options(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", parents=[common], help="chat: answer MESSAGE, or each line of stdin in turn",
                       description="Without MESSAGE, reads user turns line by line from stdin and keeps the "
                                   "conversation. Daemon or local as for generate.")
    c.add_argument("message", nargs="?", help="one user turn (default: read turns from stdin)")
    c.add_argument("--system", help="system prompt")
    _sampling_options(c)
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", parents=[common], help="run the daemon (gRPC on a Unix socket)")
    _backend_option(sv)
    sv.add_argument("--listen", metavar="ADDRESS",
                    help="unix:///path.sock, a socket path, HOST:PORT, or PORT for loopback TCP "
                         "(default: [server] listen, else the default socket)")
    sv.add_argument("--http", metavar="HOST:PORT",
                    help="also serve the HTTP API there, OpenAI's and Ollama's (PORT or :PORT: loopback; "
                         "default: [http] listen, else off)")
    _model_option(sv)
    sv.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", parents=[common, address], help="show a running daemon's status")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    ps = sub.add_parser("ps", parents=[common, address], help="list a daemon's loaded targets",
                        description="Each loaded target: its variant, the memory it is counted at, whether it is "
                                    "in use or when it unloads (keep_alive), and its resident drafts.")
    ps.add_argument("--json", action="store_true")
    ps.set_defaults(func=cmd_ps)

    ld = sub.add_parser("load", parents=[common, address], help="make a target resident in the daemon (admin)")
    ld.add_argument("name")
    ld.add_argument("--variant", help="variant to load (default: the daemon's configured one)")
    ld.set_defaults(func=cmd_load)

    ul = sub.add_parser("unload", parents=[common, address], help="drop a resident model from the daemon (admin)")
    ul.add_argument("name")
    ul.set_defaults(func=cmd_unload)

    dr = sub.add_parser("doctor", parents=[common], help="what this machine gives memspec, and whether it can serve",
                        description="OS and CPU, the native kernel path, ONNX Runtime and the GPU, memory and its "
                                    "bandwidth, each pulled target's decode limit, the default target's exactness "
                                    "self-check on each engine. Exit 0 when memspec can serve here, 1 (with the "
                                    "reasons) when it cannot.")
    dr.add_argument("--speed", action="store_true", help="also decode a few tokens with the default target and "
                                                         "compare its speed with the bandwidth's limit")
    dr.add_argument("--json", action="store_true", help="the report as JSON (schema: memspec/doctor.py)")
    _model_option(dr)
    _backend_option(dr)
    dr.set_defaults(func=cmd_doctor)

    for name, summary in DEV_COMMANDS.items():
        if name == dev_command:
            _add_dev_command(sub, common, name)
        else:  # parse_args builds the real one when this is the command given
            sub.add_parser(name, help=summary, add_help=False)
    _list_apart(p, sub, "developer commands", DEV_COMMANDS)
    return p


DEV_COMMANDS = {  # what --help says of each; its module (NumPy, ONNX Runtime, ...) is imported only to run it
    "bench": "run a prompt workload under draft policies, side by side",
    "train-draft": "train a draft model by self-distillation from the target",
    "write-prompts": "have the target write prompts to train drafts on",
    "profile": "record draft traces for `memspec train-predictor`",
    "train-predictor": "fit the draft predictor on `memspec profile` traces",
    "build-corpus": "the target's answers, the suffix draft's corpus",
}


def _add_dev_command(sub, common: argparse.ArgumentParser, name: str) -> None:
    """Register developer command `name` with its options; this imports its module."""
    if name == "bench":
        b = sub.add_parser("bench", parents=[common], help=DEV_COMMANDS["bench"])
        from memspec.bench import policies as bench

        bench.add_arguments(b)
        _backend_option(b)
        _model_option(b)
        b.set_defaults(func=cmd_bench)
    elif name == "train-draft":
        from memspec.training import drafts as train  # torch is imported only when train-draft runs

        train.add_train_draft_parser(sub).set_defaults(func=train.run_train_draft)
    elif name == "write-prompts":
        from memspec.training import self_instruct

        self_instruct.add_write_prompts_parser(sub)
    elif name == "profile":
        from memspec.training import profile

        _model_option(profile.add_profile_parser(sub))
    elif name == "build-corpus":
        from memspec.training import corpus

        corpus.add_build_corpus_parser(sub)
    else:
        from memspec.training import predictor_fit

        predictor_fit.add_train_predictor_parser(sub)


def _list_apart(p: argparse.ArgumentParser, sub, title: str, names) -> None:
    """List these commands in --help under a heading of their own instead of under "commands"
    (argparse has one list per subparsers action: move their lines to a new group)."""
    apart = [a for a in sub._choices_actions if a.dest in names]
    sub._choices_actions[:] = [a for a in sub._choices_actions if a.dest not in names]
    p.add_argument_group(title)._group_actions.extend(apart)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, parsed in two passes: the first finds the command, so that a developer
    command's module is imported only when it is the one given."""
    parser = build_parser()
    command = parser.parse_known_args(argv)[0].command
    if command in DEV_COMMANDS:
        parser = build_parser(command)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)  # --help and --version exit here, before the config is loaded
    from memspec.config import load_config

    try:
        args.config_path = args.config
        args.config = load_config(args.config)
        _choose_model(args)
        _choose_backend(args)
        rc = args.func(args)
        sys.stdout.flush()  # a reader that has gone shows here (BrokenPipeError), not at the exit's flush
        return rc
    except MemspecError as exc:
        print(f"memspec: error: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:  # e.g. `sudo -u memspec memspec pull` before /var/lib/memspec is made
        print(f"memspec: error: {exc.filename or exc}: permission denied for user {_user()}; make it writable "
              f"by that user (the README's install steps: install -d -o memspec ...) or set MEMSPEC_HOME",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `memspec models | head -1`: the reader has gone, which is no error to show
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor must the flush at exit fail again
        return 128 + 13  # as a tool killed by SIGPIPE: what a shell reports for `ls | head -1`
    except KeyboardInterrupt:
        return 130


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


if __name__ == "__main__":
    sys.exit(main())
