"""KV caches: the per-layout state (concat, shared), one sequence's appendable cache, and the IO-bound buffers of the in-place layout."""
