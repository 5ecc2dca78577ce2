"""The ground every layer may import: errors, settings, progress, options and outputs, the
ONNX file checks, tokenizer and chat template, prompt files, and the text they read.
"""
