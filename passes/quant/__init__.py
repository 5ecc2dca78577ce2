"""specport.passes.quant: weight and activation quantization of exported artifacts.

Modules: algorithms (pure numpy: RTN, HQQ, GPTQ, learned clipping, the MatMulNBits packing;
one import path over blockquant, rtn, hqq and gptq), smoothquant, calibration (text ->
activation statistics from the fp32 ONNX model), weight_only (MatMulNBits / QDQ blocked int4
pass), w8a8 (QDQ W8A8 + SmoothQuant pass), embedding (GatherBlockQuantized pass), mixed
(per-layer precision plan), ort_check (what onnxruntime fuses the result into), apply
(`quantize_artifact`, the entry point).
"""
