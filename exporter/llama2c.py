"""Import llama2.c checkpoints (`*.bin`) as Hugging Face `LlamaForCausalLM` models.

The exporter works on Hugging Face models only; llama2.c checkpoints are turned into one (plus a
`tokenizer.json`) so that they take exactly the same export, verification and runtime path.

Two checkpoint layouts exist:
- legacy (version 0): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  seq_len; vocab_size < 0 means an untied classifier), then fp32 tensors: token_embedding,
  rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_cis_real, freq_cis_imag, [wcls].
- version 1: magic "ak42", int32 version, the same 7 int32, uint8 shared_classifier, zero padding
  to 256 bytes, then fp32: rms_att, rms_ffn, rms_final, token_embedding, wq, wk, wv, wo, w1, w2,
  w3, [wcls].
llama2.c applies rotary embeddings to interleaved pairs (x0, x1), Hugging Face to halves
(x_i, x_{i+D/2}); q/k rows are permuted on import so both compute the same function.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specport.core.errors import InvalidModelError, ModelNotFoundError
from specport.exporter.sp_tokenizer import (
    build_sp_bpe_tokenizer,
    llama_tokenizer_config,
    read_llama2c_tokenizer,
    save_tokenizer,
)

logger = logging.getLogger(__name__)

# transformers 5 moves rope_theta into rope_parameters but still accepts it as a keyword.
_ROPE: dict[str, Any] = {"rope_theta": 10000.0}

MAGIC_V1 = 0x616B3432  # "ak42" read as a little-endian uint32
V1_HEADER_BYTES = 256
BOS_ID, EOS_ID = 1, 2
_MAX_DIM = 1 << 20


@dataclass(frozen=True)
class Llama2cHeader:
    """Hyper-parameters of a llama2.c checkpoint, plus where its weights start."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool
    version: int
    data_offset: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every fp32 tensor in file order; names are llama2.c's."""
        d, h, n, v = self.dim, self.hidden_dim, self.n_layers, self.vocab_size
        kv = self.n_kv_heads * self.head_dim
        linear = [
            ("wq", (n, d, d)),
            ("wk", (n, kv, d)),
            ("wv", (n, kv, d)),
            ("wo", (n, d, d)),
        ]
        ffn = [("w1", (n, h, d)), ("w2", (n, d, h)), ("w3", (n, h, d))]
        if self.version == 0:
            freq = self.seq_len * self.head_dim // 2
            shapes = [
                ("token_embedding", (v, d)),
                ("rms_att", (n, d)),
                *linear,
                ("rms_ffn", (n, d)),
                *ffn,
                ("rms_final", (d,)),
                ("freq_cis_real", (freq,)),
                ("freq_cis_imag", (freq,)),
            ]
        else:
            shapes = [
                ("rms_att", (n, d)),
                ("rms_ffn", (n, d)),
                ("rms_final", (d,)),
                ("token_embedding", (v, d)),
                *linear,
                *ffn,
            ]
        if not self.shared_classifier:
            shapes.append(("wcls", (v, d)))
        return shapes

    def expected_bytes(self) -> int:
        return self.data_offset + 4 * sum(int(np.prod(s)) for _, s in self.tensor_shapes())


