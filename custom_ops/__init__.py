"""specport.custom_ops: the `specport` op domain (schemas, function bodies, numpy references).

Importing this package registers every op in `REGISTRY`; `lowering.lower_model` swaps them for
a target's native ops.
"""

from specport.custom_ops import group_query_attention, layer_norm, rms_norm, rotary_embedding
from specport.custom_ops._base import (
    DOMAIN,
    REGISTRY,
    CustomOp,
    attach_functions,
    detach_functions,
    used_ops,
)

__all__ = [
    "DOMAIN",
    "REGISTRY",
    "CustomOp",
    "attach_functions",
    "detach_functions",
    "group_query_attention",
    "layer_norm",
    "rms_norm",
    "rotary_embedding",
    "used_ops",
]
