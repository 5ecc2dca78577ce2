"""Attention fuses in every graph family other tools export, wherever onnxruntime's own
transformer optimizer fuses it, and the output matches onnxruntime running the input.

Parametrized over tests/passes/attention_families.py: hand-built blocks in the shapes
onnxruntime's fusion tests write (fast, no torch) and tiny transformers models exported by
torch.onnx's TorchScript and dynamo exporters (slow). For each graph: `specport optimize`
succeeds, its fused attention nodes (Attention in either domain, MultiHeadAttention,
GroupQueryAttention) are at least onnxruntime's `optimize_model(model_type=gpt2|bert)` count and
at least one, and every output is within 1e-4 of onnxruntime running the input on inputs with a
padded position.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specport.cli import main
from tests.passes.attention_families import Entry, entries

ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
FAST = {"onnx.helper", "optimum"}  # graphs that need no torch export (built or kept files)


def _params():
    out = []
    for e in entries():
        marks = [] if e.exporter in FAST else [pytest.mark.slow]
        out.append(pytest.param(e, id=e.name, marks=marks))
    return out


def _attention(path: Path) -> int:
    return sum(
        n.op_type in ATTENTION_OPS
        for n in onnx.load(str(path), load_external_data=False).graph.node
    )


def _ort_fused(src: Path, entry: Entry, out: Path) -> int:
    from onnxruntime.transformers.optimizer import optimize_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimize_model(
            str(src), model_type=entry.model_type, num_heads=entry.heads, hidden_size=entry.hidden
        )
    opt.save_model_to_file(str(out))
    return _attention(out)


def _padded_feeds(sess: ort.InferenceSession, src: Path) -> dict[str, np.ndarray]:
    """B=2, S=3, past 4 (when the graph has one), the first row's first position padded."""
    from specport.core.onnx_parity import Case, _role, make_feeds

    has_past = any(_role(i.name) == "past" for i in sess.get_inputs())
    proto = onnx.load(str(src), load_external_data=False)
    feeds, _ = make_feeds(sess, proto, Case(2, 3, 4 if has_past else 0, has_past), seed=3)
    for i in sess.get_inputs():
        if _role(i.name) == "mask" and feeds[i.name].ndim == 2:
            feeds[i.name][0, 0] = 0
    return feeds


