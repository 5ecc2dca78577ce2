"""Deprecated path: the Ray Serve deployment is `specport.ray_serve` (each replica loads its
artifact, which is the API's job, so it no longer sits in the runtime).

`from specport.runtime.serve.ray import deployment` warns and keeps working until 2027-03-01,
when this module will be removed; import from `specport.ray_serve` instead.
"""

from __future__ import annotations

import warnings

from specport.ray_serve import (
    SpecportReplica,
    deployment,
    run_deployment,
    serve_with_ray,
    start_local_ray,
)

warnings.warn(
    "specport.runtime.serve.ray is deprecated and will be removed on 2027-03-01; "
    "import from specport.ray_serve instead",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["SpecportReplica", "deployment", "run_deployment", "serve_with_ray", "start_local_ray"]
