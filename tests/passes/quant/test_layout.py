"""Quantizing a `shared` KV-layout artifact in place: the quantized graph keeps the IO-bound loop
and computes what the quantized concat artifact computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import specport
from specport.artifact.manifest import read_manifest
from specport.core.contract import prefill_feeds
from specport.passes.quant.apply import quantize_artifact
from specport.passes.quant.layout import shared_prefill_feeds
from tests.fixtures import TINY, make_llama
from tests.passes.quant._tiny import write_corpus

IDS = np.array([1, 40, 50, 60, 70, 80, 90, 33, 44, 55, 66, 77], dtype=np.int64)
# head dim 16: GroupQueryAttention's CPU kernel needs a multiple of 16
SIZES = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from tests.export_cache import cached_export

    root = tmp_path_factory.mktemp("layout")
    hf = make_llama(root / "hf", context_length=128, **SIZES)
    concat, shared = root / "concat", root / "shared"
    cached_export(hf, concat, kv_layout="concat", progress=False)
    cached_export(hf, shared, kv_layout="shared", progress=False)
    return concat, shared, write_corpus(root / "calib.txt", docs=12, seed=0)


def _logits(art: Path, feeds) -> np.ndarray:  # type: ignore[no-untyped-def]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    m = read_manifest(art)
    sess = ort.InferenceSession(str(art / m.model_file), so, providers=["CPUExecutionProvider"])
    return sess.run(["logits"], feeds(sess, IDS))[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["w4a8", "w8a8"])
def test_shared_quantized_matches_concat_quantized(twins, tmp_path, scheme):
    concat, shared, calib = twins
    kw = {"algo": "rtn", "calib_files": [calib]} if scheme == "w8a8" else {"algo": "rtn"}
    quantize_artifact(concat, tmp_path / "qc", scheme, **kw)
    qs = quantize_artifact(shared, tmp_path / "qs", scheme, **kw)
    assert qs.kv.layout == "shared" and qs.quant["scheme"] == scheme
    assert qs.quant["ort_cpu"]["float_matmuls"] == 0  # the LM head is int8 too
    assert qs.quant["lm_head_bits"] == 8 and qs.quant["accuracy_level"] == 4
    want = _logits(tmp_path / "qc", prefill_feeds)
    got = _logits(tmp_path / "qs", shared_prefill_feeds)
    base = _logits(shared, shared_prefill_feeds)
    if scheme == "w8a8":
        # the shared graph's attention is GroupQueryAttention, so its output projection's
        # smoothing is tied per KV head and folded into the values, while the concat graph's
        # MatMul attention keeps an untied run-time Mul: equally close to float, not equal
        assert np.abs(got - base).mean() < 1.5 * np.abs(want - base).mean() + 1e-4
    else:
        assert np.abs(got - want).mean() < 0.1 * np.abs(got - base).mean() + 1e-4
    # the bound runtime loop runs it
    model = specport.load(tmp_path / "qs", provider="cpu", threads=1)
    r = model.generate(prompt_ids=IDS.tolist(), max_new_tokens=4, ignore_eos=True)
    assert len(r.tokens) == 4 and r.metrics["io_binding"]
