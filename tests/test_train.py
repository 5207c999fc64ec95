"""Draft training pipeline (memspec.training.drafts) and the shipped draft pool (models/).

Only the export-vs-torch test needs torch; everything else runs on the runtime
dependencies alone.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from memspec.speculation.drafts import DraftModel, draft_engine, draft_variant
from memspec.models.gguf import ArrayWeights
from memspec.runtime.config import SessionConfig
from memspec.runtime.sessions import DecoderSession
from memspec.models.store import SHIPPED_MODELS, ModelStore
from memspec.training.drafts import UNKNOWN_TARGET_ID, VocabMap, acceptance, draft_config, select_vocab

HAS_TORCH = importlib.util.find_spec("torch") is not None
DRAFTS = ("draft-code", "draft-math", "draft-chat", "draft-general")
QWEN_DRAFTS = ("qwen2.5-coder-draft-code", "qwen2.5-coder-draft-math", "qwen2.5-coder-draft-chat",
               "qwen2.5-coder-draft-text")
TARGETS = {**dict.fromkeys(DRAFTS, "smollm2-135m"), **dict.fromkeys(QWEN_DRAFTS, "qwen2.5-coder-1.5b")}
REQUIRED = {"smollm2-135m": set(range(17)) | {2}, "qwen2.5-coder-1.5b": {151643, 151644, 151645}}  # control, EOS


def test_select_vocab_keeps_required_tokens_first():
    counts = np.zeros(100)
    counts[[50, 60, 70]] = [5, 9, 1]
    vocab = select_vocab(counts, 8, required=[2, 3, 1])
    assert vocab[:4] == [0, 1, 2, 3]  # id 0 (unknown stand-in) is always added
    assert vocab[4:] == [60, 50, 70, 4]  # by count, then lowest id fills the gap
    assert len(set(vocab)) == 8


def test_select_vocab_rejects_too_many_required():
    with pytest.raises(AssertionError):
        select_vocab(np.zeros(10), 2, required=[1, 2, 3])


def test_vocab_map_round_trips_and_maps_unknown_to_id0():
    vmap = VocabMap([5, 0, 2, 9], target_vocab=12)
    assert vmap.target(vmap.draft([5, 0, 2, 9])).tolist() == [5, 0, 2, 9]
    assert vmap.draft([7, 11]).tolist() == [1, 1]  # outside the vocab -> draft id of target 0
    assert vmap.known.nonzero()[0].tolist() == [0, 2, 5, 9]
    with pytest.raises(AssertionError):
        VocabMap([5, 2], target_vocab=12)  # target id 0 missing


def test_acceptance_counts_runs_capped_at_gamma():
    # 7 matches then a miss: steps accept 5+bonus, then 1 match + bonus(the miss).
    assert acceptance(np.array([1] * 7 + [0], dtype=bool), gamma=5) == (8, 2)
    assert acceptance(np.zeros(4, dtype=bool)) == (4, 4)  # only bonus tokens
    assert acceptance(np.ones(3, dtype=bool)) == (3, 1)  # answer ends inside one step


def test_draft_config_uses_gqa():
    c = draft_config(layers=2, width=256, vocab=8192)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.tied_embeddings) == (4, 2, 64, True)
    assert draft_config(3, 192, 8192).n_kv_heads == 1


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'memspec[train]'); export check skipped")
def test_tiny_export_matches_torch_forward(tmp_path):
    import torch

    from memspec.training.drafts import export_onnx
    from memspec.training.torch_model import Llama

    torch.manual_seed(0)
    cfg = draft_config(layers=2, width=64, vocab=256, head_dim=32, context=128)
    model = Llama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim == 2 else p.uniform_(0.5, 1.5)
        # float16 storage: compare against the torch model with the same rounding
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    path = export_onnx(model, tmp_path / "tiny.onnx", max_positions=128)
    ids = [3, 17, 200, 5, 9, 255, 0, 42]
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].numpy()
    s = DecoderSession(path, SessionConfig(max_context=64, intra_op_threads=1))
    assert s.layout == "gqa"
    cache = s.new_cache()
    got = s.forward(cache, ids[:5], keep=5)
    got = np.concatenate([got, s.forward(cache, ids[5:], keep=3)])  # incremental decode path too
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'memspec[train]'); teacher check skipped")
def test_a_qwen2_teacher_computes_what_its_converted_graph_does(tmp_path):
    """The teacher of a qwen2 target (Q/K/V biases, a separate head) from its GGUF: its logits are
    the fp32 graph's; in bfloat16 its greedy tokens mostly stay the same."""
    import torch

    from memspec.models.convert import convert
    from memspec.training.teacher import load_teacher
    from test_quants import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "q.gguf", "qwen2", "Q4_K", "Q6_K", seed=2)
    teacher = load_teacher(gguf)
    assert teacher.output is not None and teacher.blocks[0].attn_q.bias is not None
    ids = [3, 17, 50, 5, 9, 95, 0, 42]
    with torch.no_grad():
        want = teacher(torch.tensor([ids]))[0].numpy()
        half = load_teacher(gguf, "bfloat16")(torch.tensor([ids]))[0].float().numpy()
    s = DecoderSession(convert(gguf, tmp_path / "q.onnx", "fp32"), SessionConfig(max_context=64, intra_op_threads=1))
    got = s.forward(s.new_cache(), ids, keep=len(ids))
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
    assert (half.argmax(-1) == want.argmax(-1)).mean() >= 0.75
    with pytest.raises(ValueError, match="teacher dtype 'float16' is not one of float32, bfloat16"):
        load_teacher(gguf, "float16")


