"""A static prefill/decode graph pair (the `qnn` target) behind the concat session interface.

The artifact's static graphs (exporter/static_graphs.py) take batch 1, a fixed number of new
tokens (the prefill chunk, or 1) and a fixed past of M slots, and return only the new slots'
keys and values. `StaticSession` answers `run` with the concat contract every runtime path
already drives (input_ids [B, S], attention_mask [B, P+S], past [B, Hkv, P, Dh] in; logits
[B, S, V], present [B, Hkv, P+S, Dh] out): per row it copies the past into an M-slot buffer,
runs the prefill graph over S in chunks (padding the last one) or the decode graph for one
token, and writes the new slots in. So plain, speculative and batched decoding run unchanged;
what it costs is a host copy of the past per call, nothing next to an NPU step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact import manifest as art
from specport.core.errors import ArtifactError, ContextLengthError
from specport.runtime.session import make_session

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arg:
    """What `get_inputs()` / `get_outputs()` describe (onnxruntime's NodeArg fields)."""

    name: str
    type: str
    shape: list[Any]


class StaticSession:
    """Runs `prefill` (S = chunk) and `decode` (S = 1) sessions as one concat-layout session."""

    def __init__(self, prefill: Any, decode: Any, static: dict[str, Any]) -> None:
        self.prefill, self.decode = prefill, decode
        self.past_length = int(static["past_length"])
        self.chunk = int(static["prefill_chunk"])
        outputs = [o.name for o in decode.get_outputs()]
        self.present = [n for n in outputs if n.startswith("present.")]
        self.past = [n.replace("present.", "past_key_values.", 1) for n in self.present]
        self._inputs = [_dynamic(a, "input") for a in decode.get_inputs()]
        self._outputs = [_dynamic(a, "output") for a in decode.get_outputs()]
        self.input_names = {a.name for a in self._inputs}

    def get_inputs(self) -> list[Arg]:
        return list(self._inputs)

    def get_outputs(self) -> list[Arg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return list(self.decode.get_providers())

    def get_session_options(self) -> Any:
        return self.decode.get_session_options()

    def run(self, names: list[str] | None, feeds: dict[str, Any], run_options: Any = None) -> list:
        ids = np.asarray(feeds["input_ids"])
        batch, seq = ids.shape
        mask = np.asarray(feeds["attention_mask"])
        past = mask.shape[1] - seq
        if past + seq > self.past_length:
            raise ContextLengthError(
                f"{past + seq} tokens do not fit this static artifact's context of "
                f"{self.past_length}; export it again with a larger --context-length."
            )
        positions = feeds.get("position_ids")
        if positions is None:
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
        rows = [
            self._row(
                ids[b], mask[b], np.asarray(positions)[b], [feeds[n][b : b + 1] for n in self.past]
            )
            for b in range(batch)
        ]
        result = {"logits": np.concatenate([r[0] for r in rows], axis=0)}
        for i, name in enumerate(self.present):
            result[name] = np.concatenate([r[1][i] for r in rows], axis=0)
        wanted = names or [a.name for a in self._outputs]
        return [result[n] for n in wanted]

    def _row(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, pasts: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One row: logits [1, S, V] and presents [1, Hkv, P+S, Dh] (past copied + new slots)."""
        seq = ids.shape[0]
        past = mask.shape[0] - seq
        m = self.past_length
        buffers = []
        for p in pasts:
            buf = np.zeros((1, p.shape[1], m, p.shape[3]), p.dtype)
            buf[:, :, :past] = p
            buffers.append(buf)
        filled = np.zeros(m, np.int64)
        filled[:past] = mask[:past]
        logits: list[np.ndarray] = []
        done = 0
        while done < seq:
            left = seq - done
            session, width = (self.decode, 1) if left == 1 else (self.prefill, self.chunk)
            n = min(left, width)
            new = slice(past + done, past + done + n)
            x = np.zeros((1, width), np.int64)
            x[0, :n] = ids[done : done + n]
            pos = np.zeros((1, width), np.int64)
            pos[0, :n] = positions[done : done + n]
            real = np.zeros(width, np.int64)
            real[:n] = mask[new]
            feeds = {
                "input_ids": x,
                "attention_mask": np.concatenate([filled, real])[None, :],
            }
            if "position_ids" in self.input_names:
                feeds["position_ids"] = pos
            for name, buf in zip(self.past, buffers):
                feeds[name] = buf
            out = session.run(["logits", *self.present], feeds)
            logits.append(out[0][:, :n])
            for buf, kv in zip(buffers, out[1:]):
                buf[:, :, new] = kv[:, :, :n]
            filled[new] = mask[new]
            done += n
        return np.concatenate(logits, axis=1), [b[:, :, : past + seq] for b in buffers]


def _dynamic(arg: Any, kind: str) -> Arg:
    """The concat contract's symbolic shape for a static graph's input or output."""
    name, shape = arg.name, list(arg.shape)
    if name in ("input_ids", "position_ids"):
        shape = ["batch", "sequence_length"]
    elif name == "attention_mask":
        shape = ["batch", "total_sequence_length"]
    elif name == "logits":
        shape = ["batch", "sequence_length", shape[-1]]
    elif name.startswith(("past_key_values.", "present.")):
        length = "past_sequence_length" if kind == "input" else "total_sequence_length"
        shape = ["batch", shape[1], length, shape[3]]
    return Arg(name, arg.type, shape)


def static_info(manifest: art.Manifest) -> dict[str, Any] | None:
    """The manifest's static-graph section (qnn target), or None."""
    static = manifest.extra.get("static")
    return static if isinstance(static, dict) and static.get("graphs") else None


def graph_files(directory: Path, static: dict[str, Any], provider: str) -> dict[str, Path]:
    """The graphs to open: the EPContext models compiled for the NPU when the provider is qnn
    and they exist, else the float static graphs (compiled by the provider at load)."""
    compiled = static.get("epcontext") or {}
    files = {}
    for role, name in static["graphs"].items():
        ctx = compiled.get(role)
        path = directory / (ctx if provider == "qnn" and ctx else name)
        if not path.exists():
            raise ArtifactError(f"{path} is missing from the artifact; export it again.")
        files[role] = path
    return files


def open_static(directory: Path, manifest: art.Manifest, config: Any) -> tuple[StaticSession, str]:
    """Open both static graphs with `config`'s provider (qnn: the manifest's SoC)."""
    from dataclasses import replace

    static = static_info(manifest)
    if static is None:
        raise ArtifactError(f"{directory} has no static graphs (export with --target qnn).")
    provider = config.provider.lower()
    if static.get("quant"):  # QDQ graphs: keep onnxruntime CPU from fusing DQ->MatMul into
        # MatMulNBits with int8 activations (an NPU computes uint16 activations)
        entries = {"session.qdq_matmulnbits_accuracy_level": "0", **config.config_entries}
        config = replace(config, config_entries=entries)
    if provider == "qnn":
        options = {"backend_type": "htp", "soc_model": str(static.get("soc", 60))}
        config = replace(config, provider_options={**options, **config.provider_options})
    files = graph_files(directory, static, provider)
    prefill, used = make_session(files["prefill"], config)
    decode, _ = make_session(files["decode"], config)
    logger.info("static graphs %s on %s", {k: v.name for k, v in files.items()}, used)
    return StaticSession(prefill, decode, static), used
