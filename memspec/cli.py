"""The `memspec` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from memspec.errors import MemspecError


class CLIError(MemspecError):
    """A user-facing command-line error: printed without a traceback, exit 2."""


def _store(args):
    from memspec.store import ModelStore

    return ModelStore(args.config.store_home)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- pull / models ---------------------------------------------------------------
def cmd_pull(args) -> int:
    from pathlib import Path

    from memspec.pull import import_gguf, pull

    store = _store(args)
    variants = tuple(args.variant) if args.variant else ("fp32", "q4")
    if args.gguf:
        name = args.name or Path(args.gguf).stem.lower().replace(" ", "-")
        import_gguf(store, Path(args.gguf), name, variants, progress=_progress, force=args.force)
    else:
        if not args.model:
            raise CLIError("give a model name (e.g. `memspec pull smollm2-135m`) or --gguf PATH")
        pull(store, args.model, variants, progress=_progress, force=args.force)
    return 0


def cmd_models(args) -> int:
    store = _store(args)
    models = store.list()
    if args.json:
        print(json.dumps([dict(m.to_json(), folder=str(m.folder)) for m in models], indent=2))
        return 0
    if not models:
        print(f"no models in {store.models_dir}; run `memspec pull smollm2-135m`")
        return 0
    print(f"{'NAME':<24} {'ROLE':<7} {'VARIANTS':<12} {'SIZE':>9}  SOURCE")
    for m in models:
        print(f"{m.name:<24} {m.role:<7} {','.join(sorted(m.variants)):<12} "
              f"{m.total_bytes / 1e6:>7.1f}MB  {m.provenance.get('source', '?')}")
    return 0


# -- generate ----------------------------------------------------------------------
def _request(args):
    from memspec.request import GenerationRequest, SamplingParams

    if args.max_tokens is not None and args.max_tokens <= 0:
        raise CLIError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return GenerationRequest(
        prompt=args.prompt,
        raw=args.raw,
        max_tokens=args.max_tokens if args.max_tokens is not None else 256,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed),
        stop=tuple(args.stop or ()),
        draft=getattr(args, "draft", None),
    )


def load_engine(config, variant: str | None = None):
    """Build the local engine from the config (the target from the store)."""
    from memspec.engine import Engine, TargetModel
    from memspec.store import ModelStore

    store = ModelStore(config.store_home)
    target = TargetModel.load(store, config.model.target, variant or config.model.variant, config.runtime)
    return Engine(target, config.limits)


def cmd_generate(args) -> int:
    from memspec.request import Completion

    if not args.prompt or not args.prompt.strip():
        raise CLIError("the prompt is empty; give the text to answer, e.g. memspec generate \"What is 2+2?\"")
    req = _request(args)
    engine = load_engine(args.config, args.variant)
    result = None
    for item in engine.stream(req):
        if isinstance(item, Completion):
            result = item
        elif not args.json:
            sys.stdout.write(item.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({
            "prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids, "text": result.text,
            "finish_reason": result.finish_reason, "timings": result.timings, "stats": result.stats,
            "model": engine.target.name, "variant": engine.target.variant,
        }))
    else:
        sys.stdout.write("\n")
        t = result.timings
        _progress(f"[{result.finish_reason}] {t['completion_tokens']} tokens, {t['tok_per_s']:.1f} tok/s, "
                  f"ttft {t['ttft_ms']:.0f} ms")
    return 0


def cmd_bench(args) -> int:
    from memspec import bench

    return bench.run_cli(args)


# -- parser --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memspec", description="memory-aware speculative decoding runtime")
    p.add_argument("--config", metavar="FILE", help="TOML config file (see memspec.example.toml)")
    sub = p.add_subparsers(dest="command", required=True)

    pl = sub.add_parser("pull", help="fetch and convert a model into the store")
    pl.add_argument("model", nargs="?", help="known model name, e.g. smollm2-135m")
    pl.add_argument("--gguf", metavar="PATH", help="convert a local llama-architecture GGUF instead")
    pl.add_argument("--name", help="store name for --gguf (default: the file's stem)")
    pl.add_argument("--variant", action="append", choices=("fp32", "q4"), help="only these variants (repeatable)")
    pl.add_argument("--force", action="store_true", help="convert again even if up to date")
    pl.set_defaults(func=cmd_pull)

    ml = sub.add_parser("models", help="list the model store")
    ml.add_argument("--json", action="store_true")
    ml.set_defaults(func=cmd_models)

    g = sub.add_parser("generate", help="generate text for a prompt")
    g.add_argument("prompt", help="the prompt (chat template applied unless --raw)")
    g.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    g.add_argument("--max-tokens", type=int, default=None, help="most new tokens (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--variant", choices=("fp32", "q4"), help="target variant (default from config: q4)")
    g.add_argument("--json", action="store_true", help="print one JSON object with ids, text and timings")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmark the target (and llama.cpp side by side)")
    b.add_argument("--variant", action="append", choices=("fp32", "q4"), help="variants to measure (default both)")
    b.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for prefill/decode runs")
    b.add_argument("--decode-tokens", type=int, default=128, help="tokens per decode run")
    b.add_argument("--repeats", type=int, default=3, help="runs per measurement (median reported)")
    b.add_argument("--max-k", type=int, default=16, help="largest verification width for cost(k)")
    b.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp side-by-side run")
    b.add_argument("--json", metavar="FILE", help="write results as JSON")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from memspec.config import load_config

    args = build_parser().parse_args(argv)
    try:
        args.config = load_config(args.config)
        return args.func(args)
    except MemspecError as exc:
        print(f"memspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
