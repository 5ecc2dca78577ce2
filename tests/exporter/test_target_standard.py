"""--target standard: a graph of ai.onnx ops only that decodes token-exactly like transformers.

Every registry architecture (tiny random models, tests/fixtures.py) is exported for the
standard target and must (1) hold no specport, com.microsoft or other custom-domain node and
no local function, (2) verify against PyTorch at export, and (3) greedy-decode the same tokens
as transformers' own `generate` on onnxruntime's CPU provider, alone and in a padded batch.
Llama is in the quick set; the other families are `slow`. The shared SmolLM2 GGUF is checked
against the transformers ids recorded in shared/README.md (slow).

OpenVINO runs the same artifacts: its onnxruntime execution provider when a plugin device
exists (Intel hardware), and its own runtime reading the ONNX file when `openvino` is
importable here or in SPECPORT_OPENVINO_PYTHON; otherwise those tests skip and say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import specport
from specport.exporter.registry import supported
from tests.fixtures import LONG_PROMPT, SHORT_PROMPT, VARIANT_CONFIGS, hf_greedy

NEW_TOKENS = 16
QUICK = {"llama"}
ROOT = Path(__file__).resolve().parents[2]


def _params() -> list:
    names = [*supported(), *sorted(VARIANT_CONFIGS)]
    return [pytest.param(n, marks=[] if n in QUICK else [pytest.mark.slow], id=n) for n in names]


def export_standard(source: Path, out: Path, **kwargs) -> Path:
    from tests.export_cache import cached_export

    cached_export(source, out, target="standard", progress=False, **kwargs)
    return out


def assert_ai_onnx_only(artifact: Path) -> None:
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    custom = sorted({f"{n.domain}.{n.op_type}" for n in model.graph.node if n.domain})
    assert not custom, f"non-standard ops in a --target standard graph: {custom}"
    assert not model.functions, [f.name for f in model.functions]
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}


@pytest.mark.parametrize("model_type", _params())
def test_standard_target_is_ai_onnx_only_and_token_exact(tiny_zoo, tmp_path, model_type):
    artifact = export_standard(tiny_zoo.source(model_type), tmp_path / "std")
    manifest = json.loads((artifact / "specport.json").read_text())
    assert manifest["target"] == "standard"
    assert manifest["kv"]["layout"] == "concat"
    assert manifest["verify"]["ok"], manifest["verify"]
    assert_ai_onnx_only(artifact)

    ref = tiny_zoo.reference(model_type)
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in (SHORT_PROMPT, LONG_PROMPT)]
    model = specport.load(artifact, provider="cpu")
    single = [
        model.generate(prompt_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens
        for p in (SHORT_PROMPT, LONG_PROMPT)
    ]
    assert single == expected
    batch = model.generate_batch(
        prompt_ids=[SHORT_PROMPT, LONG_PROMPT], max_new_tokens=NEW_TOKENS, ignore_eos=True
    )
    assert [r.tokens for r in batch] == expected


def test_standard_lowering_ops(tiny_zoo, tmp_path):
    """RMSNormalization-23 and RotaryEmbedding-23 carry the norms and rotary; attention is
    MatMul/Softmax by default (OpenVINO cannot run grouped Attention-23) and Attention-23 with
    decompose=() (what --target qnn ships)."""
    from specport.passes.pipelines import optimize_model

    artifact = export_standard(tiny_zoo.source("llama"), tmp_path / "std")
    ops = {n.op_type for n in onnx.load(str(artifact / "model.onnx")).graph.node}
    assert {"RMSNormalization", "RotaryEmbedding", "Softmax"} <= ops and "Attention" not in ops
    neutral = export_neutral(tiny_zoo.source("llama"), tmp_path / "neutral")
    model, _ = optimize_model(neutral / "model.onnx", target="standard", decompose=())
    assert "Attention" in {n.op_type for n in model.graph}
    assert all(not n.domain for n in model.graph)


def export_neutral(source: Path, out: Path) -> Path:
    from tests.export_cache import cached_export

    cached_export(source, out, target="neutral", kv_layout="concat", progress=False)
    return out


# transformers' greedy ids for SmolLM2's haiku chat (shared/README.md, fp32 from the GGUF)
HAIKU_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
                7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 19161, 253, 421, 30614, 563,
                260, 3426, 30, 2, 198, 1, 520, 9531, 198]  # fmt: skip
HAIKU_IDS = [504, 6147, 282, 260, 3426, 28, 253, 13879, 6122, 28, 198, 49, 9154, 303, 5082,
             282, 260, 10393, 28, 198, 49, 13151, 282, 260, 6122, 338, 5721, 8823, 28, 198, 49,
             13151, 282, 260, 5065, 506, 1149, 30, 2]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_standard(shared_path, tmp_path_factory) -> Path:
    gguf = shared_path("models", "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    return export_standard(gguf, tmp_path_factory.mktemp("smollm2") / "std", skip_verify=True)


# The standard target on SmolLM2 (every architecture is covered on tiny models, on onnxruntime
# and on OpenVINO's runtime) costs a SmolLM2 export, ~3-4 minutes of a worker on 2 cores.
LONG = pytest.mark.skipif(
    os.environ.get("SPECPORT_LONG_TESTS") != "1",
    reason="the standard target on SmolLM2 takes ~4 minutes on 2 cores (a SmolLM2 export); "
    "set SPECPORT_LONG_TESTS=1 to run it",
)


@pytest.mark.slow
@LONG
def test_smollm2_standard_matches_transformers(smollm2_standard):
    assert_ai_onnx_only(smollm2_standard)
    model = specport.load(smollm2_standard, provider="cpu")
    out = model.generate(prompt_ids=HAIKU_PROMPT, max_new_tokens=len(HAIKU_IDS), ignore_eos=True)
    assert out.tokens == HAIKU_IDS


# ---- OpenVINO ----------------------------------------------------------------------------
# Two ways in: onnxruntime's OpenVINO execution provider (the onnxruntime-ep-openvino plugin,
# which offers Intel devices only, or the onnxruntime-openvino build, which replaces onnxruntime
# and so lives in another environment), and OpenVINO's own runtime reading the ONNX file. The
# runtime test uses `import openvino` here, or the interpreter named by SPECPORT_OPENVINO_PYTHON
# (running scripts/greedy_onnxruntime.py, which needs no specport).


def openvino_ep_in_process() -> bool:
    from specport.runtime import providers

    try:
        providers.resolve("openvino")
    except Exception:
        return False
    return True


def openvino_runtime_runner() -> list[str] | None:
    try:
        import openvino  # noqa: F401
    except ImportError:
        python = os.environ.get("SPECPORT_OPENVINO_PYTHON")
        return [python] if python else None
    return [sys.executable]


EP_SKIP = (
    "no OpenVINO execution provider device here: the onnxruntime-ep-openvino plugin offers "
    "Intel CPUs/GPUs/NPUs only (pip install specport[openvino] on an Intel machine)"
)
RUNTIME_SKIP = (
    "OpenVINO is not installed: pip install openvino, or point SPECPORT_OPENVINO_PYTHON at a "
    "python that has it (with numpy)"
)


def openvino_runtime_greedy(runner, artifact: Path, prompt: list[int], new: int) -> list[int]:
    cmd = [
        *runner,
        str(ROOT / "scripts" / "greedy_onnxruntime.py"),
        str(artifact),
        "--runtime=openvino",
        f"--prompt-ids={','.join(map(str, prompt))}",
        f"--new-tokens={new}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["provider"].startswith("openvino"), result
    return result["tokens"]


@pytest.mark.parametrize("model_type", _params())
def test_standard_target_on_the_openvino_provider(tiny_zoo, tmp_path, model_type):
    if not openvino_ep_in_process():
        pytest.skip(EP_SKIP)
    artifact = export_standard(tiny_zoo.source(model_type), tmp_path / "std")
    model = specport.load(artifact, provider="openvino")
    ref = tiny_zoo.reference(model_type)
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        expected = hf_greedy(ref, prompt, NEW_TOKENS)
        got = model.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert got.tokens == expected


@pytest.mark.parametrize("model_type", _params())
def test_standard_target_on_the_openvino_runtime(tiny_zoo, tmp_path, model_type):
    runner = openvino_runtime_runner()
    if runner is None:
        pytest.skip(RUNTIME_SKIP)
    artifact = export_standard(tiny_zoo.source(model_type), tmp_path / "std")
    ref = tiny_zoo.reference(model_type)
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        expected = hf_greedy(ref, prompt, NEW_TOKENS)
        assert openvino_runtime_greedy(runner, artifact, prompt, NEW_TOKENS) == expected


@pytest.mark.slow
@LONG
def test_smollm2_standard_on_the_openvino_runtime(smollm2_standard):
    runner = openvino_runtime_runner()
    if runner is None:
        pytest.skip(RUNTIME_SKIP)
    tokens = openvino_runtime_greedy(runner, smollm2_standard, HAIKU_PROMPT, len(HAIKU_IDS))
    assert tokens == HAIKU_IDS


def test_the_out_of_process_runner_needs_no_specport():
    text = (ROOT / "scripts" / "greedy_onnxruntime.py").read_text()
    assert "import specport" not in text and "from specport" not in text
