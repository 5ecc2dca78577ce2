"""Size budgets (passes/quant/budget.py): every mixture a budget plans decodes token-exactly
against its own fake-quantized reference (the float graph with the weights read back from
the artifact's MatMulNBits / GatherBlockQuantized initializers and dequantized in numpy), and
the file stays within the budget."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from specport.artifact.files import write_artifact_manifest
from specport.artifact.manifest import DATA_NAME, read_manifest
from specport.build import export, quantize
from specport.core.errors import QuantizationError, UsageError
from specport.loading import load
from specport.passes.quant.budget import MIXTURES

PROMPT = [1, 40, 41, 42, 50, 60]


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint8 bytes -> `count` codes per row, low bits first."""
    per = 8 // bits
    codes = np.stack([(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=-1)
    return codes.reshape(packed.shape[0], -1)[:, :count].astype(np.float32)


def _blocks(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, g: int) -> np.ndarray:
    """codes [R, nb*g], scales/zeros [R, nb] -> dequantized [R, nb*g]."""
    r, nb = scales.shape
    q = codes.reshape(r, nb, g)
    return ((q - zeros[..., None]) * scales[..., None]).reshape(r, nb * g)


def _const(v: ir.Value | None) -> np.ndarray | None:
    """An initializer's array, or a Reshape of one (a tied table reads the head's codes)."""
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    prod = v.producer()
    if prod is not None and prod.op_type == "Reshape":
        data, shape = _const(prod.inputs[0]), _const(prod.inputs[1])
        return None if data is None or shape is None else data.reshape(shape)
    return None


def _inputs(node: ir.Node) -> list[np.ndarray | None]:
    return [_const(v) for v in node.inputs]


def _dequantized(model: ir.Model) -> ir.Model:
    """Replace MatMulNBits by MatMul and GatherBlockQuantized by Gather on float weights."""
    graph = model.graph
    for node in list(graph):
        if node.domain != "com.microsoft" or node.op_type not in (
            "MatMulNBits",
            "GatherBlockQuantized",
        ):
            continue
        a = node.attributes
        bits, g = a["bits"].as_int(), a["block_size"].as_int()
        vals = _inputs(node)
        if node.op_type == "MatMulNBits":
            k, n = a["K"].as_int(), a["N"].as_int()
            b, scales = vals[1], vals[2]
            nb = -(-k // g)
            codes = _unpack(b.reshape(n, -1), bits, nb * g)
            zp = vals[3] if len(vals) > 3 else None
            zeros = (
                np.full((n, nb), 2.0 ** (bits - 1))
                if zp is None
                else zp.reshape(n, nb)  # float zero points, one per block
                if zp.dtype == np.float32
                else _unpack(zp.reshape(n, -1), bits, nb)
            )
            w = _blocks(codes, scales.reshape(n, nb), zeros, g)[:, :k].T
            new = ir.node("MatMul", [node.inputs[0], ir.Value(name=f"{node.name}.w")])
        else:
            data, scales = vals[0], vals[2]
            zp = vals[3] if len(vals) > 3 else None
            v, nb = scales.shape
            codes = _unpack(data, bits, nb * g)
            zeros = np.full((v, nb), 2.0 ** (bits - 1)) if zp is None else _unpack(zp, bits, nb)
            w = _blocks(codes, scales, zeros, g)
            new = ir.node("Gather", [ir.Value(name=f"{node.name}.w"), node.inputs[1]])
        weight = new.inputs[0] if node.op_type == "GatherBlockQuantized" else new.inputs[1]
        assert weight is not None
        weight.const_value = ir.tensor(np.ascontiguousarray(w, dtype=np.float32), name=weight.name)
        graph.register_initializer(weight)
        graph.insert_before(node, new)
        out, ref = node.outputs[0], new.outputs[0]
        ref.shape, ref.type = out.shape, out.type
        ir.convenience.replace_all_uses_with(out, ref, replace_graph_outputs=True)
        name = out.name
        graph.remove(node, safe=True)
        ref.name = name
    return model


def _reference(q: Path, dst: Path) -> Path:
    """A copy of artifact `q` whose weights are its own, dequantized to float."""
    shutil.copytree(q, dst)
    m = read_manifest(dst)
    model = _dequantized(ir.load(q / m.model_file))
    (dst / m.model_file).unlink()
    (dst / DATA_NAME).unlink(missing_ok=True)
    ir.save(model, dst / m.model_file, external_data=DATA_NAME)
    write_artifact_manifest(dst, m)
    return dst


@pytest.mark.parametrize("target", [5.5, 6.5, 8.0])
def test_budget_mixture_decodes_like_its_fake_quantized_reference(
    quant_src, calib_text, tmp_path, target
):
    """Float activations (w4a16): the planned widths and blocks, read back and dequantized,
    give the same greedy tokens; the file holds at most the budget."""
    out = tmp_path / "q"
    m = quantize(
        quant_src,
        out,
        scheme="w4a16",
        calib_files=[calib_text],
        bits_per_weight=target,
    )
    size, plan = m.quant["size"], m.quant["budget"]
    assert size["bits_per_weight"] <= target
    assert size["bits_per_weight"] == pytest.approx(plan["planned_bits_per_weight"], abs=1e-3)
    ref = _reference(out, tmp_path / "ref")
    kw = {"prompt_ids": PROMPT, "max_new_tokens": 24, "greedy": True, "ignore_eos": True}
    assert load(out).generate(**kw).tokens == load(ref).generate(**kw).tokens


def test_w4a8_budget_uses_both_widths_and_stays_within(quant_src, calib_text, tmp_path):
    """With int8 activations 8-bit tensors are fast, so a roomy budget buys some; the plan
    and the manifest agree, and the whole file stays within the budget."""
    m = quantize(
        quant_src, tmp_path / "q", scheme="w4a8", calib_files=[calib_text], bits_per_weight=7.0
    )
    plan = m.quant["budget"]
    widths = {t["bits"] for t in plan["tensors"].values()}
    assert widths == {4, 8}
    assert m.quant["size"]["bits_per_weight"] <= 7.0
    assert m.quant["lm_head_bits"] in (4, 8) and m.quant["embedding_bits"] in (4, 8)
    assert "Precision plan" in (tmp_path / "q" / "README.md").read_text()


def test_budget_below_floor_and_bad_options(quant_src, calib_text, tmp_path):
    with pytest.raises(QuantizationError, match="smallest file"):
        quantize(quant_src, tmp_path / "a", scheme="w4a8", bits_per_weight=3.0)
    with pytest.raises(UsageError, match="not both"):
        quantize(quant_src, tmp_path / "b", bits_per_weight=5.0, mixture="q4_k_m")
    with pytest.raises(UsageError, match="lm_head_bits"):
        quantize(quant_src, tmp_path / "c", scheme="w4a8", bits_per_weight=6.0, lm_head_bits=8)
    with pytest.raises(UsageError, match="w4a8 or w4a16"):
        quantize(quant_src, tmp_path / "d", scheme="w8a8", mixture="q8_0", calib_files=[calib_text])
    assert MIXTURES["q4_k_m"] < MIXTURES["q6_k"]


@pytest.mark.shared
@pytest.mark.slow
@pytest.mark.parametrize("symmetric", [False, True])
def test_tied_table_gathers_from_the_head_codes(shared_path, tmp_path, symmetric):
    """stories260K ties its embedding: under a budget the table is gathered from the head's
    MatMulNBits codes (stored once), and the result decodes like its dequantized reference."""
    src = tmp_path / "st"
    export(shared_path("models", "stories260K"), src)
    text = shared_path("text", "tinystories_valid_dev.txt")
    out = tmp_path / "q"
    m = quantize(
        src,
        out,
        scheme="w4a16",
        algo="gptq",
        symmetric=symmetric,
        calib_files=[text],
        calib_docs=64,
        bits_per_weight=6.0,
        frequent_head_rows=0,
    )
    assert m.quant["size"]["bits_per_weight"] <= 6.0
    table = next(p for p in m.passes if p.get("name") == "quantize_embedding")
    (row,) = table["layers"].values()
    assert row["shared_with"].endswith("MatMulNBits")
    model = ir.load(out / m.model_file)
    gbq = next(n for n in model.graph if n.op_type == "GatherBlockQuantized")
    assert gbq.inputs[0].producer().op_type == "Reshape"
    ref = _reference(out, tmp_path / "ref")
    kw = {"prompt_ids": [1, 403, 407, 261, 378], "max_new_tokens": 32, "greedy": True}
    assert load(out).generate(**kw).tokens == load(ref).generate(**kw).tokens


@pytest.fixture(scope="module")
def tied_src(tiny_zoo, tmp_path_factory) -> Path:
    """A tiny SmolLM3 (tied embedding, vocab 256) with a tokenizer."""
    from tests.passes.quant._tiny import with_tokenizer

    return with_tokenizer(tiny_zoo.artifact("smollm3"), tmp_path_factory.mktemp("tied") / "src")


def test_split_head_keeps_the_float_model(tied_src, tmp_path):
    """Splitting the tied head and table by vocabulary rows (vocab_split.py) is exact on the
    float graph: ids on both sides of the split embed and score as before."""
    from specport.passes.quant.vocab_split import split_tied_head

    m = read_manifest(tied_src)
    model = ir.load(tied_src / m.model_file)
    split = split_tied_head(model, 100)
    assert (split.rows, split.vocab) == (100, 256)
    out = tmp_path / "split"
    shutil.copytree(tied_src, out)
    (out / m.model_file).unlink()
    (out / DATA_NAME).unlink(missing_ok=True)
    ir.save(model, out / m.model_file, external_data=DATA_NAME)
    write_artifact_manifest(out, m)
    kw = {"prompt_ids": [1, 40, 99, 100, 200, 255], "max_new_tokens": 24, "greedy": True}
    kw["ignore_eos"] = True
    assert load(out).generate(**kw).tokens == load(tied_src).generate(**kw).tokens


@pytest.mark.parametrize("rows", [64, None], ids=["given", "planned"])
def test_frequent_head_rows_stay_8_bit_within_the_budget(tied_src, calib_text, tmp_path, rows):
    """`frequent_head_rows`: the first ids of the tied head (and the table that gathers from
    its codes) are 8-bit, the rest planned; given, or chosen by the planner (the default under
    a budget; the calibration text uses the tiny vocabulary's first ids, so splitting pays).
    The file stays within the budget and decodes like its own dequantized reference (int8
    activations round where the float reference does not, so greedy paths may part after a
    while: the first 12 tokens are compared)."""
    out = tmp_path / "q"
    m = quantize(
        tied_src,
        out,
        scheme="w4a8",
        calib_files=[calib_text],
        bits_per_weight=6.5,
        frequent_head_rows=rows,
    )
    assert m.quant["size"]["bits_per_weight"] <= 6.5
    plan = next(p for p in m.passes if p.get("name") == "plan_bit_budget")
    heads = {name: t for name, t in plan["tensors"].items() if t["kind"] == "head+table"}
    split = next(p for p in m.passes if p.get("name") == "split_tied_head")
    ((_, head),) = heads.items()  # one planner path: a given N is its only split offered
    assert 0 < head["frequent_rows"] == split["frequent_rows"] < 256
    if rows:
        assert head["frequent_rows"] == rows
    assert (head["frequent_bits"], head["bits"]) == (8, 4)
    assert m.quant["lm_head"]["choice"] == ("given" if rows else "planned")
    wide = [n for n in ir.load(out / m.model_file).graph if n.op_type == "MatMulNBits"]
    assert {n.attributes.get_int("bits") for n in wide if "frequent" in n.name} == {8}
    table = next(p for p in m.passes if p.get("name") == "quantize_embedding")
    assert all(row["shared_with"].endswith("MatMulNBits") for row in table["layers"].values())
    ref = _reference(out, tmp_path / "ref")
    kw = {"prompt_ids": [1, 40, 63, 64, 200, 255], "max_new_tokens": 12, "greedy": True}
    kw["ignore_eos"] = True
    assert load(out).generate(**kw).tokens == load(ref).generate(**kw).tokens


def test_frequent_head_rows_without_a_budget(tied_src, tmp_path):
    """Outside a budget (no calibration: hqq), the split head's first ids are 8-bit and the
    rest 4-bit, recorded in the manifest; the file decodes like its own dequantized
    reference."""
    out = tmp_path / "q"
    m = quantize(tied_src, out, scheme="w4a8", frequent_head_rows=64)
    assert m.quant["lm_head"] == {
        "choice": "given",
        "bits": 4,
        "frequent_rows": 64,
        "frequent_bits": 8,
        "reason": "its first 64 rows (the most frequent ids) at 8 bits",
    }
    heads = {
        n.name: n.attributes.get_int("bits")
        for n in ir.load(out / m.model_file).graph
        if n.op_type == "MatMulNBits" and ("frequent" in n.name or "rare" in n.name)
    }
    assert sorted(heads.values()) == [4, 8]
    assert all(b == (8 if "frequent" in name else 4) for name, b in heads.items())
    ref = _reference(out, tmp_path / "ref")
    kw = {"prompt_ids": [1, 40, 63, 64, 200, 255], "max_new_tokens": 12, "greedy": True}
    kw["ignore_eos"] = True
    assert load(out).generate(**kw).tokens == load(ref).generate(**kw).tokens


def test_frequent_head_rows_refused_before_work(quant_src, tied_src, tmp_path):
    with pytest.raises(QuantizationError, match="frequent_head_rows"):
        quantize(tied_src, tmp_path / "a", scheme="w4a8", frequent_head_rows=64, lm_head_bits=8)
    with pytest.raises(QuantizationError, match="frequent_head_rows"):
        quantize(
            tied_src, tmp_path / "b", scheme="w4a16", bits_per_weight=6.0, frequent_head_rows=8
        )
    with pytest.raises(QuantizationError, match="tied LM head"):
        quantize(
            quant_src, tmp_path / "c", scheme="w4a8", bits_per_weight=6.0, frequent_head_rows=8
        )
    with pytest.raises(QuantizationError, match="vocabulary size"):
        quantize(
            tied_src, tmp_path / "d", scheme="w4a8", bits_per_weight=6.0, frequent_head_rows=256
        )
    with pytest.raises(QuantizationError, match="first 200 rows 8-bit as asked"):
        quantize(
            tied_src, tmp_path / "e", scheme="w4a8", bits_per_weight=4.0, frequent_head_rows=200
        )
    assert not any((tmp_path / n).exists() for n in "abcde")
