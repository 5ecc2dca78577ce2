"""mkdocs hook: writes the CLI reference from specport's own argparse parsers at build time.

`docs/reference/cli.md` holds the marker `<!-- cli-reference -->`; this hook replaces it with one
section per command (and sub-command): its help line, usage, and a table of every argument with
its default and choices. The parsers are the single source, so the reference cannot drift from
what `specport COMMAND --help` says.
"""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "reference/cli.md" or MARKER not in markdown:
        return markdown
    from specport.cli import build_parser

    return markdown.replace(MARKER, cli_markdown(build_parser()))


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    """Markdown for every sub-command of `parser`, in --help order."""
    out: list[str] = []
    _commands(parser, "specport", out, level=2)
    return "\n".join(out)


def _subparsers(parser: argparse.ArgumentParser) -> tuple[dict[str, Any], dict[str, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return dict(action.choices), helps
    return {}, {}


def _commands(parser: argparse.ArgumentParser, prog: str, out: list[str], level: int) -> None:
    children, helps = _subparsers(parser)
    for name, child in children.items():
        path = f"{prog} {name}"
        out.append(f"{'#' * level} `{path}`\n")
        if helps.get(name):
            out.append(f"{_sentence(helps[name])}\n")
        if child.description and child.description != helps.get(name):
            out.append(f"{child.description}\n")
        usage = child.format_usage().removeprefix("usage: ").strip()
        out.append(f"```text\n{usage}\n```\n")
        rows = [_row(a) for a in child._actions if _shown(a)]
        if rows:
            out.append("| argument | default | what it does |\n|---|---|---|")
            out.extend(rows)
            out.append("")
        _commands(child, path, out, level + 1)


def _shown(action: argparse.Action) -> bool:
    if isinstance(action, argparse._SubParsersAction):
        return False
    return action.help is not argparse.SUPPRESS and action.dest not in ("help", "verbose", "quiet")


def _row(action: argparse.Action) -> str:
    if action.option_strings:
        flags = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            flags += f" `{action.metavar or action.dest.upper()}`"
    else:
        flags = f"`{action.metavar or action.dest}`"
    default = action.default
    if default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0:
        shown = ""
    else:
        shown = f"`{default}`"
    text = action.help or ""
    if action.choices and not isinstance(action.choices, dict):
        text += (
            (" " if text else "") + "(one of: " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        )
    if action.required and action.option_strings:
        text = "**required.** " + text
    return f"| {flags} | {shown} | {_cell(text)} |"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("%%", "%")


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
