"""The graph families `specport optimize` fuses attention in, built tiny (random weights, no
download) the way other tools export them; tests parametrize over `entries()` and
benchmarks/bench_attention_vs_ort.py times them against onnxruntime's transformer optimizer.

Every graph is hidden 32, 4 heads, 2 layers:

    gpt2_{ts,dynamo}_{past,nopast}_{mask,nomask}   transformers GPT2LMHeadModel (eager attention
        for TorchScript, sdpa for dynamo); the past is stacked [2, B, H, P, Dh] per layer, as
        onnxruntime's gpt2_helper exports it
    gpt2_ts_sdpa_past_mask                     the same with sdpa attention (torch's
        decomposition of scaled_dot_product_attention)
    bert_{ts,dynamo}, distilbert_{ts,dynamo}   transformers BertModel / DistilBertModel with
        input_ids, attention_mask (BERT: token_type_ids) -> last_hidden_state, eager attention
    bert_ts_sdpa                               BertModel with sdpa attention
    llama_{ts,dynamo}_past                     LlamaForCausalLM (GQA), past_key_values.{i}.*
    block_{gpt2,gpt2_nopast,bert,bert_nocast,distilbert}   one attention block written node by
        node as onnxruntime's fusion-test generators write them (tests/passes/ort_blocks.py)
    optimum_{gpt2,llama,qwen2,phi3}            Optimum's TorchScript exports (tests/passes/fixtures)
    ort_{gpt2_past,gpt2_nopast,gpt2_megatron,mha_block}   GPT-2 / Megatron / MHA models shaped
        like onnxruntime's transformer-fusion test data (tests/passes/ort_shaped_graphs.py)

Each entry names the `model_type` onnxruntime's optimizer is given for it (gpt2 or bert).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

HIDDEN, HEADS, LAYERS, VOCAB = 32, 4, 2, 128
B, S, P = 2, 3, 4  # example batch, new tokens, past tokens for the exporters' traces


@dataclass(frozen=True)
class Entry:
    name: str
    family: str  # gpt2 | bert | distilbert | llama | megatron | mha
    exporter: str  # torchscript | dynamo
    model_type: str  # what onnxruntime's optimizer is told: gpt2 | bert
    build: Callable[[Path], None]
    heads: int = HEADS
    hidden: int = HIDDEN


def _randomize(model: Any) -> Any:
    """Biases and norms start at 0 / 1 and an export folds trivial ones away: perturb all."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _gpt2(attn: str) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=64
    )
    return _randomize(tf.GPT2LMHeadModel._from_config(cfg, attn_implementation=attn))


def _encoder(kind: str, attn: str) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if kind == "bert":
        cfg: Any = tf.BertConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        )
        cls: Any = tf.BertModel
    else:
        cfg = tf.DistilBertConfig(
            dim=HIDDEN,
            n_layers=LAYERS,
            n_heads=HEADS,
            hidden_dim=2 * HIDDEN,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        )
        cls = tf.DistilBertModel
    return _randomize(cls._from_config(cfg, attn_implementation=attn))


def _llama(attn: str) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return _randomize(tf.LlamaForCausalLM._from_config(cfg, attn_implementation=attn))


