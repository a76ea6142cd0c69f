"""Sparse-attention kernels: pure-JAX references (run everywhere) and Triton kernels
(GPU only, called through jax-triton).

Importing this package never imports triton or jax_triton; ``dfss_triton`` imports them
lazily on first kernel launch, so CPU-only installs work.  Typical use::

    from kernels import dfss_triton
    if dfss_triton.is_available():
        out = dfss_triton.dfss_attention_triton(q, k, v, n=2, m=4, mask=mask)
    else:
        out = dfss_reference.dfss_attention_reference(q, k, v, n=2, m=4, mask=mask)
"""

from kernels import dfss_reference
from kernels import dfss_triton
from kernels.dfss_reference import (
    decompress,
    dfss_attention_reference,
    nm_keep_mask,
    nm_prune_compress,
)
from kernels.dfss_triton import dfss_attention_triton, is_available

__all__ = [
    "dfss_reference",
    "dfss_triton",
    "decompress",
    "dfss_attention_reference",
    "dfss_attention_triton",
    "is_available",
    "nm_keep_mask",
    "nm_prune_compress",
]
