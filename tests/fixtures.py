"""Tiny models for every registry architecture, built from configs in code (no downloads).

Each builder returns a transformers config small enough to export in seconds (hidden 64, two
decoder layers, vocab 256) but with `initializer_range=0.2`, so greedy decoding walks through
varied tokens instead of repeating one: a token-exact comparison then means something.
Family-specific features are switched on on purpose: Mistral's sliding window is shorter than
the test sequences, Phi-3 uses partial rotary, Qwen2 has qkv biases, Qwen3 q/k norms, Gemma
a large head_dim and scaled embeddings, Gemma 2/3 one sliding and one global layer (Gemma 2
soft-capping, Gemma 3 a rope base per layer type and q/k norm), SmolLM3 a layer without rope,
Granite its four multipliers, OLMo 2 post-norms and whole-projection q/k norm, and
DeepSeek-V3 MLA + MoE with one MTP layer whose weights are written into the checkpoint
(transformers drops them on load; the exporter keeps them as `mtp_source.safetensors`).
`VARIANT_CONFIGS` adds one model per extra rope scaling type an entry accepts (Llama 3.x,
YaRN, Phi-3.5 long-rope).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HIDDEN = 64
LAYERS = 2
VOCAB = 256
CONTEXT = 128
INIT = 0.2  # large init: greedy output is varied, not one repeated token
BOS, EOS = 1, 2
SLIDING_WINDOW = 8  # shorter than prompt + 16 new tokens, so the window is exercised


def _common() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "initializer_range": INIT,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def _llama_like() -> dict[str, Any]:
    return {
        **_common(),
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": CONTEXT,
    }


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_llama_like())


def mistral_config() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_llama_like(), sliding_window=SLIDING_WINDOW)


def qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_llama_like())


def qwen3_config() -> Any:
    from transformers import Qwen3Config

    # head_dim * heads != hidden, as in the real Qwen3 models; q/k RMSNorm is always on.
    return Qwen3Config(**_llama_like(), head_dim=32)


def phi3_config() -> Any:
    from transformers import Phi3Config

    # Partial rotary: only half of each 16-dim head is rotated.
    return Phi3Config(**_llama_like(), partial_rotary_factor=0.5)


def gemma_config() -> Any:
    from transformers import GemmaConfig

    cfg = {**_llama_like(), "num_key_value_heads": 1, "head_dim": 32}
    cfg["tie_word_embeddings"] = True  # Gemma always ties
    # With tied embeddings and small weights the model echoes its last token; 0.5 is varied.
    cfg["initializer_range"] = 0.5
    return GemmaConfig(**cfg)


def _gemma_like(**extra: Any) -> dict[str, Any]:
    """Gemma 2/3: one sliding and one global layer, window shorter than a test run, a head_dim
    GroupQueryAttention runs (32), tied and scaled embeddings, query_pre_attn_scalar != head_dim.
    """
    # Untied: with tied random embeddings the model only echoes its last input token.
    cfg = {**_llama_like(), "num_key_value_heads": 2, "head_dim": 32, "initializer_range": 0.5}
    return {
        **cfg,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        **extra,
    }


def gemma2_config() -> Any:
    from transformers import Gemma2Config

    # Soft-capping on (attention logits and final logits) at values the random weights reach.
    return Gemma2Config(**_gemma_like(attn_logit_softcapping=5.0, final_logit_softcapping=8.0))


def gemma3_text_config() -> Any:
    from transformers import Gemma3TextConfig

    # Sliding layers and global layers rotate with their own bases; q/k RMSNorm.
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }
    return Gemma3TextConfig(**_gemma_like(rope_parameters=rope))


def smollm3_config() -> Any:
    from transformers import SmolLM3Config

    # Layer 1 has no rotary embedding (NoPE), as every 4th layer of the real model.
    return SmolLM3Config(**{**_llama_like(), "tie_word_embeddings": True}, no_rope_layers=[1, 0])


def granite_config() -> Any:
    from transformers import GraniteConfig

    return GraniteConfig(
        **_llama_like(),
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.125,
        logits_scaling=2.0,
    )


def olmo2_config() -> Any:
    from transformers import Olmo2Config

    # Post-norms, and q/k RMSNorm over the whole projection (not per head).
    # (init 0.3 / MLP 256: at the defaults greedy decoding repeats one token.)
    return Olmo2Config(**{**_llama_like(), "initializer_range": 0.3, "intermediate_size": 256})


def llama_rope_llama3_config() -> Any:
    from transformers import LlamaConfig

    # Llama 3.x frequency scaling; original length 32 so the scaled band has short wavelengths.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(**_llama_like(), rope_parameters=rope)


def llama_rope_yarn_config() -> Any:
    from transformers import LlamaConfig

    # YaRN (DeepSeek-V3 and long-context Qwen/Llama fine-tunes): frequencies and an attention
    # factor fixed at load time.
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(**_llama_like(), rope_parameters=rope)


# Below CONTEXT, so the artifact's context is capped to it (exporter/archs/phi3.py); above
# every test sequence.
LONGROPE_ORIGINAL = 64


def phi3_rope_longrope_config() -> Any:
    from transformers import Phi3Config

    # Phi-3.5 / Phi-4-mini: long-rope scaling with partial rotary (0.75 of a 16-dim head).
    half = 6  # rotary dim 12 -> 6 frequencies
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 2.0 * i for i in range(half)],
        "original_max_position_embeddings": LONGROPE_ORIGINAL,
        "partial_rotary_factor": 0.75,
    }
    return Phi3Config(
        **_llama_like(),
        rope_parameters=rope,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
    )


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=4,
        n_positions=CONTEXT,
        initializer_range=INIT,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=0,
    )


def deepseek_v3_config() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_common(),
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,  # layer 0 dense MLP, layer 1 MoE
        num_nextn_predict_layers=1,
        max_position_embeddings=CONTEXT,
    )


TINY_CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": llama_config,
    "mistral": mistral_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "phi3": phi3_config,
    "gemma": gemma_config,
    "gpt2": gpt2_config,
    "deepseek_v3": deepseek_v3_config,
    "gemma2": gemma2_config,
    "gemma3_text": gemma3_text_config,
    "smollm3": smollm3_config,
    "granite": granite_config,
    "olmo2": olmo2_config,
}

# Options of a registry entry that need their own tiny model ("<model_type>:<option>"):
# the rope scaling types the registry accepts beyond "default".
VARIANT_CONFIGS: dict[str, Callable[[], Any]] = {
    "llama:rope_llama3": llama_rope_llama3_config,
    "llama:rope_yarn": llama_rope_yarn_config,
    "phi3:rope_longrope": phi3_rope_longrope_config,
}

# Prompts used by the parity tests: different lengths so a batch needs left padding.
SHORT_PROMPT = [BOS, 17, 93, 5]
LONG_PROMPT = [BOS, 40, 41, 200, 7, 99, 123, 64, 3, 18]


def fixture_model_type(name: str) -> str:
    """ "phi3:rope_longrope" -> "phi3" (a fixture name is a model_type, optionally ":option")."""
    return name.split(":", 1)[0]


def fixture_config(name: str) -> Any:
    """The tiny config of a fixture name (a registry model_type or a "<type>:<option>")."""
    builders = {**TINY_CONFIGS, **VARIANT_CONFIGS}
    return builders[name]()


def load_kwargs(model_type: str) -> dict[str, Any]:
    """The registry entry's `from_pretrained` kwargs (e.g. DeepSeek's batched_mm experts)."""
    from specport.exporter.registry import lookup

    return dict(lookup(fixture_model_type(model_type)).load_kwargs)


def build_tiny_model(model_type: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a randomly initialised tiny checkpoint of `model_type` (a fixture name: a
    registry model_type or "<type>:<option>") to `out_dir`; return it.

    For configs that announce MTP layers (DeepSeek-V3), the checkpoint also holds
    `model.layers.{N}.*` (a full decoder layer plus enorm/hnorm/eh_proj/shared_head), the way
    the published checkpoints do.
    """
    from transformers import AutoModelForCausalLM

    config = fixture_config(model_type)
    out_dir = Path(out_dir)
    n_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    torch.manual_seed(seed)
    if n_mtp:
        # Build with N + n_mtp layers so the extra layers get real (saved-format) weights.
        config.num_hidden_layers = LAYERS + n_mtp
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **load_kwargs(model_type))
    model.save_pretrained(str(out_dir))
    if n_mtp:
        _add_mtp_weights(out_dir, n_mtp, seed)
    return out_dir


