"""What the graph micro-benches share (`bench_fusion`, `bench_exports`): the ~30M-parameter Llama
they export, a run over IO-bound inputs, and interleaved timing.

Below both, so neither bench imports the other for these.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

BENCH_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=1024,
    initializer_range=0.02,
)


def export_llama30m(root: Path) -> Path:
    from tests.passes.graph_models import export_tiny, tiny_model

    path = root / "bench_llama30m" / "model.onnx"
    if not path.exists():
        model = tiny_model("llama", **BENCH_CONFIG)
        n = sum(p.numel() for p in model.parameters())
        logger.info("exporting %.1fM-param llama to %s", n / 1e6, path)
        export_tiny(model, path)
    return path


def interleaved(fns: dict[str, Any], repeat: int) -> dict[str, dict[str, float]]:
    """Time every variant round-robin so load changes on a shared machine hit all alike.

    Each round starts one variant later: the first run of a round is measurably slower (on the
    8-layer GPT-2, ~0.4 ms of a 6.5 ms decode step, whichever graph runs first), so a fixed order
    would charge that to one variant.
    """
    for fn in fns.values():  # warm-up
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(repeat):
        k = r % len(order)
        for name, fn in order[k:] + order[:k]:
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {
        k: {"median_ms": round(statistics.median(v), 3), "min_ms": round(min(v), 3)}
        for k, v in times.items()
    }


def bound_run(sess, feeds: dict[str, np.ndarray], shared: bool):
    """IO binding; with `shared`, present.{i}.* is bound to the past buffer (in place)."""
    import onnxruntime as ort

    binding = sess.io_binding()
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()}
    for k, v in values.items():
        binding.bind_ortvalue_input(k, v)
    for out in sess.get_outputs():
        name = out.name
        if shared and name.startswith("present."):
            _, i, kv = name.split(".")
            binding.bind_ortvalue_output(name, values[f"past_key_values.{i}.{kv}"])
        else:
            binding.bind_output(name, "cpu")

    def run():
        sess.run_with_iobinding(binding)

    return run
