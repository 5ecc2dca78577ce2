"""`optimize` on graphs other tools exported (fixtures/, see fixtures/make_fixtures.py).

Each fixture is a 2-layer random model: Optimum's TorchScript exports of Llama, Qwen2, Phi-3 and
GPT-2 (past_key_values.{i}.key/value), and TorchScript GPT-2 exports in onnxruntime's gpt2_helper
layout (stacked past_{i} [2, B, H, P, Dh]; eager and sdpa attention; one without a cache), and
torch's dynamo exporter at its default opset (GPT-2 stacked past, Llama per-layer past), where
attention is still MatMul/Softmax with K transposed as a 3-D tensor.
After `optimize_model(target)` the graph loads in onnxruntime, every layer's attention is one
node, and logits (and presents) match the input model on random inputs with and without past.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from specport.passes.base import op_counts
from specport.passes.pipelines import optimize_model, save_model

FIXTURES = Path(__file__).parent / "fixtures"
LAYERS = 2
CASES = [(2, 5, 0, [0, 2]), (2, 1, 6, [0, 3]), (2, 3, 4, [0, 1]), (1, 4, 3, [0])]  # B, S, P, pads
ALL = sorted(p.name for p in FIXTURES.glob("*.onnx"))


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def feeds_for(sess: ort.InferenceSession, b: int, s: int, p: int, pads, seed: int = 0):
    """Random feeds for any of the fixture I/O layouts (4-D per-tensor or 5-D stacked past)."""
    rng = np.random.default_rng(seed)
    names = [i.name for i in sess.get_inputs()]
    has_past = any("past" in n for n in names)
    total = p + s if has_past else s
    feeds: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 128, (b, s), dtype=np.int64)
        elif i.name == "attention_mask":
            mask = np.ones((b, total), np.int64)
            for row, n in enumerate(pads[:b]):
                mask[row, :n] = 0
            feeds[i.name] = mask
        elif i.name == "position_ids":
            pos = np.tile(np.arange(p, p + s, dtype=np.int64), (b, 1))
            feeds[i.name] = np.maximum(pos - np.asarray(pads[:b])[:, None], 0)
        elif len(i.shape) == 5:  # stacked [2, B, H, P, Dh]
            feeds[i.name] = rng.standard_normal((2, b, i.shape[2], p, i.shape[4]), np.float32)
        else:
            feeds[i.name] = rng.standard_normal((b, i.shape[1], p, i.shape[3]), np.float32)
    return feeds


def max_error(base: ort.InferenceSession, fused: ort.InferenceSession, cases=CASES) -> float:
    """Worst |logit difference| over real (not left-pad) query rows; presents compared too."""
    has_past = any("past" in i.name for i in base.get_inputs())
    worst = 0.0
    for b, s, p, pads in cases:
        if not has_past and p:
            continue
        feeds = feeds_for(base, b, s, p, pads)
        want, got = base.run(None, feeds), fused.run(None, feeds)
        real = feeds["attention_mask"][:, -s:] == 1
        worst = max(worst, float(np.abs(want[0] - got[0]).max(-1)[real].max()))
        # presents at left-pad positions hold whatever a fully masked query computed (the
        # unfused graph: zeros, the fused kernel: a uniform row); only real slots are compared
        real_kv = feeds["attention_mask"] == 1
        for x, y in zip(want[1:], got[1:]):
            assert x.shape == y.shape
            keep = real_kv[:, None, :, None] if x.ndim == 4 else real_kv[None, :, None, :, None]
            worst = max(worst, float(np.abs(np.where(keep, x - y, 0)).max()))
    return worst


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """name -> (report, optimized model path), built once per fixture."""
    cache: dict[str, tuple] = {}

    def get(name: str, target: str = "cpu"):
        if (name, target) not in cache:
            model, report = optimize_model(FIXTURES / name, target)
            counts = op_counts(model)
            out = save_model(model, tmp_path_factory.mktemp(name.split(".")[0]) / "model.onnx")
            cache[name, target] = (report, out, counts)
        return cache[name, target]

    return get


def _attn(report):
    return next(p for p in report["passes"] if p["name"] == "fuse_attention")


def test_fixtures_present():
    assert {
        "optimum_llama.onnx",
        "optimum_qwen2.onnx",
        "optimum_phi3.onnx",
        "optimum_gpt2.onnx",
        "ts_gpt2_past_eager.onnx",
        "ts_gpt2_past_sdpa.onnx",
        "ts_gpt2_nopast.onnx",
        "dynamo_gpt2_past.onnx",
        "dynamo_llama_past.onnx",
    } <= set(ALL)
    assert all((FIXTURES / n).stat().st_size < 500_000 for n in ALL)


@pytest.mark.parametrize("name", ALL)
def test_every_layer_fuses_with_parity(optimized, name):
    report, out, counts = optimized(name)
    attn = _attn(report)
    assert "rejected" not in attn, attn["rejected"]
    assert attn["softmax_left"] == 0 and attn["attention_nodes"] == LAYERS
    if "nopast" in name:
        assert counts["Attention"] == LAYERS  # no cache: Attention-23 is the fused kernel
        assert len(attn["no_cache_attention"]) == LAYERS
    else:
        assert attn["matched"] == LAYERS  # one GroupQueryAttention per layer
        assert counts["com.microsoft.GroupQueryAttention"] == LAYERS
    assert max_error(_session(FIXTURES / name), _session(out)) < 1e-4


@pytest.mark.parametrize("name", ["optimum_llama.onnx", "optimum_qwen2.onnx", "optimum_phi3.onnx"])
def test_norms_and_rotary_fuse_in_optimum_llama_family(optimized, name):
    report, _, counts = optimized(name)
    assert counts["com.microsoft.SkipSimplifiedLayerNormalization"] == 2 * LAYERS
    assert counts["RMSNormalization"] == 1  # the first norm has no residual before it
    assert "ReduceMean" not in counts
    rotary = next(p for p in report["passes"] if p["name"] == "fuse_rotary")
    assert rotary["matched"]["rotate_half_rotary"] == 2 * LAYERS  # Q and K of every layer
    assert counts["RotaryEmbedding"] == 2 * LAYERS and "Neg" not in counts


@pytest.mark.parametrize("name", [n for n in ALL if "gpt2" in n])
def test_layer_norms_fuse_in_gpt2(optimized, name):
    _, _, counts = optimized(name)
    # ln_1 / ln_2 of each layer and ln_f, each after a residual add (ln_1 of layer 0 after
    # the token + position embedding sum)
    # on cpu as Add + LayerNormalization (faster there than the contrib SkipLayerNormalization)
    assert counts["LayerNormalization"] == 2 * LAYERS + 1
    assert "com.microsoft.SkipLayerNormalization" not in counts
    assert "ReduceMean" not in counts


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optimum_qwen2.onnx", "ts_gpt2_past_eager.onnx"])
@pytest.mark.parametrize("target", ["neutral", "cann"])
def test_other_targets(optimized, name, target):
    report, out, _ = optimized(name, target)
    assert _attn(report)["matched"] == LAYERS
    assert max_error(_session(FIXTURES / name), _session(out)) < 1e-4


def test_a_layer_left_unfused_is_named_with_its_reason():
    """Layer 1's Softmax over another axis: layer 0 still fuses; the report names layer 1's
    node and why it stayed (the graph keeps its MatMul/Softmax attention there)."""
    import onnx_ir as ir

    model = ir.load(str(FIXTURES / "optimum_llama.onnx"))
    softmax = [n for n in model.graph if n.op_type == "Softmax"]
    softmax[1].attributes["axis"] = ir.AttrInt64("axis", 2)
    fused, report = optimize_model(model, "cpu")
    attn = _attn(report)
    assert attn["matched"] == 1 and attn["softmax_left"] == 1
    (why,) = attn["rejected"]
    assert "layers.1" in why["node"] and "Softmax over axis 2" in why["reason"]
    assert op_counts(fused)["com.microsoft.GroupQueryAttention"] == 1
