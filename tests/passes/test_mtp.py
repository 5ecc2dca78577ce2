"""InsertMTPBranchPass: the spliced graph matches the torch MTPBranch and keeps the decoder intact."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from specport.core.errors import PassError
from specport.passes.mtp import BRANCH_OUTPUTS, InsertMTPBranchPass, find_lm_head_input

pytestmark = pytest.mark.slow  # exports a tiny decoder and an MTP branch (~10-30 s)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from specport.exporter import source as src_mod
    from specport.exporter.mtp_heads import MTPHeads, export_branch
    from tests.export_cache import cached_export
    from tests.fixtures import build_tiny_model

    tmp = tmp_path_factory.mktemp("mtp_pass")
    src = build_tiny_model("llama", tmp / "src")
    cached_export(src, tmp / "art", fuse=False, skip_verify=True, progress=False)
    base = src_mod.load_model(src_mod.resolve(src))
    torch.manual_seed(0)
    heads = MTPHeads(base, 2).eval()
    return tmp / "art" / "model.onnx", base, heads, export_branch(heads, base.config.vocab_size)


def llama_logits(base, ids: np.ndarray) -> torch.Tensor:
    return base.lm_head(base.model(input_ids=torch.tensor(ids)).last_hidden_state)


def _feeds(ids: np.ndarray, layers: int = 2) -> dict[str, np.ndarray]:
    s = ids.shape[1]
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((ids.shape[0], s), np.int64),
        "position_ids": np.tile(np.arange(s), (ids.shape[0], 1)),
    }
    for i in range(layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((ids.shape[0], 2, 0, 16), np.float32)
    return feeds


def test_branch_matches_torch_and_keeps_logits(parts, tmp_path):
    import onnxruntime as ort

    from specport.exporter.mtp_heads import MTPBranch

    path, base, heads, branch = parts
    model = ir.load(str(path))
    assert find_lm_head_input(model).shape[-1] == base.config.hidden_size
    result = InsertMTPBranchPass(branch)(model)
    assert result.modified and result.report["outputs"] == list(BRANCH_OUTPUTS)
    ir.save(model, tmp_path / "m.onnx", external_data="m.onnx.data")
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    assert names[-3:] == list(BRANCH_OUTPUTS)
    rng = np.random.default_rng(0)
    for s in (1, 2, 4):
        ids = rng.integers(3, 256, size=(2, s))
        for j in range(1, s):  # row 0 is the greedy continuation: every draft is accepted
            with torch.no_grad():
                logits = llama_logits(base, ids[:1, :j])
            ids[0, j] = int(logits[0, -1].argmax())
        with torch.no_grad():
            hidden = base.model(input_ids=torch.tensor(ids)).last_hidden_state
            want = MTPBranch(heads, fold=True)(hidden, base.lm_head(hidden), torch.tensor(ids))
        got = dict(zip(names, sess.run(None, _feeds(ids))))
        assert got["mtp_accepted"].tolist() == want[0].tolist()
        assert got["mtp_accepted"][0] == s - 1
        assert got["mtp_bonus"].tolist() == want[1].tolist()
        assert got["mtp_drafts"].tolist() == want[2].tolist() and got["mtp_drafts"].shape == (2, 2)
        ref = plain.run(["logits"], _feeds(ids))[0]
        np.testing.assert_allclose(got["logits"], ref, atol=1e-5)


def test_skips_when_already_applied_and_fails_without_lm_head(parts):
    path, _, heads, _ = parts
    from specport.exporter.mtp_heads import export_branch

    model = ir.load(str(path))
    InsertMTPBranchPass(export_branch(heads, 256))(model)
    again = InsertMTPBranchPass(export_branch(heads, 256))(model)
    assert not again.modified and "already" in again.report["skipped"]

    # A graph whose logits come straight from an input has no LM head to hook onto.
    x = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1, 1]))
    node = ir.Node("", "Identity", [x], num_outputs=1)
    node.outputs[0].name = "logits"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 23})
    with pytest.raises(PassError, match="LM head"):
        find_lm_head_input(ir.Model(graph, ir_version=10))
