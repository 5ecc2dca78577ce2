"""The artifact as other runtimes read it: genai_config.json and its graph, config.json and
tokenizer_config.json for Optimum, the README.md model card.

A layer of its own just above the core: everything that writes an artifact (the exporter,
quantization, MTP training, `eval --record`) writes these files with the manifest through
`files.write_artifact_manifest`, and nothing here imports the exporter, passes or runtime.
"""
