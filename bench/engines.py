"""End-to-end generation, side by side: memspec against llama.cpp and onnxruntime-genai on one model.

    python bench/engines.py [--workload FILE] [--limit N] [--max-tokens 128] [--rounds 3]
                            [--threads 2] [--engines memspec,target-only,onnxruntime-genai,...]
                            [--draft-max 4] [--llama-server PATH]
                            [--config FILE] [--model NAME] [--json FILE]

Every engine gets the same token ids (each prompt of the workload with the chat template,
tokenized by memspec, whose tokenizer matches llama.cpp's) and decodes greedily until EOS or
--max-tokens, the way a user runs it:

  memspec            memspec's engine as the daemon runs it: the configured target (q4 by default)
                     on the configured engine ([runtime] backend, "auto": native on a CPU) and the
                     scheduler's drafts, picked per request and step by its policy
  target-only        the same target, no drafts
  NAME@CHECKOUT      any of the memspec engines run from another checkout of memspec (its own
                     worker and package, native kernels built in place): a change against main,
                     side by side in one interleaved run
  memspec-native, target-only-native, memspec-onnxruntime, target-only-onnxruntime
                     the same two with [runtime] backend = "native" (memspec's own kernels on the
                     GGUF itself, memspec.runtime.native_target) or "onnxruntime" (the q4 graph)
  onnxruntime-genai  onnxruntime-genai's Generator on memspec's q4 file: the same ONNX graph and
                     weights, with genai's own decoding loop and KV handling
  llama.cpp          llama-cpp-python on the GGUF the q4 file was converted from
  onnxruntime-genai-spec
                     onnxruntime-genai's own speculative decoding (`model.draft`): memspec's q4
                     file verifies, the same-family draft's GGUF (Qwen2.5-Coder-0.5B for the 1.5B)
                     converted whole by memspec's converter drafts --draft-max tokens a round
  llama.cpp-spec     llama.cpp's own speculative decoding (llama-server --spec-type draft-simple,
                     --spec-draft-n-max = --draft-max) on the two GGUFs; the binary comes from
                     --llama-server, $MEMSPEC_LLAMA_SERVER or `bash bench/build_llama_cpp.sh`

The -spec engines need a target with a same-family draft GGUF in the store (`memspec pull
qwen2.5-coder-0.5b-draft`); without one, or without the binary, they are left out with the reason.
Ollama serves llama.cpp: its numbers are llama.cpp's plus an HTTP server (it is not installable
from a package index, so it is not run here).  Each engine runs in its own process, loaded once
and warmed on the first prompt; in each round every prompt runs on every engine in turn, in an
order that rotates from prompt to prompt and round to round, so that the machine's drift (speeds
here move by 10% within minutes) falls on all of them alike.  Each round starts with memspec's
suffix index emptied (it learns every answer, and a round would otherwise recall the answers of
the one before: a repeated request, which bench/suffix.py measures).  Per engine and round, tok/s =
generated tokens / seconds over the whole workload (time to first token included); the report gives the median over rounds,
the ratio to llama.cpp, the process's resident memory, and how many prompts each engine answers
exactly as memspec's target-only does (the 4-bit kernels of the three runtimes differ, so
near-ties can go either way) and, for a -spec engine, as its own plain decoding does.

Needs `pip install -e .[bench]` (llama-cpp-python, onnxruntime-genai); an engine whose package is
missing is reported and left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEMSPEC = {"memspec": None, "target-only": None, "memspec-native": "native", "target-only-native": "native",
           "memspec-onnxruntime": "onnxruntime", "target-only-onnxruntime": "onnxruntime"}  # name -> [runtime] backend
ENGINES = (*MEMSPEC, "onnxruntime-genai", "llama.cpp", "onnxruntime-genai-spec", "llama.cpp-spec")
BASELINE = "llama.cpp"
PLAIN = {"onnxruntime-genai-spec": "onnxruntime-genai", "llama.cpp-spec": "llama.cpp",  # what a -spec engine speeds up
         "memspec-native": "target-only-native", "memspec-onnxruntime": "target-only-onnxruntime"}
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memspec-bench"


def default_llama_server() -> Path:
    """Where `bash bench/build_llama_cpp.sh` puts llama-server for this CPU's instruction set."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    isa = "avx512" if {"avx512f", "avx512_vnni"} <= flags else "avx2"
    return CACHE / "llama.cpp" / f"build-{isa}" / "bin" / "llama-server"


