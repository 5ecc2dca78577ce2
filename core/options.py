"""How a message names an option: `--max-new-tokens 0` at the command line, `max_new_tokens=0`
in Python.

Checks are written once (in the API) and read by two audiences: a CLI user should be told
which flag to change, a Python caller which keyword argument. The CLI switches the spelling
for the whole command with `cli_names()`; library code writes `option("max_new_tokens", 0)`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_CLI: contextvars.ContextVar[bool] = contextvars.ContextVar("specport_cli_names", default=False)

# Keyword arguments whose flag is not simply --name-with-dashes.
FLAGS = {
    "calib_files": "--calib",
    "num_heads": "--heads",
    "num_sequences": "--sequences",
    "fuse": "--no-fuse",
    "out": "--out",
    "prompt": "--prompt",
    "chat": "--chat",
    "model": "MODEL",
    "artifact": "ARTIFACT",
    "src": "ARTIFACT",
}


@contextmanager
def cli_names() -> Iterator[None]:
    """Within the block, `option()` spells command-line flags."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


def at_cli() -> bool:
    return _CLI.get()


def option(name: str, value: Any = ..., flag: str | None = None) -> str:
    """`--name value` (CLI) or `name=value` (Python); `flag` overrides the CLI spelling."""
    if _CLI.get():
        text = flag or FLAGS.get(name) or "--" + name.replace("_", "-")
        if value is ... or isinstance(value, bool) or text.isupper():
            return text
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        return f"{text} {value}"
    if value is ...:
        return name
    return f"{name}={value!r}"
