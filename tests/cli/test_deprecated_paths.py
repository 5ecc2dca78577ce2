"""Import paths that moved keep working for a while, and say where to go and until when."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("specport.api", "load", "specport"),
        ("specport.runtime.serve.ray", "deployment", "specport.ray_serve"),
        ("specport.errors", "UsageError", "specport.core.errors"),
        ("specport.artifact", "read_manifest", "specport.artifact.manifest"),
        ("specport.artifact", "Manifest", "specport.artifact.manifest"),
    ],
)
def test_a_moved_path_warns_with_the_new_path_and_a_removal_date(old, name, new):
    code = (
        "import warnings, importlib\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    obj = getattr(importlib.import_module({old!r}), {name!r})\n"
        f"new = getattr(importlib.import_module({new!r}), {name!r})\n"
        "assert obj is new, (obj, new)\n"
        "msgs = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
        "print(msgs[0] if msgs else '')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    message = out.stdout.strip()
    assert old in message and new in message and "2027-03-01" in message


def test_the_package_itself_does_not_import_a_deprecated_path():
    code = (
        "import sys, specport\n"
        "import specport.cli as cli\n"
        "cli.build_parser() if hasattr(cli, 'build_parser') else None\n"
        "for m in ('generate', 'chat', 'export', 'quantize', 'optimize', 'serve', 'train_mtp'):\n"
        "    __import__('specport.commands.' + m)\n"
        "specport.load\n"
        "print(sorted(m for m in ('specport.api', 'specport.runtime.serve.ray', 'specport.errors')\n"
        "             if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_package_root_still_reaches_the_moved_error_module():
    code = (
        "import warnings, specport\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    cls = specport.errors.UsageError\n"
        "assert cls is specport.UsageError\n"
        "print([str(x.message) for x in w if x.category is DeprecationWarning][0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "specport.errors" in out.stdout and "2027-03-01" in out.stdout
