"""Where the daemon listens and where clients look for it.

    unix:///run/memspec/memspec.sock    the system service (RuntimeDirectory=memspec) or root
    $XDG_RUNTIME_DIR/memspec/memspec.sock   a user's daemon
    /tmp/memspec-$UID/memspec.sock      a user's daemon without XDG_RUNTIME_DIR

TCP is opt-in: "HOST:PORT" binds that host as written; "PORT" or ":PORT" binds
loopback only.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from memspec.errors import ConfigError

SYSTEM_SOCKET = Path("/run/memspec/memspec.sock")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclass(frozen=True)
class Address:
    target: str  # what grpc dials or binds: "unix:///abs/path.sock" or "host:port"
    path: Path | None = None  # the socket file, for a Unix address

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    @property
    def is_loopback(self) -> bool:
        return self.is_unix or self.target.rsplit(":", 1)[0] in LOOPBACK_HOSTS

    def __str__(self) -> str:
        return str(self.path) if self.path else self.target


def default_socket(env: Mapping[str, str] = os.environ, uid: int | None = None) -> Path:
    """The socket a daemon started now would listen on by default."""
    uid = os.getuid() if uid is None else uid
    if env.get("RUNTIME_DIRECTORY"):  # set by systemd for RuntimeDirectory=memspec
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / "memspec.sock"
    if uid == 0:
        return SYSTEM_SOCKET
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "memspec" / "memspec.sock"
    return Path(f"/tmp/memspec-{uid}") / "memspec.sock"


def check_private_folder(folder: Path, uid: int | None = None) -> None:
    """A user's socket folder under /tmp must be theirs alone: another local user could create
    /tmp/memspec-$UID first, then serve on it (and read the prompts) or listen in.  ConfigError
    when it is a link, someone else's, or open to others; a folder that does not exist is fine."""
    uid = os.getuid() if uid is None else uid
    if folder.parent != Path("/tmp") or not (folder.exists() or folder.is_symlink()):
        return
    st = folder.lstat()
    if stat.S_ISLNK(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise ConfigError(f"{folder} is a link, not yours, or open to others; remove it, or give the "
                          f"daemon's address with --address / --listen")


def parse(address: str) -> Address:
    """A Unix socket ("unix:///p", "unix:p", "/p", "./p") or TCP ("HOST:PORT", ":PORT", "PORT")."""
    a = address.strip()
    if not a:
        raise ConfigError("address is empty; give a socket path or HOST:PORT")
    if a.startswith("unix://"):
        a = a[len("unix://"):]
    elif a.startswith("unix:"):
        a = a[len("unix:"):]
    elif not (a.startswith(("/", ".", "~")) or a.endswith(".sock")):
        return _tcp(a)
    path = Path(a).expanduser().absolute()
    return Address(f"unix://{path}", path)


def _tcp(a: str) -> Address:
    host, _, port = a.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"address {a!r}: expected a socket path, HOST:PORT or PORT (1..65535)")
    return Address(f"{host or '127.0.0.1'}:{int(port)}")


def server_address(listen: str, env: Mapping[str, str] = os.environ) -> Address:
    """What `memspec serve` binds: the configured address, else the default socket."""
    return parse(listen) if listen else parse(str(default_socket(env)))


def client_address(address: str | None, env: Mapping[str, str] = os.environ, uid: int | None = None) -> Address:
    """What a client dials: the given address, $MEMSPEC_ADDRESS, else the first default
    socket that exists (the user's own daemon, then the system service)."""
    if address:
        return parse(address)
    if env.get("MEMSPEC_ADDRESS"):
        return parse(env["MEMSPEC_ADDRESS"])
    own = default_socket({k: v for k, v in env.items() if k != "RUNTIME_DIRECTORY"}, uid)
    check_private_folder(own.parent, uid)
    for candidate in (own, SYSTEM_SOCKET):
        if candidate.exists():
            return parse(str(candidate))
    return parse(str(own))