@pytest.mark.parametrize("name", DRAFTS + QWEN_DRAFTS)
def test_shipped_draft_is_intact_and_loads(name, tmp_path):
    folder = SHIPPED_MODELS / name
    if not (folder / "manifest.json").is_file():
        pytest.fail(f"{folder} has no manifest.json: the draft pool is not shipped")
    store = ModelStore(home=folder.parent / "_none", shipped=SHIPPED_MODELS)
    m = store.get(name)
    assert m.role == "draft" and m.extra["target"] == TARGETS[name]
    assert store.verify(m) == []  # sha256 and bytes match the files
    vocab = json.loads((folder / m.extra["draft_vocab"]).read_text())
    assert UNKNOWN_TARGET_ID in vocab and REQUIRED[TARGETS[name]] <= set(vocab)
    assert len(vocab) == len(set(vocab)) == m.architecture["vocab"]
    assert draft_variant(m) == "gguf"  # drafts ship as ggml blocks, which either engine runs
    # both engines run it: natively as it is, ONNX Runtime a graph built from it into the store once
    home = tmp_path / "home"
    store = ModelStore(home=home, shipped=SHIPPED_MODELS)
    rows = {}
    for backend in ("native", "onnxruntime"):
        cfg = SessionConfig(max_context=64, intra_op_threads=1, backend=backend)
        d = DraftModel.load(store, name, max(vocab) + 1, cfg)
        assert draft_engine(m, cfg) == backend and d.session.vocab_size == len(vocab)
        rows[backend] = d.session.forward(d.session.new_cache(), [1, 9, 2, 7, 30, 4], keep=4)
        assert rows[backend].shape == (4, len(vocab)) and np.isfinite(rows[backend]).all()
    assert list((home / "built").glob(f"{name}-*/q4.onnx"))  # the graph stays for the next load
    # the same weights: the engines differ only in how they round activations
    assert (rows["native"].argmax(-1) == rows["onnxruntime"].argmax(-1)).mean() >= 0.75


