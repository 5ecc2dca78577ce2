"""llama2.c import: the real stories260K checkpoint must reproduce the HF reference exactly."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from specport.core.errors import InvalidModelError, ModelNotFoundError
from specport.exporter.llama2c import (
    MAGIC_V1,
    load_llama2c,
    read_header,
    read_llama2c_state_dict,
    save_llama2c_as_hf,
)
from specport.exporter.sp_tokenizer import build_sp_bpe_tokenizer, read_llama2c_tokenizer

PROMPT_IDS = [1, 403, 407, 261, 378]  # "<s> Once upon a time"
REFERENCE_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high."
)


@pytest.fixture(scope="module")
def llama2c_files(shared_path: Callable[..., Path]) -> tuple[Path, Path]:
    return shared_path("models", "llama2c", "stories260K.bin"), shared_path(
        "models", "llama2c", "tok512.bin"
    )


@pytest.fixture(scope="module")
def hf_reference_dir(shared_path: Callable[..., Path]) -> Path:
    return shared_path("models", "stories260K")


@pytest.fixture(scope="module")
def converted_dir(llama2c_files, tmp_path_factory) -> Path:
    ckpt, tok = llama2c_files
    return save_llama2c_as_hf(ckpt, tok, tmp_path_factory.mktemp("stories260K_hf"))


def test_header_of_real_checkpoint(llama2c_files):
    header = read_header(llama2c_files[0])
    assert (header.dim, header.hidden_dim, header.n_layers) == (64, 172, 5)
    assert (header.n_heads, header.n_kv_heads, header.vocab_size, header.seq_len) == (
        8,
        4,
        512,
        512,
    )
    assert header.shared_classifier and header.version == 0
    assert header.expected_bytes() == llama2c_files[0].stat().st_size


def test_tokenizer_matches_hf_conversion(llama2c_files, hf_reference_dir, shared_path):
    pieces = read_llama2c_tokenizer(llama2c_files[1])
    ours = build_sp_bpe_tokenizer([p for p, _ in pieces], [s for _, s in pieces])
    ref = Tokenizer.from_file(str(hf_reference_dir / "tokenizer.json"))
    assert ours.get_vocab() == ref.get_vocab()
    text = shared_path("text", "tinystories_valid_dev.txt").read_text()[:100_000]
    odd = "Héllo wörld 😀\n\ttabs  and   spaces, “quotes” — ok?"
    for sample in (text, odd, "Once upon a time", " leading space", ""):
        ids = ours.encode(sample).ids
        assert ids == ref.encode(sample).ids
        assert ours.decode(ids) == ref.decode(ids)
        # Like SentencePiece, decoding drops the one leading space that encoding prepends.
        assert ours.decode(ids) == sample.removeprefix(" ")
    assert ours.encode("Once upon a time").ids == PROMPT_IDS


def test_converted_dir_greedy_matches_reference(converted_dir, hf_reference_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (converted_dir / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(converted_dir).eval()
    ref = AutoModelForCausalLM.from_pretrained(hf_reference_dir).eval()
    tok = AutoTokenizer.from_pretrained(converted_dir)
    assert tok("Once upon a time").input_ids == PROMPT_IDS
    ids = torch.tensor([PROMPT_IDS])
    out = model.generate(ids, do_sample=False, max_new_tokens=60)
    ref_out = ref.generate(ids, do_sample=False, max_new_tokens=60)
    assert out.tolist() == ref_out.tolist()
    assert tok.decode(out[0], skip_special_tokens=True).startswith(REFERENCE_TEXT)
    with torch.no_grad():
        diff = (model(out).logits - ref(out).logits).abs().max().item()
    assert diff < 1e-4


def test_load_without_tokenizer_path_finds_sibling(llama2c_files):
    model, tok, tok_config = load_llama2c(llama2c_files[0], None)
    assert tok is not None and tok_config["bos_token"] == "<s>"
    assert model.config.tie_word_embeddings and model.config.rms_norm_eps == 1e-5


# ---- synthetic checkpoints: formats and errors, no shared data needed ----

DIMS = (16, 24, 2, 4, 2, 32, 8)  # dim, hidden, layers, heads, kv heads, vocab, seq_len


def _tensors(rng: np.random.Generator, untied: bool) -> dict[str, np.ndarray]:
    d, h, n, heads, kvh, v, _s = DIMS
    kv = kvh * d // heads
    shapes = {
        "token_embedding": (v, d),
        "rms_att": (n, d),
        "wq": (n, d, d),
        "wk": (n, kv, d),
        "wv": (n, kv, d),
        "wo": (n, d, d),
        "rms_ffn": (n, d),
        "w1": (n, h, d),
        "w2": (n, d, h),
        "w3": (n, h, d),
        "rms_final": (d,),
    }
    out = {k: rng.standard_normal(sh).astype("<f4") for k, sh in shapes.items()}
    if untied:
        out["wcls"] = rng.standard_normal((v, d)).astype("<f4")
    return out


def _write_legacy(path: Path, t: dict[str, np.ndarray], untied: bool) -> Path:
    d, h, n, heads, kvh, v, s = DIMS
    freq = np.zeros(s * (d // heads) // 2, "<f4")
    order = [
        "token_embedding",
        "rms_att",
        "wq",
        "wk",
        "wv",
        "wo",
        "rms_ffn",
        "w1",
        "w2",
        "w3",
        "rms_final",
    ]
    with path.open("wb") as f:
        f.write(struct.pack("<7i", d, h, n, heads, kvh, -v if untied else v, s))
        for name in order:
            f.write(t[name].tobytes())
        f.write(freq.tobytes() * 2)
        if untied:
            f.write(t["wcls"].tobytes())
    return path


def _write_v1(path: Path, t: dict[str, np.ndarray], untied: bool, version: int = 1) -> Path:
    header = struct.pack("<Ii7iB", MAGIC_V1, version, *DIMS, 0 if untied else 1)
    order = [
        "rms_att",
        "rms_ffn",
        "rms_final",
        "token_embedding",
        "wq",
        "wk",
        "wv",
        "wo",
        "w1",
        "w2",
        "w3",
    ]
    with path.open("wb") as f:
        f.write(header.ljust(256, b"\0"))
        for name in order + (["wcls"] if untied else []):
            f.write(t[name].tobytes())
    return path


@pytest.mark.parametrize("untied", [False, True])
def test_legacy_and_v1_formats_agree(tmp_path, untied):
    t = _tensors(np.random.default_rng(0), untied)
    h0, sd0 = read_llama2c_state_dict(_write_legacy(tmp_path / "a.bin", t, untied))
    h1, sd1 = read_llama2c_state_dict(_write_v1(tmp_path / "b.bin", t, untied))
    assert (h0.version, h1.version) == (0, 1)
    assert h0.shared_classifier is h1.shared_classifier is (not untied)
    assert sd0.keys() == sd1.keys()
    for key in sd0:
        assert torch.equal(sd0[key], sd1[key]), key
    classifier = t["wcls"] if untied else t["token_embedding"]
    assert np.array_equal(sd0["lm_head.weight"].numpy(), classifier)
    # q rows are permuted (interleaved pairs -> halves), v rows are not.
    assert torch.equal(sd0["model.layers.1.self_attn.v_proj.weight"], torch.from_numpy(t["wv"][1]))
    assert torch.equal(
        sd0["model.layers.0.self_attn.q_proj.weight"][1], torch.from_numpy(t["wq"][0][2])
    )
    model, tok, _ = load_llama2c(tmp_path / "a.bin", None)
    assert tok is None and model.config.tie_word_embeddings is (not untied)


def test_conversion_draws_no_third_party_bar(tmp_path, capsys):
    """`specport export x.bin -q` prints no progress: transformers' save bar stays off."""
    t = _tensors(np.random.default_rng(0), untied=False)
    out = save_llama2c_as_hf(_write_legacy(tmp_path / "a.bin", t, False), None, tmp_path / "hf")
    assert (out / "model.safetensors").is_file()
    assert "Writing model shards" not in capsys.readouterr().err


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_llama2c(tmp_path / "nope.bin", None)


