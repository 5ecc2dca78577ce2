"""--target qnn: static prefill/decode graphs sharing weights, run on the QNN HTP emulator.

onnxruntime-qnn's x86-64 wheel compiles a graph for a Snapdragon SoC (HtpPrepare) and runs it on
the host CPU: whether a graph runs *entirely* on the NPU is checked here. Every QNN session of
specport sets `session.disable_cpu_ep_fallback=1` (a node the NPU refuses fails the load), and
the tests also read onnxruntime's record of where each node went: zero on the CPU provider.

Without onnxruntime-qnn the emulator tests skip (the static graphs are still checked on CPU).
The emulator runs float graphs in fp16: stories260K's greedy tokens equal the same static graphs
on the CPU provider and the reference text; the random tiny Llama has fp16 near-ties, so it is
compared on teacher-forced logits and on the tokens with a clear margin.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

import specport
from specport.artifact.manifest import read_manifest
from specport.core import ep_plugins
from specport.runtime.session import SessionConfig
from specport.runtime.static_session import open_static
from tests.fixtures import LONG_PROMPT, SHORT_PROMPT

QNN = pytest.mark.skipif(
    not ep_plugins.available("qnn"),
    reason="onnxruntime-qnn is not installed (pip install specport[qnn])",
)
STORIES_PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time" (shared/README.md)
STORIES_TEXT = ", there was a little girl named Lily. She loved to play outside in the park."


def export_qnn(source: Path, out: Path, **kwargs) -> Path:
    from tests.export_cache import cached_export

    cached_export(source, out, target="qnn", progress=False, **kwargs)
    return out


def recorded(config: SessionConfig) -> SessionConfig:
    entries = {**config.config_entries, "session.record_ep_graph_assignment_info": "1"}
    return replace(config, config_entries=entries)


def nodes_per_provider(session) -> dict[str, int]:
    counts: dict[str, int] = {}
    for info in session.get_provider_graph_assignment_info():
        counts[info.ep_name] = counts.get(info.ep_name, 0) + len(info.get_nodes())
    return counts


def greedy(session, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding through the concat interface StaticSession presents."""
    kv = {}
    for arg in session.get_inputs():
        if arg.name in session.past:
            kv[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
    tokens, current, done = [], list(prompt), 0
    for _ in range(new):
        feeds = {
            "input_ids": np.array([current]),
            "attention_mask": np.ones((1, done + len(current)), np.int64),
            "position_ids": np.arange(done, done + len(current))[None],
            **kv,
        }
        out = session.run(None, feeds)
        tokens.append(int(out[0][0, -1].argmax()))
        kv = dict(zip(session.past, out[1:]))
        done += len(current)
        current = [tokens[-1]]
    return tokens


@pytest.fixture(scope="module")
def tiny_qnn(tiny_zoo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qnn") / "llama"
    soc = 60 if ep_plugins.available("qnn") else None
    return export_qnn(tiny_zoo.source("llama"), out, context_length=64, prefill_chunk=8, soc=soc)


def test_static_graphs_share_the_weights_file(tiny_qnn):
    manifest = read_manifest(tiny_qnn)
    static = manifest.extra["static"]
    assert manifest.target == "qnn"
    assert (static["context_length"], static["prefill_chunk"]) == (64, 8)
    weights = {}
    for role, name in static["graphs"].items():
        graph = onnx.load(str(tiny_qnn / name), load_external_data=False).graph
        inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
        seq = 8 if role == "prefill" else 1
        assert inputs["input_ids"] == [1, seq]
        assert inputs["attention_mask"] == [1, 64 + seq]
        assert all(all(inputs[n]) for n in inputs), f"{name} has a symbolic dimension: {inputs}"
        ops = {n.op_type for n in graph.node}
        assert not ops & {"Shape", "Range"}, ops
        assert all(not n.domain for n in graph.node)
        weights[role] = {
            t.name: {e.key: e.value for e in t.external_data}["location"]
            for t in graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
        }
    assert weights["prefill"] == weights["decode"]
    assert set(weights["decode"].values()) == {"model.onnx.data"}


def test_static_graphs_decode_like_the_dynamic_graph_on_cpu(tiny_qnn):
    """The static pair (chunked prefill, padded last chunk, new-only KV) equals model.onnx."""
    manifest = read_manifest(tiny_qnn)
    static, _ = open_static(tiny_qnn, manifest, SessionConfig(provider="cpu"))
    model = specport.load(tiny_qnn, provider="cpu")  # model.onnx, the dynamic standard graph
    for prompt in (SHORT_PROMPT, LONG_PROMPT):  # 4 and 10 tokens: one and two prefill chunks
        expected = model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True).tokens
        assert greedy(static, prompt, 12) == expected


def test_static_session_refuses_past_its_context(tiny_qnn):
    from specport.core.errors import ContextLengthError

    manifest = read_manifest(tiny_qnn)
    static, _ = open_static(tiny_qnn, manifest, SessionConfig(provider="cpu"))
    with pytest.raises(ContextLengthError, match="context of 64"):
        greedy(static, list(range(1, 66)), 1)


@QNN
def test_tiny_llama_on_the_htp_emulator_without_cpu_fallback(tiny_qnn):
    manifest = read_manifest(tiny_qnn)
    assert manifest.extra["static"]["soc"] == 60
    assert set(manifest.extra["static"]["epcontext"]) == {"prefill", "decode"}
    config = recorded(SessionConfig(provider="qnn"))
    npu, used = open_static(tiny_qnn, manifest, config)
    assert used == "qnn"
    for session in (npu.prefill, npu.decode):
        counts = nodes_per_provider(session)
        assert counts.get("CPUExecutionProvider", 0) == 0 and counts["QNNExecutionProvider"] > 0
    cpu, _ = open_static(tiny_qnn, manifest, SessionConfig(provider="cpu"))
    # The emulator runs float graphs in fp16: this random tiny model (large init) has near-ties
    # fp16 can flip, so compare teacher-forced logits, and tokens wherever CPU's top-2 margin
    # is over twice the error (stories260K below is compared token for token).
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        sequence = prompt + greedy(cpu, prompt, 12)
        ref, got = forced_logits(cpu, sequence), forced_logits(npu, sequence)
        err = float(np.abs(ref - got).max())
        assert err < 0.05 * float(np.abs(ref).max()), err
        top2 = np.sort(ref, axis=-1)[:, -2:]
        sure = (top2[:, 1] - top2[:, 0]) > 2 * err
        assert sure.sum() >= len(sequence) // 2, "too few confident positions to compare"
        assert (ref.argmax(-1) == got.argmax(-1))[sure].all()


def forced_logits(session, tokens: list[int]) -> np.ndarray:
    """Logits [S, V] of one run over `tokens` (prefill chunks through StaticSession)."""
    kv = {}
    for arg in session.get_inputs():
        if arg.name in session.past:
            kv[arg.name] = np.zeros((1, arg.shape[1], 0, arg.shape[3]), np.float32)
    feeds = {
        "input_ids": np.array([tokens]),
        "attention_mask": np.ones((1, len(tokens)), np.int64),
        "position_ids": np.arange(len(tokens))[None],
        **kv,
    }
    return session.run(["logits"], feeds)[0][0].astype(np.float64)


@pytest.fixture(scope="module")
def stories_qnn(shared_path, tmp_path_factory) -> Path:
    if not ep_plugins.available("qnn"):
        pytest.skip("onnxruntime-qnn is not installed (pip install specport[qnn])")
    out = tmp_path_factory.mktemp("qnn") / "stories"
    source = shared_path("models", "stories260K")
    return export_qnn(source, out, context_length=128, prefill_chunk=16, soc=60)


@QNN
def test_stories260k_generates_on_the_emulator(stories_qnn):
    """`specport.load(provider="qnn")` -> the EPContext graphs, every node on the NPU."""
    model = specport.load(stories_qnn, provider="qnn")
    assert model.provider == "qnn"
    out = model.generate(prompt_ids=STORIES_PROMPT, max_new_tokens=20, ignore_eos=True)
    assert out.text.startswith(STORIES_TEXT[:40]), out.text
    cpu, _ = open_static(stories_qnn, model.manifest, SessionConfig(provider="cpu"))
    assert out.tokens == greedy(cpu, STORIES_PROMPT, 20)
    for session in (model.session.prefill, model.session.decode):
        assert session.get_providers()[0] == "QNNExecutionProvider"


@pytest.mark.parametrize("quant", ["w8a16", pytest.param("w4a16", marks=pytest.mark.slow)])
@QNN
def test_stories260k_qdq_on_the_emulator_equals_the_same_graph_on_cpu(shared_path, tmp_path, quant):
    """QDQ (uint16 activations, per-channel weights): every node on the NPU, greedy tokens
    equal to the same QDQ graphs on the CPU provider; weights once on disk (qdq.onnx.data)."""
    art = export_qnn(shared_path("models", "stories260K"), tmp_path / quant, quant=quant,
                     context_length=128, prefill_chunk=16, soc=60)  # fmt: skip
    manifest = read_manifest(art)
    report = manifest.extra["static"]["quant"]
    assert report["scheme"] == quant and report["decode"]["unquantized"] == 0
    for name in manifest.extra["static"]["graphs"].values():
        graph = onnx.load(str(art / name), load_external_data=False).graph
        assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in graph.node}
        files = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
        assert files <= {"qdq.onnx.data"}
    npu, _ = open_static(art, manifest, recorded(SessionConfig(provider="qnn")))
    assert nodes_per_provider(npu.decode).get("CPUExecutionProvider", 0) == 0
    cpu, _ = open_static(art, manifest, SessionConfig(provider="cpu"))
    assert greedy(npu, STORIES_PROMPT, 16) == greedy(cpu, STORIES_PROMPT, 16)


