"""Random-weight Llama models built from a config, for benchmarks and tests (no downloads).

    python -m specport.runtime.bench.model /tmp/llama32m          # the ~32M benchmark model
    python -m specport.runtime.bench.model /tmp/tiny --tiny       # 2 layers, hidden 64

A byte-level tokenizer (256 byte tokens + <unk>/<s>/</s>) is written next to the weights, since
onnxruntime-genai's builder and the artifact both want one; ids past it are valid model ids that
simply decode to nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BENCH_32M = {
    "num_hidden_layers": 8,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "vocab_size": 8192,
}
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 259,
}


def make_llama(out: str | Path, *, seed: int = 0, context_length: int = 2048, **sizes: int) -> Path:
    """Save a random LlamaForCausalLM (sizes default to the 32M benchmark model) plus a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dims: dict[str, Any] = {**BENCH_32M, **sizes}
    torch.manual_seed(seed)
    config = LlamaConfig(
        **dims,
        max_position_embeddings=context_length,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    out = Path(out)
    model.save_pretrained(out)
    write_byte_tokenizer(out)
    return out


def write_byte_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {ch: 3 + i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<unk>",
                "model_max_length": 2048,
            },
            indent=2,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    print(make_llama(args.out, **(TINY if args.tiny else {})))


if __name__ == "__main__":
    main()
