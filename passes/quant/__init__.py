"""specport.passes.quant: weight and activation quantization of exported artifacts.

Modules: blockquant (the MatMulNBits block format and packing), rtn, hqq, gptq (pure numpy
algorithms: RTN and learned clipping, HQQ, GPTQ), smoothquant, calibration (text ->
activation statistics from the fp32 ONNX model), weight_only (MatMulNBits / QDQ blocked int4
pass), w8a8 (QDQ W8A8 + SmoothQuant pass), embedding (GatherBlockQuantized pass), mixed
(per-layer precision plan), ort_check (what onnxruntime fuses the result into), apply
(`quantize_artifact`, the entry point).
"""
