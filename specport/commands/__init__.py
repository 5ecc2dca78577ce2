"""One module per CLI subcommand: `add_parser(subparsers)` and `run(args) -> int`.

Why the imports of the work sit inside `run()`: `specport --help` (cli.build_parser) imports
every command module, so their module level stays free of numpy, onnxruntime and torch (the
CLI starts in about half a second instead of several); the import-linter contracts in
pyproject.toml see those imports all the same.
"""