def _add_mtp_weights(out_dir: Path, n_mtp: int, seed: int) -> None:
    """Add the MTP-only tensors and set num_hidden_layers back to the main-model depth."""
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed + 1)
    for j in range(n_mtp):
        p = f"model.layers.{LAYERS + j}."
        tensors[p + "enorm.weight"] = torch.ones(HIDDEN)
        tensors[p + "hnorm.weight"] = torch.ones(HIDDEN)
        tensors[p + "eh_proj.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * INIT
        tensors[p + "shared_head.norm.weight"] = torch.ones(HIDDEN)
        tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_hidden_layers"] = LAYERS
    cfg_path.write_text(json.dumps(cfg, indent=2))


def load_reference(model_dir: Path, model_type: str) -> Any:
    """The PyTorch model as the exporter loads it (float32, eval, registry load kwargs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, local_files_only=True, **load_kwargs(model_type)
    )
    return model.eval()


def frozen_tiny_llama(out_dir: Path) -> Any:
    """The tiny Llama as a PyTorch model with its weights frozen: the base MTP heads train on."""
    model = load_reference(build_tiny_model("llama", out_dir), "llama")
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def eagle_config() -> Any:
    """A tiny EAGLE head's shape: hidden 32, 4 heads (2 KV), vocab 50, draft vocabulary 20."""
    from specport.exporter.eagle_head import EagleConfig

    return EagleConfig(
        hidden=32,
        heads=4,
        kv_heads=2,
        head_dim=8,
        intermediate=64,
        rope_theta=10000.0,
        eps=1e-5,
        vocab=50,
        draft_vocab=20,
    )


def tiny_eagle_head() -> Any:
    """An untrained EAGLE head of `eagle_config()` (seeded), its draft vocabulary every other id."""
    from specport.exporter.eagle_head import EagleHead

    torch.manual_seed(0)
    return EagleHead(eagle_config(), torch.randn(50, 32), torch.arange(0, 40, 2)).eval()


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate`, EOS ignored; returns only the new tokens."""
    # `eos_token_id=None` as a generate() argument means "use the model's"; clear it instead.
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt_ids])
    try:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
    finally:
        model.generation_config.eos_token_id = saved
    return [int(t) for t in out[0, len(prompt_ids) :]]


def has_pipelines() -> bool:
    """True once `specport.passes.pipelines` (the fusion pipelines) exists."""
    import importlib.util

    return importlib.util.find_spec("specport.passes.pipelines") is not None


class TinyZoo:
    """Session cache of tiny source models, their PyTorch references and exported artifacts.

    Exports take seconds each, so every (model_type, fuse) pair is exported at most once per
    test session and shared by every test that asks for it.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._sources: dict[str, Path] = {}
        self._refs: dict[str, Any] = {}
        self._artifacts: dict[tuple[str, bool], Path] = {}
        self.export_seconds: dict[tuple[str, bool], float] = {}
        self.verify: dict[tuple[str, bool], dict[str, Any]] = {}
        self._shared: dict[tuple[str, str], Path] = {}

    def source(self, model_type: str) -> Path:
        """A saved tiny checkpoint directory (config.json + model.safetensors)."""
        if model_type not in self._sources:
            where = self.root / "src" / model_type.replace(":", "-")
            self._sources[model_type] = build_tiny_model(model_type, where)
        return self._sources[model_type]

    def reference(self, model_type: str) -> Any:
        """The PyTorch model loaded from `source(model_type)`."""
        if model_type not in self._refs:
            self._refs[model_type] = load_reference(self.source(model_type), model_type)
        return self._refs[model_type]

    def artifact(self, model_type: str, fuse: bool = False) -> Path:
        """An exported artifact of the tiny model (verified against PyTorch during export)."""
        import time

        from tests.export_cache import cached_export

        key = (model_type, fuse)
        if key not in self._artifacts:
            tag = model_type.replace(":", "-")
            out = self.root / "art" / f"{tag}-{'fused' if fuse else 'plain'}"
            t0 = time.perf_counter()
            manifest = cached_export(  # the zoo checks the portable graph: concat on purpose
                self.source(model_type), out, fuse=fuse, kv_layout="concat", progress=False
            )
            self.export_seconds[key] = time.perf_counter() - t0
            self.verify[key] = manifest.verify
            self._artifacts[key] = out
        return self._artifacts[key]

    def shared(self, model_type: str, tree_mask: bool = False) -> Path:
        """A `--kv-layout shared` export of the tiny model (with `--tree-mask` if asked)."""
        from tests.export_cache import cached_export

        key = ("shared-tree" if tree_mask else "shared", model_type)
        if key not in self._shared:
            out = self.root / "art" / f"{model_type.replace(':', '-')}-{key[0]}"
            cached_export(
                self.source(model_type),
                out,
                kv_layout="shared",
                tree_mask=tree_mask,
                progress=False,
            )
            self._shared[key] = out
        return self._shared[key]

    def summary(self) -> list[str]:
        """One line per export done this session: seconds and verify max |logits diff|."""
        lines = []
        for (model_type, fuse), seconds in sorted(self.export_seconds.items()):
            err = self.verify.get((model_type, fuse), {}).get("max_abs_logits")
            err_text = f"{err:.2e}" if isinstance(err, float) else "n/a"
            mode = "fused" if fuse else "plain"
            lines.append(
                f"{model_type:<12} {mode:<6} export {seconds:6.1f}s  verify max|dlogits| {err_text}"
            )
        return lines


# ChatML, as SmolLM2 and Qwen ship it; the tiny tokenizer below has these as special tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]  # ids 0..4 (EOS = 2)


def write_chat_tokenizer(out_dir: Path) -> Path:
    """A real `tokenizers` BPE tokenizer of at most VOCAB ids, with ChatML special tokens and
    a chat template in tokenizer_config.json: what a chat model's artifact carries.

    Ids 0, 1, 2 are pad, BOS and `<|im_end|>`, matching the tiny configs' pad/BOS/EOS, so
    generation stops at the end of an answer as it does for a real chat model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=CHAT_SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    corpus = [
        "Hello! How are you today? I am fine, thank you.",
        "Tell me a story about the sea and a little boat.",
        "The capital of France is Paris. What is the weather like?",
    ] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "chat_template": CHAT_TEMPLATE,
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def add_chat_tokenizer(artifact: Path, out: Path) -> Path:
    """A copy of `artifact` that carries `write_chat_tokenizer`'s files, its manifest rehashed
    (cheaper than another export; the graph is the same)."""
    import shutil

    from specport.artifact import manifest as art
    from specport.artifact.files import write_artifact_manifest

    shutil.copytree(artifact, out)
    write_chat_tokenizer(out)
    manifest = art.read_manifest(out, check_hashes=False)  # its tokenizer files were replaced
    manifest.tokenizer = {
        "kind": "hf-tokenizers",
        "file": "tokenizer.json",
        "files": ["tokenizer.json", "tokenizer_config.json"],
    }
    write_artifact_manifest(out, manifest)
    return out


# ---- a random Llama from a config (the benchmark model's builder; TINY for tests) -------------
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