# -- workers: one process per engine -------------------------------------------------------
def _rss_mb() -> float:
    from memspec.runtime.memory import MiB, PsutilProbe

    return PsutilProbe().rss_bytes() / MiB


class MemspecWorker:
    def __init__(self, setup: dict, drafts: bool, backend: str | None = None):
        import dataclasses

        from memspec.build import build_engine
        from memspec.config import load_config

        config = load_config(setup["config"])
        runtime = dataclasses.replace(config.runtime, intra_op_threads=setup["threads"],
                                      backend=backend or config.runtime.backend)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, target=setup["target"]),
                                     runtime=runtime)
        self.engine = build_engine(config, drafts="scheduler" if drafts else "none")

    def generate(self, ids: list[int], text: str, max_new: int) -> list[int]:
        from memspec.request import GenerationRequest

        c = self.engine.generate(GenerationRequest(prompt=text, max_tokens=max_new))
        if c.prompt_token_ids != ids:  # the bench tokenizes with the same template: a bug if not
            raise RuntimeError("memspec tokenized the prompt differently from the bench")
        s = c.stats  # what its drafts did: proposed and accepted tokens, steps, the time drafting took
        self.drafted = (s.num_draft_tokens, s.num_accepted_tokens) if s.num_draft_tokens else None
        self.spec = {"steps": s.num_drafts, "draft_ms": s.draft_ms, "draft": s.draft}
        return c.token_ids

    def forget(self) -> None:
        """Empty the suffix draft's index, which learns every answer: each round starts from nothing
        (else a round would recall the answers of the rounds before it, a repeated request)."""
        self.engine.drafts.forget()

    def close(self) -> None:
        self.engine.close()


def genai_decoder(arch: dict, filename: str, threads: int) -> dict:
    """One decoder block of genai_config.json (`model.decoder`, or `model.draft`): a memspec graph,
    past and present sharing one buffer."""
    return {
        "filename": filename,
        "session_options": {"log_id": "bench", "intra_op_num_threads": threads, "provider_options": []},
        "head_size": arch["head_dim"], "hidden_size": arch["hidden"],
        "num_attention_heads": arch["n_heads"], "num_key_value_heads": arch["n_kv_heads"],
        "num_hidden_layers": arch["n_layers"],
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
    }


def genai_config(arch: dict, filename: str, eos: int, threads: int, draft: dict | None = None,
                 draft_max: int = 4) -> dict:
    """onnxruntime-genai's description of a memspec decoder: its "llama" model type, greedy; with
    `draft` ({"arch", "filename"}), genai's own speculative decoding, `draft_max` tokens a round."""
    config = {
        "model": {
            "type": "llama", "vocab_size": arch["vocab"], "context_length": 2048,
            "bos_token_id": 1, "eos_token_id": eos, "pad_token_id": eos,
            "decoder": genai_decoder(arch, filename, threads),
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": 2048, "min_length": 0,
                   "past_present_share_buffer": True, "top_k": 1, "top_p": 1.0, "temperature": 1.0,
                   "repetition_penalty": 1.0},
    }
    if draft is not None:
        if draft["arch"]["vocab"] != arch["vocab"]:
            raise ValueError(f"the draft has {draft['arch']['vocab']} logits, the target {arch['vocab']}: "
                             f"onnxruntime-genai's speculative decoding needs one vocabulary")
        config["model"]["draft"] = genai_decoder(draft["arch"], draft["filename"], threads)
        config["speculative"] = {"max_draft_tokens": draft_max}
    return config


