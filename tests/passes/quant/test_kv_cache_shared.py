"""Int8 KV cache on the shared layout: the pass on a one-node GroupQueryAttention graph (run in
place through IO binding, against a numpy reference), the calibration granularities, and a tiny
shared-layout artifact quantized end to end (logits against its fp32-KV source)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import specport
from specport.artifact.manifest import read_manifest
from specport.core.errors import QuantizationError, UsageError
from specport.passes.quant.apply import quantize_artifact
from specport.passes.quant.kv_cache_shared import QuantizeSharedKVCachePass, kernel_scale
from specport.passes.quant.kv_calibration import HeadStats, scales_from_stats

NH, KVH, D, T = 4, 2, 16, 24  # query heads, KV heads, head dim, buffer length


# -- a one-layer shared graph ---------------------------------------------------------------


def _shared_graph() -> ir.Model:
    """q/k/v in; GroupQueryAttention over past_key_values.0.* -> present.0.* (one buffer)."""
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", f, ["B", "S", NH * D]),
        helper.make_tensor_value_info("k", f, ["B", "S", KVH * D]),
        helper.make_tensor_value_info("v", f, ["B", "S", KVH * D]),
        helper.make_tensor_value_info("past_key_values.0.key", f, ["B", KVH, T, D]),
        helper.make_tensor_value_info("past_key_values.0.value", f, ["B", KVH, T, D]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        [i.name for i in inputs],
        ["out", "present.0.key", "present.0.value"],
        domain="com.microsoft",
        num_heads=NH,
        kv_num_heads=KVH,
    )
    outputs = [
        helper.make_tensor_value_info("out", f, ["B", "S", NH * D]),
        helper.make_tensor_value_info("present.0.key", f, ["B", KVH, T, D]),
        helper.make_tensor_value_info("present.0.value", f, ["B", KVH, T, D]),
    ]
    graph = helper.make_graph([node], "shared", inputs, outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=opsets))


def _scales(granularity: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = {"per_channel": (KVH, D), "per_kv_head": (KVH,), "per_tensor": (1,)}[granularity]
    return {
        name: (0.01 + 0.03 * rng.random(shape)).astype(np.float32)
        for name in ("present.0.key", "present.0.value")
    }


class _InPlace:
    """An onnxruntime session over the graph with int8 buffers bound as past and present."""

    def __init__(self, model: ir.Model, tmp: Path) -> None:
        path = tmp / "m.onnx"
        ir.save(model, path)
        self.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.k = np.zeros((1, KVH, T, D), np.int8)
        self.v = np.zeros((1, KVH, T, D), np.int8)

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, length: int) -> np.ndarray:
        """Append S = q.shape[1] positions after `length` cached ones; the attention output."""
        b = self.sess.io_binding()
        s = q.shape[1]
        for name, arr in (("q", q), ("k", k), ("v", v)):
            b.bind_cpu_input(name, arr)
        b.bind_cpu_input("seqlens_k", np.array([length + s - 1], np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(length + s, np.int32))
        keep = []
        for kind, buf in (("key", self.k), ("value", self.v)):
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            keep.append(value)
            b.bind_ortvalue_input(f"past_key_values.0.{kind}", value)
            b.bind_ortvalue_output(f"present.0.{kind}", value)
        b.bind_output("out")
        self.sess.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()[2]


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, length: int) -> np.ndarray:
    """Causal GQA of q [S, NH*D] over k/v [KVH, length, D] (the last S positions are q's)."""
    s = q.shape[0]
    qh = q.reshape(s, NH, D).transpose(1, 0, 2)
    out = np.zeros((NH, s, D))
    mask = np.tril(np.ones((s, length)), k=length - s) > 0
    for h in range(NH):
        g = h // (NH // KVH)
        scores = np.where(mask, qh[h] @ k[g, :length].T / np.sqrt(D), -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[h] = (p / p.sum(-1, keepdims=True)) @ v[g, :length]
    return out.transpose(1, 0, 2).reshape(s, NH * D)


@pytest.mark.parametrize("granularity", ["per_channel", "per_kv_head", "per_tensor"])
def test_pass_makes_the_in_place_cache_int8(tmp_path, granularity):
    """The kernel writes round(x / scale) into the bound int8 buffer and attends to every
    position, the new ones too, through it: one run of 3 tokens equals 3 runs of 1, bit for bit."""
    scales = _scales(granularity)
    model = _shared_graph()
    result = QuantizeSharedKVCachePass(scales, granularity)(model)
    assert result.modified and result.report["granularity"] == granularity
    assert result.report["current_step"] == "int8" and result.report["attention_layers"] == 1
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert node.attributes["kv_cache_bit_width"].value == 8
    quant = "PER_TENSOR" if granularity == "per_tensor" else "PER_CHANNEL"
    assert node.attributes["k_quant_type"].value == node.attributes["v_quant_type"].value == quant
    assert node.inputs[12] is not None and node.inputs[13] is not None
    k_scale = kernel_scale(scales["present.0.key"], granularity, KVH, D)
    v_scale = kernel_scale(scales["present.0.value"], granularity, KVH, D)
    assert np.array_equal(node.inputs[12].const_value.numpy(), k_scale)
    ks = np.broadcast_to(k_scale.reshape(-1, 1, D) if k_scale.size > 1 else k_scale, (KVH, 1, D))
    vs = np.broadcast_to(v_scale.reshape(-1, 1, D) if v_scale.size > 1 else v_scale, (KVH, 1, D))

    one, three = _InPlace(model, tmp_path), _InPlace(model, tmp_path)
    assert {i.type for i in one.sess.get_inputs() if i.name.startswith("past_")} == {"tensor(int8)"}
    rng = np.random.default_rng(1)
    x = {n: rng.standard_normal((1, 9, w), dtype=np.float32) for n, w in zip("qkv", (64, 32, 32))}
    for sess in (one, three):  # a 6-token prefill on the empty cache
        sess.run(x["q"][:, :6], x["k"][:, :6], x["v"][:, :6], 0)
    k6 = x["k"][0, :6].reshape(6, KVH, D).transpose(1, 0, 2)
    assert np.array_equal(one.k[0, :, :6], np.clip(np.rint(k6 / ks), -128, 127))
    out3 = one.run(x["q"][:, 6:], x["k"][:, 6:], x["v"][:, 6:], 6)
    out1 = np.concatenate(
        [
            three.run(x["q"][:, j : j + 1], x["k"][:, j : j + 1], x["v"][:, j : j + 1], j)
            for j in (6, 7, 8)
        ],
        axis=1,
    )
    np.testing.assert_array_equal(out3, out1)
    assert np.array_equal(one.k, three.k) and np.array_equal(one.v, three.v)
    ref = _attention(x["q"][0, 6:], one.k[0] * ks, one.v[0] * vs, 9)
    np.testing.assert_allclose(out3[0], ref, atol=1e-5)


def test_pass_preconditions_and_scale_shapes():
    scales = _scales("per_channel")
    concat = _shared_graph()
    concat.graph.inputs.pop()  # no total_sequence_length ...
    concat.graph.inputs.pop()  # ... nor seqlens_k: not a shared graph
    r = QuantizeSharedKVCachePass(scales)(concat)
    assert not r.modified and "not a shared KV layout" in r.report["skipped"]
    model = _shared_graph()
    QuantizeSharedKVCachePass(scales)(model)
    r = QuantizeSharedKVCachePass(scales)(model)
    assert not r.modified and "already quantized" in r.report["skipped"]
    with pytest.raises(QuantizationError, match="per-channel KV scale has shape"):
        QuantizeSharedKVCachePass(_scales("per_kv_head"))(_shared_graph())
    with pytest.raises(QuantizationError, match="no calibrated KV scale for present.0.value"):
        QuantizeSharedKVCachePass({"present.0.key": scales["present.0.key"]})(_shared_graph())
    with pytest.raises(QuantizationError, match="unknown KV scale granularity"):
        QuantizeSharedKVCachePass(scales, "per_token")
    assert kernel_scale(np.array([0.5, 0.25]), "per_kv_head", 2, 3).tolist() == [
        [[[0.5, 0.5, 0.5]], [[0.25, 0.25, 0.25]]]
    ]


def test_scales_from_stats_granularities():
    rng = np.random.default_rng(2)
    rows = np.abs(rng.standard_normal((2, 50, 4))).astype(np.float32)  # [H, positions, D]
    rows[1, :, 3] *= 20  # an outlier channel in head 1
    st = HeadStats(rows.reshape(2, -1).max(axis=1), [rows.reshape(2, -1)], rows.max(axis=1), [rows])
    chan = scales_from_stats({"k": st}, "absmax", "per_channel")["k"]
    np.testing.assert_allclose(chan, rows.max(axis=1) / 127, rtol=1e-6)
    head = scales_from_stats({"k": st}, "absmax", "per_kv_head")["k"]
    np.testing.assert_allclose(head, chan.max(axis=1), rtol=1e-6)
    tensor = scales_from_stats({"k": st}, "absmax", "per_tensor")["k"]
    assert tensor.shape == (1,) and np.isclose(tensor[0], chan.max())
    clipped = scales_from_stats({"k": st}, "p99.9", "per_channel")["k"]
    assert clipped.shape == (2, 4) and np.all(clipped <= chan + 1e-9) and np.all(clipped > 0)
    with pytest.raises(QuantizationError, match="unknown KV granularity"):
        scales_from_stats({"k": st}, "absmax", "per_token")


# -- a tiny shared-layout artifact ----------------------------------------------------------


@pytest.fixture(scope="module")
def shared_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.export_cache import cached_export
    from tests.fixtures import TINY, make_llama

    tmp = tmp_path_factory.mktemp("kv8_shared")
    hf = make_llama(tmp / "hf", context_length=128, initializer_range=0.2, **TINY)  # type: ignore[arg-type]
    cached_export(hf, tmp / "fp32", kv_layout="shared", skip_verify=True, progress=False)
    return tmp / "fp32"


@pytest.fixture(scope="module")
def shared_kv8(
    shared_src: Path, calib_text: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp("kv8_shared_q") / "kv8"
    quantize_artifact(shared_src, out, "none", kv_cache="int8", calib_files=[calib_text])
    return out


@pytest.mark.slow
def test_shared_artifact_manifest_graph_and_logits(shared_src, shared_kv8, eval_text):
    """The int8 artifact keeps the shared layout, records its scales, loads in onnxruntime with
    int8 buffers, and scores text close to its fp32-KV source (perplexity within 1%, mean KL of
    the next-token distributions < 5e-3, top-1 agreement > 95%), the same in one pass and token
    by token."""
    from specport.runtime.eval import compare, perplexity

    m = read_manifest(shared_kv8)  # hashes verified
    assert m.kv.layout == "shared" and m.kv.dtype == "int8"
    kv = m.quant["kv_cache"]
    assert kv["granularity"] == "per_channel" and kv["quant_type"] == "PER_CHANNEL"
    assert kv["layout"] == "shared" and kv["current_step"] == "int8" and "axis" not in kv
    assert set(kv["scales"]) == {n for pair in m.kv.outputs for n in pair}
    assert all(e["dtype"] == "int8" for e in m.io["inputs"] if e["name"].startswith("past_"))
    model = onnx.load(str(shared_kv8 / m.model_file), load_external_data=False)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == m.num_layers
    for n in gqa:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["kv_cache_bit_width"] == 8 and attrs["k_quant_type"] == b"PER_CHANNEL"
    sess = ort.InferenceSession(str(shared_kv8 / m.model_file), providers=["CPUExecutionProvider"])
    assert {i.type for i in sess.get_inputs() if i.name.startswith("past_")} == {"tensor(int8)"}

    fp32 = perplexity(shared_src, eval_text)["ppl"]
    one = perplexity(shared_kv8, eval_text)
    chunked = perplexity(shared_kv8, eval_text, chunk=1)
    assert chunked["tokens"] == one["tokens"] and np.isclose(chunked["ppl"], one["ppl"], rtol=1e-6)
    assert abs(one["ppl"] / fp32 - 1) < 0.01
    cmp = compare(shared_src, shared_kv8, eval_text)
    assert cmp["top1_agreement"] > 0.95 and cmp["kl"] < 5e-3  # measured 0.973, 4.9e-4


@pytest.mark.slow
def test_shared_bad_inputs(shared_src, shared_kv8, calib_text, tmp_path):
    with pytest.raises(UsageError, match="already has a int8 KV cache"):
        specport.quantize(
            shared_kv8, tmp_path / "a", scheme="none", kv_cache="int8", calib_files=[calib_text]
        )
    with pytest.raises(UsageError, match="kv_granularity applies to kv_cache='int8'"):
        specport.quantize(shared_src, tmp_path / "b", scheme="w4a16", kv_granularity="per_tensor")
    with pytest.raises(UsageError, match="must be one of per_kv_head, per_channel, per_tensor"):
        specport.quantize(
            shared_src,
            tmp_path / "c",
            scheme="none",
            kv_cache="int8",
            kv_granularity="per_token",
            calib_files=[calib_text],
        )
    assert not any((tmp_path / n).exists() for n in "abc")


def test_kv_calibration_adds_chat_turns_when_there_is_a_template(tiny_llama_artifact, tmp_path):
    """A chat template's tokens push keys and values past plain text's ranges (3x in some
    SmolLM2-135M channels), so KV calibration also runs documents as chat turns."""
    import specport
    from specport.core.chat_template import load_chat_template
    from specport.passes.quant.kv_calibration import chat_sequences
    from tests.fixtures import add_chat_tokenizer

    docs = ["The cat sat.", "A dog ran far away."]
    assert chat_sequences(tiny_llama_artifact, docs, 64) == []  # no chat tokenizer: nothing added
    chat = add_chat_tokenizer(tiny_llama_artifact, tmp_path / "chat")
    seqs = chat_sequences(chat, docs, 64)
    template = load_chat_template(specport.load(chat))
    assert [s.tolist() for s in seqs] == [
        template.render_ids([{"role": "user", "content": d}]) for d in docs
    ]


@pytest.mark.slow
def test_float_layers_and_the_chat_check(shared_src, calib_text, tmp_path):
    """`kv_float_layers` keeps those layers' caches float32 (manifest per-layer dtypes, graph
    io, attention attributes), and an artifact with a chat template gets the teacher-forced
    chat check in its manifest; a layer index the model lacks is refused."""
    from tests.fixtures import add_chat_tokenizer

    chat = add_chat_tokenizer(shared_src, tmp_path / "chat")
    out = tmp_path / "mixed"
    quantize_artifact(
        chat, out, "none", kv_cache="int8", calib_files=[calib_text], kv_float_layers=[0]
    )
    m = read_manifest(out)
    assert m.kv.dtype == "int8" and m.kv.layer_dtypes == ["float32", "int8"]
    io = {e["name"]: e["dtype"] for e in [*m.io["inputs"], *m.io["outputs"]]}
    assert io["past_key_values.0.key"] == io["present.0.value"] == "float32"
    assert io["past_key_values.1.key"] == io["present.1.value"] == "int8"
    kv = m.quant["kv_cache"]
    assert kv["float_layers"] == [0] and set(kv["scales"]) == {"present.1.key", "present.1.value"}
    check = kv["chat_check"]
    assert check["sequences"] == 8 and check["positions"] > 100
    assert 0 <= check["agreement"] <= 1 and check["ok"] == (check["agreement"] >= 0.99)
    sess = ort.InferenceSession(str(out / m.model_file), providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in sess.get_inputs()}
    assert types["past_key_values.0.key"] == "tensor(float)"
    assert types["past_key_values.1.value"] == "tensor(int8)"
    with pytest.raises(QuantizationError, match="no GroupQueryAttention cache"):
        quantize_artifact(
            shared_src, tmp_path / "bad", "none", kv_cache="int8", calib_files=[calib_text],
            kv_float_layers=[5],
        )  # fmt: skip
    with pytest.raises(UsageError, match="kv_float_layers applies to kv_cache='int8'"):
        specport.quantize(shared_src, tmp_path / "c", scheme="w4a16", kv_float_layers=[0])


@pytest.mark.slow
def test_float_layers_auto_measures_and_records_the_choice(shared_src, calib_text, tmp_path):
    """`kv_float_layers="auto"` measures all-int8 agreement first and, below the threshold,
    ranks layers by their own KL and keeps the fewest float32 that reach it; the choice and
    the measurements go to the manifest, and the artifact's layer dtypes follow it."""
    from specport.passes.quant import kv_select

    out = tmp_path / "auto"
    quantize_artifact(
        shared_src, out, "none", kv_cache="int8", calib_files=[calib_text], kv_float_layers="auto"
    )
    m = read_manifest(out)
    choice = m.passes[-1]["float_layer_choice"]
    kept = choice["kept"]
    assert m.quant["kv_cache"]["float_layers"] == kept
    assert choice["all_int8"]["positions"] > 0 and choice["threshold"] == kv_select.THRESHOLD
    if choice["all_int8"]["agreement"] >= choice["threshold"]:
        assert kept == [] and m.kv.layer_dtypes == []
    else:
        assert len(choice["layer_kl"]) == 2 and 1 <= len(kept) <= 1
        assert m.kv.layer_dtypes == ["float32" if i in kept else "int8" for i in range(2)]


@pytest.mark.slow
def test_choose_float_layers_ranks_by_each_layers_own_kl(shared_src, calib_text):
    """With an unreachable threshold every step is measured: the layers are ranked by the KL
    of each one int8 alone and the most sensitive one is kept (all but one layer)."""
    from specport.passes.quant import calibration as C
    from specport.passes.quant.kv_calibration import calibrate_kv_scales
    from specport.passes.quant.kv_select import choose_float_layers

    m = read_manifest(shared_src)
    scales = calibrate_kv_scales(
        shared_src / m.model_file, m, shared_src, [calib_text], granularity="per_channel"
    )
    docs = C.read_documents([calib_text])[:4]
    seqs = C.tokenize(docs, shared_src / "tokenizer.json", m.config.get("bos_token_id"), 64)
    kept, report = choose_float_layers(
        shared_src / m.model_file, scales, "per_channel", seqs, 2, threshold=1.01
    )
    kl = report["layer_kl"]
    assert len(kl) == 2 and kl[0] != kl[1]
    assert kept == [int(np.argmax(kl))] and report["result"]["agreement"] <= 1
    assert report["all_int8"]["kl"] > 0
