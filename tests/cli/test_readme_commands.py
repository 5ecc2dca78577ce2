"""Every command a user copies from README.md or the docs site (docs/**/*.md) parses with the
CLI it names, and none writes to /tmp (a user's copy must work as it is, anywhere).

`specport ...` lines go through specport's own parser (`build_parser()`, as `specport.cli.main`
builds it); `python -m specport.X` and `python scripts/X.py` lines through the parser their
`main()` builds, stopped right after parsing (nothing runs). Abbreviated options are refused
here although argparse accepts them: `--max-new` works only until another option shares the
prefix. Options named in comments and in inline `specport ...` spans must exist too, and
`--opt a|b|c` alternatives must be among the option's choices. A failure names the file and
line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from specport.cli import build_parser
from tests.cli.readme_commands import (
    ROOT,
    Block,
    Command,
    bash_blocks,
    doc_name,
    documents,
    inline_spans,
)

BLOCKS = [b for path in documents() for b in bash_blocks(path)]
SPANS = [(doc_name(path), line, text) for path in documents() for line, text in inline_spans(path)]
COMMANDS = [c for b in BLOCKS for c in b.commands]
SPECPORT = [c for c in COMMANDS if c.program == "specport"]
MODULES = [c for c in COMMANDS if c.program.startswith(("-m specport.", "-m benchmarks."))]
SCRIPTS = [c for c in COMMANDS if re.fullmatch(r"scripts/[\w-]+\.py", c.program)]
_FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)(?:[ =]+([\w.:/|-]+))?")


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _no_abbrev(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbrev(sub)


@cache
def _specport_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    _no_abbrev(parser)
    return parser


def _leaf(parser: argparse.ArgumentParser, argv: tuple[str, ...]) -> argparse.ArgumentParser:
    """The (sub-)subcommand parser that `argv` ends up in."""
    words = iter(a for a in argv if not a.startswith("-"))
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return parser
        word = next(words, None)
        if word is None:  # `specport --version`: no subcommand
            return parser
        parser = subs[0].choices[word]


def _parse_specport(cmd: Command) -> argparse.ArgumentParser:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _specport_parser().parse_args(list(cmd.argv))
    except SystemExit as e:
        if e.code:
            pytest.fail(f"{cmd.where}: `{cmd}` does not parse:\n{err.getvalue()}")
    return _leaf(_specport_parser(), cmd.argv)


def _load(cmd: Command) -> Any:
    """The module or script a README line runs (imported, not run)."""
    if cmd.program.startswith("-m "):
        name = cmd.program[3:]
        if importlib.util.find_spec(name) is None:
            pytest.fail(f"{cmd.where}: no module {name}")
        return importlib.import_module(name)
    path = ROOT / cmd.program
    if not path.is_file():
        pytest.fail(f"{cmd.where}: no file {cmd.program}")
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[None]:
    """Make ArgumentParser.parse_args raise _Parsed (carrying the parser) once it succeeds."""
    original = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        _no_abbrev(self)
        original(self, args, namespace)
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = parse_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


@cache
def _parse_main(cmd: Command) -> argparse.ArgumentParser | None:
    """Call the module's main() on the README's argv, stopped after parse_args; the parser,
    or None for a module that has no argparse main()."""
    module = _load(cmd)
    main = getattr(module, "main", None)
    if main is None or "argparse" not in Path(module.__file__).read_text(encoding="utf-8"):
        return None
    err = io.StringIO()
    argv, sys.argv = sys.argv, [cmd.program, *cmd.argv]
    try:
        with contextlib.redirect_stderr(err), _stop_after_parsing():
            main()
    except _Parsed as done:
        return done.parser
    except SystemExit as e:
        pytest.fail(f"{cmd.where}: `{cmd}` does not parse:\n{err.getvalue() or e}")
    finally:
        sys.argv = argv
    pytest.fail(f"{cmd.where}: {cmd.program}'s main() returned without parse_args")


def _parser_of(cmd: Command) -> argparse.ArgumentParser | None:
    if cmd.program == "specport":
        return _parse_specport(cmd)
    if cmd in MODULES or cmd in SCRIPTS:
        return _parse_main(cmd)
    return None


def _check_flags(where: str, text: str, parsers: list[argparse.ArgumentParser]) -> None:
    """Each `--flag` in `text` is an option of one of `parsers`; `--flag a|b` values are among
    its choices when it has some."""
    for flag, value in _FLAG.findall(text):
        actions = [
            p._option_string_actions[flag] for p in parsers if flag in p._option_string_actions
        ]
        assert actions, f"{where}: `{flag}` is not an option of {sorted({p.prog for p in parsers})}"
        if "|" in value and actions[0].choices is not None:
            wrong = [v for v in value.split("|") if v not in (*actions[0].choices, "...")]
            assert not wrong, f"{where}: {flag} has no choice {wrong} ({list(actions[0].choices)})"


def _all_specport_parsers() -> list[argparse.ArgumentParser]:
    found: list[argparse.ArgumentParser] = []

    def walk(p: argparse.ArgumentParser) -> None:
        found.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)

    walk(_specport_parser())
    return found


def test_readme_has_commands() -> None:
    """The extraction still finds the README's and the docs' commands (not silently zero)."""
    assert len(SPECPORT) > 50 and MODULES and SCRIPTS
    assert any(c.doc == "README.md" for c in SPECPORT)
    assert any(c.doc == "docs/getting-started.md" for c in SPECPORT)


def test_no_command_writes_to_tmp() -> None:
    """Commands are copied as they are: no /tmp paths (they vanish, and collide between users)."""
    found = [f"{c.where}: {c}" for c in COMMANDS if "/tmp" in str(c)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("cmd", SPECPORT, ids=lambda c: f"{c.where}:{c.argv[0]}")
def test_specport_command_parses(cmd: Command) -> None:
    _parse_specport(cmd)


@pytest.mark.parametrize(
    "cmd", [c for c in SPECPORT if c.argv[0] == "bench"], ids=lambda c: c.where
)
def test_bench_names_real_prompt_sets_and_peers(cmd: Command) -> None:
    """--prompt-set and --peer are checked when the bench starts, not by the parser."""
    from specport.bench.peers import SPECPORT_PEER, check_peer_name
    from specport.bench.prompt_sets import CHAT_SETS, PROMPT_SETS
    from specport.bench.spec_peers import check_spec_peer_name
    from specport.core.errors import InputError

    args = _specport_parser().parse_args(list(cmd.argv))
    if args.prompt_set is not None:
        known = [*PROMPT_SETS, *CHAT_SETS]
        assert args.prompt_set in known, f"{cmd.where}: no prompt set {args.prompt_set}"
    for peer in args.peer:
        try:
            if args.speculative:
                check_spec_peer_name(peer)
            elif not peer.startswith(SPECPORT_PEER):  # its artifact is a README placeholder
                check_peer_name(peer)
        except InputError as e:
            pytest.fail(f"{cmd.where}: {e}")


@pytest.mark.parametrize("cmd", MODULES + SCRIPTS, ids=lambda c: f"{c.where}:{c.program}")
def test_python_command_parses(cmd: Command) -> None:
    _parse_main(cmd)


@pytest.mark.parametrize(
    "script", [c for c in COMMANDS if c.program.endswith(".sh")], ids=lambda c: c.program
)
def test_shell_script_exists(script: Command) -> None:
    assert (ROOT / script.program).is_file(), f"{script.where}: no {script.program}"


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.comments], ids=lambda b: f"{b.doc}:{b.start}"
)
def test_options_in_comments_exist(block: Block) -> None:
    """An option a comment names (`# or --algo default`, a list of serve options) exists on a
    command of the same block, or at least on some specport command."""
    parsers = [p for c in block.commands if (p := _parser_of(c)) is not None]
    parsers += _all_specport_parsers()
    for line, text in block.comments:
        _check_flags(f"{block.doc}:{line}", text, parsers)


@pytest.mark.parametrize("span", SPANS, ids=lambda s: f"{s[0]}:{s[1]}")
def test_inline_commands_parse(span: tuple[str, int, str]) -> None:
    """A command written in prose: `python -m specport.X ...` parses; `specport SUB --opt ...`
    names a real command and real options, and parses unless it is a fragment (arguments or an
    option's value left out, an UPPERCASE placeholder for a number or a choice, [optional]
    parts); of `a|b` it parses `a`."""
    doc, line, text = span
    argv = shlex.split(text)
    if argv[0] == "python":
        _parse_main(Command(line, f"-m {argv[2]}", tuple(argv[3:]), doc))
        return
    parser, words = _specport_parser(), [a for a in argv[1:] if not a.startswith("-")]
    while subs := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
        assert words and words[0] in subs[0].choices, f"{doc}:{line}: `{text}`: no such command"
        parser = subs[0].choices[words.pop(0)]
    _check_flags(f"{doc}:{line}: `{text}`", text, [parser])
    if "[" in text:
        return
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _specport_parser().parse_args([a.split("|")[0] for a in argv[1:]])
    except SystemExit as e:
        fragment = re.search(
            r"arguments are required|expected one argument|(?:value:|got|choice:) '[A-Z_]+'",
            err.getvalue(),
        )
        assert not e.code or fragment, f"{doc}:{line}: `{text}` does not parse:\n{err.getvalue()}"


def test_extraction_reads_shell_like_bash(tmp_path: Path) -> None:
    """Continuations, comments, variables, loops and prefixes come out as a shell runs them."""
    doc = tmp_path / "README.md"
    doc.write_text(
        "```bash\n"
        "T=data.txt\n"
        "specport eval ppl A \\\n"
        "    --text $T   # a comment with 'an apostrophe\n"
        "for x in a b; do specport inspect $x; done\n"
        "for x in c; do\n"
        "  nice -n 5 specport inspect ${x} &\n"
        "done\n"
        "python -m specport.samples.chat_distill --messages m#1\n"
        "```\n",
        encoding="utf-8",
    )
    (block,) = bash_blocks(doc)
    assert [(c.line, c.program, c.argv) for c in block.commands] == [
        (3, "specport", ("eval", "ppl", "A", "--text", "data.txt")),
        (5, "specport", ("inspect", "a")),
        (5, "specport", ("inspect", "b")),
        (7, "specport", ("inspect", "c")),
        (9, "-m specport.samples.chat_distill", ("--messages", "m#1")),
    ]
    assert block.comments == [(4, "a comment with 'an apostrophe")]
