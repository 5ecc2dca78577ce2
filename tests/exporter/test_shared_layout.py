"""`export_model(..., kv_layout="shared")`: the runtime's fast path made by exporter -> passes.

The shared artifact must verify against PyTorch through its own contract (ragged rows in one
[B, Hkv, T, D] buffer, logits_index, next_token), generate transformers' greedy tokens through
IO binding, batch like one-by-one, and be refused with an actionable message where onnxruntime's
GroupQueryAttention cannot run it.
"""

from __future__ import annotations

import pytest

import specport
from specport.core.errors import ExportError
from tests.fixtures import CONTEXT, build_tiny_model, hf_greedy, load_reference

PROMPTS = [[1, 74, 75, 76, 90], [1, 100], [1, 5, 6, 7, 8, 9, 10, 11, 12]]
MAX_LENGTH = 96


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    # head_dim 16 (hidden 64, 4 heads): the smallest GroupQueryAttention runs
    return build_tiny_model("llama", tmp_path_factory.mktemp("shared_src") / "llama")


@pytest.fixture(scope="module")
def shared_art(tiny_llama, tmp_path_factory):
    from tests.export_cache import cached_export

    out = tmp_path_factory.mktemp("shared_art") / "art"
    cached_export(tiny_llama, out, kv_layout="shared", max_length=MAX_LENGTH, progress=False)
    return out


@pytest.mark.slow
def test_shared_export_verifies_its_own_contract(shared_art):
    from specport.artifact import manifest as art

    m = art.read_manifest(shared_art)
    assert m.kv.layout == "shared" and m.kv.max_length == MAX_LENGTH
    assert m.kv.dtype == "float32" and m.kv.num_heads == [2, 2] and m.kv.key_dim == [16, 16]
    assert m.verify["ok"] and m.verify["kv_layout"] == "shared"
    assert {c["name"] for c in m.verify["cases"]} >= {"prefill_b2_leftpad", "chunk_b2_past"}
    assert m.verify["max_abs_logits"] < 1e-4
    inputs = {i["name"] for i in m.io["inputs"]}
    outputs = {o["name"] for o in m.io["outputs"]}
    assert {"seqlens_k", "total_sequence_length", "logits_index"} <= inputs
    assert "attention_mask" not in inputs and "position_ids" not in inputs  # rotary folded
    assert "next_token" in outputs
    runtime = m.extra["runtime"]
    assert runtime["logits_index_input"] == "logits_index"
    assert runtime["next_token_output"] == "next_token"
    names = [p["name"] for p in m.passes]
    assert names[-3:] == ["shared_kv", "pack_projections", "select_logits"]


@pytest.mark.slow
def test_shared_greedy_equals_transformers(shared_art, tiny_llama):
    model = specport.load(shared_art, provider="cpu", threads=1)
    ref = load_reference(tiny_llama, "llama")
    for prompt in PROMPTS:
        r = model.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)
        assert r.metrics["io_binding"] and r.metrics["greedy_in_graph"]
        assert r.tokens == hf_greedy(ref, prompt, 16)


@pytest.mark.slow
def test_shared_batch_equals_one_by_one(shared_art):
    model = specport.load(shared_art, provider="cpu", threads=1)
    singles = [
        model.generate(prompt_ids=p, max_new_tokens=12, ignore_eos=True).tokens for p in PROMPTS
    ]
    batch = model.generate_batch(prompt_ids=PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [r.tokens for r in batch] == singles


def _artifact_step(sess, ids, lens, cache):
    """One run of a shared artifact's graph: ids [B, S] on top of lens[b] cached tokens."""
    import numpy as np

    b, s = ids.shape
    feeds = {
        "input_ids": ids,
        "seqlens_k": (lens + s - 1).astype(np.int32),
        "total_sequence_length": np.array(lens.max() + s, np.int32),
        "logits_index": np.tile(np.arange(s, dtype=np.int64), (b, 1)),
        **cache,
    }
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, feeds)))
    present = {k.replace("present.", "past_key_values."): v for k, v in out.items()}
    return out["logits"], {k: v for k, v in present.items() if k in cache}


