"""A config that disagrees with its weights is blamed on the config, by field and value.

What users rely on: `specport export` of a model directory whose config.json has a field
removed or changed names that field and the value the weight files imply, before any weight is
loaded (no "re-download the model" for weights that are fine); a truncated weight file is still
blamed on the file; a GGUF file whose metadata disagrees with its own tensors names the key.
Models are built here (tiny random Llama, saved with save_pretrained; GGUF via gguf's writer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specport.cli import main
from tests.gguf_files import random_model, tiny_config

SMALL = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("good") / "model"
    random_model(tiny_config("llama", 128, **SMALL)).save_pretrained(str(d))
    return d


def _variant(good: Path, tmp_path: Path, edit) -> Path:
    import shutil

    d = tmp_path / "model"
    shutil.copytree(good, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _export_error(d: Path, tmp_path: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["export", str(d), "--out", str(tmp_path / "out")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and not (tmp_path / "out").exists()
    return err[0]


@pytest.mark.parametrize(
    "edit, field, implied, said",
    [
        (lambda c: c.pop("hidden_size"), "hidden_size", 64, "has no hidden_size, so transformers"),
        (lambda c: c.update(intermediate_size=128), "intermediate_size", 96, "= 128"),
        (lambda c: c.update(num_key_value_heads=4), "num_key_value_heads", 2, "= 4"),
        (lambda c: c.update(head_dim=32), "head_dim", 16, "= 32"),
        (lambda c: c.update(vocab_size=256), "vocab_size", 128, "= 256"),
        (lambda c: c.update(num_hidden_layers=3), "num_hidden_layers", 2, "= 3"),
    ],
)
def test_the_config_field_is_named_not_the_weights(
    good_dir, tmp_path, capsys, edit, field, implied, said
):
    err = _export_error(_variant(good_dir, tmp_path, edit), tmp_path, capsys)
    assert f"{field} {said}" in err or said in err, err
    assert f'"{field}": {implied}' in err, err
    assert "weight files are fine" in err and "re-download" not in err


def test_a_truncated_weight_file_is_still_blamed_on_the_file(good_dir, tmp_path, capsys):
    d = _variant(good_dir, tmp_path, lambda c: None)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    err = _export_error(d, tmp_path, capsys)
    assert "shorter than its header says" in err and "re-download" in err


def test_a_config_that_matches_passes_silently(good_dir):
    from transformers import AutoConfig

    from specport.exporter.config_check import check_config_against_weights

    config = AutoConfig.from_pretrained(str(good_dir))
    check_config_against_weights(good_dir, config, "num_hidden_layers", {})


@pytest.mark.parametrize(
    "attr, value, key, implied",
    [
        ("intermediate_size", 128, "llama.feed_forward_length", 96),
        ("num_key_value_heads", 4, "llama.attention.head_count_kv", 2),
    ],
)
def test_gguf_metadata_that_disagrees_with_its_tensors(tmp_path, attr, value, key, implied):
    from specport.core.errors import InvalidModelError
    from specport.exporter.gguf_import import save_gguf_as_hf
    from tests.gguf_files import llama_vocab, write_gguf

    model = random_model(tiny_config("llama", 400, **SMALL))
    path = tmp_path / "bad.gguf"
    setattr(model.config, attr, value)  # the metadata says `value`, the tensors keep theirs
    write_gguf(model, llama_vocab(), path)
    with pytest.raises(InvalidModelError) as e:
        save_gguf_as_hf(path, tmp_path / "hf")
    assert f"metadata {key} is {value}" in str(e.value) and f"implies {implied}" in str(e.value)