# -- quantized draft weights ---------------------------------------------------------
def test_block_quantization_reconstructs_within_half_a_step():
    from tiny_models import tiny_config, tiny_weights

    cfg = tiny_config(vocab=64)
    w = tiny_weights(cfg, seed=3)._tensors
    q8 = ArrayWeights(cfg, w, quantize="Q8_0")
    q4 = ArrayWeights(cfg, w, quantize="Q4_1")
    assert q8.qtype("blk.0.attn_q.weight") == "Q8_0" and q8.qtype("blk.0.attn_norm.weight") == "F32"
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"):
        x = w[name].astype(np.float32).reshape(w[name].shape[0], -1, 32)
        b = q8.q8_0(name)
        assert b.q.dtype == np.int8 and np.abs(b.q).max() <= 127
        assert np.all(np.abs(b.d[..., None] * b.q - x) <= b.d[..., None] / 2 + 1e-6)
        c = q4.q4_1(name)
        assert c.q.dtype == np.uint8 and c.q.max() <= 15
        assert np.all(np.abs(c.d[..., None] * c.q + c.m[..., None] - x) <= c.d[..., None] / 2 + 1e-6)
    with pytest.raises(ValueError, match="Q2_K"):
        ArrayWeights(cfg, w, quantize="Q2_K")


def test_q8_draft_export_tracks_the_float_model(tmp_path):
    """The shipped drafts' format: 8-bit MatMulNBits layers, 8-bit embedding and LM head."""
    import onnx

    from memspec.models.convert import DecoderBuilder
    from tiny_models import tiny_config, tiny_weights

    cfg = tiny_config(vocab=256, hidden=64)
    w = tiny_weights(cfg, seed=5, scale=4.0)._tensors
    paths = {}
    for label, variant, quantize in (("f32", "fp32", None), ("q8", "q4", "Q8_0")):
        proto = DecoderBuilder(ArrayWeights(cfg, w, quantize=quantize), variant, 256).build()
        ops = {n.op_type for n in proto.graph.node}
        assert ("MatMulNBits" in ops and "GatherBlockQuantized" in ops) == (quantize is not None)
        onnx.save(proto, str(tmp_path / f"{label}.onnx"))
        paths[label] = tmp_path / f"{label}.onnx"
    ids = list(np.random.default_rng(0).integers(0, 256, size=48))
    out = {}
    for label, path in paths.items():
        s = DecoderSession(path, SessionConfig(max_context=64, intra_op_threads=1))
        cache = s.new_cache()
        out[label] = np.concatenate([s.forward(cache, ids[:40], keep=40), s.forward(cache, ids[40:], keep=8)])
    err = np.abs(out["q8"] - out["f32"]).max() / out["f32"].std()
    agree = np.mean(out["q8"].argmax(-1) == out["f32"].argmax(-1))
    print(f"q8 vs float: max |logit error| {err:.4f} of the logits' std, argmax agreement {agree:.3f}")
    assert err < 0.1 and agree >= 0.9, (err, agree)
    assert os.path.getsize(paths["q8"]) < 0.4 * os.path.getsize(paths["f32"])


def test_write_draft_ships_one_gguf_variant(tmp_path):
    from types import SimpleNamespace

    from memspec.training.drafts import write_draft
    from tiny_models import tiny_config, tiny_weights

    cfg = tiny_config(vocab=64)
    model = SimpleNamespace(c=cfg, tensors=lambda: tiny_weights(cfg, seed=1)._tensors)  # what export reads
    vmap = VocabMap([0, *range(1, 64)], 100)
    folder = tmp_path / "draft-x"
    folder.mkdir()
    (folder / "q8.onnx").write_bytes(b"old")  # a previous export in another format goes away
    write_draft(folder, "draft-x", model, vmap, {"source": "test"}, {"target": "t"})
    m = ModelStore(home=tmp_path / "_none", shipped=tmp_path).get("draft-x")
    assert set(m.variants) == {"gguf"} and m.format == "gguf" and not (folder / "q8.onnx").exists()
    assert m.provenance["weights_stored_as"].startswith("Q8_0")
    from memspec.models.gguf import GGUFModel

    g = GGUFModel(m.variant_path("gguf"))
    assert g.config.vocab == 64 and g.qtype("blk.0.attn_q.weight") == "Q8_0"
    store = ModelStore(home=tmp_path / "home", shipped=tmp_path)
    for backend in ("native", "onnxruntime"):
        d = DraftModel.load(store, "draft-x", 100, SessionConfig(max_context=64, intra_op_threads=1, backend=backend))
        assert d.session.forward(d.session.new_cache(), [1, 2, 3], keep=1).shape == (1, 64)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is an optional extra (pip install -e .[train])")