def read_header(path: Path) -> Llama2cHeader:
    """Parse and sanity-check the header of a llama2.c checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(
            f"llama2.c checkpoint {path} not found: pass the path of a llama2.c .bin file."
        )
    with path.open("rb") as f:
        head = f.read(V1_HEADER_BYTES)
    if len(head) < 28:
        raise InvalidModelError(
            f"llama2.c checkpoint {path} is only {len(head)} bytes: the file is truncated."
        )
    (magic,) = struct.unpack_from("<I", head, 0)
    if magic == MAGIC_V1:
        if len(head) < V1_HEADER_BYTES:
            raise InvalidModelError(f"llama2.c checkpoint {path}: header truncated.")
        (version,) = struct.unpack_from("<i", head, 4)
        if version != 1:
            raise InvalidModelError(
                f"llama2.c checkpoint {path} is format version {version}; only the legacy and "
                "fp32 version-1 formats are supported (re-export with `export.py --version 1`)."
            )
        params = struct.unpack_from("<7i", head, 8)
        shared = bool(head[36])
        offset = V1_HEADER_BYTES
    else:
        version = 0
        params = struct.unpack_from("<7i", head, 0)
        shared = params[5] > 0
        offset = 28
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = params
    vocab_size = abs(vocab_size)
    problems = []
    if not all(
        0 < x < _MAX_DIM
        for x in (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)
    ):
        problems.append("a size is zero, negative or absurdly large")
    elif dim % n_heads or (dim // n_heads) % 2:
        problems.append(f"dim {dim} is not n_heads {n_heads} x an even head size")
    elif n_heads % n_kv_heads:
        problems.append(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    if problems:
        raise InvalidModelError(
            f"llama2.c checkpoint {path} has a bad header {params}: {problems[0]}. "
            "Is this a llama2.c model .bin (not a tokenizer or another format)?"
        )
    return Llama2cHeader(
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len, shared, version, offset
    )


def _permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows from interleaved rotary pairs to rotate-half. w: [H*Dh, D]."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def read_llama2c_state_dict(path: Path) -> tuple[Llama2cHeader, dict[str, torch.Tensor]]:
    """Read a llama2.c checkpoint into a Hugging Face Llama state dict (fp32)."""
    header = read_header(path)
    size = Path(path).stat().st_size
    expected = header.expected_bytes()
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise InvalidModelError(
            f"llama2.c checkpoint {path} is {what}: {size} bytes, header "
            f"(dim={header.dim}, layers={header.n_layers}, vocab={header.vocab_size}) needs "
            f"{expected}. Re-download or re-export the checkpoint."
        )
    flat = np.fromfile(path, dtype="<f4", offset=header.data_offset)
    raw: dict[str, torch.Tensor] = {}
    pos = 0
    for name, shape in header.tensor_shapes():
        count = int(np.prod(shape))
        raw[name] = torch.from_numpy(flat[pos : pos + count].reshape(shape).copy())
        pos += count

    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": raw["token_embedding"],
        "model.norm.weight": raw["rms_final"],
    }
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = raw["rms_att"][i]
        sd[p + "post_attention_layernorm.weight"] = raw["rms_ffn"][i]
        sd[p + "self_attn.q_proj.weight"] = _permute_rotary(raw["wq"][i], header.n_heads)
        sd[p + "self_attn.k_proj.weight"] = _permute_rotary(raw["wk"][i], header.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = raw["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = raw["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = raw["w1"][i]
        sd[p + "mlp.down_proj.weight"] = raw["w2"][i]
        sd[p + "mlp.up_proj.weight"] = raw["w3"][i]
    sd["lm_head.weight"] = raw["token_embedding"] if header.shared_classifier else raw["wcls"]
    return header, sd


def llama2c_config(header: Llama2cHeader) -> LlamaConfig:
    """The Hugging Face config of a llama2.c model (llama2.c hard-codes eps 1e-5, theta 1e4)."""
    return LlamaConfig(
        hidden_size=header.dim,
        intermediate_size=header.hidden_dim,
        num_hidden_layers=header.n_layers,
        num_attention_heads=header.n_heads,
        num_key_value_heads=header.n_kv_heads,
        head_dim=header.head_dim,
        vocab_size=header.vocab_size,
        max_position_embeddings=header.seq_len,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        **_ROPE,
        tie_word_embeddings=header.shared_classifier,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        attention_bias=False,
        mlp_bias=False,
        dtype="float32",
    )


def find_llama2c_tokenizer(checkpoint: Path) -> Path | None:
    """The tokenizer that sits next to a checkpoint (`tokenizer.bin` or a single `tok*.bin`)."""
    folder = Path(checkpoint).parent
    if (folder / "tokenizer.bin").is_file():
        return folder / "tokenizer.bin"
    candidates = sorted(p for p in folder.glob("tok*.bin") if p != Path(checkpoint))
    return candidates[0] if len(candidates) == 1 else None


def load_llama2c(
    checkpoint: Path, tokenizer: Path | None
) -> tuple[LlamaForCausalLM, Tokenizer | None, dict]:
    """Load a llama2.c checkpoint (and its `tok*.bin`) as a HF model, tokenizer and tokenizer config.

    `tokenizer=None` looks for `tokenizer.bin` / a single `tok*.bin` next to the checkpoint and
    returns no tokenizer when there is none. The dict is the `tokenizer_config.json` content.
    """
    checkpoint = Path(checkpoint)
    header, sd = read_llama2c_state_dict(checkpoint)
    config = llama2c_config(header)
    model = LlamaForCausalLM(config)
    if header.shared_classifier:
        sd.pop("lm_head.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (header.shared_classifier and k == "lm_head.weight")]
    if missing or unexpected:
        raise InvalidModelError(
            f"llama2.c import of {checkpoint} does not match LlamaForCausalLM "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); this is a specport bug."
        )
    model.tie_weights()
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    logger.info(
        "imported llama2.c v%d checkpoint %s: dim %d, %d layers, %d/%d heads, vocab %d",
        header.version,
        checkpoint,
        header.dim,
        header.n_layers,
        header.n_heads,
        header.n_kv_heads,
        header.vocab_size,
    )

    tok_path = Path(tokenizer) if tokenizer is not None else find_llama2c_tokenizer(checkpoint)
    if tok_path is None:
        logger.warning(
            "no llama2.c tokenizer found next to %s; importing the model only", checkpoint
        )
        return model, None, {}
    pieces = read_llama2c_tokenizer(tok_path)
    if len(pieces) != header.vocab_size:
        raise InvalidModelError(
            f"tokenizer {tok_path} has {len(pieces)} tokens but checkpoint {checkpoint} has a "
            f"vocab of {header.vocab_size}: pass the tokenizer the model was trained with."
        )
    tok = build_sp_bpe_tokenizer([p for p, _ in pieces], [s for _, s in pieces])
    return model, tok, llama_tokenizer_config(tok, model_max_length=header.seq_len)


def _save_without_bar(model: Any, out_dir: Path) -> None:
    """save_pretrained without transformers' "Writing model shards" bar: the conversion is part
    of specport's "resolving source model" stage, and `-q` and log files must stay free of it."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def save_llama2c_as_hf(checkpoint: Path, tokenizer: Path | None, out_dir: Path) -> Path:
    """Convert a llama2.c checkpoint into a regular Hugging Face model directory.

    Writes config.json, model.safetensors, generation_config.json and, when a tokenizer is found,
    tokenizer.json, tokenizer_config.json and special_tokens_map.json. Returns `out_dir`.
    """
    model, tok, tok_config = load_llama2c(checkpoint, tokenizer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_without_bar(model, out_dir)
    if not (out_dir / "generation_config.json").is_file():
        (out_dir / "generation_config.json").write_text(
            json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, indent=2) + "\n"
        )
    if tok is not None:
        save_tokenizer(tok, tok_config, out_dir)
    logger.info("wrote Hugging Face model for %s to %s", checkpoint, out_dir)
    return out_dir
