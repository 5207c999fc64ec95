"""Memory: how much the system has free, how much this process holds, what a load costs.

* `MemoryProbe` is what the working set asks (`available_bytes()`, `rss_bytes()`);
  `PsutilProbe` answers from the OS, tests pass fakes.
* `release_heap()` hands freed heap pages back to the OS (glibc `malloc_trim(0)`).
  Unloading a model gives its RSS back only when all of these hold:
  1. ONNX Runtime keeps no CPU memory arena (memspec.runtime.sessions), so a dropped
     session frees its buffers to malloc;
  2. nothing else references the session (the working set drops the proposer
     before it trims, and its loader thread keeps no local copy);
  3. glibc's malloc thresholds are fixed (`tune_malloc()`): by default freeing a
     large mmapped buffer raises the mmap threshold, so the next model's weights
     land in the loader thread's own heap, whose top malloc_trim never shrinks;
  4. then `reclaim()`: `gc.collect()` and `malloc_trim(0)`.
* `measure()` is the footprint of a load: the RSS it added beside the declared file size.
* `Ledger` is the running account of what is resident: target, drafts, KV caches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol, TypeVar

MiB = 1 << 20
T = TypeVar("T")
KINDS = ("target", "draft", "kv")


class MemoryProbe(Protocol):
    def available_bytes(self) -> int: ...  # memory the kernel can still hand out (MemAvailable)

    def rss_bytes(self) -> int: ...  # resident set size of this process

    def limit_bytes(self) -> int: ...  # the memory this process may use at most (its cgroup's); 0 = no limit


@dataclass(frozen=True)
class CgroupMemory:
    """This process's cgroup v2 memory limits (systemd's MemoryMax= / MemoryHigh=)."""

    folder: Path  # /sys/fs/cgroup/<the process's cgroup>
    limit: int  # the lower of memory.max and memory.high, in bytes

    def current(self) -> int:
        """What the cgroup holds now (memory.current)."""
        return int((self.folder / "memory.current").read_text())

    def available(self) -> int:
        return max(self.limit - self.current(), 0)


CGROUP_SLACK = 300 * MiB  # what the budget does not see (gRPC buffers, short-lived allocations) ...
CGROUP_SLACK_RATIO = 1.25  # ... and the systemd unit's MemoryHigh = budget x 1.25 + 300 MiB


def budget_under(limit: int) -> int:
    """The memory budget a cgroup limit leaves: the inverse of the unit's rule, MemoryHigh =
    budget x 1.25 + 300 MiB (systemd/memspec.service), so that the example config (budget_mb = 0)
    and the unit agree.  0 when the limit is too small for any budget."""
    return max(int((limit - CGROUP_SLACK) / CGROUP_SLACK_RATIO), 0)


def memory_budget(budget_mb: int, probe: MemoryProbe) -> int:
    """The one memory budget ([scheduler] budget_mb) in bytes; with none configured, what the
    cgroup's limit (systemd's MemoryHigh= / MemoryMax=) leaves, if any; 0 = no budget."""
    limit = probe.limit_bytes()
    return budget_mb * MiB or (budget_under(limit) if limit else 0)


def cgroup_memory(proc_cgroup: Path = Path("/proc/self/cgroup"),
                  root: Path = Path("/sys/fs/cgroup")) -> CgroupMemory | None:
    """The cgroup v2 memory limit this process runs under, or None (cgroup v1, no limit, unreadable)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rel = next((ln[3:] for ln in lines if ln.startswith("0::")), None)  # v2: "0::/system.slice/x.service"
    if rel is None:
        return None
    folder = root / rel.lstrip("/")
    limits = []
    for name in ("memory.max", "memory.high"):
        try:
            value = (folder / name).read_text().strip()
        except OSError:
            continue
        if value and value != "max":
            limits.append(int(value))
    if not limits:
        return None
    return CgroupMemory(folder, min(limits))


class PsutilProbe:
    """The OS's view, through psutil, within the process's cgroup memory limit when it has one
    (under systemd's MemoryMax= the kernel kills at the limit, whatever MemAvailable says)."""

    def __init__(self, cgroup: CgroupMemory | None = None):
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self.cgroup = cgroup if cgroup is not None else cgroup_memory()

    def available_bytes(self) -> int:
        system = int(self._psutil.virtual_memory().available)
        if self.cgroup is None:
            return system
        try:
            return min(system, self.cgroup.available())
        except (OSError, ValueError):  # the cgroup went away: the system's figure still holds
            return system

    def rss_bytes(self) -> int:
        return int(self._proc.memory_info().rss)

    def limit_bytes(self) -> int:
        return self.cgroup.limit if self.cgroup is not None else 0


_libc = None


def _malloc_trim():
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                lib.malloc_trim.restype = ctypes.c_int
                _libc = lib
            except (OSError, AttributeError):  # musl has no malloc_trim
                _libc = False
    return _libc.malloc_trim if _libc else None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def tune_malloc(mmap_threshold: int = 128 * 1024) -> bool:
    """Fix glibc's mmap and trim thresholds (at their defaults), turning off their dynamic
    growth: large buffers are then always mmapped and unmapped on free.  Process-wide,
    idempotent; False where there is no glibc."""
    if _malloc_trim() is None:
        return False
    _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        _libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold))