@pytest.mark.slow
@QNN
@pytest.mark.skipif(
    os.environ.get("SPECPORT_LONG_TESTS") != "1",
    reason="SmolLM2 on the HTP emulator takes 25+ minutes on 2 cores (export, two context "
    "compiles, ~25 s per decode step): set SPECPORT_LONG_TESTS=1 to run it",
)
def test_smollm2_compiles_for_the_soc_and_decodes(shared_path, tmp_path):
    """SmolLM2-135M (30 layers) compiled for SoC 60 and a few decode steps on the emulator."""
    gguf = shared_path("models", "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    art = export_qnn(gguf, tmp_path / "smollm2", context_length=128, prefill_chunk=16, soc=60,
                     skip_verify=True)  # fmt: skip
    manifest = read_manifest(art)
    npu, _ = open_static(art, manifest, recorded(SessionConfig(provider="qnn")))
    assert nodes_per_provider(npu.decode).get("CPUExecutionProvider", 0) == 0
    prompt = [6403, 1980, 253, 655]  # "Once upon a time"
    start = time.perf_counter()
    tokens = greedy(npu, prompt, 4)
    seconds = time.perf_counter() - start
    cpu, _ = open_static(art, manifest, SessionConfig(provider="cpu"))
    assert tokens[:2] == greedy(cpu, prompt, 2)  # fp16 on the emulator: the first tokens agree
    print(f"SmolLM2 on the HTP emulator: prefill + 3 decode steps in {seconds:.1f} s")
