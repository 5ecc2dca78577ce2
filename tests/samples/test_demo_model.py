"""The demo model: a tiny training run gives a loadable HF directory, cached and reused."""

from __future__ import annotations

import json

import pytest
import torch

from specport.samples.demo_model import (
    DEMO_PROMPT,
    REQUIRED_FILES,
    demo_model_dir,
    ensure_demo_model,
)
from specport.samples.trainer import DemoTrainConfig

TINY = DemoTrainConfig(
    hidden_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    n_docs=400,
    batch_size=4,
    seq_len=64,
    max_steps=4,
    warmup_steps=2,
    time_budget_s=20.0,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPORT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tiny_training_gives_loadable_hf_dir(cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_demo_model(progress=False, config=TINY)
    assert path == demo_model_dir() == cache / "demo-model-v1"
    for name in REQUIRED_FILES:
        assert (path / name).is_file(), name
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp dirs left
    info = json.loads((path / "demo_train.json").read_text())
    assert info["steps"] == TINY.max_steps

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (1, 2, 1)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 3)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
    ids = tok(DEMO_PROMPT).input_ids
    assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == DEMO_PROMPT
    # Byte fallback: characters never seen in training still round-trip.
    odd = "Zoë paid 5€ 😀"
    assert tok.decode(tok(odd).input_ids, skip_special_tokens=True) == odd
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=5)
    assert out.shape == (1, len(ids) + 5)


def test_cached_model_is_reused_and_force_retrains(cache):
    path = ensure_demo_model(progress=False, config=TINY)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(progress=False, config=TINY) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    ensure_demo_model(progress=False, force=True, config=TINY)
    assert (path / "model.safetensors").stat().st_mtime_ns != stamp


def test_partial_dir_is_rebuilt(cache):
    partial = demo_model_dir()
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    path = ensure_demo_model(progress=False, config=TINY)
    assert all((path / name).is_file() for name in REQUIRED_FILES)


@pytest.mark.slow
def test_full_demo_training_writes_english(cache):
    """The default budget (~90 s on 2 idle cores) gives a low loss and varied sentences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_demo_model(progress=False)
    info = json.loads((path / "demo_train.json").read_text())
    assert info["final_loss"] < 1.2, info
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(DEMO_PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=40)[0, ids.shape[1] :].tolist()
    assert len(set(out)) > 10  # not one repeated token
    text = tok.decode(out, skip_special_tokens=True)
    assert text.count(".") >= 2 and any(w in text.split() for w in ("was", "the", "a")), text
