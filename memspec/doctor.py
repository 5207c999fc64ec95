"""`memspec doctor`: what this machine gives memspec, in one screen, and whether memspec can serve here.

    report = doctor.examine(config)              # every section; seconds (a bandwidth probe, a target load)
    print(doctor.render(report))                 # the screen; json.dumps(report) is `--json`
    sys.exit(0 if report["ok"] else 1)

Each section reads what another module owns: the kernel path (memspec.runtime.kernels), the engine a
target runs on (memspec.runtime.plan.engine_for), the exactness self-check every target runs at load
(`Target.rows`, memspec.runtime.invariance), the providers (memspec.runtime.sessions), the memory
probes and the budget (memspec.runtime.memory).  What is its own: the GPU probe, the memory-bandwidth
probe, and the decode limit it implies (a decoded token reads every weight once: bandwidth / bytes
read per token bounds the target-only tokens a second).

`--json` prints the report as it is; its keys (schema 1; a key is added, never renamed, and a change of
meaning bumps "schema"):

    schema          1
    memspec         the version
    ok              true: the default target can be served here; false: see "problems"
    problems        [str]: why memspec cannot serve here, each with what to do (empty when ok)
    warnings        [str]: what serves, but not as well as it could
    system          {os, machine, cpu, physical_cores, logical_cores, python}
    kernels         {built, isa (null when not built), isa_name, isas, forced ($MEMSPEC_NATIVE_ISA or null), error
                     (built with an error: the extension does not load, e.g. forced to a path this CPU lacks)}
    onnxruntime     {installed, version, providers, cuda, tensorrt, error}
    gpu             {found, name, memory_bytes (null: unknown; a Jetson's is the system's, shared), source,
                     variant (what the default target would run on a GPU; null: no ONNX Runtime), pulled, note}
    memory          {total_bytes, available_bytes, cgroup_limit_bytes (0: none), budget_bytes (0: none), budget_from}
    bandwidth       {bytes_per_s, buffer_bytes, passes, threads, seconds, others_cpu_share (0..1: the CPU other
                     processes used meanwhile; past 0.25 a warning says the figure reads low)}
    default_target  {name, variant, engine (null: none can run it), pulled, footprint_bytes, context (tokens the
                     daemon would give it: [runtime] max_context, "auto" within the memory; null: it did not
                     load), context_reason, kv (its KV cache's format: [runtime] kv on the native engine,
                     the graph's own on ONNX Runtime; null: it did not load)}
    targets         [{name, default, engine, variant, bytes_per_token, limit_tok_per_s, error}] per pulled target
    exactness       [{engine, variant, exact, pad_rows, max_diff, reason, load_s, error}] per engine, default target
    speed           null without --speed; else {engine, variant, tokens, tok_per_s, limit_tok_per_s, share_of_limit,
                     others_cpu_share}
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from memspec import __version__
from memspec.config import Config
from memspec.errors import MemspecError
from memspec.runtime.costs import BUSY_SHARE, others_cpu_share

SCHEMA = 1
PROBE_SECONDS = 2.0  # how long the bandwidth probe reads
MIN_PASSES = 3  # ... and at least this many passes, however long they take
PROBE_MIN_BYTES = 512 << 20  # the probe's buffer: at least this, and 16x the largest cache
SPEED_TOKENS = 32  # tokens `--speed` decodes after a short prompt
ISA_NAMES = {"avx512": "AVX-512 VNNI", "avx2": "AVX2", "neon": "NEON dotprod", "scalar": "scalar"}
ENGINES = ("native", "onnxruntime")


# -- bandwidth -------------------------------------------------------------------------------
def median_bandwidth(nbytes: int, seconds: Sequence[float]) -> float:
    """Bytes a second of passes that each read `nbytes` and took `seconds` (their median: a pass that
    another process slowed counts no more than one pass)."""
    if not seconds or min(seconds) <= 0:
        raise ValueError(f"a bandwidth needs passes of positive duration, got {list(seconds)}")
    return nbytes / statistics.median(seconds)


def decode_limit(bytes_per_token: int, bytes_per_s: float) -> float:
    """Tokens a second a target-only decode cannot pass: each token reads every weight once."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes read per token must be positive, got {bytes_per_token}")
    return bytes_per_s / bytes_per_token


