"""Write docs/reference.md: every command and flag of `memspec` (from its argparse parser), every
config option (from memspec.example.toml, its default and the comment above it) and every
environment variable memspec reads (found in the code, described below).

    .venv/bin/python scripts/reference.py            # rewrite docs/reference.md
    .venv/bin/python scripts/reference.py --check    # exit 1 when the page is stale

tests/test_docs.py fails while the page differs from what this makes.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference.md"
EXAMPLE = REPO / "memspec.example.toml"
COMMAND = ".venv/bin/python scripts/reference.py"

# every environment variable the code reads (variables_read finds them; tests/test_docs.py fails when
# one is read and not described here, or described and no longer read)
ENVIRONMENT = {
    "MEMSPEC_HOME": "The model store's folder; wins over the config's `home`. Default: "
                    "`$XDG_DATA_HOME/memspec`, else `~/.local/share/memspec`. The systemd unit sets "
                    "`/var/lib/memspec`.",
    "XDG_DATA_HOME": "Where the store goes when neither `MEMSPEC_HOME` nor `home` says "
                     "(`$XDG_DATA_HOME/memspec`).",
    "MEMSPEC_ADDRESS": "The daemon a client command (`generate`, `chat`, `status`, `ps`, `load`, `unload`, "
                       "`models --address`) and `memspec.serving.client.Client()` dial when no `--address` "
                       "is given: a socket path or `HOST:PORT`. Set, it insists on that daemon.",
    "XDG_RUNTIME_DIR": "A user's default socket: `$XDG_RUNTIME_DIR/memspec/memspec.sock` (without it "
                       "`/tmp/memspec-$UID/memspec.sock`; root's is `/run/memspec/memspec.sock`).",
    "RUNTIME_DIRECTORY": "Set by systemd for `RuntimeDirectory=memspec`: the daemon's socket goes there "
                         "(`/run/memspec/memspec.sock`).",
    "MEMSPEC_API_KEY": "The HTTP API's key; wins over `[http] api_key`. The variable's name is "
                       "`[http] api_key_env`, this one by default. Under systemd, put it in "
                       "`/etc/memspec/http.env`.",
    "MEMSPEC_NATIVE_ISA": "Force the native kernels' path: `scalar`, `avx2`, `avx512` or `neon` (default: "
                          "the best this CPU runs). One the CPU cannot run is an error at start.",
    "NOTIFY_SOCKET": "Set by systemd for `Type=notify`: where the daemon says READY, STATUS and RELOADING.",
    "WATCHDOG_USEC": "Set by systemd for `WatchdogSec=`: the daemon pings at half this interval "
                     "(`[server] watchdog`).",
    "WATCHDOG_PID": "Set by systemd with `WATCHDOG_USEC`: the process the watchdog is meant for.",
    "PYTHON": "`./setup.sh` only: the Python that creates `.venv` (default `python3`; 3.10 or newer).",
}

_READS = [re.compile(p) for p in (r"environ\.get\(\s*\"(\w+)\"", r"environ\[\s*\"(\w+)\"\s*\]",
                                  r"\benv\.get\(\s*\"(\w+)\"", r"\benv\[\s*\"(\w+)\"\s*\]",
                                  r"getenv\(\s*\"(\w+)\"", r"\$\{(\w+):-")]  # the last: setup.sh's


def variables_read() -> set[str]:
    """The environment variables memspec's Python and C sources and setup.sh read, and the API key's
    variable (`[http] api_key_env`, read by name from the config)."""
    from memspec.config import HttpConfig

    found = {HttpConfig().api_key_env}
    sources = [f for f in (REPO / "memspec").rglob("*") if f.suffix in (".py", ".c") and "_proto" not in f.parts]
    sources.append(REPO / "setup.sh")
    for f in sources:
        text = f.read_text()
        for pattern in _READS:
            found.update(pattern.findall(text))
    return found


def parsers() -> dict[str, argparse.ArgumentParser]:
    """`memspec` and each of its commands (the developer commands with their real options)."""
    sys.path.insert(0, str(REPO))
    from memspec.cli import DEV_COMMANDS, build_parser

    top = build_parser()
    out = {"memspec": top}
    for name, p in _commands(top).items():
        out[f"memspec {name}"] = _commands(build_parser(name))[name] if name in DEV_COMMANDS else p
    return out


def _commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _summary(p: argparse.ArgumentParser, command: str) -> str:
    if command == "memspec":
        return p.description or ""
    top = parsers()["memspec"]
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    summary = helps.get(command.split(" ", 1)[1], "")
    return f"{summary}. {p.description}" if p.description else summary


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if action.default in (None, argparse.SUPPRESS) or action.default == []:
        return ""
    return f"`{action.default}`"


def _option_rows(p: argparse.ArgumentParser) -> list[str]:
    formatter = p._get_formatter()
    rows = []
    for action in p._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
        if action.option_strings and action.nargs != 0:
            name += f" {action.metavar or action.dest.upper()}"
        what = formatter._expand_help(action) if action.help else ""
        if action.choices and not isinstance(action.choices, dict):
            what += f" (one of: {', '.join(map(str, action.choices))})"
        if isinstance(action, argparse._AppendAction):
            what += " (repeatable)" if "repeatable" not in what else ""
        if isinstance(action, argparse._VersionAction):
            what = "print memspec's version and exit"
        rows.append(f"| {name} | {_default(action)} | {_cell(what)} |")
    return rows


def config_keys(path: Path = EXAMPLE) -> list[tuple[str, str, str, str]]:
    """(section, key, default as written, the comment above it) for every option of a config file
    written as memspec.example.toml is: a comment block right above each option."""
    out, section, comment = [], "", []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            comment.append(line[1:])
        elif m := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section, comment = m.group(1), []
        elif m := re.fullmatch(r"(\w+)\s*=\s*(.+)", line.strip()):
            out.append((section, m.group(1), _value(m.group(2)), "\n".join(comment).strip("\n")))
            comment = []
        else:
            comment = []
    return [(s, k, v, _dedent(c)) for s, k, v, c in out]


def _value(text: str) -> str:
    """An option's value as written, without a comment after it on its line."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    for at in [i for i, c in enumerate(text) if c == "#"]:
        try:
            tomllib.loads(f"x = {text[:at]}")
            return text[:at].strip()
        except tomllib.TOMLDecodeError:
            continue
    return text.strip()


