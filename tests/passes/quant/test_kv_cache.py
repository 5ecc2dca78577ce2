"""Int8 KV cache: numpy reference, the pass on a hand-built graph, and whole artifacts
(tiny Llama, alone and with W4A16) run in bare onnxruntime sessions over decode steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import specport
from specport.artifact.manifest import read_manifest
from specport.cli import main
from specport.core.contract import prefill_feeds
from specport.core.errors import QuantizationError
from specport.passes.quant.apply import quantize_artifact
from specport.passes.quant.kv_cache import (
    QuantizeKVCachePass,
    dequantize_int8,
    kv_bytes_per_token,
    quantize_int8,
)
from specport.passes.quant.kv_calibration import HeadStats, scales_from_stats
from specport.runtime.eval import compare, perplexity

# -- numpy reference ------------------------------------------------------------------------


def test_reference_roundtrip_error_and_saturation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32) * np.array([1, 4, 0.1])[
        None, :, None, None
    ].astype(np.float32)  # [B, Hkv, T, D], very different ranges per head
    absmax = np.abs(x).max(axis=(0, 2, 3))
    scale = (absmax / 127).astype(np.float32)
    q = quantize_int8(x, scale)
    assert q.dtype == np.int8 and q.min() >= -127 and q.max() <= 127
    err = np.abs(dequantize_int8(q, scale) - x)
    assert np.all(err <= scale[None, :, None, None] / 2 * (1 + 1e-5))
    assert np.array_equal(quantize_int8(dequantize_int8(q, scale), scale), q)  # idempotent
    big = np.full((1, 3, 1, 8), 1e6, np.float32)
    assert np.all(quantize_int8(big, scale) == 127) and np.all(quantize_int8(-big, scale) == -128)


def test_scales_from_stats_clips():
    rng = np.random.default_rng(1)
    sample = np.abs(rng.standard_normal((2, 4000))).astype(np.float32)
    sample[:, 0] = 50.0  # one outlier per head
    st = HeadStats(sample.max(axis=1), [sample])
    absmax = scales_from_stats({"present.0.key": st}, "absmax")["present.0.key"]
    assert np.allclose(absmax, 50.0 / 127)
    for clip in ("mse", "p99.9", "p99.99"):
        s = scales_from_stats({"present.0.key": st}, clip)["present.0.key"]
        assert s.shape == (2,) and np.all(s > 0) and np.all(s < absmax)
    zero = HeadStats(np.zeros(2, np.float32), [np.zeros((2, 3), np.float32)])
    assert np.all(scales_from_stats({"k": zero})["k"] > 0)
    with pytest.raises(QuantizationError, match="unknown KV clip"):
        scales_from_stats({"k": st}, "p50")


# -- the pass on a hand-built concat graph -------------------------------------------------


def _concat_graph(heads: int = 2, dim: int = 4, wrap: bool = False) -> ir.Model:
    """past [B,H,P,D] ++ new [B,H,S,D] -> present; out = ReduceSum(present) reads the cache.

    wrap: present = Identity(Concat(...)), a producer the pass does not see through."""
    f = ir.TensorType(ir.DataType.FLOAT)
    past = ir.Value(name="past_key_values.0.key", shape=ir.Shape(["B", heads, "P", dim]), type=f)
    new = ir.Value(name="new", shape=ir.Shape(["B", heads, "S", dim]), type=f)
    cat = ir.node("Concat", [past, new], attributes={"axis": 2}, name="cat")
    nodes = [cat]
    if wrap:
        cat.outputs[0].name = "cat_out"
        nodes.append(ir.node("Identity", [cat.outputs[0]], name="wrap"))
    present = nodes[-1].outputs[0]
    present.name, present.type = "present.0.key", f
    present.shape = ir.Shape(["B", heads, "T", dim])
    red = ir.node("ReduceSum", [present], attributes={"keepdims": 0}, name="sum")
    red.outputs[0].name, red.outputs[0].type = "total", f
    red.outputs[0].shape = ir.Shape([])
    shape = ir.node("Shape", [past], name="shape")
    shape.outputs[0].name, shape.outputs[0].type = "past_shape", ir.TensorType(ir.DataType.INT64)
    graph = ir.Graph(
        [past, new],
        [red.outputs[0], present, shape.outputs[0]],
        nodes=[*nodes, red, shape],
        opset_imports={"": 23},
    )
    return ir.Model(graph, ir_version=10)


def _session(model: ir.Model, tmp_path: Path) -> ort.InferenceSession:
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("wrap", [False, True], ids=["int8_concat", "requantize"])
def test_pass_on_concat_graph(tmp_path, wrap):
    scale = np.array([0.05, 0.2], np.float32)
    model = _concat_graph(wrap=wrap)
    result = QuantizeKVCachePass({"present.0.key": scale})(model)
    assert result.modified and result.report["scales"]["present.0.key"] == [0.05, 0.2]
    # Concat(dequant(past), new) becomes Concat(past, quant(new)): the float concat and the
    # past's DequantizeLinear go; the present's DequantizeLinear feeds ReduceSum.
    assert result.report["int8_concat"] == (0 if wrap else 1)
    assert result.report["ops_after"]["DequantizeLinear"] == (2 if wrap else 1)
    assert result.report["current_step"] == "int8"
    assert result.report["ops_after"]["QuantizeLinear"] == 1
    sess = _session(model, tmp_path)
    types = {v.name: v.type for v in [*sess.get_inputs(), *sess.get_outputs()]}
    assert types["past_key_values.0.key"] == types["present.0.key"] == "tensor(int8)"
    rng = np.random.default_rng(0)
    past = rng.integers(-127, 128, (1, 2, 3, 4)).astype(np.int8)
    new = rng.standard_normal((1, 2, 2, 4)).astype(np.float32)
    total, present, shape = sess.run(None, {"past_key_values.0.key": past, "new": new})
    assert np.array_equal(present[:, :, :3], past)  # the cache bytes pass through unchanged
    assert np.array_equal(present[:, :, 3:], quantize_int8(new, scale))
    # the cache's reader sees every position through int8, the new ones too
    assert np.isclose(total, dequantize_int8(present, scale).sum(), rtol=1e-5)
    assert shape.tolist() == [1, 2, 3, 4]
    # empty past, as the runtime feeds it on the first step
    _, present, _ = sess.run(None, {"past_key_values.0.key": past[:, :, :0], "new": new})
    assert present.shape == (1, 2, 2, 4)


def test_pass_without_cache_reader_keeps_current_step_float(tmp_path):
    """A fused attention that outputs present itself reads its new positions in float."""
    model = _concat_graph(wrap=True)
    g = model.graph
    g.outputs.pop(0)
    g.remove(next(n for n in g if n.op_type == "ReduceSum"), safe=True)
    result = QuantizeKVCachePass({"present.0.key": np.array([0.1, 0.1], np.float32)})(model)
    assert result.report["current_step"] == "float"
    assert result.report["float_step_tensors"] == ["present.0.key"]
    assert result.report["ops_after"]["DequantizeLinear"] == 1
    sess = _session(model, tmp_path)
    past = np.zeros((1, 2, 1, 4), np.int8)
    present, _ = sess.run(
        None, {"past_key_values.0.key": past, "new": np.ones((1, 2, 1, 4), np.float32)}
    )
    assert present.dtype == np.int8 and np.all(present[:, :, 1] == 10)


def test_pass_refuses_shared_layout_and_requantizing():
    model = _concat_graph()
    seq = ir.Value(name="seqlens_k", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT32))
    model.graph.inputs.append(seq)
    r = QuantizeKVCachePass({"present.0.key": np.ones(2, np.float32)})(model)
    assert not r.modified and "shared KV layout" in r.report["skipped"]
    model = _concat_graph()
    QuantizeKVCachePass({"present.0.key": np.ones(2, np.float32)})(model)
    r = QuantizeKVCachePass({"present.0.key": np.ones(2, np.float32)})(model)
    assert not r.modified and "not float32" in r.report["skipped"]
    with pytest.raises(QuantizationError, match="2 KV heads"):
        QuantizeKVCachePass({"present.0.key": np.ones(3, np.float32)})(_concat_graph())


# -- whole artifacts ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv8(quant_src: Path, calib_text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kv8") / "kv8"
    quantize_artifact(quant_src, out, "none", kv_cache="int8", calib_files=[calib_text])
    return out


def _bare(artifact: Path) -> tuple[ort.InferenceSession, list[str]]:
    m = read_manifest(artifact)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(artifact / m.model_file), so, ["CPUExecutionProvider"])
    return sess, [o.name for o in sess.get_outputs()]


def _decode(sess, names, ids, past=None, start=0):
    """Feed ids [S] at positions start.. on top of `past`; (logits [S, V], presents)."""
    if past is None:
        past = {k: v for k, v in prefill_feeds(sess, ids).items() if k.startswith("past_")}
    s = len(ids)
    feeds = {
        "input_ids": ids[None, :],
        "attention_mask": np.ones((1, start + s), np.int64),
        "position_ids": np.arange(start, start + s, dtype=np.int64)[None, :],
        **past,
    }
    outs = sess.run(names, feeds)
    presents = {
        n.replace("present.", "past_key_values.", 1): o for n, o in zip(names[1:], outs[1:])
    }
    return outs[0][0], presents


@pytest.mark.slow
def test_int8_artifact_manifest(kv8, quant_src, calib_text):
    m = read_manifest(kv8)  # hashes verified
    assert m.kv.dtype == "int8" and m.kv.layout == "concat"
    kv = m.quant["kv_cache"]
    assert kv["dtype"] == "int8" and kv["axis"] == 1 and kv["clip"] == "absmax"
    assert kv["calibration"]["sha256"] and len(kv["calibration"]["sha256"]) == 64
    assert m.quant["scheme"] == "none" and m.passes[-1]["name"] == "quantize_kv_cache"
    past_io = [e for e in m.io["inputs"] if e["name"].startswith("past_key_values.")]
    assert past_io and all(e["dtype"] == "int8" for e in past_io)
    assert set(kv["scales"]) == {n for pair in m.kv.outputs for n in pair}
    src = read_manifest(quant_src)
    assert kv_bytes_per_token(src) == 4 * kv_bytes_per_token(m)
    # the graph's scale initializers are the recorded ones
    model = ir.load(kv8 / m.model_file)
    init = model.graph.initializers["/model/layers.0/kv_cache/key/scale"].const_value.numpy()
    assert np.allclose(init, kv["scales"]["present.0.key"], rtol=1e-6)


@pytest.mark.slow
def test_int8_decode_steps_vs_fp32(kv8, quant_src):
    """Decode steps in bare sessions. The unfused graph's attention reads every position through
    int8, so step logits equal the one-pass logits; layer 0's new cache entries (a function of
    token and position only) are within scale/2 of fp32; logits stay close to fp32."""
    q_sess, q_names = _bare(kv8)
    f_sess, f_names = _bare(quant_src)
    kv = read_manifest(kv8).quant["kv_cache"]
    assert kv["current_step"] == "int8"
    scales = kv["scales"]
    ids = np.array([1, 40, 41, 42, 60, 70, 80, 44, 45, 46, 47, 50], np.int64)
    one_pass, _ = _decode(q_sess, q_names, ids)
    q_logits, q_past = _decode(q_sess, q_names, ids[:4])
    f_logits, f_past = _decode(f_sess, f_names, ids[:4])
    np.testing.assert_allclose(q_logits, one_pass[:4], atol=1e-4, rtol=1e-4)
    for t in range(4, len(ids)):  # one token per step on the carried caches
        deq = {
            k: dequantize_int8(v, scales[k.replace("past_key_values.", "present.")])
            for k, v in q_past.items()
        }
        _, ref_present = _decode(f_sess, f_names, ids[t : t + 1], deq, t)
        q_logits, q_past_new = _decode(q_sess, q_names, ids[t : t + 1], q_past, t)
        f_logits, f_past = _decode(f_sess, f_names, ids[t : t + 1], f_past, t)
        np.testing.assert_allclose(q_logits[0], one_pass[t], atol=1e-4, rtol=1e-4)
        for k, present in q_past_new.items():
            assert present.dtype == np.int8 and present.shape[2] == t + 1
            assert np.array_equal(present[:, :, :t], q_past[k])  # old entries unchanged
            if not k.startswith("past_key_values.0."):
                continue
            s = np.asarray(scales[k.replace("past_key_values.", "present.")], np.float32)
            new, ref = present[:, :, t:], ref_present[k][:, :, t:]
            s4 = s[None, :, None, None]
            inside = np.abs(ref) <= 127 * s4  # beyond the calibrated range it saturates
            err = np.abs(dequantize_int8(new, s) - ref)
            assert np.all((err <= s4 / 2 + 1e-6) | ~inside)
            assert np.all((np.abs(new.astype(np.int32)) >= 127) | inside)
        spread = float(np.abs(f_logits).max())
        assert np.abs(q_logits - f_logits).max() <= 0.05 * spread
        q_past = q_past_new


@pytest.mark.slow
def test_int8_runtime_paths(kv8, quant_src, eval_text):
    """Eval (one pass and chunked), the generator and speculative decoding run int8 KV; since
    logits do not depend on the split into runs, greedy speculative output equals plain greedy."""
    one = perplexity(kv8, eval_text)
    fp32 = perplexity(quant_src, eval_text)
    chunked = perplexity(kv8, eval_text, chunk=1)
    assert chunked["chunk"] == 1 and chunked["tokens"] == one["tokens"]
    assert np.isclose(chunked["ppl"], one["ppl"], rtol=1e-5)
    assert np.isclose(perplexity(quant_src, eval_text, chunk=3)["ppl"], fp32["ppl"], rtol=1e-5)
    assert abs(chunked["ppl"] / fp32["ppl"] - 1) < 0.05
    cmp = compare(quant_src, kv8, eval_text, chunk=2)
    assert cmp["chunk"] == 2 and cmp["top1_agreement"] > 0.9
    model = specport.load(kv8)
    prompt = [1, 40, 41, 42]
    plain = model.generate(prompt_ids=prompt, max_new_tokens=16, greedy=True, ignore_eos=True)
    spec = model.generate(
        prompt_ids=prompt,
        max_new_tokens=16,
        greedy=True,
        ignore_eos=True,
        speculative="ngram",
        num_draft=3,
    )
    assert len(plain.tokens) == 16 and spec.tokens == plain.tokens


@pytest.mark.slow
def test_int8_kv_with_w4a16(quant_src, calib_text, eval_text, tmp_path):
    out = tmp_path / "w4kv"
    m = quantize_artifact(quant_src, out, "w4a16", 32, "rtn", [calib_text], kv_cache="int8")
    assert m.quant["scheme"] == "w4a16" and m.kv.dtype == "int8"
    assert m.quant["ort_cpu"]["kernels"]["com.microsoft.MatMulNBits"] >= 1
    names = [p["name"] for p in m.passes]
    assert names[-1] == "quantize_kv_cache" and "quantize_weights_nbits" in names
    sess, _ = _bare(out)
    assert {i.type for i in sess.get_inputs() if i.name.startswith("past_")} == {"tensor(int8)"}
    w4 = perplexity(out, eval_text, chunk=1)["ppl"]
    assert abs(w4 / perplexity(quant_src, eval_text)["ppl"] - 1) < 0.25


@pytest.mark.slow
def test_errors(quant_src, calib_text, kv8, tmp_path):
    with pytest.raises(QuantizationError, match="needs calibration"):
        quantize_artifact(quant_src, tmp_path / "a", "none", kv_cache="int8")
    with pytest.raises(QuantizationError, match="nothing to do"):
        quantize_artifact(quant_src, tmp_path / "b", "none", calib_files=[calib_text])
    with pytest.raises(QuantizationError, match="weight-only baseline"):
        quantize_artifact(
            quant_src, tmp_path / "c", "w4a16", 32, "ort-hqq", [calib_text], kv_cache="int8"
        )
    with pytest.raises(QuantizationError, match="already has a int8 KV cache"):
        quantize_artifact(kv8, tmp_path / "d", "none", calib_files=[calib_text], kv_cache="int8")
    with pytest.raises(QuantizationError, match="one scale per KV head"):
        quantize_artifact(
            quant_src,
            tmp_path / "e",
            "none",
            calib_files=[calib_text],
            kv_cache="int8",
            kv_granularity="per_channel",
        )
    assert not any((tmp_path / n).exists() for n in "abcde")


@pytest.mark.slow
def test_cli(quant_src, calib_text, eval_text, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["quantize", str(quant_src), "--out", str(out), "--kv-cache", "int8"]
    assert main([*args, "--calib", str(calib_text), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scheme"] == "none" and summary["kv_cache"]["dtype"] == "int8"
    assert main([*args, "--calib", str(calib_text)]) == 0  # an artifact: replaced
    text = capsys.readouterr().out
    assert "KV cache: int8" in text and "kernels" not in text  # no empty `{}` for float weights
    assert main(["quantize", str(quant_src), "--out", str(tmp_path / "x")]) == 2
    capsys.readouterr()
    assert main(["eval", "ppl", str(out), "--text", str(eval_text), "--chunk", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chunk"] == 4


@pytest.mark.slow
def test_fused_gqa_artifact(tiny_zoo, calib_text, eval_text, tmp_path):
    """The default (fused GroupQueryAttention, If fallback) export: the new keys/values are
    round-tripped through int8 before attention, so chunking does not change the logits."""
    from tests.passes.quant._tiny import with_tokenizer

    src = with_tokenizer(tiny_zoo.artifact("llama", fuse=True), tmp_path / "fused")
    out = tmp_path / "fused8"
    m = quantize_artifact(src, out, "none", kv_cache="int8", calib_files=[calib_text])
    report = m.passes[-1]
    assert report["gqa_int8_inputs"] == 2 * m.num_layers and report["current_step"] == "int8"
    one = perplexity(out, eval_text)["ppl"]
    assert np.isclose(perplexity(out, eval_text, chunk=1)["ppl"], one, rtol=1e-5)
    assert abs(one / perplexity(src, eval_text)["ppl"] - 1) < 0.05
    model = specport.load(out)
    kw = {"prompt_ids": [1, 40, 41, 42], "max_new_tokens": 16, "greedy": True, "ignore_eos": True}
    assert model.generate(**kw, speculative="ngram").tokens == model.generate(**kw).tokens