def genai_graph(model_path: Path, out: Path) -> None:
    """memspec's graph with `logits_to_keep` fixed to 0 (every position; genai does not feed that input)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    inputs = [i for i in model.graph.input if i.name != "logits_to_keep"]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0, dtype=np.int64), "logits_to_keep"))
    onnx.save(model, str(out))


def genai_folder(model_path: Path, folder: Path, arch: dict, eos: int, threads: int,
                 draft: dict | None = None, draft_max: int = 4) -> Path:
    """A folder onnxruntime-genai loads: memspec's graph (and, with `draft` = {"arch", "path"}, the
    draft's as draft.onnx) made genai's, the tokenizer files and genai_config.json."""
    genai_graph(model_path, folder / "model.onnx")
    if draft is not None:
        genai_graph(Path(draft["path"]), folder / "draft.onnx")
        draft = {"arch": draft["arch"], "filename": "draft.onnx"}
    for name in ("tokenizer.json", "tokenizer_config.json"):  # genai reads them only for its Tokenizer
        if (model_path.parent / name).is_file():
            (folder / name).write_bytes((model_path.parent / name).read_bytes())
    config = genai_config(arch, "model.onnx", eos, threads, draft, draft_max)
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def whole_draft(gguf: str) -> dict:
    """The same-family draft's GGUF as one memspec q4 graph with its whole vocabulary (what genai's
    speculative decoding needs; memspec's own copy of it keeps a trimmed head), converted once and
    cached under CACHE by the GGUF's size and name: {"arch", "path"}."""
    from memspec.models.convert import convert
    from memspec.models.gguf import GGUFModel

    src = Path(gguf)
    out = CACHE / f"genai-draft-{src.stem}-{src.stat().st_size}" / "q4.onnx"
    if not out.is_file():
        convert(src, out, "q4")
    return {"arch": dict(GGUFModel(src).config.__dict__), "path": str(out)}  # as a pulled model's manifest has it


class GenaiWorker:
    def __init__(self, setup: dict, speculative: bool = False):
        import onnxruntime_genai as og

        self.og = og
        self.speculative = speculative
        self.drafted: tuple[int, int] | None = None  # the last request's draft tokens (proposed, accepted)
        draft = None
        if speculative:
            if not setup.get("draft_gguf"):
                raise LeftOut(setup.get("no_draft") or "no same-family draft GGUF")
            draft = whole_draft(setup["draft_gguf"])
        if not setup["model"]:
            raise LeftOut(f"{setup['target']} has no q4 graph in the store (pulled with its GGUF alone): "
                          f"memspec pull {setup['target']} --variant q4")
        self.tmp = tempfile.TemporaryDirectory(prefix="memspec-genai-")
        folder = genai_folder(Path(setup["model"]), Path(self.tmp.name), setup["arch"], setup["eos"],
                              setup["threads"], draft, setup.get("draft_max", 4))
        self.model = og.Model(str(folder))

    def generate(self, ids: list[int], text: str, max_new: int) -> list[int]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + max_new, do_sample=False)
        gen = og.Generator(self.model, params)
        gen.append_tokens(ids)
        out: list[int] = []
        while not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        if self.speculative:
            stats = gen.get_speculative_stats()
            self.drafted = (int(stats["draft_tokens_proposed"]), int(stats["draft_tokens_accepted"]))
        return out

    def close(self) -> None:
        self.tmp.cleanup()


