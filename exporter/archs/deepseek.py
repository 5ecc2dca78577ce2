"""DeepSeek-V3: MLA attention + MoE, optionally with multi-token-prediction (MTP) modules.

transformers' default MoE path (`grouped_mm`) is a custom op with no ONNX translation and its
eager expert loop is data-dependent; the `batched_mm` experts implementation exports cleanly.
The HF class drops the checkpoint's MTP layers (`model.layers.{N}` and beyond) on load; we keep
them so the MTP stage can build its draft branch from the real weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from specport.exporter.archs.base import ArchConfig, register_arch

logger = logging.getLogger(__name__)


@register_arch("deepseek_v3")
class DeepseekV3(ArchConfig):
    load_kwargs = {"experts_implementation": "batched_mm"}
    rope = "interleaved"
    rope_types = frozenset({"default", "yarn"})  # the published checkpoints use YaRN

    @classmethod
    def normalize(cls, config: Any) -> dict[str, Any]:
        out = super().normalize(config)
        out["head_dim"] = int(config.qk_nope_head_dim + config.qk_rope_head_dim)
        out["v_head_dim"] = int(config.v_head_dim)
        out["kv_lora_rank"] = int(config.kv_lora_rank)
        out["num_mtp_layers"] = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        return out

    @classmethod
    def extra_weights(cls, source_dir: Path | None, config: Any) -> dict[str, Any] | None:
        n_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if source_dir is None or n_mtp == 0:
            return None
        from safetensors import safe_open

        first = int(config.num_hidden_layers)
        prefixes = tuple(f"model.layers.{first + j}." for j in range(n_mtp))
        files = sorted(Path(source_dir).glob("*.safetensors"))
        index = Path(source_dir) / "model.safetensors.index.json"
        if index.exists():
            names = set(json.loads(index.read_text())["weight_map"].values())
            files = [Path(source_dir) / n for n in sorted(names)]
        tensors: dict[str, Any] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if key.startswith(prefixes):
                        tensors[key] = sf.get_tensor(key)
        if not tensors:
            logger.info("config announces %d MTP layers but the checkpoint has none", n_mtp)
            return None
        return tensors