def time_passes(read: Callable[[], object], budget_s: float = PROBE_SECONDS, min_passes: int = MIN_PASSES,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of each call of read(), called until `budget_s` has passed and at least `min_passes` times."""
    out, start = [], clock()
    while len(out) < min_passes or clock() - start < budget_s:
        t = clock()
        read()
        out.append(clock() - t)
    return out


def largest_cache(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of the CPU's largest cache (Linux sysfs), 0 where unknown."""
    sizes = []
    for f in root.glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1))
        except (OSError, ValueError):  # unreadable, or a format of another kernel: not a size to go by
            continue
    return max(sizes, default=0)


def probe_bandwidth(threads: int, available_bytes: int, budget_s: float = PROBE_SECONDS,
                    clock: Callable[[], float] = time.perf_counter) -> dict:
    """Memory-read bandwidth: `threads` threads (NumPy releases the GIL in its reductions) sum their
    slices of a float64 buffer far larger than the caches, until `budget_s` has passed; the median pass."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    nbytes = max(PROBE_MIN_BYTES, 16 * largest_cache())
    nbytes = min(nbytes, max(available_bytes // 4, 64 << 20)) // 8 * 8  # never the memory a target needs
    buf = np.ones(nbytes // 8)  # written, so its pages are committed (an untouched page reads as the zero page)
    parts = np.array_split(buf, threads)
    with ThreadPoolExecutor(threads) as pool:
        read = lambda: list(pool.map(np.sum, parts))  # noqa: E731
        read()  # warm: the threads started, the pages in the TLB
        seconds, busy = others_cpu_share(lambda: time_passes(read, budget_s, clock=clock))
    return {"bytes_per_s": median_bandwidth(nbytes, seconds), "buffer_bytes": nbytes, "passes": len(seconds),
            "threads": threads, "seconds": round(sum(seconds), 3), "others_cpu_share": round(busy, 2)}


def bytes_per_token(gguf: Path) -> int:
    """Bytes of weights a token's pass reads from this GGUF: every tensor, less the token embedding
    where the head is its own tensor (a token then reads one row of the embedding).  A tensor's bytes
    run to the next tensor's offset (its alignment padding included), the last one's to the file's end."""
    from memspec.models.gguf import read_layout

    _, tensors = read_layout(gguf)
    starts = sorted((info.offset, name) for name, info in tensors.items())
    ends = [o for o, _ in starts[1:]] + [gguf.stat().st_size]
    extent = {name: end - start for (start, name), end in zip(starts, ends)}
    skip = extent["token_embd.weight"] if "output.weight" in extent and "token_embd.weight" in extent else 0
    return sum(extent.values()) - skip


# -- the machine ----------------------------------------------------------------------------------
def os_name(release: Path = Path("/etc/os-release")) -> str:
    """The distribution's PRETTY_NAME and the kernel release, else what platform knows."""
    pretty = ""
    try:
        for line in release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                pretty = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return f"{pretty} (kernel {platform.release()})" if pretty else platform.platform()


def system_section() -> dict:
    from memspec.runtime.costs import cpu_name
    from memspec.runtime.contracts import physical_cores

    return {"os": os_name(), "machine": platform.machine(), "cpu": cpu_name(), "physical_cores": physical_cores(),
            "logical_cores": os.cpu_count() or 1, "python": platform.python_version()}


def kernels_section() -> dict:
    out = {"built": False, "isa": None, "isa_name": None, "isas": [],
           "forced": os.environ.get("MEMSPEC_NATIVE_ISA") or None, "error": None}
    try:
        from memspec.runtime import kernels
    except ImportError as exc:  # built, but refusing $MEMSPEC_NATIVE_ISA: every engine choice imports it
        return dict(out, built=True, error=str(exc))  # kernels.NativeIsaRefused says what to do
    out["built"] = kernels.available()
    if not out["built"]:
        out["error"] = kernels.NOT_BUILT
        return out
    out["isa"] = kernels.isa()
    out["isa_name"] = ISA_NAMES.get(out["isa"], out["isa"])
    out["isas"] = list(kernels.isas())
    return out


def onnxruntime_section() -> dict:
    from memspec.runtime.config import GPU_PROVIDERS

    out = {"installed": False, "version": None, "providers": [], "cuda": False, "tensorrt": False, "error": None}
    try:
        import onnxruntime as ort
    except ImportError as exc:
        out["error"] = f"not installed ({exc}): pip install 'memspec[cpu]', or NVIDIA's onnxruntime-gpu on a Jetson"
        return out
    providers = list(ort.get_available_providers())
    out.update(installed=True, version=ort.__version__, providers=providers, cuda=GPU_PROVIDERS[1] in providers,
               tensorrt=GPU_PROVIDERS[0] in providers)
    return out


