"""Attention kinds. Importing this package registers every kind."""
from lra_sparse.attention.registry import (AUX_LOSS, AUX_METRICS, AttentionDims,
                                           attention_kinds, build_attention,
                                           register_attention)
from lra_sparse.attention.dense import dense_attention
from lra_sparse.attention import dfss, dsa, nystrom  # registers "dfss", "dsa", "nystrom"
from lra_sparse.attention.nm import nm_mask
from lra_sparse.attention.dfss import dfss_attention
from lra_sparse.attention.nystrom import nystrom_attention

__all__ = ["AUX_LOSS", "AUX_METRICS", "AttentionDims", "attention_kinds", "build_attention",
           "register_attention", "dense_attention", "nm_mask", "dfss_attention",
           "nystrom_attention"]
