"""End to end: two pulled targets and the real `memspec serve --http` whose memory budget holds one
at a time, asked through the official `openai` SDK the way chat front ends ask: list the models,
take one, ask it.  Every listed model answers (the switch happens, the answers are the models' own,
peak RSS stays under the budget); two clients alternating between the targets both get answers
and the log shows the swaps; a target that cannot fit gets the clear error, and the daemon keeps
serving.

The second target is Qwen2.5-Coder-0.5B (q4, 671 MiB: pulled once, about a minute and a half),
the smallest known model beside SmolLM2-135M whose footprint makes the two not fit together.
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
from pathlib import Path

import pytest
from openai import APIStatusError, OpenAI

from test_daemon_e2e import Daemon
from two_targets import BUDGET_MB, QUESTION, QWEN, SMOL, config, store_of_two

from memspec.errors import InsufficientMemoryError
from memspec.request import Completion

SMALL_BUDGET_MB = 600  # SmolLM2, not the 0.5B: its load is refused


@pytest.fixture(scope="module")
def home(model_store):
    """The two targets, the 0.5B pulled on first use."""
    from memspec.models.pull import pull

    pull(model_store, QWEN, ("q4",))
    with tempfile.TemporaryDirectory(prefix="ms-tg-") as d:
        yield store_of_two(Path(d), model_store.models_dir)


def start(home: Path, folder: Path, name: str, budget: int) -> Daemon:
    dm = Daemon(folder, home, name=name)
    dm.config.write_text(config(home, budget))
    dm.args = ["--http", "127.0.0.1:0"]
    return dm.start(timeout=180)


@pytest.fixture(scope="module")
def daemon(home):
    with tempfile.TemporaryDirectory(prefix="ms-tg-") as d:
        dm = start(home, Path(d), "t", BUDGET_MB)
        yield dm
        dm.stop()


def sdk_for(dm: Daemon) -> OpenAI:
    with dm.client(timeout=30) as c:
        listen = c.status()["http_listen"]
    return OpenAI(base_url=f"http://{listen}/v1", api_key="unused", max_retries=0, timeout=600)


def ask(sdk: OpenAI, model: str) -> str:
    out = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert out.model == model and out.model_extra["memspec"]["model"] == model
    return out.choices[0].message.content


def peak_rss_mb(dm: Daemon) -> float:
    """The daemon's peak RSS since it started (the kernel's high-water mark)."""
    for line in Path(f"/proc/{dm.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def log_events(dm: Daemon, msg: str) -> list[dict]:
    rows = [json.loads(line) for line in dm.log.read_text().splitlines() if line.startswith("{")]
    return [r for r in rows if r["msg"] == msg]


ANSWERS: dict[str, str] = {}  # model -> its greedy answer, from the first flow


def test_every_listed_model_answers_with_one_target_at_a_time_under_the_budget(daemon, capsys):
    from memspec.cli import main

    sdk = sdk_for(daemon)
    listed = sdk.models.list().data
    assert [(m.id, m.model_extra["loaded"]) for m in listed] == [(SMOL, True), (QWEN, False)]
    for m in listed:  # what a chat front end does: take a listed model, ask it
        ANSWERS[m.id] = ask(sdk, m.id)
    assert "Paris" in ANSWERS[SMOL] and "Paris" in ANSWERS[QWEN] and ANSWERS[SMOL] != ANSWERS[QWEN]
    after = [(m.id, m.model_extra["loaded"]) for m in sdk.models.list().data]
    assert after == [(QWEN, True), (SMOL, False)]  # the switch happened: the budget holds one target
    assert ask(sdk, SMOL) == ANSWERS[SMOL]  # and back: the same answer from the reloaded target
    with daemon.client(timeout=30) as c:
        rows = {t["name"]: t for t in c.status()["targets"]}
    assert (rows[SMOL]["loads"], rows[SMOL]["unloads"], rows[QWEN]["loads"], rows[QWEN]["unloads"]) == (2, 1, 1, 1)
    assert main(["ps", "--address", str(daemon.sock)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[0] == SMOL and "never (kept)" in out[1] and len(out) == 3  # header, SmolLM2, memory
    assert peak_rss_mb(daemon) < BUDGET_MB


def test_two_clients_alternating_between_the_targets_both_get_their_answers(daemon):
    sdk = sdk_for(daemon)
    got: dict[str, list] = {"a": [], "b": []}

    def client(name: str, order: list[str]) -> None:
        for model in order:
            got[name].append((model, ask(sdk, model)))

    swaps_before = len(log_events(daemon, "target unloaded"))
    threads = [threading.Thread(target=client, args=("a", [SMOL, QWEN, SMOL])),
               threading.Thread(target=client, args=("b", [QWEN, SMOL, QWEN]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
        assert not t.is_alive(), "a client hangs"
    for name, answers in got.items():
        assert len(answers) == 3 and all(text == ANSWERS[model] for model, text in answers), (name, answers)
    unloaded = log_events(daemon, "target unloaded")[swaps_before:]
    assert len(unloaded) >= 2 and all(u["why"].startswith("to make room for ") for u in unloaded)
    assert peak_rss_mb(daemon) < BUDGET_MB


def test_a_target_that_cannot_fit_is_refused_with_the_figures_and_the_daemon_keeps_serving(home):
    with tempfile.TemporaryDirectory(prefix="ms-tg-") as d:
        dm = start(home, Path(d), "s", SMALL_BUDGET_MB)
        try:
            sdk = sdk_for(dm)
            with pytest.raises(APIStatusError) as err:
                ask(sdk, QWEN)
            assert err.value.status_code == 507
            body = err.value.response.json()["error"]
            assert body["code"] == "insufficient_memory" and re.match(
                f"{QWEN} \\(q4\\) cannot be loaded: it needs 11\\d\\d MiB and the budget is {SMALL_BUDGET_MB} MiB, of "
                f"which \\d+ MiB stay held with every other target unloaded; raise \\[scheduler\\] budget_mb",
                body["message"]), body["message"]
            with dm.client(timeout=120) as c:
                with pytest.raises(InsufficientMemoryError, match="raise \\[scheduler\\] budget_mb"):
                    list(c.generate("Hi", model=QWEN, max_tokens=4))
                done = [i for i in c.generate("Hi", max_tokens=4) if isinstance(i, Completion)][0]
                rows = {t["name"]: t for t in c.status()["targets"]}
            assert done.model == SMOL and "Paris" in ask(sdk, SMOL)
            assert rows[QWEN]["refused"] == 2 and rows[QWEN]["state"] == "unloaded"
            assert rows[SMOL]["state"] == "loaded" and rows[SMOL]["unloads"] == 0  # nothing went for it
            assert peak_rss_mb(dm) < SMALL_BUDGET_MB
        finally:
            dm.stop()