def test_export_only_keeps_the_record_of_the_folder_it_rewrites(tmp_path):
    """Regression: --export-only looked the draft up in a store, found the shipped draft of the
    same name, and wrote the shipped draft's training record over the new one."""
    import argparse

    import torch

    from memspec.training.drafts import add_train_draft_parser, run_train_draft, write_draft
    from memspec.training.torch_model import Llama

    cfg = draft_config(layers=1, width=64, vocab=32, head_dim=32, context=128)
    model = Llama(cfg).eval()
    work = tmp_path / "work" / "smollm2-135m"
    work.mkdir(parents=True)
    torch.save(model.state_dict(), work / "draft-code.pt")  # the name of a shipped draft
    vmap = VocabMap(list(range(32)), 100)
    write_draft(tmp_path / "out" / "draft-code", "draft-code", model, vmap, {"source": "this run"},
                {"target": "smollm2-135m", "training": {"steps": 7}}, weights="fp16")
    parser = argparse.ArgumentParser()
    add_train_draft_parser(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "--name", "draft-code", "--export-only", "--out", str(tmp_path / "out"),
                              "--work", str(tmp_path / "work")])
    assert run_train_draft(args) == 0
    m = json.loads((tmp_path / "out" / "draft-code" / "manifest.json").read_text())
    assert m["provenance"]["source"] == "this run" and m["extra"]["training"] == {"steps": 7}
    assert set(m["variants"]) == {"gguf"}  # --weights q8, the default, is Q8_0 blocks in a GGUF


@pytest.mark.parametrize("flags,message", [(["--width", "200"], "--width must be a multiple of 64"),
                                           (["--width", "0"], "--width must be a multiple of 64"),
                                           (["--layers", "0"], "--layers must be at least 1")])
def test_train_draft_refuses_a_bad_shape_before_any_work(flags, message):
    """Before: --width 200 failed with a bare AssertionError, after the teacher data was generated."""
    import argparse

    from memspec.errors import MemspecError
    from memspec.training.drafts import add_train_draft_parser, run_train_draft

    parser = argparse.ArgumentParser()
    add_train_draft_parser(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "--name", "draft-x", "--domain", "chat", *flags])
    with pytest.raises(MemspecError, match=message):
        run_train_draft(args)  # raises before torch is needed, so this runs without the [train] extra


def test_training_prompts_are_distinct_reproducible_and_never_a_benchmark_prompt_or_near_copy():
    """Each domain's prompts as train-draft draws them: distinct within a seed, the same for the
    same seed, disjoint across seeds, and none of them a prompt the benchmarks measure drafts on
    nor a near copy of one (the templates produced both: "Write a haiku about autumn leaves." is a
    bench prompt, and so, with a longer list, was "Convert this list to a markdown table with columns
    Fruit and Color: apple red, ..."), checked here word by word, not through the filter's index."""
    from memspec.training.prompts import DOMAINS, NEAR_SHARE, content_words, domain_prompts, measured_prompts

    measured = measured_prompts()
    # the built-in 48, then bench/: held-out, fresh, everyday, and the predictor's two calibration sets
    assert len(measured) == 48 + 21 + 36 + 48 + 48 + 48 and "Write a haiku about autumn leaves." in measured
    bench = [w for w in map(content_words, measured) if w]
    for domain in DOMAINS:
        used: set[str] = set()  # earlier seeds' prompts only: domain_prompts keeps the benchmarks' out itself
        for seed in (0, 1, 2):
            got = domain_prompts(domain, 512, seed, exclude=used)
            assert len(got) == len(set(got)) and not used & set(got) and not measured & set(got), domain
            assert got == domain_prompts(domain, 512, seed, exclude=used), domain
            for p in got:
                words = content_words(p)
                for m in bench:
                    need = len(m) if len(m) < 3 else NEAR_SHARE * len(m)
                    assert len(words & m) < need, (domain, p, sorted(m))
            used |= set(got)
        assert len(used) > 100, domain  # scripts, the smallest domain, has 153


