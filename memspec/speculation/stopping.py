"""Stop strings over a stream of text deltas."""

from __future__ import annotations


class StopMatcher:
    """Holds back text that could still become a stop string.

    feed() returns the text that is safe to emit; once a stop string appears,
    `hit` is True and the text before it is the last thing emitted.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.hit: str | None = None

    def feed(self, delta: str) -> str:
        if self.hit is not None:
            return ""
        if not self.stops:
            return delta
        buf = self.pending + delta
        first = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if first is not None:
            self.hit = first[1]
            self.pending = ""
            return buf[: first[0]]
        hold = self._held_suffix(buf)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of generation: whatever was held back (no stop matched)."""
        out, self.pending = ("" if self.hit is not None else self.pending), ""
        return out
