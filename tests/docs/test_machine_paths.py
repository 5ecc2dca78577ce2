"""No page, README or developer script names a path that exists on one machine only.

A reader copies commands as they are: `/tmp/x` vanishes and collides between users, and
`/work/...`, `/root/...` or `/home/NAME/...` are where one machine kept its files. Pages and
scripts say `out/NAME` (a folder of the checkout, git-ignored), a name the page's own commands
create, `../shared/...` beside the checkout where the page says so, or a per-user location
(`~/.cache/specport`, `$HOME/...`). Read as text (prose, code blocks, script comments and
defaults alike), so a path in an environment prefix (`OUT=/tmp/x bash ...`) is caught too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli.readme_commands import ROOT, doc_name, documents

# An absolute path into a folder that belongs to one machine or user; not a URL's path
# (`http://host/tmp`) and not a relative `out/tmp`.
MACHINE_PATH = re.compile(r"(?<![\w.~$/])/(tmp|work|root|home|Users|mnt|scratch)(?=/|\b)")


def _files() -> list[Path]:
    scripts = [
        p
        for folder in ("benchmarks", "scripts")
        for p in sorted((ROOT / folder).iterdir())
        if p.suffix in (".py", ".sh")
    ]
    return [*documents(), ROOT / "mkdocs.yml", *scripts]


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line of `text` that names a machine path."""
    return [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]


def test_pages_and_scripts_name_no_machine_path() -> None:
    found = [
        f"{doc_name(path)}:{n}: {line}"
        for path in _files()
        for n, line in machine_paths(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "paths a reader cannot have (write out/NAME or a name made on the page):\n"
        + ("\n".join(found))
    )


@pytest.mark.parametrize(
    ("line", "hit"),
    [
        ("OUT=/tmp/vllm6 ROUNDS=1 bash benchmarks/serve_vs_vllm.sh", True),
        ("ART=${ART:-/work/h23-newcomer/smollm}", True),
        ("specport generate /root/smollm --prompt hi", True),
        ("see /home/alice/models", True),
        ("(`/tmp`)", True),
        ("OUT=out/vllm6 ROUNDS=1 bash benchmarks/serve_vs_vllm.sh", False),
        ("kept in `~/.cache/specport/step_costs.json`", False),
        ("VLLM_VENV=$HOME/.cache/specport/venvs/vllm-cpu", False),
        ("curl http://127.0.0.1:8000/v1/completions", False),
        ("specport export ../shared/models/stories260K --out out/tmp", False),
        ("`/usr/bin/time -v` and tmp_path", False),
    ],
)
def test_machine_path_pattern(line: str, hit: bool) -> None:
    assert bool(machine_paths(line)) is hit
