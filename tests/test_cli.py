"""The command line on bad input: a clear message and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


HEAVY = ("numpy", "onnxruntime", "sklearn", "torch")  # what the light commands must not import


def memspec(*args, home=None, timeout=300, python=()):
    env = dict(os.environ)
    if home is not None:
        env["MEMSPEC_HOME"] = str(home)
    return subprocess.run([sys.executable, *python, "-m", "memspec.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def imported(importtime_stderr: str) -> set[str]:
    """The modules that `python -X importtime` says it imported (one line each on stderr)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def test_imported_sees_numpy():
    """The check below can fail: importtime's lines name numpy when it is imported."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import numpy"], capture_output=True, text=True)
    assert "numpy" in imported(r.stderr)


@pytest.mark.parametrize("args, rc", [
    (["--help"], 0),
    (["--version"], 0),
    (["status", "--address", "{sock}"], 2),
    (["models", "--address", "{sock}"], 2),
    (["models"], 0),
], ids=["help", "version", "status", "models-address", "models-store"])
def test_light_commands_import_no_numpy_or_onnxruntime(tmp_path, args, rc):
    args = [a.format(sock=tmp_path / "missing.sock") for a in args]
    r = memspec(*args, home=tmp_path / "store", python=("-X", "importtime"))
    assert r.returncode == rc, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    modules = imported(r.stderr)
    assert "memspec.cli" in modules or "memspec.errors" in modules  # the output was importtime's
    assert not modules & set(HEAVY), f"memspec {' '.join(args)} imported {sorted(modules & set(HEAVY))}"


def test_version():
    from memspec import __version__

    r = memspec("--version")
    assert r.returncode == 0 and r.stdout == f"memspec {__version__}\n" == "memspec 0.1.0\n", r


def test_python_dash_m_memspec_runs_the_command_line():
    """`python -m memspec` is `memspec`, for an environment whose scripts folder is not on PATH."""
    from memspec import __version__

    r = subprocess.run([sys.executable, "-m", "memspec", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"memspec {__version__}\n", r
    r = subprocess.run([sys.executable, "-m", "memspec", "no-such-command"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_help_lists_developer_commands_apart():
    r = memspec("--help")
    assert r.returncode == 0, r.stderr
    user, dev = r.stdout.split("\ncommands:\n")[1].split("\ndeveloper commands:\n")

    def listed(section: str) -> set[str]:
        return {line.split()[0] for line in section.splitlines() if line.startswith("  ")}

    assert listed(user) == {"COMMAND", "pull", "models", "generate", "chat", "serve", "status", "ps", "load",
                            "unload", "doctor"}
    assert listed(dev) == {"bench", "build-corpus", "profile", "train-draft", "train-predictor", "write-prompts"}


@pytest.mark.parametrize("command, option", [("bench", "--policies"), ("profile", "--segment-tokens"),
                                             ("train-draft", "--vocab-size"), ("train-predictor", "--traces")])
def test_developer_commands_keep_their_options(capsys, command, option):
    from memspec.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: memspec {command} ") and option in out


@pytest.fixture(scope="module")
def home(model_store):
    return model_store.home


def test_generate_json_keys(home):
    r = memspec("generate", "--local", "--json", "--max-tokens", "8", "What is the capital of France?", home=home)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"prompt_token_ids", "token_ids", "text", "finish_reason", "timings", "stats"} <= set(out)
    assert len(out["token_ids"]) <= 8 and out["finish_reason"] in ("eos", "length")
    assert out["prompt_token_ids"][:3] == [1, 9690, 198]  # <|im_start|>system\n: the chat template


@pytest.mark.parametrize("args, message", [
    (["generate", "--local", ""], "prompt is empty"),
    (["generate", "--local", "   "], "prompt is empty"),
    (["generate", "--local", "--max-tokens", "0", "hi"], "--max-tokens must be at least 1, got 0"),
    (["generate", "--local", "--max-tokens", "-5", "hi"], "--max-tokens must be at least 1, got -5"),
    (["generate", "--local", "--temperature", "9", "hi"], "temperature: 9.0 is out of range"),
    (["generate", "--local", "--top-p", "0", "hi"], "top_p: 0.0 is out of range"),
    (["generate", "--local", "--draft", "no-such-draft", "hi"], "unknown draft 'no-such-draft'"),
    (["generate", "--local", "--frequency-penalty", "2.5", "hi"], "frequency_penalty: 2.5 is out of range"),
    (["generate", "--local", "--repetition-penalty", "0", "hi"], "repetition_penalty: 0.0 is out of range"),
    (["generate", "--local", "--min-p", "1.5", "hi"], "min_p: 1.5 is out of range"),
    (["generate", "--local", "--logit-bias", "hello", "hi"], "--logit-bias takes TOKEN=BIAS"),
    (["generate", "--local", "--logit-bias", "49152=1", "hi"], "logit_bias: token id 49152 is outside the vocab"),
    (["generate", "--local", "--logit-bias", "5=101", "hi"], "logit_bias: bias 101.0 of token 5 is out of range"),
])
def test_bad_generate_arguments(home, args, message):
    r = memspec(*args, home=home)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_generate_under_a_schema_or_a_grammar(home, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                                  "required": ["answer"], "additionalProperties": False}))
    r = memspec("generate", "--local", "--json", "--json-schema", str(schema), "Is the sky blue?", home=home)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert json.loads(out["text"])["answer"] in ("yes", "no") and out["finish_reason"] == "stop"
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "Paris" | "London"\n')
    r = memspec("generate", "--local", "--json", "--grammar", str(grammar), "Capital of France?", home=home)
    assert r.returncode == 0 and json.loads(r.stdout)["text"] in ("Paris", "London"), r.stderr
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= nope\n")
    for args, message in [(["--grammar", str(bad)], "--grammar: "), (["--json-schema", str(bad)], "is not JSON"),
                          (["--json-schema", str(tmp_path / "none.json")], "cannot read"),
                          (["--grammar", str(grammar), "--json-schema", str(schema)], "not both")]:
        r = memspec("generate", "--local", *args, "hi", home=home)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_prompt_longer_than_context(home, tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text("[runtime]\nmax_context = 64\n")
    r = memspec("--config", str(cfg), "generate", "--local", "--raw", "word " * 200, home=home)
    assert r.returncode != 0
    assert "do not fit the context of 64 tokens" in r.stderr, r.stderr


def test_missing_model(tmp_path):
    r = memspec("generate", "--local", "hello", home=tmp_path / "empty-store")
    assert r.returncode != 0
    assert "model 'smollm2-135m' is not in the store" in r.stderr and "memspec pull smollm2-135m" in r.stderr


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"], ["serve"], ["bench"]],
                         ids=["generate", "chat", "serve", "bench"])
def test_unknown_model_lists_the_store_and_what_pull_knows(tmp_path, command):
    r = memspec(*command, "--model", "llama-70b", home=tmp_path / "empty-store")
    assert r.returncode == 2, r.stderr
    assert "model 'llama-70b' is not in the store" in r.stderr and "(have: " in r.stderr
    assert "`memspec pull` knows smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b" in r.stderr
    assert "Traceback" not in r.stderr


def empty_target(home, name: str) -> None:
    """A manifest for `name` in the store at `home`: enough for --model to find it."""
    folder = home / "models" / name
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"name": name, "role": "target", "format": "onnx",
                                                      "variants": {}}))


@pytest.mark.parametrize("argv", [["generate", "hi"], ["chat"], ["serve"], ["bench"]],
                         ids=["generate", "chat", "serve", "bench"])
def test_model_becomes_the_configs_target(tmp_path, monkeypatch, argv):
    from memspec.cli import _choose_model, parse_args
    from memspec.config import load_config

    empty_target(tmp_path, "other")
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path))
    args = parse_args([*argv, "--model", "other"])
    args.config = load_config(None)
    _choose_model(args)
    assert args.config.model.target == "other" and args.config.model.variant == "q4"


def test_variant_picks_the_local_engine_and_model_goes_to_the_daemon(tmp_path):
    """--variant and --backend choose a local engine: with --address, a clear error; --model is asked of
    the daemon (tests/test_server.py), so here, with no daemon at the socket, the error is the daemon's."""
    empty_target(tmp_path, "other")
    r = memspec("generate", "--variant", "fp32", "--address", str(tmp_path / "d.sock"), "hi", home=tmp_path)
    assert r.returncode == 2 and "--variant picks the local engine" in r.stderr, r.stderr
    r = memspec("generate", "--model", "other", "--address", str(tmp_path / "d.sock"), "hi", home=tmp_path)
    assert r.returncode == 2 and "picks the local" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_with_model(home):
    r = memspec("generate", "--model", "smollm2-135m", "--json", "--max-tokens", "2", "Hi", home=home)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "smollm2-135m"