def _export(
    module: Any,
    args: tuple,
    path: Path,
    names: list[str],
    outs: list[str],
    dims: dict[str, dict[int, str]],
    dynamo: bool,
) -> None:
    """torch.onnx.export with named dynamic dims, by either exporter."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not dynamo:
            torch.onnx.export(
                module,
                args,
                str(path),
                dynamo=False,
                opset_version=14,
                input_names=names,
                output_names=outs,
                dynamic_axes={k: v for k, v in dims.items() if k in names or k in outs},
            )
            return
        shapes = {
            n: {i: torch.export.Dim.AUTO for i in dims.get(n, {})} for n in names
        }  # AUTO: torch names the dims; onnx keeps them symbolic
        prog = torch.onnx.export(
            module,
            args,
            dynamo=True,
            dynamic_shapes=_nested([shapes[n] for n in names], module),
            input_names=names,
            output_names=outs,
        )
        prog.save(str(path))


def _nested(shapes: list[Any], module: Any) -> tuple:
    """dynamic_shapes in the structure of `module.forward(a, b, *rest)`: (a, b, (rest...))."""
    import inspect

    params = inspect.signature(module.forward).parameters.values()
    fixed = sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    rest = shapes[fixed:]
    return (*shapes[:fixed], tuple(rest)) if rest else tuple(shapes)


def _gpt2_wrapper(model: Any, past: bool, mask: bool) -> Any:
    import torch
    from transformers import DynamicCache

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, *rest):
            position_ids = rest[0] if mask else None
            attention_mask = rest[1] if mask else None
            kv = rest[2:] if mask else rest
            # an empty cache even without a past: with no mask and no cache, transformers looks
            # for packed sequences (aten::diff, which TorchScript cannot export)
            cache = DynamicCache()
            for i, t in enumerate(kv):
                cache.update(t[0], t[1], i)
            out = self.m(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=past,
            )
            if not past:
                return out.logits
            layers = out.past_key_values.layers
            return (out.logits, *(torch.stack([x.keys, x.values]) for x in layers))

    return Wrapper()


def build_gpt2(path: Path, dynamo: bool, past: bool, mask: bool, attn: str = "eager") -> None:
    import torch

    p = P if past else 0
    d = HIDDEN // HEADS
    args: list[Any] = [torch.randint(0, VOCAB, (B, S))]
    names = ["input_ids"]
    if mask:
        args += [torch.arange(p, p + S).expand(B, S).contiguous(), torch.ones(B, p + S).long()]
        names += ["position_ids", "attention_mask"]
    outs = ["logits"]
    dims = {
        "input_ids": {0: "batch", 1: "seq"},
        "position_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "logits": {0: "batch", 1: "seq"},
    }
    if past:
        for i in range(LAYERS):
            args.append(torch.randn(2, B, HEADS, p, d))
            names.append(f"past_{i}")
            outs.append(f"present_{i}")
            dims[f"past_{i}"] = {1: "batch", 3: "past"}
            dims[f"present_{i}"] = {1: "batch", 3: "total"}
    wrapper = _gpt2_wrapper(_gpt2(attn), past, mask)
    _export(wrapper, tuple(args), path, names, outs, dims, dynamo)


def build_encoder(path: Path, kind: str, dynamo: bool, attn: str = "eager") -> None:
    import torch

    model = _encoder(kind, attn)
    token_types = kind == "bert"

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, *rest):
            kw = {"token_type_ids": rest[0]} if token_types else {}
            return self.m(input_ids=input_ids, attention_mask=attention_mask, **kw)[0]

    ids = torch.randint(0, VOCAB, (B, S + 2))
    mask = torch.ones(B, S + 2, dtype=torch.int64)
    mask[0, -1] = 0  # a padded row: the mask path must not fold away
    args: list[Any] = [ids, mask]
    names = ["input_ids", "attention_mask"]
    if token_types:
        args.append(torch.zeros(B, S + 2, dtype=torch.int64))
        names.append("token_type_ids")
    dims = {n: {0: "batch", 1: "seq"} for n in [*names, "last_hidden_state"]}
    _export(Wrapper(), tuple(args), path, names, ["last_hidden_state"], dims, dynamo)


def build_llama(path: Path, dynamo: bool) -> None:
    import torch

    from specport.exporter.wrapper import FlatKVWrapper

    model = _llama("sdpa" if dynamo else "eager")
    kv_heads, d = HEADS // 2, HIDDEN // HEADS
    kv = [f"past_key_values.{i}.{x}" for i in range(LAYERS) for x in ("key", "value")]
    names = ["input_ids", "attention_mask", "position_ids", *kv]
    outs = ["logits", *(k.replace("past_key_values", "present") for k in kv)]
    args = [
        torch.randint(0, VOCAB, (B, S)),
        torch.ones(B, P + S, dtype=torch.int64),
        torch.arange(P, P + S).expand(B, S).contiguous(),
        *(torch.randn(B, kv_heads, P, d) for _ in kv),
    ]
    dims: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"},
        "position_ids": {0: "batch", 1: "seq"},
        "logits": {0: "batch", 1: "seq"},
        **{k: {0: "batch", 2: "past"} for k in kv},
        **{k: {0: "batch", 2: "total"} for k in outs[1:]},
    }
    _export(FlatKVWrapper(model, LAYERS), tuple(args), path, names, outs, dims, dynamo)


def build_ort_shaped(path: Path, kind: str) -> None:
    from tests.passes import ort_shaped_graphs

    ort_shaped_graphs.build(kind, path, blemish="typeless_outputs", layers=LAYERS)


def copy_fixture(path: Path, name: str) -> None:
    """Optimum's exports (optimum-onnx pins an older transformers, so they are made in its own
    environment by tests/passes/fixtures/make_fixtures.py and kept as files)."""
    import shutil

    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).parent / "fixtures" / name, path)


def build_block(path: Path, kind: str) -> None:
    from tests.passes import ort_blocks

    ort_blocks.build(kind, path)


def entries() -> list[Entry]:
    out: list[Entry] = []
    for exporter in ("torchscript", "dynamo"):
        tag = "ts" if exporter == "torchscript" else "dynamo"
        dyn = exporter == "dynamo"
        attn = "sdpa" if dyn else "eager"
        for past in (True, False):
            for mask in (True, False):
                name = f"gpt2_{tag}_{'past' if past else 'nopast'}_{'mask' if mask else 'nomask'}"
                out.append(
                    Entry(
                        name,
                        "gpt2",
                        exporter,
                        "gpt2",
                        lambda p, d=dyn, a=past, m=mask, at=attn: build_gpt2(p, d, a, m, at),
                    )
                )
        for kind in ("bert", "distilbert"):
            out.append(
                Entry(
                    f"{kind}_{tag}",
                    kind,
                    exporter,
                    "bert",
                    lambda p, k=kind, d=dyn: build_encoder(p, k, d, "eager"),
                )
            )
        out.append(
            Entry(
                f"llama_{tag}_past", "llama", exporter, "gpt2", lambda p, d=dyn: build_llama(p, d)
            )
        )
    out.append(
        Entry(
            "gpt2_ts_sdpa_past_mask",
            "gpt2",
            "torchscript",
            "gpt2",
            lambda p: build_gpt2(p, False, True, True, "sdpa"),
        )
    )
    out.append(
        Entry(
            "bert_ts_sdpa",
            "bert",
            "torchscript",
            "bert",
            lambda p: build_encoder(p, "bert", False, "sdpa"),
        )
    )
    for kind in ("gpt2", "gpt2_nopast", "bert", "bert_nocast", "distilbert"):
        out.append(
            Entry(
                f"block_{kind}",
                kind.split("_")[0],
                "onnx.helper",
                "gpt2" if kind.startswith("gpt2") else "bert",
                lambda p, k=kind: build_block(p, k),
                heads=4,
                hidden=32,
            )
        )
    for arch in ("gpt2", "llama", "qwen2", "phi3"):
        out.append(
            Entry(
                f"optimum_{arch}",
                "llama" if arch != "gpt2" else "gpt2",
                "optimum",
                "gpt2",
                lambda p, a=arch: copy_fixture(p, f"optimum_{a}.onnx"),
            )
        )
    for kind, family, mtype in (
        ("gpt2_past", "gpt2", "gpt2"),
        ("gpt2_nopast", "gpt2", "gpt2"),
        ("gpt2_megatron", "megatron", "gpt2"),
        ("mha_block", "mha", "bert"),
    ):
        out.append(
            Entry(
                f"ort_{kind}",
                family,
                "torchscript",
                mtype,
                lambda p, k=kind: build_ort_shaped(p, k),
            )
        )
    return out


def build_corpus(root: Path, only: str | None = None) -> dict[str, tuple[Entry, Path]]:
    """name -> (entry, path to model.onnx), built once under `root` (kept between runs)."""
    built: dict[str, tuple[Entry, Path]] = {}
    for entry in entries():
        if only and only not in entry.name:
            continue
        path = root / entry.name / "model.onnx"
        if not path.exists():
            logger.info("building %s", entry.name)
            entry.build(path)
        built[entry.name] = (entry, path)
    return built
