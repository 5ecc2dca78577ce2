"""Deprecated import path: the error family lives in `specport.core.errors`, and every class is
importable from `specport` itself (`except specport.UsageError:`).

`from specport.errors import SpecportError` keeps working, with a DeprecationWarning, until
2027-03-01, when this module will be removed.
"""

from __future__ import annotations

import warnings

from specport.core import errors as _errors
from specport.core.errors import *  # noqa: F403  (the same classes, under the old path)

warnings.warn(
    "specport.errors is deprecated and will be removed on 2027-03-01; import the same names "
    "from specport (e.g. `except specport.UsageError`) or specport.core.errors",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(_errors.__all__)