def test_pull_help_names_the_known_models():
    r = memspec("pull", "--help")
    assert r.returncode == 0 and "smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b" in " ".join(r.stdout.split())


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    r = memspec("pull", "--gguf", str(bad), home=tmp_path / "store")
    assert r.returncode != 0
    assert "not a readable GGUF file" in r.stderr, r.stderr


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[runtime]\nmax_contxt = 64\n")
    r = memspec("--config", str(cfg), "models", home=tmp_path)
    assert r.returncode != 0
    assert "unknown option(s) max_contxt" in r.stderr, r.stderr


def test_models_lists_the_store(home):
    r = memspec("models", home=home)
    assert r.returncode == 0 and "smollm2-135m" in r.stdout and "fp32,q4" in r.stdout


def test_a_store_the_user_cannot_write_is_a_message_not_a_traceback(monkeypatch, capsys):
    import memspec.cli as cli

    def cannot(args):
        raise PermissionError(13, "Permission denied", "/var/lib/memspec/models")

    monkeypatch.setattr(cli, "cmd_pull", cannot)
    assert cli.main(["pull", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memspec: error: /var/lib/memspec/models: permission denied for user ")
    assert "install -d -o memspec" in err and "Traceback" not in err


def test_pull_offers_every_variant_the_converter_builds():
    import memspec.cli as cli
    from memspec.models.convert import ON_REQUEST, VARIANTS

    pull = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["pull"]._actions
                if "--variant" in a.option_strings)
    assert set(pull.choices) == {*VARIANTS, *ON_REQUEST}


def test_models_counts_a_model_as_a_daemons_listing_does(tmp_path, monkeypatch, capsys):
    """Issue 45: `memspec models` said 786.2MB where `memspec models --address` said 784.5MB for the
    same store: the local listing counted the tokenizer files too. Both count what the variants hold."""
    import memspec.cli as cli
    from memspec.config import load_config
    from memspec.models.store import ModelStore, file_record
    from memspec.serving.backend import EngineBackend

    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "q4.onnx").write_bytes(b"x" * 1_500_000)
    (folder / "tokenizer.json").write_bytes(b"t" * 900_000)
    (folder / "manifest.json").write_text(json.dumps({
        "name": "m", "role": "target", "format": "onnx", "variants": {"q4": file_record(folder / "q4.onnx")},
        "tokenizer": {"tokenizer.json": file_record(folder / "tokenizer.json")}}))
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path))
    assert cli.main(["models"]) == 0
    local = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("m "))
    rows = EngineBackend(load_config(None), lambda cfg, v: None, ModelStore(tmp_path, shipped=None)).models()
    daemon = sum(next(r for r in rows if r["name"] == "m")["variants"].values())  # what _daemon_models sums
    assert local.split()[3] == f"{daemon / 1e6:.1f}MB" == "1.5MB"
