"""Every artifact a page's commands read is made on that page first, so the page runs as written
from a fresh clone (with ../shared beside it where the page says so).

A reader who opens one page copies its blocks in order: `specport generate smollm` works only
if a command above it wrote `smollm`. Made means a command's `--out DIR` (or a folder under it,
`demo/fp32` after `specport demo --out demo`), or a folder the benchmark scripts write
(`python -m benchmarks.model DIR`, `python -m benchmarks.X ... --out DIR`); read means an artifact argument (`generate`, `chat`,
`serve`, `bench`, `quantize`, `eval`, `inspect`, `train-*`, `upgrade`, `optimize`), a draft
(`--draft`), a peer artifact (`--peer specport:DIR`), or `loadtest --artifact`. The models and
texts of `../shared` are inputs, not artifacts. Nothing is run.
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import PurePosixPath

import pytest

from specport.cli import build_parser
from tests.cli.readme_commands import Command, bash_blocks, doc_name, documents

# specport subcommands whose positional arguments are artifacts, and how many of them
READS = {
    "inspect": 1,
    "generate": 1,
    "chat": 1,
    "serve": 1,
    "optimize": 1,
    "quantize": 1,
    "bench": 1,
    "train-mtp": 1,
    "train-draft": 1,
    "upgrade": 1,
    "ppl": 1,  # eval ppl ART
    "compare": None,  # eval compare A B [C ...]: all of them
}
_PEER = "specport:"
# a Hugging Face model id (`owner/name`), which export reads from the hub cache, not a path
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _options_with_values() -> set[str]:
    """The options that take a value (so a value is not taken for a positional argument),
    read from the CLI's parser."""
    found: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            elif action.option_strings and action.nargs != 0:
                found.update(action.option_strings)

    walk(build_parser())
    return found


VALUED = _options_with_values()


def _positionals(argv: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in VALUED and "=" not in arg
        else:
            out.append(arg)
    return out


def _values(argv: tuple[str, ...], option: str) -> list[str]:
    return [b for a, b in itertools.pairwise(argv) if a == option]


def reads_and_makes(cmd: Command) -> tuple[list[str], list[str]]:
    """(artifacts and local sources the command reads, folders it makes)."""
    if cmd.program == "-m benchmarks.model" and cmd.argv:
        return [], [cmd.argv[0]]
    if cmd.program.endswith("scripts/random_checkpoint.py") and len(cmd.argv) > 1:
        return [], [cmd.argv[1]]
    if cmd.program.startswith("-m benchmarks."):  # a benchmark that writes a copy: --out DIR
        return [], _values(cmd.argv, "--out")
    if cmd.program != "specport" or not cmd.argv:
        return [], []
    args = cmd.argv
    makes = _values(args, "--out")
    words = _positionals(args)
    sub = words[1] if words[:1] == ["eval"] and len(words) > 1 else words[0] if words else ""
    rest = words[2:] if words[:1] == ["eval"] else words[1:]
    count = READS.get(sub, 0)
    reads = rest if count is None else rest[:count]
    if sub == "export" and rest and not HUB_ID.fullmatch(rest[0]):
        reads.append(rest[0])  # a local source: ../shared, or made above (a hub id is fetched)
    reads += [v for v in _values(args, "--draft") if v != "self"]  # self: made by the command
    reads += [p[len(_PEER) :] for p in _values(args, "--peer") if p.startswith(_PEER)]
    if sub == "loadtest":
        reads += _values(args, "--artifact")
    return reads, makes


def _is_input(path: str) -> bool:
    return path.startswith("../shared/") or "$" in path or path.startswith("http")


def _made(path: str, made: set[str]) -> bool:
    p = PurePosixPath(path)
    return any(str(q) in made for q in (p, *p.parents))


def unmade_reads(doc) -> list[str]:
    made: set[str] = set()
    missing = []
    for block in bash_blocks(doc):
        for cmd in block.commands:
            reads, makes = reads_and_makes(cmd)
            missing += [
                f"{cmd.where}: {cmd} reads {r!r}, which no command above it on the page makes"
                for r in reads
                if not _is_input(r) and not _made(r, made)
            ]
            made.update(str(PurePosixPath(m)) for m in makes)
    return missing


@pytest.mark.parametrize("doc", documents(), ids=doc_name)
def test_page_makes_the_artifacts_it_reads(doc) -> None:
    missing = unmade_reads(doc)
    assert not missing, "\n".join(missing)


def test_reads_and_makes() -> None:
    cmd = Command(1, "specport", ("bench", "smol", "--peer", "specport:smol-w4", "--runs", "1"))
    assert reads_and_makes(cmd) == (["smol", "smol-w4"], [])
    cmd = Command(1, "specport", ("eval", "compare", "A", "B", "C", "--text", "t.txt"))
    assert reads_and_makes(cmd) == (["A", "B", "C"], [])
    cmd = Command(1, "specport", ("quantize", "A", "--out", "B", "--scheme", "w4a8"))
    assert reads_and_makes(cmd) == (["A"], ["B"])
    cmd = Command(1, "specport", ("export", "../shared/models/stories260K", "--out", "S"))
    assert reads_and_makes(cmd) == (["../shared/models/stories260K"], ["S"])
    cmd = Command(1, "specport", ("export", "HuggingFaceTB/SmolLM2-135M", "--out", "S"))
    assert reads_and_makes(cmd) == ([], ["S"])
    cmd = Command(1, "specport", ("export", "model.Q4_1.gguf", "--out", "S"))
    assert reads_and_makes(cmd) == (["model.Q4_1.gguf"], ["S"])
    assert _made("demo/fp32", {"demo"}) and not _made("demox", {"demo"})
