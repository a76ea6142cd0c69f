"""Module paths that moved: importing an old one fails with one line naming its new home.

The kernels moved into one folder per family and the math they share into ``lra_sparse.ops``;
scripts and specs written before still say e.g. ``from lra_sparse.kernels import dfss_triton``
or ``from lra_sparse.attention.nm import parse_nm``. A finder on ``sys.meta_path`` (installed by
``import lra_sparse``) answers those imports with an ImportError that names the new module.
"""
from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "lra_sparse.attention.nm": "lra_sparse.ops.nm",
    "lra_sparse.kernels.dfss_reference": "lra_sparse.kernels.dfss.reference",
    "lra_sparse.kernels.dfss_triton": "lra_sparse.kernels.dfss.triton",
    "lra_sparse.kernels.dfss_fused_kernels": "lra_sparse.kernels.dfss.triton_kernels",
    "lra_sparse.kernels.dfss_select": "lra_sparse.kernels.dfss.triton_select",
    "lra_sparse.kernels.dfss_tiles": "lra_sparse.kernels.dfss.tiles",
    "lra_sparse.kernels.dfss_compressed": "lra_sparse.kernels.dfss.compressed",
    "lra_sparse.kernels.dfss_compressed_kernels": "lra_sparse.kernels.dfss.compressed_kernels",
    "lra_sparse.kernels.dfss_mgpu": "lra_sparse.kernels.dfss.mosaic",
    "lra_sparse.kernels.dfss_launch":
        "lra_sparse.kernels.shared.prologue (launch: lra_sparse.kernels.shared.launch)",
    "lra_sparse.kernels.dfss_dropout": "lra_sparse.ops.dropout",
    "lra_sparse.kernels.dfss_dropout_kernels": "lra_sparse.kernels.shared.philox",
    "lra_sparse.kernels.dsa_reference": "lra_sparse.kernels.dsa.reference",
    "lra_sparse.kernels.dsa_triton": "lra_sparse.kernels.dsa.triton",
    "lra_sparse.kernels.dsa_attention_kernels": "lra_sparse.kernels.dsa.attention_kernels",
    "lra_sparse.kernels.dsa_select_kernels": "lra_sparse.kernels.dsa.select_kernels",
    "lra_sparse.kernels.dsa_gram": "lra_sparse.kernels.dsa.gram",
    "lra_sparse.kernels.dsa_gram_kernels": "lra_sparse.kernels.dsa.gram_kernels",
    "lra_sparse.kernels.landmark_attention_pallas": "lra_sparse.kernels.nystrom.landmark",
    "lra_sparse.kernels.length_conv_pallas": "lra_sparse.kernels.nystrom.length_conv",
    "lra_sparse.kernels.pinv_pallas": "lra_sparse.kernels.nystrom.pinv",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder):
  """Raises one ImportError naming the new module for an import of a moved one."""

  def find_spec(self, fullname, path=None, target=None):  # pylint: disable=unused-argument
    if fullname in MOVED:
      raise ImportError(f"{fullname} moved to {MOVED[fullname]}", name=fullname)
    return None


def install() -> None:
  """Puts the finder on ``sys.meta_path`` once."""
  if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())
