"""Issue 70: `memspec generate` and `chat` sent while the daemon is still loading its default
target wait for it, with a line on stderr, instead of failing with "the daemon is starting"
(as they wait for a target the daemon loads on demand); up to memspec.cli.START_WAIT_S."""

from __future__ import annotations

import threading

import pytest

from test_server import make  # noqa: F401  (the fixture: a Harness, its fake engine and gRPC server)

from memspec import cli


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(cli, "START_POLL_S", 0.05)


def test_generate_waits_for_a_starting_daemon_and_says_so(make, capsys, fast_poll):  # noqa: F811
    h = make(start=False)
    assert h.client.status()["state"] == "starting"
    timer = threading.Timer(0.5, h.start)  # the daemon's load finishes half a second later
    timer.start()
    try:
        assert cli.main(["generate", "--address", str(h.path), "--max-tokens", "2", "a b"]) == 0
    finally:
        timer.join()
    got = capsys.readouterr()
    assert got.out.startswith("b a ")
    assert f"memspec: the daemon at {h.path} is starting" in got.err and "waiting for it" in got.err
    assert cli.main(["chat", "--address", str(h.path), "--max-tokens", "1", "a b"]) == 0  # serving: no wait
    assert "is starting" not in capsys.readouterr().err


def test_a_daemon_still_starting_after_the_wait_is_a_clear_error(make, capsys, fast_poll, monkeypatch):  # noqa: F811
    h = make(start=False)
    monkeypatch.setattr(cli, "START_WAIT_S", 0.3)
    assert cli.main(["chat", "--address", str(h.path), "hi"]) == 2
    err = capsys.readouterr().err
    assert "is starting" in err and "is still starting after 0.3 s; `memspec status` shows what it loads" in err
