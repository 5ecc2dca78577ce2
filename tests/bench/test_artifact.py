"""`specport bench` end to end on a tiny model (quick), plus the byte accounting it relies on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specport.artifact import manifest as art
from tests.fixtures import TINY, make_llama


@pytest.fixture(scope="module")
def tiny_fused(tmp_path_factory):
    from tests.export_cache import cached_export

    hf = make_llama(tmp_path_factory.mktemp("bench_hf"), context_length=128, **TINY)
    out = tmp_path_factory.mktemp("bench_art") / "art"
    cached_export(hf, out, kv_layout="shared", progress=False)
    return out


def _bench_json(capsys, *args):
    from specport.cli import main

    assert main(["bench", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_json_end_to_end(tiny_fused, capsys):
    report = _bench_json(
        capsys,
        str(tiny_fused),
        "--prompt-len",
        "6",
        "--new-tokens",
        "5",
        "--runs",
        "2",
        "--threads",
        "1",
        "--peer",
        "transformers",
    )
    ours = report["engines"]["specport"]
    for key in (
        "ttft_ms",
        "tpot_ms",
        "cpu_ms_per_token",
        "decode_tok_per_s",
        "prefill_tok_per_s",
        "framework_overhead_pct",
        "peak_rss_mb",
    ):
        assert ours[key] is not None and ours[key] >= 0, key
    assert ours["kv_layout"] == "shared" and ours["runs"] == 2
    assert ours["cpu_ms_per_token"] > 0
    hw = report["hardware"]
    assert hw["bandwidth"]["median_gb_s"] > 0 and hw["floor_tpot_ms"] > 0
    assert hw["kernel_floor"]["median_ms"] > 0 and ours["tpot_vs_kernel_floor"] > 0
    peer = report["engines"]["transformers"]
    assert peer["decode_tok_per_s"] > 0
    assert set(peer["specport_speedup"]) == {
        "ttft_ms",
        "tpot_ms",
        "cpu_ms_per_token",
        "decode_tok_per_s",
        "prefill_tok_per_s",
    }


def test_every_measured_run_reads_its_whole_prompt(tiny_fused):
    """The generator keeps the KV of the prompt it last read, and a bench repeats one prompt:
    each run must still read all of it (its TTFT and prefill tok/s stand beside peers that
    do), not just the last token behind a cache hit."""
    from specport.bench.artifact import specport_loader
    from specport.bench.results import BenchConfig

    once, _ = specport_loader(tiny_fused, [[5, 6, 7, 8, 9, 10]], BenchConfig(new_tokens=3))()
    assert [once()["cached_prompt_tokens"] for _ in range(3)] == [0, 0, 0]


def test_bench_several_batches_and_prompt_ids(tiny_fused, capsys):
    report = _bench_json(
        capsys,
        str(tiny_fused),
        "--prompt-ids",
        "1,5,6,7",
        "--new-tokens",
        "3",
        "--runs",
        "1",
        "--threads",
        "1",
        "--batch",
        "1",
        "2",
    )
    assert [r["config"]["batch"] for r in report["batches"]] == [1, 2]
    assert report["batches"][1]["config"]["prompt_len"] == 4


@pytest.mark.slow
def test_bench_another_artifact_as_peer(tiny_fused, capsys, tmp_path):
    """`--peer specport:DIR` runs a second artifact (here the int8-KV quantization) on the same
    prompts, interleaved, with a ratio column; its KV buffers are int8."""
    from specport.cli import main
    from specport.passes.quant.apply import quantize_artifact
    from tests.passes.quant._tiny import write_corpus

    kv8 = tmp_path / "kv8"
    calib = write_corpus(tmp_path / "calib.txt", docs=8)
    quantize_artifact(tiny_fused, kv8, "none", kv_cache="int8", calib_files=[calib])
    peer = f"specport:{kv8}"
    report = _bench_json(
        capsys, str(tiny_fused), "--prompt-len", "6", "--new-tokens", "4", "--runs", "2",
        "--threads", "1", "--peer", peer,
    )  # fmt: skip
    other = report["engines"][peer]
    assert other["kv_layout"] == "shared" and other["runs"] == 2
    assert other["decode_tok_per_s"] > 0 and other["specport_speedup"]["tpot_ms"] > 0
    code = main(["bench", str(tiny_fused), "--peer", f"specport:{tmp_path / 'nope'}"])
    assert code == 2 and "is not an artifact" in capsys.readouterr().err


def test_bytes_per_token_counts_the_embedding_as_one_row(tiny_fused):
    from specport.bench.hardware import bytes_per_token

    manifest = art.read_manifest(tiny_fused)
    b = bytes_per_token(tiny_fused / manifest.model_file)
    emb = TINY["vocab_size"] * TINY["hidden_size"] * 4
    assert b["gather_tables"] == emb
    assert b["weights"] == b["all_initializers"] - emb + TINY["hidden_size"] * 4


def test_bytes_per_token_counts_a_quantized_embedding_as_one_row(tmp_path):
    """An 8-bit table (GatherBlockQuantized: codes, scales, zero points) is gathered too."""
    import onnx
    from onnx import TensorProto, helper

    from specport.bench.hardware import bytes_per_token

    vocab, dim, block = 64, 32, 16
    inits = [
        helper.make_tensor("codes", TensorProto.UINT8, [vocab, dim], [0] * (vocab * dim)),
        helper.make_tensor("scales", TensorProto.FLOAT, [vocab, dim // block], [1.0] * (vocab * 2)),
        helper.make_tensor("zeros", TensorProto.UINT8, [vocab, dim // block], [0] * (vocab * 2)),
    ]
    node = helper.make_node(
        "GatherBlockQuantized", ["codes", "ids", "scales", "zeros"], ["emb"],
        domain="com.microsoft", block_size=block, bits=8,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, dim])], inits,
    )  # fmt: skip
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
    b = bytes_per_token(tmp_path / "m.onnx")
    assert b["gather_tables"] == b["all_initializers"] == vocab * (dim + 2 * 4 + 2)
    assert b["weights"] == dim + 2 * 4 + 2  # one row of each


def test_table_has_a_ratio_column_per_peer(tiny_fused):
    from specport.bench.artifact import run_bench
    from specport.bench.report import format_table
    from specport.bench.results import BenchConfig

    report = run_bench(tiny_fused, BenchConfig(prompt_len=4, new_tokens=3, runs=1, threads=1))
    text = format_table(report)
    assert "decode tok/s" in text and "bandwidth floor" in text


@pytest.mark.slow
def test_bench_with_onnxruntime_genai_peer(tiny_fused, capsys, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime_genai")
    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path))
    report = _bench_json(
        capsys,
        str(tiny_fused),
        "--prompt-len",
        "6",
        "--new-tokens",
        "4",
        "--runs",
        "1",
        "--threads",
        "1",
        "--peer",
        "onnxruntime-genai",
    )
    assert report["engines"]["onnxruntime-genai"]["decode_tok_per_s"] > 0


def test_kernel_floor_rebuilds_every_weight_kernel(tiny_fused):
    """The floor graph has one node per weight kernel of the artifact, the same weight bytes (the
    embedding is gathered, not streamed), and runs; the bench reports it next to each engine."""
    import onnx

    from specport.bench.hardware import bytes_per_token
    from specport.bench.kernel_floor import KernelFloor, floor_graph

    model = tiny_fused / "model.onnx"
    blob, feeds, covered = floor_graph(model, rows=2)
    floor = onnx.load_from_string(blob)
    shipped = onnx.load(str(model), load_external_data=False)
    inits = {t.name for t in shipped.graph.initializer}
    kernels = [n for n in shipped.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert [n.op_type for n in floor.graph.node] == ["MatMul"] * len(kernels)
    assert all(v.shape[0] == 2 for v in feeds.values())
    assert covered <= bytes_per_token(model)["weights"] * 1.01
    kf = KernelFloor(model, threads=1, rows=1)
    assert kf.sample(repeats=2) > 0
    assert kf.summary()["median_ms"] > 0
    kf.close()


def test_bench_requests_measures_the_engines(tiny_fused, capsys):
    """`specport bench --requests N`: batching vs serial engine, one request alone (same tokens
    as Model.generate), and the prefix cache on a shared system prompt."""
    report = _bench_json(
        capsys,
        str(tiny_fused),
        "--requests",
        "3",
        "--new-tokens",
        "4",
        "--prompt-len",
        "5",
        "--prefix-tokens",
        "20",
        "--runs",
        "1",
        "--threads",
        "1",
    )
    assert report["batching_tok_per_s"] > 0 and report["serial_tok_per_s"] > 0
    assert report["alone_same_tokens"] is True
    assert report["shared_prefix_ttft_ms_cached"] > 0


def test_bench_requests_speculative_compares_the_batching_engine(tiny_fused, capsys):
    """`specport bench --requests N --speculative ngram`: the batching engine with and without
    speculation on the same copy prompts; greedy, so both give the same tokens."""
    report = _bench_json(
        capsys,
        str(tiny_fused),
        "--requests",
        "2",
        "--speculative",
        "ngram",
        "--spec-max-rows",
        "2",
        "--new-tokens",
        "8",
        "--prompt-len",
        "12",
        "--runs",
        "2",
        "--threads",
        "1",
    )
    assert report["plain_tok_per_s"] > 0 and report["speculative_tok_per_s"] > 0
    assert report["same_tokens"] is True
    assert report["config"]["spec_max_rows"] == 2 and report["spec_steps"] > 0
    assert report["speculative_ttft_ms_p99"] >= report["speculative_ttft_ms_p50"] > 0
    assert 0 <= report["accepted"] <= report["drafted"]


def test_bench_requests_speculative_on_a_prompt_set(tiny_fused, capsys):
    """`--prompt-set copy` with `--requests`: the requests' prompts come from the built-in set
    (cycled to N), and both engines still give the same tokens."""
    report = _bench_json(
        capsys,
        str(tiny_fused),
        "--requests",
        "3",
        "--speculative",
        "ngram",
        "--prompt-set",
        "copy",
        "--new-tokens",
        "8",
        "--runs",
        "1",
        "--threads",
        "1",
    )
    assert report["config"]["prompt_set"] == "copy"
    assert report["same_tokens"] is True and report["plain_tok_per_s"] > 0


def test_plain_decode_bytes_leave_out_an_mtp_branch(tiny_fused, tmp_path):
    """Plain decoding runs without the MTP heads (stripped at load), so the bytes per token and
    the kernel floor of an MTP artifact are those of its base; the heads are reported apart."""
    import onnx

    from specport.bench.hardware import bytes_per_token
    from specport.bench.kernel_floor import floor_graph
    from tests.export_cache import cached_mtp

    cached_mtp(tiny_fused, tmp_path / "mtp")
    base = bytes_per_token(tiny_fused / "model.onnx")
    mtp_model = tmp_path / "mtp" / "model.onnx"
    with_heads = bytes_per_token(mtp_model)
    shipped = onnx.load(str(mtp_model), load_external_data=False)
    head_bytes = sum(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * int(np.prod(t.dims))
        for t in shipped.graph.initializer
        if t.name.startswith("mtp.")
    )
    assert head_bytes > 0
    assert base["not_in_plain_decode"] == 0
    assert with_heads["weights"] == base["weights"]
    assert with_heads["all_initializers"] == base["all_initializers"]
    assert with_heads["not_in_plain_decode"] == head_bytes
    assert floor_graph(mtp_model)[2] == floor_graph(tiny_fused / "model.onnx")[2]