@pytest.mark.slow
def test_shared_batched_chunk_on_a_past_equals_rows_alone(shared_art):
    """Batch 2, three new tokens per row on pasts of different lengths in one run (what
    batched speculative verification feeds): each row's logits equal that row run alone."""
    import numpy as np
    import onnxruntime as ort

    from specport.artifact import manifest as art

    m = art.read_manifest(shared_art)
    sess = ort.InferenceSession(str(shared_art / "model.onnx"), providers=["CPUExecutionProvider"])
    empty = {
        f"past_key_values.{i}.{kind}": np.zeros((1, h, MAX_LENGTH, d), np.float32)
        for i, (h, d) in enumerate(zip(m.kv.num_heads, m.kv.key_dim))
        for kind in ("key", "value")
    }
    prompts, chunk = PROMPTS[:2], np.array([[11, 12, 13], [21, 22, 23]], np.int64)
    lens = np.array([len(p) for p in prompts])
    caches, alone = [], []
    for r, prompt in enumerate(prompts):
        _, cache = _artifact_step(sess, np.array([prompt]), np.array([0]), dict(empty))
        caches.append({k: v.copy() for k, v in cache.items()})
        alone.append(_artifact_step(sess, chunk[r : r + 1], lens[r : r + 1], cache)[0][0])
    batch_cache = {k: np.concatenate([c[k] for c in caches]) for k in caches[0]}
    logits, _ = _artifact_step(sess, chunk, lens, batch_cache)
    assert logits.shape[:2] == (2, 3)
    for r in range(2):
        np.testing.assert_allclose(logits[r], alone[r], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_shared_stops_at_its_max_length(shared_art):
    from specport.core.errors import ContextLengthError

    model = specport.load(shared_art, provider="cpu", threads=1)
    result = model.generate(prompt_ids=[1] * (MAX_LENGTH - 3), max_new_tokens=10, ignore_eos=True)
    assert len(result.tokens) == 3 and result.finish_reason == "context"
    with pytest.raises(ContextLengthError, match="context window"):
        model.generate(prompt_ids=[1] * MAX_LENGTH, max_new_tokens=1)


def test_default_max_length_is_context_capped():
    from specport.exporter.kv_layout_choice import shared_buffer_length

    shapes = [(2, 16, 16)]
    assert shared_buffer_length("shared", shapes, {"context_length": 128}, None) == 128
    big = {"context_length": 131072}
    assert shared_buffer_length("shared", shapes, big, None) == 4096
    assert shared_buffer_length("concat", shapes, big, None) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target": "cann"}, "target cpu or cuda"),
        ({"target": "neutral"}, "target cpu or cuda"),
        ({"fuse": False}, "drop --no-fuse"),
        ({"max_length": CONTEXT + 1}, "outside 1"),
        ({"kv_layout": "paged"}, "unknown KV layout"),
    ],
)
def test_refuses_what_shared_cannot_do(tiny_llama, tmp_path, kwargs, match):
    from tests.export_cache import cached_export

    options = {"kv_layout": "shared", **kwargs}
    with pytest.raises(ExportError, match=match):
        cached_export(tiny_llama, tmp_path / "out", progress=False, **options)
    assert not (tmp_path / "out").exists()


def test_refuses_head_dims_gqa_cannot_run(tmp_path):
    from tests.export_cache import cached_export
    from tests.fixtures import TINY, make_llama

    hf = make_llama(tmp_path / "hf", context_length=64, **{**TINY, "num_attention_heads": 8})
    with pytest.raises(ExportError, match="multiple of 16.*--kv-layout concat"):
        cached_export(hf, tmp_path / "out", kv_layout="shared", progress=False)
    assert not (tmp_path / "out").exists()


SHARED_FAMILIES = [
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma2",
    "gemma3_text",
    "smollm3",
    "granite",
    "olmo2",
    "llama:rope_llama3",
    "phi3:rope_longrope",
]


def test_auto_layout_keeps_concat_for_head_dims_gqa_cannot_run(tmp_path):
    from specport.commands.inspect import summarize
    from tests.export_cache import cached_export
    from tests.fixtures import TINY, make_llama

    hf = make_llama(tmp_path / "hf", context_length=64, **{**TINY, "num_attention_heads": 8})
    m = cached_export(hf, tmp_path / "out", skip_verify=True, progress=False)  # auto
    assert m.kv.layout == "concat"
    choice = m.extra["kv_layout_choice"]
    assert choice["requested"] == "auto" and "multiple of 16" in choice["reason"]
    assert summarize(m)["kv_layout_reason"] == choice["reason"]


@pytest.mark.slow
def test_auto_layout_is_shared_where_the_fused_kernel_runs(tiny_llama, tmp_path):
    from tests.export_cache import cached_export

    m = cached_export(tiny_llama, tmp_path / "a", skip_verify=True, progress=False)
    assert m.kv.layout == "shared" and "fused attention" in m.extra["kv_layout_choice"]["reason"]
    for kwargs, why in (({"fuse": False}, "--no-fuse"), ({"target": "neutral"}, "target neutral")):
        m = cached_export(tiny_llama, tmp_path / why, skip_verify=True, progress=False, **kwargs)
        assert m.kv.layout == "concat" and why in m.extra["kv_layout_choice"]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SHARED_FAMILIES)
def test_shared_other_families(model_type, tmp_path):
    """qkv biases (no packing), a sliding window shorter than the run, partial rotary (rotary
    stays outside the attention op, position_ids kept), soft-capping, sliding and global
    layers with their own rope bases, layers without rope: verified and greedy ==
    transformers, every layer's attention one GroupQueryAttention."""
    from tests.export_cache import cached_export

    src = build_tiny_model(model_type, tmp_path / "src")
    m = cached_export(src, tmp_path / "art", kv_layout="shared", progress=False)
    assert m.verify["ok"] and m.kv.layout == "shared"
    model = specport.load(tmp_path / "art", provider="cpu", threads=1)
    prompt = PROMPTS[2]
    got = model.generate(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True).tokens
    assert got == hf_greedy(load_reference(src, model_type), prompt, 16)
    assert m.kv.num_heads and len(m.kv.num_heads) == m.config["num_layers"]