@pytest.mark.parametrize("prompt, near", [
    ("Write a TypeScript function to check whether a string is a palindrome.", True),  # the task, in another language
    ("Write a JavaScript function to check whether two strings are anagrams.", True),
    ("What is 5 multiplied by 24? Show your work step by step.", True),  # the template, other numbers
    ("Rewrite this paragraph in the passive voice: The committee approved the budget. The manager announced "
     "the decision. The staff celebrated the news and went home.", True),
    ("Tell me a short story about a dragon who is afraid of fire.", True),
    ("What is the capital of France?", True),
    ("Write a Python function to reverse a string.", False),
    ("What is the capital of Peru?", False),
    ("Write a poem about a lighthouse in a storm.", False),
    ("Summarize in two sentences: The museum opens a new wing for modern sculpture next spring.", False),
])
def test_near_copies_of_measured_prompts_are_recognised(prompt, near):
    from memspec.training.prompts import near_measured

    assert near_measured()(prompt) is near


def test_resume_refuses_a_checkpoint_without_the_record_of_its_vocabulary(tmp_path):
    """Regression: --resume with an --out that held no vocab.json chose a new vocabulary and loaded
    the old embedding rows under it, so every token's row belonged to another token."""
    from memspec.errors import MemspecError
    from memspec.training.drafts import checkpoint_record

    (tmp_path / "draft-chat.pt").write_bytes(b"weights")
    with pytest.raises(MemspecError, match="train without --resume"):
        checkpoint_record(tmp_path / "draft-chat.pt")


@pytest.mark.skipif(not HAS_TORCH, reason="needs the [train] extra (torch)")
def test_checkpoint_keeps_its_vocabulary_and_export_only_refuses_another(tmp_path):
    import argparse

    from memspec.errors import MemspecError
    from memspec.training.drafts import (add_train_draft_parser, checkpoint_record, run_train_draft, save_checkpoint,
                                         write_draft)
    from memspec.training.torch_model import Llama

    cfg = draft_config(layers=1, width=64, vocab=32, head_dim=32, context=128)
    model = Llama(cfg).eval()
    work = tmp_path / "work" / "smollm2-135m"
    work.mkdir(parents=True)
    trained = VocabMap([0] + list(range(40, 71)), 100)
    save_checkpoint(model, trained, work / "draft-x.pt", {"steps": 3})
    vocab, record = checkpoint_record(work / "draft-x.pt")
    assert vocab == [0] + list(range(40, 71)) and record == {"n_layers": 1, "hidden": 64, "training": {"steps": 3}}

    # a folder of the same name and size, but another vocabulary
    write_draft(tmp_path / "out" / "draft-x", "draft-x", model, VocabMap(list(range(32)), 100), {"source": "x"},
                {"target": "smollm2-135m", "training": {}}, weights="fp16")
    parser = argparse.ArgumentParser()
    add_train_draft_parser(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "--name", "draft-x", "--export-only", "--out", str(tmp_path / "out"),
                              "--work", str(tmp_path / "work")])
    with pytest.raises(MemspecError, match="another vocabulary"):
        run_train_draft(args)


