"""sd_notify(3): readiness, status and watchdog messages to systemd, without libsystemd.

systemd passes a datagram socket in $NOTIFY_SOCKET (a path, or "@name" for the
abstract namespace) and, with WatchdogSec=, the interval in $WATCHDOG_USEC.
Each message is one datagram of "KEY=value" lines.  Outside systemd every call
is a no-op that returns False.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Iterator, Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] = os.environ):
        addr = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())  # the watchdog may be meant for another process
        self.watchdog_usec = int(usec) if usec.isdigit() and mine else 0

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half the interval systemd enforces."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, *lines: str) -> bool:
        if not self.address:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            try:
                s.sendto("\n".join(lines).encode(), self.address)
            except OSError:
                return False  # systemd went away; nothing to tell
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def reloading(self, status: str) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for `seconds` more before it gives up on the start (a long load)."""
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    @contextlib.contextmanager
    def busy(self, every_s: float = 10.0, watchdog: bool = True) -> Iterator[None]:
        """While the block runs (a model load that may take minutes: a TensorRT engine build),
        keep extending systemd's timeout and, with `watchdog`, pinging it, from a thread."""
        done = threading.Event()

        def keep_alive():
            while True:
                self.extend_timeout(3 * every_s)
                if watchdog and self.watchdog_usec:
                    self.watchdog()
                if done.wait(min(every_s, self.watchdog_interval or every_s)):
                    return

        t = threading.Thread(target=keep_alive, name="memspec-notify", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
