"""GGUF import: tiny GGUF files written like llama.cpp's converter writes them.

The import must compute what transformers' own GGUF loader computes from the same file (every
tensor type), what the original model computed (per architecture: q/k un-permuted, Gemma's
1 + w norms undone), and tokenize exactly like `AutoTokenizer.from_pretrained(..., gguf_file=)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="the gguf extra is not installed (pip install 'specport[gguf]')")

from specport.core.errors import InvalidModelError, UnsupportedArchitectureError
from specport.exporter.gguf_import import save_gguf_as_hf
from tests.gguf_files import gpt2_vocab, llama_vocab, random_model, tiny_config, write_gguf

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
TYPES += ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
IDS = [1, 40, 41, 200, 7, 99, 123, 64, 3, 18, 250, 5]
TEXTS = [
    "Once upon a time",
    "  leading and   inner   spaces\n\n\ttabs and\r\nnewlines  ",
    "héllo wörld — naïve café 日本語 🤗",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<s>Hello</s> world",
    "numbers 12345 and symbols <>{}[]()",
    " ",
]


def _hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _transformers_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _imported(path: Path, out: Path) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    report = save_gguf_as_hf(path, out, progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    return model, report


@pytest.fixture(scope="module")
def gpt2_tok() -> dict[str, Any]:
    return gpt2_vocab()


@pytest.mark.parametrize("qtype", TYPES)
def test_every_tensor_type_matches_transformers_gguf_loader(
    qtype: str, gpt2_tok: dict[str, Any], tmp_path: Path
) -> None:
    model = random_model(tiny_config("llama", len(gpt2_tok["tokens"])))
    path = write_gguf(model, gpt2_tok, tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
    ours, report = _imported(path, tmp_path / "hf")
    ref = _hf_logits(_transformers_gguf(path), IDS)
    got = _hf_logits(ours, IDS)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert report["tensor_types"][qtype if qtype != "F32" else "F32"] > 0
    if qtype in ("F32", "F16", "BF16"):
        assert report["kept_exactly"] == sorted({"F32", qtype})
        assert qtype not in report["converted"]
    else:
        assert "dequantized" in report["converted"][qtype]
    if qtype in ("F16", "BF16"):  # half-precision weights are copied, not widened
        header = _safetensors_header(tmp_path / "hf" / "model.safetensors")
        assert header["model.layers.0.mlp.up_proj.weight"]["dtype"] == qtype


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


ARCHS = {
    "llama": {},
    "mistral": {"sliding_window": 4},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "gemma": {},
}


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_architectures_reproduce_the_original_model(
    model_type: str, gpt2_tok: dict[str, Any], tmp_path: Path
) -> None:
    """An F32 file must give back the model it was written from (q/k order, norms, biases)."""
    config = tiny_config(model_type, len(gpt2_tok["tokens"]), **ARCHS[model_type])
    original = random_model(config)
    path = write_gguf(original, gpt2_tok, tmp_path / f"{model_type}.gguf")
    ours, report = _imported(path, tmp_path / "hf")
    assert ours.config.model_type == model_type
    assert report["model_type"] == model_type
    ref = _hf_logits(original, IDS)
    got = _hf_logits(ours, IDS)
    assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_matches_transformers_gguf_tokenizer(kind: str, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    vocab = gpt2_vocab() if kind == "gpt2" else llama_vocab()
    model = random_model(tiny_config("llama", len(vocab["tokens"])))
    path = write_gguf(model, vocab, tmp_path / "tok.gguf")
    save_gguf_as_hf(path, tmp_path / "hf", progress=False)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    ours = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))  # what the runtime reads
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=True).ids
        assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        ), text
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == ref.chat_template
    assert config["model_max_length"] == 256


def test_truncated_file_is_a_clear_error(gpt2_tok: dict[str, Any], tmp_path: Path) -> None:
    model = random_model(tiny_config("llama", len(gpt2_tok["tokens"])))
    path = write_gguf(model, gpt2_tok, tmp_path / "full.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InvalidModelError, match="truncated or corrupt"):
        save_gguf_as_hf(cut, tmp_path / "hf")


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "bloom")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="llama, mistral"):
        save_gguf_as_hf(tmp_path / "x.gguf", tmp_path / "hf")


@pytest.mark.slow
def test_cli_export_of_a_quantized_gguf_generates_like_transformers(
    gpt2_tok: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`specport export tiny.gguf`: ONNX logits and greedy tokens vs transformers on the file."""
    import specport
    from specport.cli import main
    from specport.core.chat_template import load_chat_template
    from specport.exporter.gguf_import import file_sha256

    model = random_model(tiny_config("llama", len(gpt2_tok["tokens"])))
    path = write_gguf(model, gpt2_tok, tmp_path / "tiny-q4k.gguf", qtype="Q4_K")
    out = tmp_path / "art"
    # concat: the logits check below runs the graph in a plain session; the source is given
    # relative to the working directory, as users type it
    monkeypatch.chdir(tmp_path)
    assert main(["export", path.name, "--out", str(out), "--kv-layout", "concat", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == "llama"

    manifest = json.loads((out / "specport.json").read_text())
    src = manifest["source"]
    assert src["kind"] == "gguf"
    assert src["path"] == str(path.resolve())  # found again from any directory
    assert f"| source | `{path.name}` (gguf" in (out / "README.md").read_text()
    assert src["gguf"]["sha256"] == file_sha256(path)
    assert src["gguf"]["tensor_types"] == {"F32": 5, "Q4_K": 16}
    assert src["gguf"]["kept_exactly"] == ["F32"]
    assert "Q4_K" in src["gguf"]["converted"]
    assert (out / "tokenizer.json").is_file()

    ref = _transformers_gguf(path)
    art = specport.load(out)
    feeds_ids = np.array([IDS], dtype=np.int64)
    got = _onnx_logits(art, feeds_ids, manifest)
    want = _hf_logits(ref, IDS)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())

    with torch.no_grad():
        hf_ids = ref.generate(
            torch.tensor([IDS]), max_new_tokens=16, do_sample=False, eos_token_id=None
        )[0, len(IDS) :].tolist()
    result = art.generate(prompt_ids=IDS, max_new_tokens=16, ignore_eos=True)
    assert result.tokens == hf_ids

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want_ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    template = load_chat_template(art)
    assert template is not None
    assert template.render_ids(messages) == list(want_ids)


def _onnx_logits(art: Any, ids: np.ndarray, manifest: dict[str, Any]) -> np.ndarray:
    kv = manifest["kv"]
    feeds: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(ids.shape[1])[None],
    }
    for (k, v), h, kd, vd in zip(kv["inputs"], kv["num_heads"], kv["key_dim"], kv["value_dim"]):
        feeds[k] = np.zeros((1, h, 0, kd), np.float32)
        feeds[v] = np.zeros((1, h, 0, vd), np.float32)
    return art.session.run(["logits"], feeds)[0][0]


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(
    gpt2_tok: dict[str, Any], tmp_path: Path
) -> None:
    """Llama 3.x files carry their rope scaling only as `rope_freqs` divisors."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specport.exporter.gguf_config import _llama3_divisors

    params = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = tiny_config("llama", 300, rope_theta=500000.0, rope_scaling=dict(params))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    base = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    divisors = _llama3_divisors(params, 500000.0, 64)  # what llama.cpp writes as rope_freqs
    assert np.allclose(base.numpy() / divisors, scaled.numpy(), rtol=1e-6)

    model = random_model(tiny_config("llama", len(gpt2_tok["tokens"]), rope_theta=500000.0))
    path = write_gguf(model, gpt2_tok, tmp_path / "l3.gguf", extra={"rope_freqs.weight": divisors})
    save_gguf_as_hf(path, tmp_path / "hf", progress=False)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_scaling"] == params
