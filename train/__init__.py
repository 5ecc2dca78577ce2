"""specport.train: drafters trained for an artifact (EAGLE heads, MTP heads).

The data (the target's answers and features, their caches), the objectives and the training
loops. Training sits beside the pipeline, not in it: it runs the target (the runtime) and hands
the heads it trained to the exporter's writers (``exporter.eagle_artifact``,
``exporter.mtp_artifact``), which know the heads as modules to export (``exporter.eagle_head``,
``exporter.mtp_heads``) and nothing of how they were trained. Neither the runtime nor the
exporter imports training (the layer contracts in pyproject.toml).
"""
