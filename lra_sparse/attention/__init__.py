"""Attention kinds. Importing this package registers every kind."""
from lra_sparse.attention.registry import (AUX_LOSS, AUX_METRICS, AttentionDims, KindConfig,
                                           attention_kinds, build_attention,
                                           default_attention_config, kind_fields,
                                           parse_attention_config, register_attention)
from lra_sparse.attention import common
from lra_sparse.attention.dense import DenseConfig, dense_attention
from lra_sparse.attention.dfss import DFSSConfig, dfss_attention
from lra_sparse.attention.dsa import DSAConfig
from lra_sparse.attention.nystrom import NystromConfig, nystrom_attention
from lra_sparse.ops.nm import nm_mask, parse_nm

__all__ = ["AUX_LOSS", "AUX_METRICS", "AttentionDims", "KindConfig", "attention_kinds",
           "build_attention", "default_attention_config", "kind_fields",
           "parse_attention_config", "register_attention", "common", "DenseConfig",
           "dense_attention", "DFSSConfig", "dfss_attention", "DSAConfig",
           "nm_mask", "parse_nm", "NystromConfig", "nystrom_attention"]
