"""`specport bench`'s table: a row per metric, a column per engine, and the floors under them."""

from __future__ import annotations

from typing import Any

ONNXRUNTIME_PEERS = ("onnxruntime-genai",)  # peers whose steps run onnxruntime's kernels


def format_table(report: dict[str, Any]) -> str:
    """One table: a row per metric, a column per engine, and ours-vs-peer speedups."""
    engines = report["engines"]
    names = list(engines)
    rows = [
        ("ttft_ms", "TTFT ms"),
        ("tpot_ms", "TPOT ms"),
        ("decode_tok_per_s", "decode tok/s"),
        ("prefill_tok_per_s", "prefill tok/s"),
        ("framework_overhead_pct", "overhead %"),
        ("peak_rss_mb", "peak RSS MB"),
        ("cpu_ms_per_token", "CPU ms/token"),
        ("spread_pct", "decode spread %"),
    ]
    header = ["metric", *names, *[f"specport/{n}" for n in names[1:]]]
    lines = [header]
    for key, label in rows:
        line = [label] + [_fmt(engines[n].get(key)) for n in names]
        for n in names[1:]:
            line.append(_fmt(engines[n].get("specport_speedup", {}).get(key), "x"))
        lines.append(line)
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(header))]
    text = "\n".join(
        "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        for r in lines
    )
    hw = report["hardware"]
    cfg = report["config"]
    text += (
        f"\n\nbatch {cfg['batch']}, prompt {cfg['prompt_len']}, new {cfg['new_tokens']}, runs {cfg['runs']} "
        f"(medians; speedup = median of per-round ratios, > 1 = specport better)\n"
        f"bytes per decode step: weights {hw['weight_bytes_per_step'] / 1e6:.1f} MB + KV "
        f"{hw['kv_bytes_per_step'] / 1e6:.2f} MB; bandwidth ({hw['bandwidth'].get('method')}, "
        f"{hw['bandwidth']['buffer_mb']} MB) "
        f"median {hw['bandwidth']['median_gb_s']} GB/s, best {hw['bandwidth']['best_gb_s']} GB/s\n"
        f"bandwidth floor: TPOT {hw['floor_tpot_ms']} ms ({hw['floor_decode_tok_per_s']} tok/s); "
        f"specport TPOT / floor = {engines['specport'].get('tpot_vs_floor')}; load average {hw['load_average']}"
    )
    kernel = hw.get("kernel_floor")
    if kernel and kernel.get("median_ms"):
        text += (
            f"\nkernel floor: {kernel['median_ms']} ms per step ({kernel['method']}, "
            f"{kernel['weight_bytes'] / 1e6:.1f} MB); TPOT / kernel floor: "
            + ", ".join(f"{n} {engines[n].get('tpot_vs_kernel_floor')}" for n in names)
        )
        for n in names[1:]:
            peer_tpot = engines[n].get("tpot_ms")
            if peer_tpot and n in ONNXRUNTIME_PEERS:  # the bound holds for onnxruntime's kernels
                text += (
                    f"\nthe most any runtime on these kernels could gain over {n} here: "
                    f"{peer_tpot / kernel['median_ms']:.2f}x"
                )
    if hw.get("weights_fit_in_cache"):
        text += (
            f"\nnote: the bytes of a step fit in the last-level cache "
            f"({hw['last_level_cache_bytes'] / 2**20:.0f} MiB), so they are read from cache, "
            "not DRAM: the floor above is measured over the same buffer size and is a cache floor"
        )
    return text


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{suffix}" if abs(value) < 100 else f"{value:.1f}{suffix}"
    return f"{value}{suffix}"