@pytest.mark.parametrize("files, flags, message", [
    ({"a.jsonl": '{"prompt": "hi", "category": "qa"}\n'}, ["--prompt-categories", "poems"],
     r"--prompt-categories poems: no --prompts line has that category \(the files have: qa\)"),
    ({"a.jsonl": '{"prompt": "hi"}\nnot json\n'}, [], r"a.jsonl:2: not JSON"),
    ({"a.jsonl": '{"text": "hi"}\n'}, [], r"a.jsonl:1: needs a non-empty string field 'prompt'"),
    ({"a.jsonl": "\n"}, [], r"a.jsonl holds no prompts"),
    ({"missing.jsonl": None}, [], r"cannot read .*missing.jsonl"),
    ({"a.jsonl": '{"prompt": "hi"}\n', "b/a.jsonl": '{"prompt": "ho"}\n'}, [], r"also named a\.\*"),
    ({}, ["--prompt-categories", "qa"], r"give --prompts FILE"),
])
def test_train_draft_refuses_bad_prompt_files_before_any_work(tmp_path, files, flags, message):
    """Bad --prompts files or categories are a MemspecError naming the file, line or category before
    the teacher loads (before torch is needed)."""
    import argparse

    from memspec.errors import MemspecError
    from memspec.training.drafts import add_train_draft_parser, run_train_draft

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if text is not None:
            (tmp_path / name).write_text(text)
    parser = argparse.ArgumentParser()
    add_train_draft_parser(parser.add_subparsers())
    given = ["--prompts", *(str(tmp_path / n) for n in files)] if files else ["--domain", "chat"]
    args = parser.parse_args(["train-draft", "--name", "draft-x", *given, *flags])
    with pytest.raises(MemspecError, match=message):
        run_train_draft(args)


def test_prompt_categories_keep_the_answers_of_those_lines_only():
    from memspec.training.drafts import of_categories

    lines = [{"prompt": "a", "category": "qa"}, {"prompt": "b", "category": "rewriting"},
             {"prompt": "c", "category": "summarization"}, {"prompt": "d"}]
    data = {"train": [{"text": "a"}, {"text": "b"}, {"text": "d"}], "eval": [{"text": "c"}], "info": {"prompts": 4}}
    got = of_categories(data, lines, ["rewriting", "summarization"])
    assert got["train"] == [{"text": "b"}] and got["eval"] == [{"text": "c"}]
    assert got["info"] == {"prompts": 4, "categories": ["rewriting", "summarization"]}
    assert len(data["train"]) == 3  # the cached data set itself is left whole


def test_prompt_files_read_every_file_and_keep_their_lines(tmp_path):
    from memspec.training.drafts import prompt_files

    (tmp_path / "a.jsonl").write_text('{"prompt": "x", "category": "qa"}\n\n{"prompt": "y", "category": "rewriting"}\n')
    (tmp_path / "b.jsonl").write_text('{"prompt": "z", "category": "creative"}\n')
    got = prompt_files([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], ["rewriting", "creative"])
    assert {p.name: [x["prompt"] for x in lines] for p, lines in got.items()} == {"a.jsonl": ["x", "y"], "b.jsonl": ["z"]}
    assert [x["category"] for x in got[tmp_path / "a.jsonl"]] == ["qa", "rewriting"]


def test_python_m_memspec_train_reports_errors_without_a_traceback(capsys):
    """`python -m memspec.training.drafts` (the way to train without installing the CLI) printed a
    traceback for a bad argument; it now reports it as `memspec train-draft` does."""
    from memspec.training.drafts import main

    assert main(["train-draft", "--name", "draft-x", "--domain", "chat", "--width", "200"]) == 2
    assert "memspec-train: error: --width must be a multiple of 64" in capsys.readouterr().err


