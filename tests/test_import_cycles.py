"""scripts/import_cycles.py (run by scripts/lint_imports.sh in CI) finds a cycle between modules,
including one closed by an import inside a function, and reports none where imports point one
way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "import_cycles", ROOT / "scripts/import_cycles.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, name: str, files: dict[str, str]) -> None:
    folder = root / name
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for module, text in files.items():
        (folder / f"{module}.py").write_text(text)


@pytest.mark.parametrize(
    ("files", "cycles"),
    [
        ({"a": "from cyc_pkg import b\n", "b": "X = 1\n"}, 0),
        ({"a": "from cyc_pkg import b\n", "b": "def f():\n    from cyc_pkg import a\n"}, 1),
        (
            {
                "a": "import cyc_pkg.b\n",
                "b": "import cyc_pkg.c\n",
                "c": "import cyc_pkg.a\n",
                "d": "import cyc_pkg.e\n",
                "e": "import cyc_pkg.d\n",
            },
            2,
        ),
    ],
)
def test_counts_cycles(tmp_path: Path, monkeypatch, capsys, files, cycles) -> None:
    _package(tmp_path, "cyc_pkg", files)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert _script().report(["cyc_pkg"]) == cycles
    out = capsys.readouterr().out
    assert f"{cycles} import cycles" in out
    if cycles:
        assert "cyc_pkg.a -> " in out and out.count(" -> ") >= 2