def _run_quietly(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def gpu_section(run: Callable[[list[str]], str | None] = _run_quietly, root: Path = Path("/"),
                total_memory: int = 0) -> dict:
    """The first GPU found: nvidia-smi's name and memory, else the driver's /proc/driver/nvidia (name
    only), else a Jetson's /proc/device-tree/model (its memory is the system's, shared by CPU and GPU)."""
    out = {"found": False, "name": None, "memory_bytes": None, "source": None}
    smi = run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    if smi and smi.strip():
        name, _, mib = smi.strip().splitlines()[0].rpartition(",")
        if name:
            try:
                memory = int(float(mib)) << 20
            except ValueError:  # "[N/A]": a Jetson's nvidia-smi, whose GPU shares the system's memory
                memory = total_memory or None
            return dict(out, found=True, name=name.strip(), memory_bytes=memory, source="nvidia-smi")
    for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information")):
        try:
            text = info.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Model:"):
                return dict(out, found=True, name=line.split(":", 1)[1].strip(), source=str(info))
    model = root / "proc/device-tree/model"
    if model.is_file():
        name = model.read_bytes().rstrip(b"\0").decode(errors="replace").strip()
        if "jetson" in name.lower() or "nvidia" in name.lower():
            return dict(out, found=True, name=name, memory_bytes=total_memory or None, source=str(model))
    return out


def gpu_variant(config: Config, manifest) -> dict:
    """What the default target would run on a GPU (CUDA in ONNX Runtime): the variant loading it there
    picks (memspec.runtime.plan.variant_for), whether the store has it, and a note where that is
    not the fast one."""
    from memspec.runtime.config import GPU_PROVIDERS
    from memspec.runtime.config import onnxruntime_missing
    from memspec.runtime.plan import variant_for

    missing = onnxruntime_missing()
    if missing:  # no ONNX Runtime: nothing runs on a GPU
        return {"variant": None, "pulled": False, "note": missing}
    have = manifest.variants if manifest is not None else {}
    variant, note = variant_for(config.model.variant, [GPU_PROVIDERS[1]], have)
    return {"variant": variant, "pulled": variant in have, "note": note}


def memory_section(config: Config, probe) -> dict:
    import psutil

    from memspec.runtime.memory import memory_budget

    limit = probe.limit_bytes()
    budget = memory_budget(config.scheduler.budget_mb, probe)
    source = "[scheduler] budget_mb" if config.scheduler.budget_mb else "the cgroup's limit" if budget else "none"
    return {"total_bytes": int(psutil.virtual_memory().total), "available_bytes": probe.available_bytes(),
            "cgroup_limit_bytes": limit, "budget_bytes": budget, "budget_from": source}


# -- the targets ----------------------------------------------------------------------------------
def _engine_config(config: Config, engine: str):
    import dataclasses

    return dataclasses.replace(config.runtime, backend=engine)


def target_rows(store, config: Config, bandwidth: float) -> list[dict]:
    """Each pulled target: the engine it runs on here, the bytes a token reads (the native engine: the
    GGUF's weights, bytes_per_token; ONNX Runtime: its graph's file) and the decode limit they imply."""
    from memspec.runtime.config import NATIVE_VARIANT
    from memspec.runtime.plan import engine_for

    rows = []
    for m in (m for m in store.list() if m.role == "target"):
        row = {"name": m.name, "default": m.name == config.model.target, "engine": None, "variant": None,
               "bytes_per_token": None, "limit_tok_per_s": None, "error": None}
        rows.append(row)
        try:
            row["engine"] = engine_for(store, m, config.model.variant, config.runtime)
        except MemspecError as exc:
            row["error"] = str(exc)
            continue
        if row["engine"] == "native":
            row["variant"], gguf = NATIVE_VARIANT, store.gguf_path(m)
            if gguf is None or not gguf.is_file():
                row["error"] = f"its GGUF is not in the store, and the native engine runs it: memspec pull {m.name}"
                continue
            row["bytes_per_token"] = bytes_per_token(gguf)
        else:
            row["variant"] = config.model.variant
            if row["variant"] not in m.variants:
                row["error"] = (f"no {row['variant']} graph for ONNX Runtime: "
                                f"memspec pull {m.name} --variant {row['variant']}")
                continue
            row["bytes_per_token"] = m.variant_bytes(row["variant"])
        row["limit_tok_per_s"] = decode_limit(row["bytes_per_token"], bandwidth)
    return rows


def load_on(store, manifest, config: Config, engine: str) -> tuple[object | None, dict]:
    """The default target loaded on `engine`, with its self-check's verdict (None and the reason when
    that engine cannot run it here)."""
    from memspec.runtime.plan import plan
    from memspec.runtime.target import open_target

    row = {"engine": engine, "variant": None, "exact": None, "pad_rows": None, "max_diff": None, "reason": None,
           "load_s": None, "error": None}
    t0 = time.perf_counter()
    try:
        runtime = _engine_config(config, engine)
        p = plan(store, manifest.name, config.model.variant, runtime)
        target, variant = open_target(store, p, runtime), p.variant
    except (MemspecError, ImportError) as exc:  # ImportError: the kernels or ONNX Runtime are missing
        return None, dict(row, error=str(exc))
    except Exception as exc:  # noqa: BLE001 (ONNX Runtime's own errors, a kernel's)
        # the report names what failed to load: a doctor that died of it would name nothing
        return None, dict(row, error=f"{type(exc).__name__}: {exc}")
    rows = target.rows
    return target, dict(row, variant=variant, exact=rows.exact, pad_rows=rows.pad_rows, max_diff=rows.max_diff,
                        reason=rows.warning() or rows.reason or "", load_s=round(time.perf_counter() - t0, 2))


def decode_speed(target, tokens: int = SPEED_TOKENS, clock: Callable[[], float] = time.perf_counter) -> float:
    """Tokens a second of a greedy target-only decode: a 16-token prompt, then `tokens` passes of one
    token each (the median pass: other work on the machine only ever adds time)."""
    import numpy as np

    vocab = target.vocab_size or 1000
    prompt = [(37 * i + 11) % vocab for i in range(16)]
    cache = target.new_cache(len(prompt) + tokens + 1)
    tok = int(np.argmax(target.forward(cache, prompt, keep=1)[-1]))
    steps = []
    for _ in range(tokens):
        t = clock()
        tok = int(np.argmax(target.forward(cache, [tok], keep=1)[-1]))
        steps.append(clock() - t)
    return 1.0 / statistics.median(steps)


# -- the report -------------------------------------------------------------------------------------
def examine(config: Config, speed: bool = False, probe_seconds: float | None = None) -> dict:
    """Every section of the report, and its verdict (see the module's docstring for the keys)."""
    from memspec.models.store import ModelStore
    from memspec.runtime.memory import PsutilProbe

    store = ModelStore(config.store_home)
    report = {"schema": SCHEMA, "memspec": __version__, "ok": True, "problems": [], "warnings": [],
              "system": system_section(), "kernels": kernels_section(), "onnxruntime": onnxruntime_section()}
    memory = report["memory"] = memory_section(config, PsutilProbe())
    name = config.model.target
    manifest = next((m for m in store.list() if m.name == name and m.role == "target"), None)
    report["gpu"] = dict(gpu_section(total_memory=memory["total_bytes"]), **gpu_variant(config, manifest))
    report["bandwidth"] = probe_bandwidth(report["system"]["physical_cores"], memory["available_bytes"],
                                          PROBE_SECONDS if probe_seconds is None else probe_seconds)
    report["speed"] = None
    report["warnings"] += busy_warnings(report)
    report["default_target"] = {"name": name, "variant": config.model.variant, "engine": None,
                                "pulled": manifest is not None, "footprint_bytes": None,
                                "context": None, "context_reason": None, "kv": None}
    report["targets"], report["exactness"] = [], []
    if report["kernels"]["built"] and report["kernels"]["error"]:  # they do not load: no engine is chosen
        report["problems"].append(f"the native kernels do not load: {report['kernels']['error']}")
        report["ok"] = False
        return report
    report["targets"] = target_rows(store, config, report["bandwidth"]["bytes_per_s"])
    if manifest is None:
        have = [t["name"] for t in report["targets"]]
        report["problems"].append(f"the default target {name} is not pulled into {store.models_dir}: memspec pull "
                                  f"{name}" + (f" (pulled: {', '.join(have)}; [model] target or --model picks one)"
                                               if have else ""))
    else:
        check_default(report, store, manifest, config, speed)
    if not report["kernels"]["built"]:
        report["warnings"].append(report["kernels"]["error"])
    report["ok"] = not report["problems"]
    return report


def check_default(report: dict, store, manifest, config: Config, speed: bool) -> None:
    """The default target's part of the report: its engine and footprint, its self-check on each engine,
    whether it fits the memory budget, and with `speed` its decode rate."""
    from memspec.runtime.plan import engine_for, plan

    default, memory, problems = report["default_target"], report["memory"], report["problems"]
    name, variant = manifest.name, config.model.variant
    try:
        default["engine"] = engine_for(store, manifest, variant, config.runtime)
    except MemspecError as exc:  # e.g. backend = "native" without the kernels
        problems.append(f"{name} cannot run as configured: {exc}")
    try:
        default["footprint_bytes"] = plan(store, name, variant, config.runtime).planned_bytes
    except (MemspecError, KeyError):  # no file to size it by: the load below says why
        pass
    served = None
    for engine in ENGINES:
        target, row = load_on(store, manifest, config, engine)
        report["exactness"].append(row)
        if row["exact"] is False:
            report["warnings"].append(f"{name} on {engine}: {row['reason']}")
        if target is not None and engine == default["engine"]:
            served = (target, row)  # the one the daemon would run
        del target  # the other engine's goes now, before --speed decodes
    if served is not None:  # the context the daemon would give it (memspec.runtime.context)
        from memspec.build import fit_context

        choice = fit_context(config, store, name, manifest, served[0])
        default.update(context=choice.tokens, context_reason=choice.reason, kv=served[0].kv)
    if default["engine"] and served is None:
        why = "; ".join(f"{r['engine']}: {r['error']}" for r in report["exactness"] if r["error"])
        problems.append(f"{name} does not load on the {default['engine']} engine ([runtime] backend = "
                        f"\"{config.runtime.backend}\"): {why}")
    budget, footprint = memory["budget_bytes"], default["footprint_bytes"]
    if footprint and budget and budget < footprint:
        problems.append(f"the memory budget ({_mib(budget)}, from {memory['budget_from']}) is below {name}'s "
                        f"footprint ({_mib(footprint)}): raise [scheduler] budget_mb (and the unit's "
                        f"MemoryHigh=/MemoryMax=), or pick a smaller target")
    elif footprint and memory["available_bytes"] < footprint:
        report["warnings"].append(f"only {_mib(memory['available_bytes'])} of memory is available; loading {name} "
                                  f"needs about {_mib(footprint)}")
    if speed and served:
        report["speed"] = _speed(*served, report["targets"])
        report["warnings"] += busy_warnings({"speed": report["speed"]})


def _speed(target, loaded: dict, targets: list[dict]) -> dict:
    """--speed: the loaded default target's decode rate, and its share of the bandwidth's limit."""
    limit = next((t["limit_tok_per_s"] for t in targets if t["default"]), None)
    tok_s, busy = others_cpu_share(lambda: decode_speed(target))
    return {"engine": loaded["engine"], "variant": loaded["variant"], "tokens": SPEED_TOKENS, "tok_per_s": tok_s,
            "limit_tok_per_s": limit, "share_of_limit": tok_s / limit if limit else None,
            "others_cpu_share": round(busy, 2)}


def busy_warnings(report: dict) -> list[str]:
    """What other processes on the machine may have taken from the measurements (memspec.runtime.costs:
    past BUSY_SHARE of the CPU, a cost curve is not kept either)."""
    out = []
    for key, what in (("bandwidth", "the bandwidth probe"), ("speed", "the --speed decode")):
        share = (report.get(key) or {}).get("others_cpu_share", 0.0)
        if share > BUSY_SHARE:
            out.append(f"other processes used {share:.0%} of the CPU during {what}: its figures read low; "
                       f"run it again on an idle machine")
    return out


# -- the screen -------------------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.0f} MiB"


def render(r: dict) -> str:
    """The report as one screen of text: a line a fact, each led by its section's name."""
    lines = [f"memspec {r['memspec']} doctor", *_machine_lines(r), *_target_lines(r)]
    lines += [f"warning     {w}" for w in r["warnings"]]
    lines += [f"problem     {p}" for p in r["problems"]]
    d = r["default_target"]
    lines.append(f"verdict     memspec can serve {d['name']} here, on the {d['engine']} engine" if r["ok"] else
                 "verdict     memspec cannot serve here (the problems above say what to do)")
    return "\n".join(lines)


def _machine_lines(r: dict) -> list[str]:
    s, k, o, g, m, b = r["system"], r["kernels"], r["onnxruntime"], r["gpu"], r["memory"], r["bandwidth"]
    out = [f"system      {s['os']}, {s['machine']}, Python {s['python']}",
           f"cpu         {s['cpu']}: {s['physical_cores']} cores, {s['logical_cores']} threads"]
    forced = f" (forced by MEMSPEC_NATIVE_ISA={k['forced']})" if k["forced"] else ""
    if k["built"] and not k["error"]:
        out.append(f"kernels     built; path {k['isa']} ({k['isa_name']}){forced}; this CPU runs "
                   f"{', '.join(k['isas'])}")
    else:
        out.append(f"kernels     {'NOT LOADING' if k['built'] else 'NOT BUILT'}: {k['error']}")
    gpu_eps = ", ".join(n for n, have in (("CUDA", o["cuda"]), ("TensorRT", o["tensorrt"])) if have) or "none"
    out.append(f"onnxruntime {o['version']}: {', '.join(o['providers'])} (GPU: {gpu_eps})" if o["installed"]
               else f"onnxruntime {o['error']}")
    gpu = (f"{g['name']}, {_mib(g['memory_bytes'])} ({g['source']})" if g["found"]
           else "none found (nvidia-smi, /proc/driver/nvidia, /proc/device-tree/model)")
    name = r["default_target"]["name"]
    if g["variant"] is None:
        out.append(f"gpu         {gpu}; {g['note']}")
    else:
        pulled = "" if g["pulled"] else f" (not pulled: memspec pull {name} --variant {g['variant']})"
        out.append(f"gpu         {gpu}; on a GPU {name} would run {g['variant']}{pulled}"
                   + (f"; {g['note']}" if g["note"] else ""))
    limit = _mib(m["cgroup_limit_bytes"]) if m["cgroup_limit_bytes"] else "none"
    budget = f"{_mib(m['budget_bytes'])} (from {m['budget_from']})" if m["budget_bytes"] else "none"
    out.append(f"memory      {_mib(m['available_bytes'])} available of {_mib(m['total_bytes'])}; cgroup limit "
               f"{limit}; budget {budget}")
    out.append(f"bandwidth   {b['bytes_per_s'] / 1e9:.1f} GB/s reading ({b['threads']} threads, median of "
               f"{b['passes']} passes over {_mib(b['buffer_bytes'])})")
    return out


def _target_lines(r: dict) -> list[str]:
    out, name = [], r["default_target"]["name"]
    for t in r["targets"]:
        mark = " (default)" if t["default"] else ""
        out.append(f"target      {t['name']}{mark}: {t['error']}" if t["error"] else
                   f"target      {t['name']}{mark} on {t['engine']} ({t['variant']}): reads "
                   f"{t['bytes_per_token'] / 1e6:.0f} MB a token, at most {t['limit_tok_per_s']:.1f} tok/s")
    for e in r["exactness"]:
        if e["error"]:
            verdict = f"cannot load: {e['error']}"
        elif e["exact"]:
            verdict = "exact (a row's logits the same at any row count)" + (f"; {e['reason']}" if e["reason"] else "")
        else:
            verdict = f"NOT exact: {e['reason']}"
        out.append(f"exactness   {name} on {e['engine']}: {verdict}")
    d = r["default_target"]
    if d.get("context"):
        out.append(f"context     {name}: {d['context']:,} tokens ({d['context_reason']}), KV {d['kv']}")
    sp = r["speed"]
    if sp:
        share = (f", {sp['share_of_limit']:.0%} of the {sp['limit_tok_per_s']:.1f} tok/s limit"
                 if sp["share_of_limit"] else "")
        out.append(f"speed       {name} on {sp['engine']}: {sp['tok_per_s']:.1f} tok/s decoding {sp['tokens']} "
                   f"tokens{share}")
    return out


def main(config: Config, speed: bool = False, as_json: bool = False, out=None) -> int:
    """`memspec doctor`: print the report; 0 when memspec can serve here, 1 when it cannot."""
    import json

    report = examine(config, speed)
    print(json.dumps(report, indent=2) if as_json else render(report), file=out or sys.stdout)
    return 0 if report["ok"] else 1