def test_drafts_run_on_their_own_providers_when_the_config_names_them(tmp_path):
    """[runtime] draft_providers puts drafts on other execution providers than the target (a
    tiny draft can step faster on the CPU than a GPU kernel launch each): the CPU's is the native
    engine where it is built; a provider this onnxruntime build lacks is an error naming it, at
    load time."""
    from memspec.runtime import kernels
    from memspec.speculation.drafts import DraftModel
    from memspec.errors import ModelFormatError

    store = ModelStore(home=tmp_path, shipped=SHIPPED_MODELS)
    cpu_only = SessionConfig(providers=("auto",), draft_providers=("CPUExecutionProvider",), max_context=64)
    d = DraftModel.load(store, "draft-code", 49152, cpu_only)
    assert d.session.device == "cpu"
    assert d.session.providers == ([f"memspec-native ({kernels.isa()})"] if kernels.available()
                                   else ["CPUExecutionProvider"])
    missing = SessionConfig(draft_providers=("NoSuchExecutionProvider",), max_context=64)
    with pytest.raises(ModelFormatError, match="NoSuchExecutionProvider are not in this onnxruntime build"):
        DraftModel.load(store, "draft-code", 49152, missing)


def test_a_draft_vocabulary_map_that_does_not_fit_the_target_is_a_clear_error(tmp_path):
    from memspec.errors import ModelFormatError
    from memspec.models.store import Manifest
    from memspec.speculation.drafts import read_vocab_map, target_to_draft

    m = Manifest("d", "draft", "onnx", {}, {}, {}, extra={"draft_vocab": "vocab.json"}, folder=tmp_path)
    with pytest.raises(ModelFormatError, match="draft 'd': cannot read its vocabulary map"):
        read_vocab_map(m, 10)
    (tmp_path / "vocab.json").write_text("[3, 0, 12]")
    with pytest.raises(ModelFormatError, match=r"holds ids 0\.\.12, the target's vocabulary has 10"):
        read_vocab_map(m, 10)
    (tmp_path / "vocab.json").write_text("[3, 0, 3]")
    with pytest.raises(ModelFormatError, match="gives one target id to two draft ids"):
        read_vocab_map(m, 10)
    (tmp_path / "vocab.json").write_text("[3, 0, 12]")
    to_target = read_vocab_map(m, 13)
    # every target id maps to its draft id, and the ones the draft lacks to its unknown token (target id 0)
    assert target_to_draft(to_target, 13).tolist() == [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2]
    outside = Manifest("d", "draft", "onnx", {}, {}, {}, extra={"draft_vocab": "../x.json"}, folder=tmp_path)
    with pytest.raises(ModelFormatError, match="is outside the model's folder"):
        read_vocab_map(outside, 13)


def test_top_logprobs_orders_best_first_with_ties_by_lower_id():
    """The teacher's soft labels: the k best ids of each row best first, equal logits by the lower
    id (so the first is np.argmax's, the greedy token), and their log-probabilities."""
    from memspec.training.teacher import top_logprobs

    logits = np.array([[0.0, 3.0, 1.0, 3.0, -2.0], [5.0, 4.0, 4.0, 0.0, 1.0]], dtype=np.float32)
    ids, lp = top_logprobs(logits, 3)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert ids[:, 0].tolist() == logits.argmax(axis=1).tolist()
    want = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert lp.dtype == np.float16 and np.allclose(lp, np.take_along_axis(want, ids, axis=1), atol=2e-3)