def release_heap() -> bool:
    """Give freed heap memory back to the OS (glibc malloc_trim(0)); False where there is none."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def reclaim() -> None:
    """After the caller dropped its references to a model: collect cycles and trim the heap."""
    gc.collect()
    release_heap()


# A draft's RSS once loaded, per byte of its files, planned before its first load, by the
# variant it ships as.  q8 (8-bit MatMulNBits blocks, kept as they are): measured 1.43x
# (draft-code, 7.4 MiB file) and 1.85x (draft-general, 16.3 MiB; its embedding is larger).
# fp32 (float16 initializers that load as float32; ONNX Runtime keeps both): measured
# 2.9-4.3x.  q4 (a sibling draft's 4-bit MatMulNBits blocks, which ONNX Runtime prepacks beside
# the file's copy): measured 1.86x (qwen2.5-coder-0.5b-draft, 257 MiB file, after its first
# proposal).  gguf (ggml blocks the native engine maps, its small blocks interleaved at load and
# their mapped pages dropped, as a native target's: NATIVE_FOOTPRINT_PER_FILE_BYTE 1.1, plus the
# pass's buffers).  Where ONNX Runtime runs a GGUF draft, its graph built from it is larger (the
# tied head stored twice): after a load the working set accounts what it really added, when
# that is more.
FOOTPRINT_PER_FILE_BYTE = {"q8": 2.0, "q4": 2.0, "fp32": 3.5, "gguf": 1.25}


def planned_draft_footprint(file_bytes: int, variant: str = "fp32") -> int:
    """The RSS a draft of `file_bytes` stored as `variant` should add when loaded (what budgets plan with)."""
    return int(file_bytes * FOOTPRINT_PER_FILE_BYTE.get(variant, max(FOOTPRINT_PER_FILE_BYTE.values())))


# A target's RSS while it loads, per byte of its files: ONNX Runtime prepacks 4-bit blocks beside the
# file's copy and frees some of it once the session is built.  Measured on the q4 ONNX targets: at
# the peak of the load 1.68x (qwen2.5-coder-0.5b, 671 MiB file), once loaded 1.35x (the 0.5B) and
# 1.53x (SmolLM2-135M, 139 MiB).  Loading plans with the peak; a load that adds more is then
# planned at what it added.
TARGET_FOOTPRINT_PER_FILE_BYTE = 1.75


def planned_target_footprint(file_bytes: int) -> int:
    """The RSS a target of `file_bytes` should add while it loads (what loading on demand plans with)."""
    return int(file_bytes * TARGET_FOOTPRINT_PER_FILE_BYTE)


def request_kv_bytes(tokens: int, target: Callable[[int], int], drafts: Iterable[Callable[[int], int]],
                     slack: int) -> int:
    """The KV memory one request may touch: the one footprint admission checks and the working set
    reserves.  `target` and each of `drafts` size a cache (tokens -> bytes; DecoderSession.cache_nbytes);
    `tokens` is prompt + max_tokens; `slack` the slots a verification pass writes past the committed
    ones; `drafts` the caches of the drafts the request may run, of which it holds one at a time
    (the one it names, or any a policy may pick: the largest counts)."""
    n = tokens + slack
    return target(n) + max((draft(n) for draft in drafts), default=0)


@dataclass(frozen=True)
class Footprint:
    """What loading one model cost."""

    name: str
    declared_bytes: int  # the model files' size (what budgets plan with)
    rss_delta_bytes: int  # the process's RSS growth during the load (noisy under concurrency)
    seconds: float  # wall time of the load


def measure(name: str, load: Callable[[], tuple[T, int]], probe: MemoryProbe,
            clock: Callable[[], float]) -> tuple[T, Footprint]:
    """Run `load() -> (thing, declared_bytes)` and return it with its footprint."""
    before, t0 = probe.rss_bytes(), clock()
    thing, declared = load()
    return thing, Footprint(name, int(declared), probe.rss_bytes() - before, clock() - t0)


@dataclass
class Ledger:
    """A running account of resident bytes by kind ("target", "draft", "kv") and name. Thread-safe."""

    entries: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, name) -> bytes
    peak_bytes: int = 0  # the most ever accounted at once
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, name: str, nbytes: int) -> None:
        assert kind in KINDS, f"ledger kind must be one of {KINDS}, got {kind!r}"
        with self._lock:
            self.entries[(kind, name)] = self.entries.get((kind, name), 0) + int(nbytes)
            self.peak_bytes = max(self.peak_bytes, sum(self.entries.values()))

    def remove(self, kind: str, name: str, nbytes: int | None = None) -> int:
        """Take `nbytes` (default: all) of (kind, name) off the account; returns what was taken."""
        with self._lock:
            have = self.entries.get((kind, name), 0)
            take = have if nbytes is None else min(int(nbytes), have)
            if have - take > 0:
                self.entries[(kind, name)] = have - take
            else:
                self.entries.pop((kind, name), None)
            return take

    def total(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(b for (k, _), b in self.entries.items() if kind is None or k == kind)

    def to_dict(self) -> dict:
        with self._lock:
            out: dict = {k: {} for k in KINDS}
            for (k, n), b in sorted(self.entries.items()):
                out[k][n] = b
            out["total_bytes"] = sum(self.entries.values())
            out["peak_bytes"] = self.peak_bytes
            return out


class RssSampler:
    """Samples the process RSS in a background thread; `peak_bytes` is the largest seen.

    with RssSampler(probe, interval_s=0.02) as s: ...;  s.peak_bytes
    """

    def __init__(self, probe: MemoryProbe, interval_s: float = 0.02):
        self.probe, self.interval_s = probe, interval_s
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, self.probe.rss_bytes())
            self.samples += 1
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "RssSampler":
        self.peak_bytes = self.probe.rss_bytes()
        self._thread = threading.Thread(target=self._run, name="memspec-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.probe.rss_bytes())
