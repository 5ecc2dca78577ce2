"""MTP head weights on disk: our own safetensors file, and DeepSeek-V3's checkpoint layers.

Kept apart from `mtp_heads` (the torch modules and the graph branch) because it is only
about names and layouts of tensors: `save_heads` / `load_heads` round-trip the trained heads,
`load_deepseek_mtp` maps a checkpoint's real MTP layers (per-expert tensors fused as
transformers expects) onto the same module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specport.core.errors import InputError
from specport.exporter.mtp_heads import MTPHeads


def save_heads(heads: MTPHeads, directory: Path) -> Path:
    """Write the heads' weights (and draft vocabulary) as ``mtp_heads.safetensors``."""
    from safetensors.torch import save_file

    path = Path(directory) / "mtp_heads.safetensors"
    save_file({k: v.detach().contiguous() for k, v in heads.state_dict().items()}, str(path))
    return path


def load_heads(base: Any, path: Path) -> MTPHeads:
    """Heads over ``base`` from a file `save_heads` wrote (the head count from its keys)."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    n = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("heads."))
    heads = MTPHeads(base, n, draft_vocab=state.get("draft_vocab"))
    heads.load_state_dict(state)
    return heads.eval()


def load_deepseek_mtp(base: Any, weights: dict[str, torch.Tensor]) -> MTPHeads:
    """Real DeepSeek-V3 MTP layers (`model.layers.{N+j}.*`, from mtp_source.safetensors) as heads.

    enorm/hnorm/eh_proj map one to one, `shared_head.norm` is the head's final norm, the rest
    is the decoder block. The embedding and LM head copies in the checkpoint equal the main
    model's and are not duplicated.
    """

    first = int(base.config.num_hidden_layers)
    depths = sorted({int(k.split(".")[2]) for k in weights})
    heads = MTPHeads(base, len(depths))
    state: dict[str, torch.Tensor] = {}
    for j, layer in enumerate(depths):
        if layer != first + j:
            raise InputError(f"MTP layers are not contiguous after layer {first}: found {depths}")
        prefix = f"model.layers.{layer}."
        for key, value in weights.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            if name.startswith(("embed_tokens.", "shared_head.head.")):
                continue
            if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                state[f"heads.{j}.{name}"] = value
            elif name.startswith("shared_head.norm."):
                state[f"heads.{j}.norm.{name[len('shared_head.norm.') :]}"] = value
            else:
                state[f"heads.{j}.block.{name}"] = value
    state = _fuse_experts(state)
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"DeepSeek MTP weights do not fit the MTP module: missing {missing}, unexpected {unexpected}"
        )
    return heads.eval()


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (`experts.{e}.gate_proj.weight`, ...) to transformers' fused
    `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]."""
    import re

    pattern = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        m = pattern.match(key)
        if m is None:
            out[key] = value
        else:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
    for prefix, experts in groups.items():
        order = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out
