"""onnxruntime's own QNN QDQ recipe on a specport artifact, as a baseline for `--form npu`.

`get_qnn_qdq_config` + `quantize` (onnxruntime.quantization) on the artifact's graph, calibrated
on the same feeds specport's npu form uses (`specport.passes.quant.npu.calibration_feeds`: the
same documents, tokenizer and late-position run), written as a sibling artifact that
`specport eval ppl` scores like any other. Recipes: `u8` (the recipe's defaults: uint16
activations, uint8 per-tensor weights), `s8pc` (int8 symmetric per-channel weights), `s4pc`
(int4 symmetric per-channel weights).

    python scripts/ort_qnn_baseline.py ARTIFACT OUT --calib TEXT --recipe u8
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RECIPES = ("u8", "s8pc", "s4pc")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", help="float32 specport artifact (concat KV layout)")
    p.add_argument("out", help="new artifact directory")
    p.add_argument(
        "--calib", required=True, help="calibration text (documents separated by blank lines)"
    )
    p.add_argument("--calib-docs", type=int, default=64, help="documents used (default 64)")
    p.add_argument("--recipe", default="u8", choices=RECIPES)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    from specport.artifact.manifest import read_manifest
    from specport.passes.quant.npu import calibration_feeds

    src, out = Path(args.artifact), Path(args.out)
    manifest = read_manifest(src)
    model = src / manifest.model_file
    feeds = calibration_feeds(model, manifest, src, [args.calib], max_docs=args.calib_docs)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self) -> dict[str, Any] | None:
            return next(self.it, None)

    kw: dict[str, Any] = {"activation_type": QuantType.QUInt16, "weight_type": QuantType.QUInt8}
    if args.recipe in ("s8pc", "s4pc"):
        weight = QuantType.QInt8 if args.recipe == "s8pc" else QuantType.QInt4
        kw = {**kw, "weight_type": weight, "per_channel": True, "weight_symmetric": True}
    out.mkdir(parents=True, exist_ok=False)
    quantize(
        str(model), str(out / manifest.model_file), get_qnn_qdq_config(str(model), Reader(), **kw)
    )
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith((manifest.model_file, "specport.json")):
            shutil.copyfile(f, out / f.name)
    record = json.loads((src / "specport.json").read_text())
    record.pop("files", None)
    # the same CPU session setting specport's npu artifacts carry: DQ->MatMul stays float
    record["quant"] = {
        "scheme": f"ort-qnn-{args.recipe}",
        "ort_session_config": {"session.qdq_matmulnbits_accuracy_level": "0"},
    }
    (out / "specport.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
