"""The commands a user copies from README.md and docs/**/*.md, as argv lists with the file and
line they start on.

Reads the ```bash blocks the way a shell would read them closely enough for checking: joins
backslash continuations, drops `#` comments (kept apart, for the options they name), expands
`NAME=value` variables and `for VAR in ...; do ...; done` loops, splits on `;`, `&&`, `|`, `&`,
and strips `nice -n N` / `time` prefixes. Used by test_readme_commands.py; nothing is run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def documents() -> list[Path]:
    """README.md and every page of the docs site, in a stable order."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def doc_name(path: Path) -> str:
    """`path` as the failure messages name it (relative to the repository root)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


_FENCE_OPEN = re.compile(r"^\s*```bash\s*$")
_FENCE_CLOSE = re.compile(r"^\s*```\s*$")
_ASSIGN = re.compile(r"^[A-Za-z_]\w*=")
_VAR = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")
_OPERATORS = {";", "&&", "||", "|", "&"}


@dataclass(frozen=True)
class Command:
    """One simple command: `program` is "specport", "-m MODULE", a script path or another
    program; `argv` is what follows it."""

    line: int
    program: str
    argv: tuple[str, ...]
    doc: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def __str__(self) -> str:
        return " ".join(shlex.quote(a) for a in (self.program, *self.argv))


@dataclass
class Block:
    """One ```bash block: its commands and its comments (line, text)."""

    start: int
    commands: list[Command] = field(default_factory=list)
    comments: list[tuple[int, str]] = field(default_factory=list)
    doc: str = "README.md"


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of one shell line: `#` starts a comment only at the start of a word and
    outside quotes (so `a#b` and "# in quotes" stay code, like in bash)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1 :].strip()
    return line, ""


def _tokens(code: str) -> list[str]:
    lex = shlex.shlex(code, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = ""
    return list(lex)


def _segments(tokens: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for tok in tokens:
        if tok in _OPERATORS:
            out.append([])
        else:
            out[-1].append(tok)
    return [s for s in out if s]


def _strip_prefixes(argv: list[str]) -> list[str]:
    """Drop what runs the command rather than being it: `X=1`, `nice -n 5`, `time -v`."""
    while argv:
        if _ASSIGN.match(argv[0]) and len(argv) > 1:
            argv = argv[1:]
        elif argv[0] == "nice":
            argv = argv[3:] if len(argv) > 2 and argv[1] == "-n" else argv[1:]
        elif argv[0] in ("time", "/usr/bin/time"):
            argv = argv[2:] if len(argv) > 1 and argv[1] == "-v" else argv[1:]
        else:
            return argv
    return argv


def _command(line: int, argv: list[str]) -> Command | None:
    argv = _strip_prefixes(argv)
    if not argv:
        return None
    prog = Path(argv[0]).name
    if prog == "specport":
        return Command(line, "specport", tuple(argv[1:]))
    if re.fullmatch(r"python[\d.]*", prog) and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2:
            if argv[2] == "specport":
                return Command(line, "specport", tuple(argv[3:]))
            return Command(line, f"-m {argv[2]}", tuple(argv[3:]))
        return Command(line, argv[1], tuple(argv[2:]))
    if prog in ("bash", "sh") and len(argv) > 1:
        return Command(line, argv[1], tuple(argv[2:]))
    return Command(line, argv[0], tuple(argv[1:]))


def _logical_lines(lines: list[tuple[int, str]], block: Block) -> list[tuple[int, str]]:
    """Join backslash continuations; comments go to `block.comments`."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in lines:
        code, comment = split_comment(text)
        if comment:
            block.comments.append((number, comment))
        code = code.rstrip()
        cont = code.endswith("\\")
        code = code[:-1] if cont else code
        pending = (pending[0], f"{pending[1]} {code}") if pending else (number, code)
        if not cont:
            out.append(pending)
            pending = None
    if pending:
        out.append(pending)
    return out


def _substitute(argv: list[str], env: dict[str, str]) -> list[str]:
    return [_VAR.sub(lambda m: env.get(m[1], m[0]), a) for a in argv]


def _read_block(start: int, lines: list[tuple[int, str]], env: dict[str, str]) -> Block:
    block = Block(start)
    loop: tuple[str, list[str], list[tuple[int, list[str]]]] | None = None
    for number, code in _logical_lines(lines, block):
        for seg in _segments(_tokens(code)):
            if len(seg) == 1 and _ASSIGN.match(seg[0]):
                name, value = seg[0].split("=", 1)
                env[name] = value
                continue
            if seg[0] == "for" and len(seg) >= 3 and seg[2] == "in":
                loop = (seg[1], seg[3:], [])
                continue
            if seg[0] == "do" and loop is not None:
                seg = seg[1:]
                if not seg:
                    continue
            if seg[0] == "done" and loop is not None:
                var, values, body = loop
                for value in values:
                    for n, argv in body:
                        found = _command(n, _substitute(argv, {**env, var: value}))
                        if found:
                            block.commands.append(found)
                loop = None
                continue
            if loop is not None:
                loop[2].append((number, seg))
                continue
            found = _command(number, _substitute(seg, env))
            if found:
                block.commands.append(found)
    return block


def bash_blocks(path: Path = README) -> list[Block]:
    """Every ```bash block of `path`, in order. Variables set in one block (`T=...`) carry
    into the later ones, as they would in the user's shell session."""
    name = doc_name(path)
    blocks = _bash_blocks(path)
    for block in blocks:
        block.doc = name
        block.commands = [replace(c, doc=name) for c in block.commands]
    return blocks


def _bash_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    env: dict[str, str] = {}
    inside: list[tuple[int, str]] | None = None
    start = 0
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if inside is None:
            if _FENCE_OPEN.match(text):
                inside, start = [], number
        elif _FENCE_CLOSE.match(text):
            blocks.append(_read_block(start, inside, env))
            inside = None
        else:
            inside.append((number, text))
    return blocks


def inline_spans(path: Path = README) -> list[tuple[int, str]]:
    """(line, text) of every `specport ...` / `python -m specport...` code span outside fenced
    blocks; a span may wrap across the lines of its paragraph (its text comes back on one)."""
    paragraphs: list[tuple[int, list[str]]] = []
    fenced, blank = False, True
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if text.lstrip().startswith("```"):
            fenced, blank = not fenced, True
        elif fenced or not text.strip():
            blank = True
        elif blank:
            paragraphs.append((number, [text]))
            blank = False
        else:
            paragraphs[-1][1].append(text)
    found: list[tuple[int, str]] = []
    for start, lines in paragraphs:
        text = "\n".join(lines)
        for m in re.finditer(r"`((?:specport |python -m specport\.)[^`]+)`", text):
            found.append((start + text.count("\n", 0, m.start()), " ".join(m[1].split())))
    return found