def test_truncated_checkpoint(tmp_path):
    path = _write_legacy(tmp_path / "m.bin", _tensors(np.random.default_rng(1), False), False)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(InvalidModelError, match="truncated"):
        load_llama2c(path, None)
    path.write_bytes(data[:10])
    with pytest.raises(InvalidModelError, match="truncated"):
        read_header(path)


def test_bad_header(tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(struct.pack("<7i", 64, 172, 5, 7, 4, 512, 512) + b"\0" * 64)
    with pytest.raises(InvalidModelError, match="bad header"):
        read_header(path)
    path.write_bytes(b"\xff" * 400)
    with pytest.raises(InvalidModelError, match="bad header"):
        read_header(path)
    path.write_bytes(struct.pack("<Ii7iB", MAGIC_V1, 2, *DIMS, 1).ljust(256, b"\0"))
    with pytest.raises(InvalidModelError, match="version 2"):
        read_header(path)


def test_tokenizer_vocab_mismatch(tmp_path, llama2c_files):
    path = _write_legacy(tmp_path / "m.bin", _tensors(np.random.default_rng(2), False), False)
    with pytest.raises(InvalidModelError, match="vocab"):
        load_llama2c(path, llama2c_files[1])


def test_truncated_tokenizer(tmp_path):
    path = tmp_path / "tok.bin"
    path.write_bytes(struct.pack("<ifi", 5, 0.0, 10) + b"abc")
    with pytest.raises(InvalidModelError, match="truncated"):
        read_llama2c_tokenizer(path)
    with pytest.raises(ModelNotFoundError):
        read_llama2c_tokenizer(tmp_path / "none.bin")