def test_the_native_teacher_answers_what_the_target_alone_decodes(gguf_path):
    """Regression guard for the default teacher: decoding prompts together (one pass a step, some
    finishing early at max_new or at an end token, one id or any of a set) gives every prompt the
    greedy answer of the target fed alone, token for token, with that token first among its labels."""
    from memspec.runtime.native_target import NativeTarget
    from memspec.training.teacher import TOP_K, NativeTeacher

    prompts = [[1, 9690, 198, 2683, 314, 253, 5356], [1, 4093, 198, 17361, 597, 30, 2], [1, 504, 3056]]
    teacher = NativeTeacher(gguf_path, threads=1, batch=2)  # two passes' worth of batches
    solo = NativeTarget(gguf_path, threads=1, check_rows=False)
    greedy = []  # each prompt's first 10 greedy tokens, fed alone
    for p in prompts:
        cache = solo.new_cache(len(p) + 10)
        logits, got = solo.forward(cache, p)[-1], []
        while len(got) < 10:
            got.append(int(np.argmax(logits)))
            logits = solo.forward(cache, [got[-1]])[-1]
        greedy.append(got)
    middle = greedy[0][4]  # an end token that cuts the first answer short
    for eos in (2, {2, middle}):
        ends = {eos} if isinstance(eos, int) else eos
        for p, g, rec in zip(prompts, greedy, teacher.answers(prompts, 10, eos)):
            cut = next((i + 1 for i, t in enumerate(g) if t in ends), len(g))
            want = g[:cut]
            assert rec["prompt"] == p and rec["answer"] == want, eos
            assert rec["top_ids"].shape == (len(want), TOP_K) and rec["top_ids"][:, 0].tolist() == want
            assert (np.diff(rec["top_lp"].astype(np.float32), axis=1) <= 0).all()


def test_the_native_teacher_gives_a_finished_answers_slot_to_the_next_prompt(gguf_path):
    """Regression guard for the teacher's throughput: when an answer ends, the next prompt enters
    the very next pass beside the rows still decoding (its prompt fed whole, theirs one token each),
    so the passes number about the tokens over the batch, not each batch's longest answer; the
    answers stay the target's alone."""
    from memspec.training.teacher import NativeTeacher

    prompts = [[1, 9690, 198, 2683, 314, 253, 5356], [1, 4093, 198, 17361, 597, 30, 2], [1, 504, 3056]]
    plain = NativeTeacher(gguf_path, threads=1, batch=1).answers(prompts, 8, 2)
    end = plain[2]["answer"][3]  # prompt 2 (the shortest, first in) ends at its 4th token with this end id
    want = NativeTeacher(gguf_path, threads=1, batch=1).answers(prompts, 8, {2, end})
    teacher = NativeTeacher(gguf_path, threads=1, batch=2)
    passes = []
    forward_batch = teacher.target.forward_batch

    def spy(caches, feeds, keeps):
        passes.append([len(f) for f in feeds])
        return forward_batch(caches, feeds, keeps)

    teacher.target.forward_batch = spy
    got = teacher.answers(prompts, 8, {2, end})
    assert [g["answer"] for g in got] == [w["answer"] for w in want]
    assert len(want[2]["answer"]) == 4 and all(len(w["answer"]) == 8 for i, w in enumerate(want) if i != 2)
    # pass 1 feeds the two shortest prompts whole; prompt 2 ends at its 4th token, and pass 5 feeds
    # the last prompt whole beside the other row's next token
    assert passes[0] == [3, 7] and passes[4] == [1, 7]
    tokens = sum(len(w["answer"]) for w in want)
    assert len(passes) == 4 + 8 < 2 * 8  # batches of two, each run to its longest answer: 16 passes
    assert sum(map(sum, passes)) == sum(map(len, prompts)) + tokens - len(prompts)  # each token fed once


def test_the_native_teacher_without_the_kernels_says_to_build_them_or_use_torch(gguf_path, monkeypatch):
    """Bad input: --teacher native (the default) on a machine whose native kernels were not built
    is a MemspecError naming the way out, not an ImportError traceback."""
    from memspec.errors import MemspecError
    from memspec.runtime import kernels
    from memspec.training.teacher import NativeTeacher

    monkeypatch.setattr(kernels, "_native", None)
    with pytest.raises(MemspecError, match="--teacher torch"):
        NativeTeacher(gguf_path, threads=1)
