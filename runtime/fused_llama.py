"""A fused, shared-KV Llama-family graph built straight from Hugging Face weights (CPU target).

Why this exists: the fast runtime path (IO binding, KV written in place) needs a graph whose
attention is com.microsoft GroupQueryAttention over one preallocated buffer per layer. Until the
fusion passes (`passes/`) produce that from the traced graph, this builder writes it directly,
the way onnxruntime-genai's builder does, so the runtime and `specport bench` can be measured.
It is a stopgap owned by the runtime; when `passes/` emits a `shared` artifact, drop this.

Graph contract (manifest `kv.layout == "shared"`, `extra.runtime` describes the extra I/O):
    input_ids int64 [B, S]        right-padded prompt (row b's real tokens first)
    seqlens_k int32 [B]           per row: tokens in cache after this step - 1
    total_sequence_length int32 []  max over rows of (seqlens_k + 1)
    logits_index int64 [B, K]     which of the S positions leave the graph as logits
    past_key_values.{i}.key/value float32 [B, Hkv, T, Dh]   bound to present.{i}.* (same buffer)
 -> logits float32 [B, K, V], next_token int64 [B, K] (greedy argmax, in graph),
    present.{i}.key/value [B, Hkv, T, Dh]
Rotary positions come from seqlens_k inside GQA (do_rotary), so there is no position_ids input.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specport import artifact as art
from specport.errors import ExportError

logger = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2")
# One [D, 2I] MatMul + Split, or two [D, I] MatMuls (genai's choice); see the module notes.
FUSE_GATE_UP = True
MS = "com.microsoft"


def build_fused_artifact(
    hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, progress: bool | None = None
) -> art.Manifest:
    """Write a fused shared-KV artifact for a Llama-family HF model directory to `out`."""
    import torch

    from specport.exporter import source as src_mod
    from specport.exporter.tokenizer_files import copy_tokenizer
    from specport.progress import Stages

    stages = Stages(total=3, show=progress)
    stages.start("loading PyTorch weights")
    source = src_mod.resolve(hf_dir)
    model = src_mod.load_model(source)
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ExportError(
            f"the fused shared-KV builder handles {', '.join(SUPPORTED)}, not {cfg.model_type!r}; "
            "use `specport export` (concat layout) for this model."
        )
    norm = source.arch.normalize(cfg)
    norm["num_layers"] = cfg.num_hidden_layers
    stages.start("building the fused graph")
    with torch.no_grad():
        proto, layout = _build(model, norm)
    stages.start("writing the artifact")
    with art.atomic_artifact_dir(Path(out)) as tmp:
        onnx.save_model(
            proto,
            str(tmp / art.MODEL_NAME),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=art.DATA_NAME,
            size_threshold=1024,
        )
        tok_info = copy_tokenizer(source.path, tmp)
        from specport.exporter.export import _io_signature

        manifest = art.Manifest(
            architecture=norm["model_type"],
            config=norm,
            io=_io_signature(tmp / art.MODEL_NAME),
            kv=layout,
            source=source.describe(),
            target="cpu",
            tokenizer=tok_info,
            passes=[
                {
                    "name": "runtime.fused_llama",
                    "report": {
                        "attention": "com.microsoft.GroupQueryAttention",
                        "qkv": "one MatMul",
                        "gate_up": "one MatMul",
                    },
                }
            ],
            verify={
                "skipped": True,
                "note": "checked by tests/runtime (greedy tokens vs the traced export)",
            },
            extra={"runtime": RUNTIME_IO},
        )
        art.write_manifest(tmp, manifest)
    stages.done()
    return manifest


RUNTIME_IO: dict[str, Any] = {
    "padding": "right",
    "seqlens_input": "seqlens_k",
    "total_length_input": "total_sequence_length",
    "logits_index_input": "logits_index",
    "next_token_output": "next_token",
}


def _np(t: Any) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _build(model: Any, norm: dict[str, Any]) -> tuple[onnx.ModelProto, art.KVLayout]:
    cfg = model.config
    layers = cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if head_dim % 16:
        raise ExportError(
            f"head dim {head_dim} is not a multiple of 16, which onnxruntime's GroupQueryAttention "
            "requires; use `specport export` (concat layout) for this model."
        )
    eps = float(cfg.rms_norm_eps)
    inter = cfg.intermediate_size
    inits: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def init(name: str, arr: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def node(
        op: str, ins: list[str], outs: list[str], domain: str = "", name: str = "", **attrs: Any
    ) -> None:
        nodes.append(helper.make_node(op, ins, outs, name=name or outs[0], domain=domain, **attrs))

    m = model.model
    init("embed_tokens.weight", _np(m.embed_tokens.weight))
    node("Gather", ["embed_tokens.weight", "input_ids"], ["/model/embed/output"])
    cos, sin = _rotary_caches(m, norm["context_length"], head_dim)
    init("cos_cache", cos)
    init("sin_cache", sin)
    init("/const/zero", np.array([0], np.int64))
    init("/const/inter", np.array([inter], np.int64))
    init("/const/inter2", np.array([2 * inter], np.int64))
    init("/const/minus1", np.array([-1], np.int64))

    residual, mlp_out = "/model/embed/output", ""
    for i, layer in enumerate(m.layers):
        p = f"/model/layers.{i}"
        ln = init(f"{p}/input_layernorm.weight", _np(layer.input_layernorm.weight))
        if i == 0:
            node(
                "SimplifiedLayerNormalization",
                [residual, ln],
                [f"{p}/ln1"],
                axis=-1,
                epsilon=eps,
                stash_type=1,
            )
        else:
            node(
                "SkipSimplifiedLayerNormalization",
                [mlp_out, residual, ln],
                [f"{p}/ln1", "", "", f"{p}/res1"],
                domain=MS,
                epsilon=eps,
            )
            residual = f"{p}/res1"
        a = layer.self_attn
        wqkv = np.concatenate(
            [_np(a.q_proj.weight), _np(a.k_proj.weight), _np(a.v_proj.weight)], 0
        ).T
        node("MatMul", [f"{p}/ln1", init(f"{p}/attn/qkv_proj.weight", wqkv)], [f"{p}/qkv"])
        qkv = f"{p}/qkv"
        if a.q_proj.bias is not None:
            bias = np.concatenate([_np(a.q_proj.bias), _np(a.k_proj.bias), _np(a.v_proj.bias)])
            node("Add", [qkv, init(f"{p}/attn/qkv_proj.bias", bias)], [f"{p}/qkv_b"])
            qkv = f"{p}/qkv_b"
        node(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                "seqlens_k",
                "total_sequence_length",
                "cos_cache",
                "sin_cache",
            ],
            [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"],
            domain=MS,
            num_heads=heads,
            kv_num_heads=kv_heads,
            scale=float(a.scaling),
            do_rotary=1,
            rotary_interleaved=0,
            local_window_size=_window(cfg),
        )
        node(
            "MatMul",
            [f"{p}/attn", init(f"{p}/attn/o_proj.weight", _np(a.o_proj.weight).T)],
            [f"{p}/o"],
        )
        ln2 = init(
            f"{p}/post_attention_layernorm.weight", _np(layer.post_attention_layernorm.weight)
        )
        node(
            "SkipSimplifiedLayerNormalization",
            [f"{p}/o", residual, ln2],
            [f"{p}/ln2", "", "", f"{p}/res2"],
            domain=MS,
            epsilon=eps,
        )
        residual = f"{p}/res2"
        mlp = layer.mlp
        if FUSE_GATE_UP:
            wgu = np.concatenate([_np(mlp.gate_proj.weight), _np(mlp.up_proj.weight)], 0).T
            node("MatMul", [f"{p}/ln2", init(f"{p}/mlp/gate_up_proj.weight", wgu)], [f"{p}/gu"])
            node(
                "Slice", [f"{p}/gu", "/const/zero", "/const/inter", "/const/minus1"], [f"{p}/gate"]
            )
            node(
                "Slice", [f"{p}/gu", "/const/inter", "/const/inter2", "/const/minus1"], [f"{p}/up"]
            )
        else:
            node(
                "MatMul",
                [f"{p}/ln2", init(f"{p}/mlp/gate_proj.weight", _np(mlp.gate_proj.weight).T)],
                [f"{p}/gate"],
            )
            node(
                "MatMul",
                [f"{p}/ln2", init(f"{p}/mlp/up_proj.weight", _np(mlp.up_proj.weight).T)],
                [f"{p}/up"],
            )
        node("Sigmoid", [f"{p}/gate"], [f"{p}/sig"])
        node("Mul", [f"{p}/gate", f"{p}/sig"], [f"{p}/silu"])
        node("Mul", [f"{p}/silu", f"{p}/up"], [f"{p}/act"])
        node(
            "MatMul",
            [f"{p}/act", init(f"{p}/mlp/down_proj.weight", _np(mlp.down_proj.weight).T)],
            [f"{p}/down"],
        )
        mlp_out = f"{p}/down"
    fw = init("/model/norm.weight", _np(m.norm.weight))
    node(
        "SkipSimplifiedLayerNormalization",
        [mlp_out, residual, fw],
        ["/model/norm"],
        domain=MS,
        epsilon=eps,
    )
    # Only the positions the runtime asks for reach the LM head: [B, S, D] -> [B, K, D].
    node("Unsqueeze", ["logits_index", "/const/minus1"], ["/model/logits_index3"])
    node("GatherND", ["/model/norm", "/model/logits_index3"], ["/model/norm_kept"], batch_dims=1)
    head = model.get_output_embeddings().weight
    node("MatMul", ["/model/norm_kept", init("lm_head.weight", _np(head).T)], ["logits"])
    node("ArgMax", ["logits"], ["next_token"], axis=-1, keepdims=0)

    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    kv_in, kv_out = [], []
    for i in range(layers):
        for kind in ("key", "value"):
            kv_in.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", f32, ["batch", kv_heads, "max_length", head_dim]
                )
            )
            kv_out.append(
                helper.make_tensor_value_info(
                    f"present.{i}.{kind}", f32, ["batch", kv_heads, "max_length", head_dim]
                )
            )
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence_length"]),
        helper.make_tensor_value_info("seqlens_k", i32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
        helper.make_tensor_value_info("logits_index", i64, ["batch", "kept"]),
        *kv_in,
    ]
    outputs = [
        helper.make_tensor_value_info("logits", f32, ["batch", "kept", norm["vocab_size"]]),
        helper.make_tensor_value_info("next_token", i64, ["batch", "kept"]),
        *kv_out,
    ]
    graph = helper.make_graph(nodes, "specport_fused", inputs, outputs, initializer=inits)
    proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
        producer_name="specport",
    )
    proto.ir_version = 10
    layout = art.KVLayout(
        layout="shared",
        inputs=[[f"past_key_values.{i}.key", f"past_key_values.{i}.value"] for i in range(layers)],
        outputs=[[f"present.{i}.key", f"present.{i}.value"] for i in range(layers)],
        num_heads=[kv_heads] * layers,
        key_dim=[head_dim] * layers,
        value_dim=[head_dim] * layers,
        max_length=int(norm["context_length"]),
    )
    return proto, layout


def _window(cfg: Any) -> int:
    window = getattr(cfg, "sliding_window", None)
    use = getattr(cfg, "use_sliding_window", True)
    return int(window) if window and use else -1


def _rotary_caches(m: Any, length: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, Dh/2] from the model's own rotary module (so rope scaling variants carry over)."""
    import torch

    rot = m.rotary_emb
    pos = torch.arange(length, dtype=torch.int64)[None]
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rot(x, pos)  # [1, T, Dh] (halves duplicated)
    half = cos.shape[-1] // 2
    if cos.shape[-1] != head_dim:
        raise ExportError(
            "partial rotary is not supported by the fused builder; use `specport export`."
        )
    return _np(cos[0, :, :half]), _np(sin[0, :, :half])


def main() -> None:
    """`python -m specport.runtime.fused_llama HF_DIR OUT`: build the fused shared-KV artifact."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("hf_dir")
    parser.add_argument("out")
    args = parser.parse_args()
    build_fused_artifact(args.hf_dir, args.out, progress=True)
    print(args.out)


if __name__ == "__main__":
    main()