def _real(feeds: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray | bool:
    """Where an output is defined by real tokens: a query at a padded position with no past
    attends to nothing (the input fills its scores with -10000, the fused kernel with the
    lowest float), so its row, and the K/V a later layer computes from it, are not compared."""
    mask = next((v for k, v in feeds.items() if "mask" in k and v.ndim == 2), None)
    if mask is None:
        return True
    b, t = mask.shape
    if len(shape) == 5 and shape[1] == b and shape[3] == t:  # stacked present [2, B, H, T, D]
        return (mask == 1)[None, :, None, :, None]
    if len(shape) == 4 and shape[0] == b and shape[2] == t:  # present [B, H, T, D]
        return (mask == 1)[:, None, :, None]
    if len(shape) >= 2 and shape[0] == b and shape[1] <= t:  # [B, S, ...]: query rows
        rows = mask[:, t - shape[1] :] == 1
        return rows.reshape(rows.shape + (1,) * (len(shape) - 2))
    return True


@pytest.mark.parametrize("entry", _params())
def test_attention_fuses_where_onnxruntime_fuses_it(entry, tmp_path, capsys):
    src = tmp_path / "in" / "model.onnx"
    entry.build(src)
    out = tmp_path / "o.onnx"
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parity"]["checked"], info["parity"]
    assert info["parity"]["max_abs_error"] <= 1e-4
    ours, theirs = _attention(out), _ort_fused(src, entry, tmp_path / "ort.onnx")
    assert ours >= max(theirs, 1), (ours, theirs)
    ref, got = ort.InferenceSession(str(src)), ort.InferenceSession(str(out))
    feeds = _padded_feeds(ref, src)
    for want, have in zip(ref.run(None, feeds), got.run(None, feeds)):
        keep = _real(feeds, want.shape)
        np.testing.assert_allclose(np.where(keep, have, 0), np.where(keep, want, 0), atol=1e-4)


def test_the_check_names_the_dims_it_used(tmp_path, capsys):
    """A block with onnxruntime's dim names (`past_sequence_length + sequence_length`) and a
    float 0/1 mask is checked, each symbolic dim given one value, and the report lists them."""
    from tests.passes import ort_blocks

    src = ort_blocks.build("gpt2", tmp_path / "gpt2.onnx")
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx")]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("  checked against onnxruntime on the input"), line
    assert "past_sequence_length + sequence_length=7, past_sequence_length=4" in line


def test_unnamed_and_unknown_dims_get_one_value_each(tmp_path, capsys):
    """Dims named as tf2onnx names them (unk__N) and shared by two inputs get the same value:
    the check runs instead of reporting that no random input ran."""
    from tests.passes import ort_blocks

    src = ort_blocks.build("bert", tmp_path / "bert.onnx")
    model = onnx.load(str(src))
    for vi in [*model.graph.input, *model.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param:
                d.dim_param = {"batch_size": "unk__0", "sequence_length": "unk__1"}[d.dim_param]
    onnx.save(model, str(src))
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx"), "--json"]) == 0
    parity = json.loads(capsys.readouterr().out)["parity"]
    assert parity["checked"] and "unk__0=2, unk__1=3" in parity["cases"][0]


def test_verbose_names_the_rule_that_almost_matched(tmp_path, capsys):
    """A Where that fills masked scores with -1 (not a mask) stops the decomposed-attention
    rule after the Softmax and MatMul(p, V) matched: -v says so, with the reason."""
    from tests.passes import ort_blocks

    src = ort_blocks.build("distilbert", tmp_path / "d.onnx")
    model = onnx.load(str(src))
    where = next(n for n in model.graph.node if n.op_type == "Where")
    fill = next(t for t in model.graph.initializer if t.name == where.input[1])
    fill.CopyFrom(onnx.numpy_helper.from_array(np.asarray(-1.0, np.float32), fill.name))
    onnx.save(model, str(src))
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx"), "-v"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "nearest rule" in ln]
    assert len(lines) == 1, lines
    assert "decomposed attention -> Attention-23" in lines[0]
    assert "matched Softmax -> MatMul(p, V)" in lines[0]
    assert "does not fill with a large negative constant" in lines[0]


@pytest.mark.slow
def test_bert_norms_and_gelu_fuse(tmp_path):
    """BERT's TorchScript export: LayerNorm without its folded-away epsilon and the exact erf
    GELU are fused (they were left as 14 ops per norm / 5 per GELU)."""
    from specport.passes.base import op_counts
    from specport.passes.pipelines import optimize_model
    from tests.passes.attention_families import build_encoder

    src = tmp_path / "bert.onnx"
    build_encoder(src, "bert", dynamo=False)
    model, report = optimize_model(src, "cpu")
    counts = op_counts(model)
    assert counts["LayerNormalization"] == 5 and "ReduceMean" not in counts  # 2 layers x 2 + 1
    assert counts["com.microsoft.BiasGelu"] == 2 and "Erf" not in counts


def test_layernorm_below_opset_17_as_onnxruntimes_generators_write_it(tmp_path, capsys):
    """onnxruntime's GPT-2 generator writes LayerNormalization at opset 16 (its contrib kernel in
    the ai.onnx domain; onnx's checker knows no such op) with a misspelt `epsion` attribute:
    accepted, noted, fused and checked."""
    from tests.passes import ort_blocks

    src = ort_blocks.build("gpt2", tmp_path / "g.onnx", opset=16)
    model = onnx.load(str(src))
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "LayerNormalization" and attr.name == "epsilon":
                attr.name = "epsion"
    onnx.save(model, str(src))
    capsys.readouterr()
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert any("onnxruntime loads it" in r for r in info["repairs"])
    assert info["parity"]["checked"] and info["parity"]["max_abs_error"] <= 1e-4
    assert _attention(tmp_path / "o.onnx") == 1
