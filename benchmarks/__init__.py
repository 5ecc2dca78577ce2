"""Developer benchmarks: not part of the installed package (run from a checkout's root, e.g.
`python -m benchmarks.bench_fusion`). What users run is `specport bench`."""