class LlamaCppWorker:
    def __init__(self, setup: dict):
        from llama_cpp import Llama

        self.llm = Llama(setup["gguf"], n_ctx=2048, n_threads=setup["threads"], n_threads_batch=setup["threads"],
                         n_batch=512, verbose=False, use_extra_bufts=False)  # AMX buffers SIGILL on some VMs
        self.eos = setup["eos"]

    def _argmax(self) -> int:  # the last row of logits, read in place
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).argmax())

    def generate(self, ids: list[int], text: str, max_new: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(ids)
        out = [self._argmax()]
        while out[-1] != self.eos and len(out) < max_new:
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return out

    def close(self) -> None:
        self.llm.close()


class LlamaServerWorker:
    """llama.cpp's own speculative decoding: a llama-server process with the target GGUF and the
    same-family draft GGUF (--spec-type draft-simple), asked over HTTP on 127.0.0.1 for token ids."""

    def __init__(self, setup: dict):
        import socket

        binary = setup.get("llama_server")
        if not binary or not Path(binary).is_file():
            raise LeftOut(f"no llama-server binary ({binary or 'none given'}): build one with "
                          f"`bash bench/build_llama_cpp.sh` and pass --llama-server PATH")
        if not setup.get("draft_gguf"):
            raise LeftOut(setup.get("no_draft") or "no same-family draft GGUF")
        with socket.socket() as s:  # a free port, released for the server to take
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        t = str(setup["threads"])
        self.eos = setup["eos"]
        self.drafted: tuple[int, int] | None = None  # the last request's draft tokens (proposed, accepted)
        self.log = tempfile.NamedTemporaryFile(prefix="memspec-llama-server-", suffix=".log")
        self.proc = subprocess.Popen(
            [binary, "-m", setup["gguf"], "-md", setup["draft_gguf"], "--spec-type", "draft-simple",
             "--spec-draft-n-max", str(setup.get("draft_max", 4)), "-t", t, "-tb", t, "-td", t, "-tbd", t,
             "-c", "2048", "-np", "1", "--no-webui", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited while loading (status {self.proc.returncode}):\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become ready in 300 s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def _post(self, path: str, body: dict | None = None, timeout: float = 600) -> dict:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def _healthy(self) -> bool:
        try:
            return self._post("/health", timeout=2).get("status") == "ok"
        except OSError:  # not listening yet, or 503 while loading
            return False

    def generate(self, ids: list[int], text: str, max_new: int) -> list[int]:
        body = {"prompt": ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        try:
            r = self._post("/completion", body)
        except OSError as exc:  # it crashed (say, an AMX build on this host) or refused the request
            state = "exited" if self.proc.poll() is not None else "failed"
            raise RuntimeError(f"llama-server {state} on a request ({exc}):\n{self.log_tail()}") from None
        out = [int(t) for t in r["tokens"]]
        timings = r.get("timings") or {}
        self.drafted = (int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0)))
        if r.get("stop_type") == "eos" and (not out or out[-1] != self.eos) and len(out) < max_new:
            out.append(self.eos)  # the server leaves the end token out; the other engines count it
        return out

    def rss_mb(self) -> float:
        import psutil

        from memspec.runtime.memory import MiB

        return _rss_mb() + psutil.Process(self.proc.pid).memory_info().rss / MiB

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class LeftOut(Exception):
    """An engine that cannot run here, with the reason (a missing binary or draft)."""


def worker_main(name: str, setup: dict) -> int:
    """Load `name`, say ready, then answer one JSON request per stdin line.  The answers go to the
    process's original stdout; anything a library prints there goes to stderr instead."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def say(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    t = time.perf_counter()
    try:
        if name in MEMSPEC:
            w = MemspecWorker(setup, drafts=name.startswith("memspec"), backend=MEMSPEC[name])
        elif name in ("onnxruntime-genai", "onnxruntime-genai-spec"):
            w = GenaiWorker(setup, speculative=name == "onnxruntime-genai-spec")
        elif name == "llama.cpp-spec":
            w = LlamaServerWorker(setup)
        else:
            w = LlamaCppWorker(setup)
    except ImportError as exc:
        say({"error": f"{exc.name or exc} is not installed (pip install -e .[bench])"})
        return 1
    except LeftOut as exc:
        say({"error": str(exc)})
        return 1
    rss = getattr(w, "rss_mb", _rss_mb)
    say({"ready": True, "load_s": time.perf_counter() - t, "rss_mb": rss(), "forgets": hasattr(w, "forget")})
    try:
        for line in sys.stdin:
            req = json.loads(line)
            if req.get("forget"):  # a round starts: nothing learned from the requests before it
                w.forget()
                say({"forgot": True})
                continue
            t = time.perf_counter()
            out = w.generate(req["ids"], req["text"], req["max_new"])
            say({"ids": out, "seconds": time.perf_counter() - t, "rss_mb": rss(),
                 "drafted": getattr(w, "drafted", None), "spec": getattr(w, "spec", None)})
    finally:
        w.close()
    return 0


def split_checkout(name: str) -> tuple[str, Path | None]:
    """"memspec@PATH" -> ("memspec", PATH): a memspec engine run from another checkout of memspec
    (its own bench/engines.py worker, its package first on the path), to compare two versions of the
    code side by side in one interleaved run; a plain name -> (name, None)."""
    base, at, path = name.partition("@")
    return (base, Path(path).expanduser().resolve()) if at else (name, None)


class Engine:
    """The parent's handle on one worker process."""

    def __init__(self, name: str, setup: dict):
        self.name = name
        base, checkout = split_checkout(name)
        script, env = Path(__file__), None
        if checkout is not None:  # that checkout's worker and package (its native kernels built in place)
            script = checkout / "bench" / "engines.py"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout),
                                                                              os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, str(script), "--worker", base, "--setup", json.dumps(setup)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()
        self.peak_rss_mb = self.info.get("rss_mb", 0.0)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (status {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def generate(self, ids: list[int], text: str, max_new: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "text": text, "max_new": max_new}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        self.peak_rss_mb = max(self.peak_rss_mb, r["rss_mb"])
        return r

    def forget(self) -> None:
        """Have the engine forget what it learned from earlier requests (a worker that says it can)."""
        if self.info.get("forgets"):
            self.proc.stdin.write(json.dumps({"forget": True}) + "\n")
            self.proc.stdin.flush()
            self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# -- the run -------------------------------------------------------------------------------
def prompts(workload: str | None, limit: int | None, config_path: str | None,
            model: str | None = None) -> tuple[list[dict], dict]:
    """The workload's prompts with their token ids, and what the workers need to load the target
    (`model`, else the config's [model] target)."""
    from memspec.bench.policies import load_workload
    from memspec.config import load_config
    from memspec.models.store import ModelStore

    config = load_config(config_path)
    store = ModelStore(config.store_home)
    m = store.get(model or config.model.target)
    encode = chat_ids(m)
    items = load_workload(workload)[:limit]
    for w in items:
        w["ids"] = encode(w["prompt"])
    graph = str(m.variant_path("q4")) if "q4" in m.variants else None  # onnxruntime-genai runs it
    gguf = store.gguf_path(m)
    if gguf is None:
        raise SystemExit(f"{m.name}: the store records no GGUF for it (pulled by an older memspec): "
                         f"memspec pull {m.name} again")
    setup = {"config": config_path, "target": m.name, "model": graph, "arch": m.architecture,
             "eos": int(m.extra["eos_token_ids"][0]), "gguf": str(gguf)}
    setup.update(sibling_gguf(store, m.name))
    return items, setup


def chat_ids(m):
    """prompt -> the token ids of one user turn under store target m's chat template (what memspec
    generates from, and what the other engines are sent)."""
    from memspec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")
    return lambda prompt: tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


def sibling_gguf(store, target: str) -> dict:
    """{"draft_gguf": path} of the same-family draft's GGUF for `target` (what the -spec engines
    draft with), or {"no_draft": why not}."""
    from memspec.models.catalog import KNOWN_DRAFTS

    names = [n for n, d in KNOWN_DRAFTS.items() if d.target == target]
    have = {m.name: m for m in store.list()}
    for name in names:
        if name in have:
            path = store.gguf_path(have[name])
            if path is not None and path.is_file():
                return {"draft_gguf": str(path)}
    if not names:
        return {"no_draft": f"{target} has no same-family draft in the catalog"}
    return {"no_draft": f"the same-family draft's GGUF is not in the store: memspec pull {names[0]}"}


def run(names: list[str], items: list[dict], setup: dict, max_new: int, rounds: int, progress=print) -> dict:
    engines: dict[str, Engine] = {}
    for name in names:
        try:
            e = Engine(name, setup)
        except RuntimeError as exc:  # it could not load (the worker's traceback is on stderr)
            progress(f"{name}: left out: {exc}")
            continue
        if "error" in e.info:
            progress(f"{name}: left out: {e.info['error']}")
            e.close()
            continue
        e.generate(items[0]["ids"], items[0]["prompt"], 8)  # warm-up
        engines[name] = e
        progress(f"{name}: loaded in {e.info['load_s']:.2f} s, {e.info['rss_mb']:.0f} MiB")
    if not engines:
        return {"rows": []}
    per_round: dict[str, list[dict]] = {n: [] for n in engines}
    outputs: dict[str, list[list[int]]] = {}
    names = list(engines)
    try:
        for r in range(rounds):
            for e in engines.values():  # no round (nor the warm-up) leaves its answers to the next
                e.forget()
            acc = {n: {"tokens": 0, "seconds": 0.0, "outs": [], "drafted": None, "prompts": []} for n in names}
            for i, w in enumerate(items):
                shift = (r + i) % len(names)
                for name in names[shift:] + names[:shift]:  # each prompt on every engine, in rotating order
                    res = engines[name].generate(w["ids"], w["prompt"], max_new)
                    a = acc[name]
                    a["tokens"] += len(res["ids"])
                    a["seconds"] += res["seconds"]
                    a["outs"].append(res["ids"])
                    a["prompts"].append({"category": w.get("category", "-"), "tokens": len(res["ids"]),
                                         "seconds": res["seconds"], "drafted": res.get("drafted"),
                                         "spec": res.get("spec")})
                    if res.get("drafted"):  # an engine whose own speculation reports its draft tokens
                        a["drafted"] = [x + y for x, y in zip(a["drafted"] or (0, 0), res["drafted"])]
            for name in names:
                a = acc[name]
                tokens, seconds, drafted = a["tokens"], a["seconds"], a["drafted"]
                per_round[name].append({"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                                        "drafted": drafted, "prompts": a["prompts"]})
                outputs.setdefault(name, a["outs"])
                said = f", {drafted[1]}/{drafted[0]} draft tokens accepted" if drafted else ""
                progress(f"round {r + 1}/{rounds} {name}: {tokens / seconds:.1f} tok/s ({tokens} tokens{said})")
    finally:
        for e in engines.values():
            e.close()
    return summarize(per_round, outputs, {n: e.peak_rss_mb for n, e in engines.items()},
                     {n: e.info["load_s"] for n, e in engines.items()})


def summarize(per_round: dict, outputs: dict, rss: dict, load_s: dict) -> dict:
    """Median tok/s per engine, its ratio to llama.cpp (and to target-only), memory, agreement (with
    memspec's target-only, and for a -spec engine with its own plain decoding)."""
    med = {n: statistics.median(r["tok_per_s"] for r in runs) for n, runs in per_round.items()}
    ref = outputs.get("target-only")
    rows = []
    for n in per_round:
        same = sum(a == b for a, b in zip(outputs[n], ref)) if ref is not None else None
        plain = outputs.get(PLAIN.get(n))
        rows.append({
            "engine": n, "tok_per_s": round(med[n], 2),
            "vs_llama_cpp": round(med[n] / med[BASELINE], 3) if BASELINE in med else None,
            "vs_target_only": round(med[n] / med["target-only"], 3) if "target-only" in med else None,
            "tokens": per_round[n][0]["tokens"], "rounds": [round(r["tok_per_s"], 2) for r in per_round[n]],
            "peak_rss_mib": round(rss[n], 1), "load_s": round(load_s[n], 2),
            "same_output_as_target_only": same, "prompts": len(outputs[n]),
            "same_output_as_plain": sum(a == b for a, b in zip(outputs[n], plain)) if plain is not None else None,
            "draft_acceptance": acceptance(per_round[n]),
        })
    return {"rows": rows, "categories": by_category(per_round)}


def by_category(per_round: dict) -> list[dict]:
    """Per engine and category of the workload: tok/s (the median over rounds of the category's
    tokens over its seconds), its ratio to target-only's, and where the engine drafts, the share
    of draft tokens accepted, tokens a verification step, drafting's share of the time, and the
    draft that ran most often."""
    rows = []
    cats = list(dict.fromkeys(p["category"] for runs in per_round.values() for r in runs
                              for p in r.get("prompts", ())))
    for cat in cats:
        speed = {}
        for n, runs in per_round.items():
            speed[n] = statistics.median(
                sum(p["tokens"] for p in r["prompts"] if p["category"] == cat)
                / max(sum(p["seconds"] for p in r["prompts"] if p["category"] == cat), 1e-9) for r in runs)
        for n, runs in per_round.items():
            ps = [p for r in runs for p in r["prompts"] if p["category"] == cat]
            drafted = [p["drafted"] for p in ps if p.get("drafted")]
            specs = [p["spec"] for p in ps if p.get("spec")]
            proposed, accepted = sum(d[0] for d in drafted), sum(d[1] for d in drafted)
            steps = sum(s["steps"] for s in specs)
            used: dict[str, int] = {}
            for s in specs:
                if s["draft"]:
                    used[s["draft"]] = used.get(s["draft"], 0) + 1
            rows.append({
                "category": cat, "engine": n, "tok_per_s": round(speed[n], 2),
                "vs_target_only": round(speed[n] / speed["target-only"], 3) if speed.get("target-only") else None,
                "acceptance": round(accepted / proposed, 3) if proposed else None,
                "tokens_per_step": round(1 + accepted / steps, 2) if steps else None,
                "draft_share": round(sum(s["draft_ms"] for s in specs) / 1e3 / sum(p["seconds"] for p in ps), 3)
                if specs else None,
                "draft": max(used, key=used.get) if used else None,
            })
    return rows


def acceptance(runs: list[dict]) -> float | None:
    """Accepted / proposed draft tokens over an engine's rounds; None for an engine that reports none."""
    drafted = [r["drafted"] for r in runs if r.get("drafted")]
    proposed = sum(d[0] for d in drafted)
    return round(sum(d[1] for d in drafted) / proposed, 3) if proposed else None


def print_report(result: dict, out=sys.stdout) -> None:
    def ratio(v):
        return "-" if v is None else f"{v:.2f}x"

    def share(r, key):
        return "-" if r.get(key) is None else f"{r[key]}/{r['prompts']}"

    print(f"{'engine':<22} {'tok/s':>7} {'vs llama.cpp':>12} {'vs target-only':>14} {'tokens':>7} "
          f"{'RSS MiB':>8} {'load s':>6}  same output as target-only (as its plain engine)", file=out)
    for r in result["rows"]:
        plain = f" ({share(r, 'same_output_as_plain')})" if r.get("same_output_as_plain") is not None else ""
        if r.get("draft_acceptance") is not None:
            plain += f"; {r['draft_acceptance']:.0%} of its draft tokens accepted"
        print(f"{r['engine']:<22} {r['tok_per_s']:>7.1f} {ratio(r['vs_llama_cpp']):>12} "
              f"{ratio(r['vs_target_only']):>14} {r['tokens']:>7} {r['peak_rss_mib']:>8.0f} {r['load_s']:>6.2f}  "
              f"{share(r, 'same_output_as_target_only')}{plain}", file=out)
    cats = result.get("categories") or []
    if len({c["category"] for c in cats}) > 1:
        print(f"\n{'category':<14} {'engine':<22} {'tok/s':>7} {'vs target-only':>14} {'accepted':>8} "
              f"{'tok/step':>8} {'drafting':>8}  draft run most", file=out)
        for c in cats:
            def pct(v):
                return "-" if v is None else f"{v:.0%}"
            step = "-" if c["tokens_per_step"] is None else f"{c['tokens_per_step']:.2f}"
            print(f"{c['category']:<14} {c['engine']:<22} {c['tok_per_s']:>7.1f} {ratio(c['vs_target_only']):>14} "
                  f"{pct(c['acceptance']):>8} {step:>8} {pct(c['draft_share']):>8}  {c['draft'] or '-'}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", help="JSONL with `prompt` fields (default: memspec's built-in 48 prompts)")
    ap.add_argument("--limit", type=int, help="only the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over the workload (each prompt on every engine in turn)")
    ap.add_argument("--threads", type=int, default=None, help="threads per engine (default: physical cores)")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"comma-separated, from {', '.join(ENGINES)}; a memspec engine may be NAME@CHECKOUT: "
                         "run from another checkout of memspec (say, main before a change), side by side")
    ap.add_argument("--config", help="memspec TOML config for the memspec engines")
    ap.add_argument("--model", metavar="NAME", help="target from the store (default: the config's [model] target)")
    ap.add_argument("--draft-max", type=int, default=4, help="draft tokens a round for the -spec engines (1-16)")
    ap.add_argument("--llama-server", metavar="PATH", default=os.environ.get("MEMSPEC_LLAMA_SERVER"),
                    help="llama-server binary for llama.cpp-spec (default: $MEMSPEC_LLAMA_SERVER, else the one "
                         "bench/build_llama_cpp.sh builds, if built)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, json.loads(args.setup))
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    bad = [n for n in names if split_checkout(n)[0] not in ENGINES]
    if bad or not names:
        ap.error(f"--engines: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(ENGINES)}")
    for n in names:
        base, checkout = split_checkout(n)
        if checkout is not None and (base not in MEMSPEC or not (checkout / "bench" / "engines.py").is_file()):
            ap.error(f"--engines: {n}: NAME@CHECKOUT takes a memspec engine and a memspec checkout "
                     f"(a folder with bench/engines.py)")
    if args.max_tokens < 1 or args.rounds < 1 or (args.limit is not None and args.limit < 1):
        ap.error("--max-tokens, --rounds and --limit must be at least 1")
    if not 1 <= args.draft_max <= 16:
        ap.error(f"--draft-max must be 1..16 (onnxruntime-genai's range), got {args.draft_max}")
    from memspec.errors import MemspecError
    from memspec.runtime.contracts import physical_cores

    try:
        items, setup = prompts(args.workload, args.limit, args.config, args.model)
    except MemspecError as exc:
        print(f"engines: {exc}", file=sys.stderr)
        return 2
    setup["threads"] = args.threads or physical_cores()
    setup["draft_max"] = args.draft_max
    setup["llama_server"] = args.llama_server or str(default_llama_server())
    progress = (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        result = run(names, items, setup, args.max_tokens, args.rounds, progress)
    except RuntimeError as exc:  # a worker died mid-run
        print(f"engines: {exc}", file=sys.stderr)
        return 1
    if not result["rows"]:
        print("engines: no engine could run", file=sys.stderr)
        return 1
    result.update({"prompts": len(items), "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "threads": setup["threads"], "workload": args.workload or "built-in",
                   "draft_max": args.draft_max})
    print(f"\n{len(items)} prompts, greedy, up to {args.max_tokens} tokens each, {setup['threads']} threads per "
          f"engine, median of {args.rounds} interleaved rounds")
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
