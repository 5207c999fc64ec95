"""Prompts the target writes itself (`memspec write-prompts`), for drafts that accept beyond templates.

The built-in prompt domains (memspec.training.prompts) are templates over short lists, and a draft
trained on a template's answers accepts well on that template and little elsewhere: on prompts
written apart from them (bench/fresh_mixed.jsonl) the specialists accept 1.2-1.8 tokens a step
where they reach 1.5-4.2 on their own templates.  Here the target writes the prompts instead,
sampled (NativeTeacher.sample), in two kinds:

* requests: asked to write one message a person might send an assistant, of a kind and on a
  subject drawn from short lists (the wording, the details and the question are the target's);
* passages: asked to write a paragraph on a subject, which then comes with a task on it
  (summarize, rewrite, list, ...), the way users bring text to summarize or rewrite.

Each text is cleaned (the "Sure! Here is a message:" a model puts around what it was asked for,
quotes), kept only if it reads as a request of sensible length, written once (texts with the same
content words are one), and never a benchmark's prompt nor a near copy of one (near_measured).
The result is a JSONL file of {"prompt", "category"} lines that `memspec train-draft --prompts`
reads; the target's answers to them are the draft's training data.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from memspec.training import log
from memspec.training.prompts import content_words, near_measured

REQUEST_KINDS = {  # category: the kinds of message asked for
    "qa": ["asking a factual question about {s}", "asking why something about {s} is the way it is",
           "asking how something to do with {s} works", "asking for the difference between two things in {s}",
           "asking what a term from {s} means", "asking for practical advice about {s}",
           "asking a question about {s} that a student might have"],
    "creative": ["asking for a short poem about {s}", "asking for a very short story involving {s}",
                 "asking for a funny limerick or joke about {s}", "asking for a slogan or a toast about {s}",
                 "asking for a short speech or letter to do with {s}", "asking for a list of creative ideas about {s}",
                 "asking for a description of a scene to do with {s}"],
    "chat": ["asking for help planning something to do with {s}", "asking for an opinion or a recommendation about {s}",
             "asking for step-by-step instructions for a task to do with {s}", "asking for the pros and cons of a choice about {s}",
             "asking for a polite email or message to do with {s}", "asking to explain {s} simply to a beginner"],
    "code": ["asking for a short Python function that does something to do with {s}",
             "asking for help fixing a small bug in a program about {s}, with the code included",
             "asking for a SQL query over a table of data about {s}",
             "asking what a short piece of code about {s} does, with the code included",
             "asking for a JavaScript snippet for a web page about {s}",
             "asking for a shell command or a small script to handle files about {s}"],
    "math": ["asking to solve a word problem with numbers about {s}",
             "asking to work out a percentage or a ratio to do with {s}",
             "asking for help solving an equation that comes up in a problem about {s}",
             "asking a probability question about {s}", "asking to convert units in a problem about {s}",
             "asking how long something takes, given rates, in a problem about {s}"],
}
DEFAULT_KINDS = ("chat", "creative", "qa")  # --kinds: what draft-chat was trained on (models/qwen2.5-coder-draft-chat)
SUBJECTS = [
    "cooking", "gardening", "personal finance", "travel", "history", "astronomy", "biology", "chemistry", "physics",
    "geography", "music", "painting", "films", "books", "sports", "fitness", "sleep", "nutrition", "pets", "birds",
    "the ocean", "weather", "climate", "energy", "cars", "trains", "airplanes", "architecture", "cities", "farming",
    "languages", "grammar", "mathematics", "computers", "the internet", "smartphones", "photography", "fashion",
    "friendship", "family", "parenting", "school", "university", "job interviews", "working from home", "meetings",
    "small businesses", "marketing", "economics", "law", "elections", "philosophy", "psychology", "medicine",
    "first aid", "mountains", "rivers", "volcanoes", "insects", "trees", "holidays", "birthdays", "weddings",
    "moving house", "cleaning", "recycling", "coffee", "tea", "bread", "chess", "board games", "video games",
    "ancient Rome", "ancient Egypt", "the Middle Ages", "inventions", "space travel", "robots", "dinosaurs",
]
PASSAGE_STYLES = ["a news report", "an encyclopedia entry", "a personal blog post", "a product description",
                  "a letter to a friend", "a short opinion piece", "a how-to guide", "meeting notes", "a story opening"]
PASSAGE_TASKS = {  # category: tasks put to a passage the target wrote
    "summarization": ["Summarize the following text in two sentences:", "Give a one-sentence summary of this:",
                      "What are the main points of this text? Answer as a short bulleted list.",
                      "Write a short title and a one-line summary for this text:", "TL;DR this for me:"],
    "rewriting": ["Rewrite the following text in a more formal tone:", "Rewrite this so a ten-year-old can follow it:",
                  "Make this text shorter without losing its meaning:", "Rewrite this text in the first person:",
                  "Improve the flow and wording of this text:", "Rewrite this as a friendly message:"],
}
MIN_CHARS, MAX_CHARS = 12, 1500
LEADS = re.compile(r"^\s*(sure|certainly|of course|here(?:'s| is)|okay|ok)\b[^\n:\"]*[:!.,]?\s*", re.I)
LABEL = re.compile(r"^\s*(message|user|person|request|question|prompt)( from [^:\n]{1,40})?\s*:\s*", re.I)


def meta_requests(n: int, rng: random.Random, kinds=DEFAULT_KINDS) -> list[tuple[str, str]]:
    """(category, instruction to the target) for n requests, the categories `kinds` in turn, a kind
    of message and a subject drawn for each."""
    cats = sorted(kinds)
    out = []
    for i in range(n):
        cat = cats[i % len(cats)]
        kind = rng.choice(REQUEST_KINDS[cat]).format(s=rng.choice(SUBJECTS))
        out.append((cat, f"Write one message that a person might send to an AI assistant, {kind}. "
                         f"Write only the message itself, in the person's own words."))
    return out


def meta_passages(n: int, rng: random.Random) -> list[str]:
    """Instructions for n passages of about 40-120 words, styles and subjects drawn."""
    return [f"Write {rng.choice(PASSAGE_STYLES)} of about {rng.choice((40, 60, 80, 100, 120))} words about "
            f"{rng.choice(SUBJECTS)}. Write only the text itself." for _ in range(n)]


def clean(text: str) -> str | None:
    """The message a model wrote, without the wrapping it puts around it; None when what is left
    does not read as a request (too short or long, or a remark about the task)."""
    t = text.strip()
    for _ in range(2):
        t = LABEL.sub("", LEADS.sub("", t)).strip()
    quoted = re.fullmatch(r"[\"“](.+?)[\"”]\s*(\n.*)?", t, re.S)
    if quoted:  # "the message" and, after it, remarks on it
        t = quoted.group(1).strip()
    if not MIN_CHARS <= len(t) <= MAX_CHARS or re.search(r"\b(you can ask|the AI assistant|AI assistant,)\b", t, re.I):
        return None
    return t


def clean_passage(text: str) -> str | None:
    t = LEADS.sub("", text.strip()).strip().strip('"').strip()
    t = re.sub(r"^\s*(title|#+)[^\n]*\n+", "", t, flags=re.I)  # a heading the model put first
    words = len(t.split())
    return t if 25 <= words <= 220 and len(t) <= MAX_CHARS else None


def write_prompts(teacher, tokenizer, eos, n_requests: int, n_passages: int, seed: int = 0,
                  temperature: float = 1.0, top_p: float = 0.95, kinds=DEFAULT_KINDS) -> list[dict]:
    """[{"prompt", "category"}]: n_requests requests (of the categories `kinds`, in turn) and
    n_passages passages with a task, written by
    `teacher` (NativeTeacher.sample), cleaned, each with its own content words, none a near copy
    of a measured prompt; fewer where texts are dropped."""
    rng = random.Random(f"self-instruct-{seed}")

    def chat(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    metas = meta_requests(n_requests, rng, kinds)
    passages = meta_passages(n_passages, rng)
    log(f"the target writes {n_requests} requests and {n_passages} passages")
    texts = teacher.sample([chat(m) for _, m in metas] + [chat(m) for m in passages], 200, eos,
                           temperature, top_p, seed)
    near, seen, out = near_measured(), set(), []
    dropped = {"unclean": 0, "repeat": 0, "near": 0}
    tasks = sorted(PASSAGE_TASKS)
    for i, ids in enumerate(texts):
        raw = tokenizer.decode(ids)
        if i < len(metas):
            cat, prompt = metas[i][0], clean(raw)
        else:
            body = clean_passage(raw)
            cat = tasks[i % len(tasks)]
            prompt = None if body is None else f"{rng.choice(PASSAGE_TASKS[cat])}\n\n{body}"
        if prompt is None:
            dropped["unclean"] += 1
            continue
        words = content_words(prompt)
        if words in seen:
            dropped["repeat"] += 1
            continue
        if near(prompt):
            dropped["near"] += 1
            continue
        seen.add(words)
        out.append({"prompt": prompt, "category": cat})
    log(f"kept {len(out)} prompts; dropped {dropped['unclean']} that did not read as requests, "
        f"{dropped['repeat']} repeats, {dropped['near']} near copies of a benchmark's prompt")
    return out


def add_write_prompts_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("write-prompts", help="have the target write training prompts (for train-draft --prompts)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="the target that writes them (a GGUF in the store)")
    p.add_argument("--requests", type=int, default=480, help="requests to write (of the --kinds in turn)")
    p.add_argument("--kinds", nargs="+", choices=sorted(REQUEST_KINDS), default=list(DEFAULT_KINDS),
                   help=f"categories of request (default: {' '.join(DEFAULT_KINDS)})")
    p.add_argument("--passages", type=int, default=240, help="passages to write, each given a summarize or rewrite task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.set_defaults(func=run_write_prompts)
    return p


def run_write_prompts(args) -> int:
    from memspec.errors import MemspecError
    from memspec.training.drafts import _target_files
    from memspec.training.teacher import NativeTeacher

    if args.requests < 0 or args.passages < 0 or args.requests + args.passages == 0:
        raise MemspecError("--requests and --passages must be non-negative, and not both 0")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise MemspecError(f"--temperature must be > 0 and --top-p in (0, 1], got {args.temperature}, {args.top_p}")
    tok, gguf = _target_files(args.target, getattr(getattr(args, "config", None), "store_home", None))
    rows = write_prompts(NativeTeacher(gguf, args.threads), tok, tok.eos_token_ids, args.requests, args.passages,
                         args.seed, args.temperature, args.top_p, args.kinds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log(f"wrote {len(rows)} prompts to {out}")
    return 0