def _dedent(comment: str) -> str:
    lines = comment.splitlines()
    return "\n".join(line[1:] if line.startswith(" ") else line for line in lines)


def _config_entry(key: str, value: str, comment: str) -> list[str]:
    """One option as a list item: its comment's plain lines as paragraphs, its indented lines (lists,
    examples) as a block, as they stand in the file."""
    parts: list[tuple[str, list[str]]] = []  # ("text" | "block", lines)
    for line in comment.splitlines():
        kind = "block" if line.startswith(" ") else "text"
        if not line.strip():
            kind = parts[-1][0] if parts else "text"
        if parts and parts[-1][0] == kind:
            parts[-1][1].append(line)
        else:
            parts.append((kind, [line]))
    out = [f"- `{key}` = `{value}`"]
    for i, (kind, lines) in enumerate(parts):
        if kind == "text":
            text = " ".join(" ".join(lines).split())
            if i == 0:
                out[0] += f": {text}"
            else:
                out += ["", f"  {text}"]
        else:
            out += ["", "  ```text", *(f"  {line}" for line in lines if line.strip()), "  ```"]
    return out


def _synopsis(command: str, p: argparse.ArgumentParser) -> str:
    positionals = [a for a in p._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    names = [(a.metavar or a.dest).upper() for a in positionals]
    names = [f"[{n}]" if a.nargs == "?" else n for a, n in zip(positionals, names)]
    sub = " COMMAND" if any(isinstance(a, argparse._SubParsersAction) for a in p._actions) else ""
    return " ".join([command, "[options]", *names]) + sub


def render() -> str:
    out = ["# Reference", "",
           f"Generated by `{COMMAND}` from the command line's parser (`memspec/cli.py`), "
           "`memspec.example.toml` and the environment variables the code reads; do not edit it by hand "
           "(`tests/test_docs.py` fails when it is stale). Precedence: a flag, then the environment, then "
           "the config file (`--config FILE`), then the default. Every command also takes `-h` / `--help`.", "",
           "- [Commands](#commands)", "- [Configuration](#configuration)",
           "- [Environment variables](#environment-variables)", "", "## Commands", ""]
    for command, p in parsers().items():
        out += [f"### `{command}`", "", _cell(_summary(p, command)), "", f"`{_synopsis(command, p)}`", "",
                "| option | default | what |", "| --- | --- | --- |", *_option_rows(p), ""]
    out += ["## Configuration", "",
            "A TOML file, `--config FILE` (the daemon under systemd: `/etc/memspec/memspec.toml`); an unknown "
            "section or option is an error. Each option below with its default and what "
            "`memspec.example.toml` says of it.", ""]
    section = None
    for s, key, value, comment in config_keys():
        if s != section:
            section = s
            out += [f"### `[{s}]`" if s else "### Top level", ""]
        out += [*_config_entry(key, value, comment), ""]
    out += ["## Environment variables", "", "| variable | what |", "| --- | --- |"]
    for name in sorted(variables_read()):
        out.append(f"| `{name}` | {_cell(ENVIRONMENT.get(name, 'not described: add it to scripts/reference.py'))} |")
    page = "\n".join(line.rstrip() for line in out).rstrip() + "\n"
    return _relative(page)


def _relative(page: str) -> str:
    """Defaults that are paths inside the checkout (`train-predictor --out`) shown relative to it,
    so the page is the same in every clone."""
    import memspec
    for root in {REPO, Path(memspec.__file__).resolve().parents[1]}:
        page = page.replace(f"{root}/", "")
    return page


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write docs/reference.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/reference.md is stale, writing nothing")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text() != page
        print(f"{PAGE.relative_to(REPO)} is {'stale: run ' + COMMAND if stale else 'current'}")
        return int(stale)
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
