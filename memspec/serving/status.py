"""The daemon's status as one frozen tree: what GetStatus, /metrics and `memspec status` show.

Built by the serving layer from its parts (the backend's targets and drafts, admission, the
request counters, the system's memory) and read by attribute by every front end; it becomes a
dict only at the edges: the protobuf GetStatusResponse it mirrors field for field (to_dict), and
back from it in the CLI (from_dict, which gives the numbers of a protobuf map their types again
and ignores a newer daemon's extra fields): memspec.request's to_plain and from_plain, as for a
request's own results.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memspec.request import from_plain, to_plain


@dataclass(frozen=True)
class ResidentModel:
    """A model whose weights are in memory now."""

    name: str
    role: str  # "target", "batched" (the batched pass's own copy) or "draft"
    variant: str
    bytes: int  # size of the loaded weights
    device: str = "cpu"  # "cpu" or "cuda"
    providers: tuple[str, ...] = ()  # ONNX Runtime execution providers in use
    row_invariant: bool = False  # the target's self-check found every row exact (drafts: not checked)
    exactness: str = ""  # that check's finding in words ("" = exact as the graph is)


@dataclass(frozen=True)
class SystemMemory:
    total_bytes: int = 0
    available_bytes: int = 0  # what the kernel can hand out without swapping
    process_rss_bytes: int = 0  # the daemon's resident set


@dataclass(frozen=True)
class DraftStatus:
    """One draft and what it did across requests (vLLM's words)."""

    name: str
    resident: bool = False
    bytes: int = 0
    requests: int = 0  # requests it served
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_acceptance_length: float = 1.0


@dataclass(frozen=True)
class TargetStatus:
    """A target as the loaded set holds it (memspec.scheduling.targets)."""

    name: str
    state: str = "unloaded"  # "loading", "loaded", "draining", "unloading" or "unloaded"
    variant: str = ""
    bytes: int = 0  # what the memory budget counts for it
    active: int = 0  # requests holding it now
    waiting: int = 0  # requests waiting for it to load
    drafts: tuple[str, ...] = ()  # its resident drafts
    keep_alive_s: float = 0.0  # how long it stays once idle; -1 = until told otherwise
    expires_in_s: float = -1.0  # seconds until it is unloaded; -1 = not while idle (or in use)
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0
    failed_loads: int = 0
    refused: int = 0  # loads refused: it did not fit the memory
    context: int = 0  # its context in tokens while loaded (memspec.runtime.context); 0 = not loaded
    kv: str = ""  # its KV cache's format while loaded ([runtime] kv on the native engine); "" = not loaded


@dataclass(frozen=True)
class RequestTotals:
    """Requests by outcome and their tokens (the proto's RequestCounters; counted by
    memspec.serving.counters.RequestCounters)."""

    started: int = 0  # admitted to generation
    completed: int = 0
    cancelled: int = 0
    rejected: int = 0
    invalid: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass(frozen=True)
class ModelsStatus:
    """The backend's part: its targets, their drafts and the counters of their schedulers."""

    resident: tuple[ResidentModel, ...] = ()
    drafts: tuple[DraftStatus, ...] = ()
    targets: tuple[TargetStatus, ...] = ()
    predictor: Mapping[str, float] = field(default_factory=dict)
    scheduler: Mapping[str, float] = field(default_factory=dict)
    batch: Mapping[str, float] = field(default_factory=dict)  # continuous batching; empty when off
    prefix_cache: Mapping[str, float] = field(default_factory=dict)  # reused prompt prefixes; empty when off
    warnings: tuple[str, ...] = ()
    budget_bytes: int = 0  # memory budget for models and KV caches; 0 = none


@dataclass(frozen=True)
class Status:
    """GetStatusResponse (protos/memspec/v1/memspec.proto), field for field."""

    version: str = ""
    state: str = ""  # "starting", "serving" or "draining"
    listen: str = ""  # the gRPC address
    http_listen: str = ""  # the HTTP API's address; "" = off
    uptime_s: float = 0.0
    resident: tuple[ResidentModel, ...] = ()
    resident_bytes: int = 0  # sum of resident[].bytes
    budget_bytes: int = 0
    kv_bytes: int = 0  # KV-cache bytes held by the streams generating now
    queue_depth: int = 0
    active_streams: int = 0
    max_concurrent: int = 0
    max_queue: int = 0
    system_memory: SystemMemory = field(default_factory=SystemMemory)
    requests: RequestTotals = field(default_factory=RequestTotals)
    drafts: tuple[DraftStatus, ...] = ()
    targets: tuple[TargetStatus, ...] = ()
    predictor: Mapping[str, float] = field(default_factory=dict)
    scheduler: Mapping[str, float] = field(default_factory=dict)
    batch: Mapping[str, float] = field(default_factory=dict)
    prefix_cache: Mapping[str, float] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Status":
        return from_plain(cls, d)
