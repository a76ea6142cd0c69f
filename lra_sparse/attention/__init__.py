"""Attention kinds. Importing this package registers every kind."""
from lra_sparse.attention.registry import (AUX_LOSS, AUX_METRICS, AttentionDims,
                                           attention_kinds, build_attention,
                                           register_attention)
from lra_sparse.attention.dense import dense_attention

__all__ = ["AUX_LOSS", "AUX_METRICS", "AttentionDims", "attention_kinds", "build_attention",
           "register_attention", "dense_attention"]
