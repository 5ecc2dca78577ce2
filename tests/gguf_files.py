"""Tiny GGUF files written the way llama.cpp's converter writes them (no downloads, no llama.cpp).

A random-weight Hugging Face model is built from a config, then written with gguf's own
`GGUFWriter`: llama.cpp's tensor names, q/k rows permuted into interleaved rotary pairs (Llama
family), Gemma's norms stored as 1 + w, 1-D tensors in F32, matrices in the requested type
(gguf.quants.quantize; the K-quants, which gguf cannot quantize in Python, get random valid
blocks). The tokenizer is either byte-level BPE (`gpt2`, trained here on a few sentences) or a
SentencePiece-style vocabulary (`llama`: pieces with scores and byte fallback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
CORPUS = [
    "Once upon a time there was a little girl named Lily. She loved to play outside.",
    "The capital of France is Paris. The sea is wide and blue, and the waves are loud.",
    "héllo wörld, naïve café! 日本語 text and emoji 🤗 sit next to    runs of spaces.\n\tTabs too.",
    "def f(x):\n    return x * 2  # code, numbers 12345 and symbols <>{}[]()",
]
# bytes per 256-value block, and where its fp16 super-block scales sit: (offset, value) pairs
K_BLOCK = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
K_SCALES = {
    "Q2_K": [(80, 2e-3), (82, 2e-3)],  # scales, qs, d, dmin
    "Q3_K": [(108, 8e-4)],  # hmask, qs, scales, d
    "Q4_K": [(0, 1e-4), (2, 1e-3)],  # d, dmin, scales, qs
    "Q5_K": [(0, 5e-5), (2, 1e-3)],  # d, dmin, scales, qh, qs
    "Q6_K": [(208, 1e-5)],  # ql, qh, int8 scales, d
}
K_QUANTS = set(K_BLOCK)


def gpt2_vocab(size: int = 384) -> dict[str, Any]:
    """A byte-level BPE vocabulary (tokens, merges, types) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    state = tok.to_str()
    import json

    model = json.loads(state)["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    return {
        "model": "gpt2",
        "tokens": tokens,
        "merges": merges,
        "types": types,
        "bos": 1,
        "eos": 2,
        "pad": 0,
        "add_bos": False,
    }


def llama_vocab(size: int = 400) -> dict[str, Any]:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte pieces, then scored pieces."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS * 4, vocab_size=size, show_progress=False)
    pieces = [
        p
        for p, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])
        if not p.startswith("<")
    ]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{i:02X}>" for i in range(256)]]
    seen = set(tokens)
    pieces = [p for p in pieces if p not in seen]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    return {
        "model": "llama",
        "tokens": tokens + pieces,
        "scores": scores,
        "types": types,
        "bos": 1,
        "eos": 2,
        "add_bos": True,
    }


def tiny_config(model_type: str, vocab: int, **over: Any) -> Any:
    """hidden 256 / intermediate 512 so every matrix row is a whole number of 256-wide K-blocks."""
    from transformers import AutoConfig

    base: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 256,
        "initializer_range": 0.1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    if model_type == "gemma":
        base.update(num_key_value_heads=1, tie_word_embeddings=True, initializer_range=0.3)
    base.update(over)
    return AutoConfig.for_model(model_type, **base)


def random_model(config: Any, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norm weights, so a wrong (1 + w) or a dropped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (rotate-half -> interleaved rotary pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _random_k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks, with fp16 super-block scales sized for weights ~0.05."""
    nb = cols // 256
    raw = rng.integers(0, 256, size=(rows, nb, K_BLOCK[qtype]), dtype=np.uint8)
    for offset, value in K_SCALES[qtype]:
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return raw.reshape(rows, nb * K_BLOCK[qtype])


def write_gguf(
    model: Any,
    vocab: dict[str, Any],
    path: Path,
    qtype: str | dict[str, str] = "F32",
    arch: str | None = None,
    seed: int = 0,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `model` as a GGUF file the way llama.cpp's convert_hf_to_gguf.py lays it out.

    `qtype`: one type for every matrix, or {GGUF name fragment: type} (first match, else F32).
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = model.config
    mt = cfg.model_type
    arch = arch or {"mistral": "llama"}.get(mt, mt)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {mt}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(int(cfg.head_dim * getattr(cfg, "partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "pad" in vocab:
        w.add_pad_token_id(vocab["pad"])
    w.add_add_bos_token(vocab["add_bos"])
    w.add_chat_template(CHATML)

    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        gname = f"{table.get_name(base)}.{suffix}"
        arr = tensor.detach().float().numpy().copy()
        if arch in ("llama",) and gname.endswith(("attn_q.weight", "attn_q.bias")):
            arr = _permute(arr, cfg.num_attention_heads)
        if arch in ("llama",) and gname.endswith(("attn_k.weight", "attn_k.bias")):
            arr = _permute(arr, cfg.num_key_value_heads)
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            arr = arr + 1
        if isinstance(qtype, str):
            qt = qtype
        else:
            qt = next((v for k, v in qtype.items() if k in gname), "F32")
        if arr.ndim == 1 or qt == "F32":
            w.add_tensor(gname, arr.astype(np.float32))
        elif qt == "F16":
            w.add_tensor(gname, arr.astype(np.float16))
        elif qt in K_QUANTS:
            w.add_tensor(gname, _random_k_blocks(*arr.shape, qt, rng), raw_dtype=Q[qt])
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, Q[qt]), raw_dtype=Q[qt])
    for name, arr in (extra or {}).items():  # e.g. rope_freqs (Llama 3's rope scaling)
        w.add_tensor(name, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
