"""Compare grammar libraries on a model's tokenizer: init, compile, mask per token, rollback.

    pip install --target /tmp/gl-llguidance llguidance      (likewise outlines-core)
    PYTHONPATH=/tmp/gl-llguidance:. python bench/grammar_libraries.py llguidance qwen2.5-coder-1.5b

It walks a JSON document valid for SCHEMA token by token: the mask before each token, then consume.
"""
import json, statistics, sys, time
import numpy as np
lib, model = sys.argv[1], sys.argv[2]
from memspec.models.store import ModelStore
from memspec.models.tokenizer import Tokenizer
m = ModelStore().get(model)
tok = Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")
V = tok.vocab_size
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "kind": {"enum": ["person", "robot"]}, "score": {"type": "number"}},
    "required": ["name", "age", "tags", "address", "kind", "score"], "additionalProperties": False}
doc = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1"}, "kind": "person", "score": 9.75}
ids = tok.encode(json.dumps(doc, separators=(",", ":")))
print(f"{lib} on {model}: V={V}, doc tokens={len(ids)}")
eos = tok.eos_token_id
t0 = time.perf_counter()
if lib == "llguidance":
    import llguidance, llguidance.numpy as lln
    lt = llguidance.LLTokenizer(tok.to_json(), n_vocab=V, eos_token=eos)
    t1 = time.perf_counter()
    g = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    mt = llguidance.LLMatcher(lt, g)
    assert not mt.is_error(), mt.get_error()
    t2 = time.perf_counter()
    bm = lln.allocate_token_bitmask(1, V)
    times, ok = [], True
    for t in ids:
        a = time.perf_counter(); lln.fill_next_token_bitmask(mt, bm); times.append(time.perf_counter() - a)
        bits = np.unpackbits(bm[0].view(np.uint8), bitorder="little")[:V]
        ok &= bool(bits[t]); assert mt.consume_token(t), mt.get_error()
    print("accepting at end:", mt.is_accepting(), "all tokens allowed:", ok)
    rb = []
    for k in (1, 4, 8):
        a = time.perf_counter(); mt.rollback(k); rb.append((k, time.perf_counter() - a)); mt.consume_tokens(ids[-k:])
    mt.rollback(len(ids)); a = time.perf_counter(); mt.consume_tokens(ids); cons = time.perf_counter() - a
    vers = llguidance.__version__
else:
    import outlines_core as oc
    vmap = {}
    for i in range(V):
        if i == eos: continue
        vmap.setdefault(tok.token_bytes(i), []).append(i)
    voc = oc.Vocabulary(eos, vmap)
    t1 = time.perf_counter()
    rx = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    idx = oc.Index(rx, voc)
    guide = oc.Guide(idx, max_rollback=64)
    t2 = time.perf_counter()
    bm = np.zeros((V + 31) // 32, dtype=np.int32)
    times, ok = [], True
    for t in ids:
        a = time.perf_counter(); guide.write_mask_into(bm.ctypes.data, bm.size, 4); times.append(time.perf_counter() - a)
        bits = np.unpackbits(bm.view(np.uint8), bitorder="little")[:V]
        ok &= bool(bits[t]); guide.advance(t)
    print("finished at end:", guide.is_finished(), "all tokens allowed:", ok)
    rb = []
    for k in (1, 4, 8):
        a = time.perf_counter(); guide.rollback_state(k); rb.append((k, time.perf_counter() - a))
        for t in ids[-k:]: guide.advance(t)
    cons = float("nan")
    import importlib.metadata as md; vers = md.version("outlines_core")
print(f"tokenizer init {t1 - t0:.3f}s  grammar compile {t2 - t1:.3f}s")
print(f"mask per token: median {statistics.median(times)*1e6:.0f}us  p90 {sorted(times)[int(.9*len(times))]*1e6:.0f}us  max {max(times)*1e6:.0f}us")
print("rollback:", ", ".join(f"{k} tokens {s*1e6:.1f}us" for k, s in rb), f"; consume whole doc {cons*1e6:.0f}us", "version", vers)
