"""Configuration: one frozen dataclass per component, read once from TOML.

Every option is documented in ``memspec.example.toml`` at the repository root.
Precedence: command-line flag > environment (MEMSPEC_HOME) > config file > default.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memspec.errors import ConfigError
from memspec.request import Limits
from memspec.runtime.config import SessionConfig, check_setting
from memspec.scheduling.config import SchedulerConfig
from memspec.speculation.config import SpecConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6)
    import tomli as tomllib


@dataclass(frozen=True)
class ModelConfig:
    """Which target to serve."""

    target: str = "smollm2-135m"  # store name of the target model
    variant: str = "q4"  # "q4" (fast, the GGUF's own 4-bit weights) or "fp32" (exact)
    # how long a target loaded on demand stays once idle (Ollama's keep_alive: "5m", "90s", "0" = unload
    # after the answer, "-1" = keep); the target above stays loaded until told otherwise
    keep_alive: str = "5m"


@dataclass(frozen=True)
class ServerConfig:
    """The daemon's listening socket and request handling."""

    listen: str = ""  # "unix:///path.sock" or "HOST:PORT"; "" = default Unix socket
    socket_mode: int = 0o660  # permissions of the Unix socket
    max_concurrent: int = 4  # requests generating at once
    max_queue: int = 32  # requests waiting beyond those; more get RESOURCE_EXHAUSTED
    grace_seconds: float = 30.0  # how long SIGTERM lets in-flight streams finish
    watchdog: bool = True  # send WATCHDOG=1 to systemd when it asks for it
    memory_headroom_mb: int = 256  # system memory admission leaves free for everything else
    log_level: str = "info"  # "debug", "info", "warning" or "error" (JSON lines on stderr)


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP API (OpenAI's and Ollama's), beside gRPC in the same daemon (memspec.serving.http)."""

    listen: str = ""  # "HOST:PORT" (":PORT" or "PORT": loopback); "" = off
    api_key: str = ""  # clients send "Authorization: Bearer <key>"; "" = no key (the env var wins)
    api_key_env: str = "MEMSPEC_API_KEY"  # environment variable the key is read from when it is set
    allow_unauthenticated: bool = False  # listen beyond loopback without a key (logged as a warning)
    timeout_seconds: float = 600.0  # a request's deadline, queue wait included (504 after it); 0 = none
    # browser origins allowed to call the API (CORS), e.g. ["http://localhost:3000"]; ["*"] = any; [] = off
    cors_origins: tuple[str, ...] = ()

    def key(self, env=os.environ) -> str:
        """The API key in force: the environment variable's, else the config's ("" = none)."""
        return env.get(self.api_key_env, "") if self.api_key_env and env.get(self.api_key_env) else self.api_key


@dataclass(frozen=True)
class Config:
    home: str = ""  # model store; "" = $MEMSPEC_HOME or the user's data dir
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: SessionConfig = field(default_factory=SessionConfig)
    limits: Limits = field(default_factory=Limits)
    speculative: SpecConfig = field(default_factory=SpecConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def store_home(self) -> Path | None:
        if os.environ.get("MEMSPEC_HOME"):
            return Path(os.environ["MEMSPEC_HOME"]).expanduser()
        return Path(self.home).expanduser() if self.home else None


_SECTIONS = {"model": ModelConfig, "runtime": SessionConfig, "limits": Limits, "speculative": SpecConfig,
             "server": ServerConfig, "http": HttpConfig, "scheduler": SchedulerConfig}


MOVED = {"server": {"memory_budget_mb": "memspec has one memory budget, [scheduler] budget_mb, which counts "
                                        "the process (runtime and target), the drafts and the KV caches"}}


def _wrong_type(default: Any, val: Any) -> bool:
    """Whether a TOML value cannot stand for an option with this default (a whole number is a fine
    float; a fraction is not a fine int)."""
    if isinstance(default, bool) or isinstance(val, bool):
        return not (isinstance(default, bool) and isinstance(val, bool))
    if isinstance(default, int):
        return not isinstance(val, int)
    if isinstance(default, float):
        return not isinstance(val, (int, float))
    if isinstance(default, str):
        return not isinstance(val, str)
    return False


def _per_model_context(val: Any, where: str) -> tuple[tuple[str, int | str], ...]:
    """[runtime] model_max_context: a table of store name -> tokens or "auto"."""
    if not isinstance(val, dict):
        raise ConfigError(f"{where} must be a table of model name = tokens or \"auto\", e.g. "
                          f"{{ \"qwen2.5-coder-1.5b\" = 8192 }}; got {val!r}")
    return tuple((str(k), check_setting(v, f"{where}.{k}")) for k, v in sorted(val.items()))


# options whose value is not one TOML type: checked by their own function (value, where) -> value
_SPECIAL = {("runtime", "max_context"): check_setting, ("runtime", "model_max_context"): _per_model_context}


def _section(cls: type, name: str, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{name}] must be a table, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if name in MOVED and set(values) & set(MOVED[name]):
        key = sorted(set(values) & set(MOVED[name]))[0]
        raise ConfigError(f"[{name}] {key} is gone: {MOVED[name][key]}")
    if unknown:
        raise ConfigError(f"[{name}]: unknown option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    out = {}
    for key, val in values.items():
        special = _SPECIAL.get((name, key))
        if special is not None:
            out[key] = special(val, f"[{name}] {key}")
            continue
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            if not isinstance(val, list) or not all(isinstance(v, str) for v in val):
                raise ConfigError(f"[{name}] {key} must be a list of strings, got {val!r}")
            val = tuple(val)
        elif _wrong_type(default, val) and not (isinstance(val, bool) and "bool" in str(fields[key].type)):
            raise ConfigError(f"[{name}] {key} must be {type(default).__name__}, got {val!r}")
        out[key] = val
    return cls(**out)


def load_config(path: str | Path | None = None) -> Config:
    """Read a TOML config (or return the defaults when path is None)."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {p} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(_SECTIONS) - {"home"})
    if unknown:
        raise ConfigError(f"config {p}: unknown section(s) {', '.join(unknown)}; known: home, {', '.join(_SECTIONS)}")
    kwargs: dict[str, Any] = {k: _section(cls, k, data[k]) for k, cls in _SECTIONS.items() if k in data}
    if "home" in data:
        if not isinstance(data["home"], str):
            raise ConfigError(f"config {p}: home must be a string path")
        kwargs["home"] = data["home"]
    return Config(**kwargs)
