"""Sparse-attention kernels: pure-JAX references (run everywhere) and Triton kernels
(GPU only, called through jax-triton).

Importing this package never imports triton or jax_triton; ``dfss_triton`` imports them
lazily on first kernel launch, so CPU-only installs work.  Typical use::

    from lra_sparse.kernels import dfss_reference, dfss_triton
    if dfss_triton.is_available() and dfss_triton.unsupported_reason(q, v, 2, 4) is None:
      out = dfss_triton.dfss_attention_triton(q, k, v, n=2, m=4, mask=mask)
    else:
      out = dfss_reference.dfss_attention_reference(q, k, v, n=2, m=4, mask=mask)
"""

from lra_sparse.kernels import dfss_reference
from lra_sparse.kernels import dfss_triton
from lra_sparse.kernels.dfss_reference import (
    decompress,
    dfss_attention_reference,
    nm_prune_compress,
)
from lra_sparse.kernels.dfss_triton import dfss_attention_triton, is_available, unsupported_reason

__all__ = [
    "dfss_reference",
    "dfss_triton",
    "decompress",
    "dfss_attention_reference",
    "dfss_attention_triton",
    "is_available",
    "nm_prune_compress",
    "unsupported_reason",
]
