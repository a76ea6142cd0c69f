"""Tile choices of the DFSS Triton kernels (plain Python: no jax, no triton).

Kernel families: "fwd" (fused forward), "bwd" (fused backward over key blocks: one pass with dQ
by atomics, or the dK/dV kernel of the deterministic pair), "dq" (the deterministic dQ kernel)
and "cmp" (every kernel of the compressed pipeline).  Chosen on the H100 / from ptxas register
and spill reports for sm_90a (the Triton kernels' tuning report).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

META_BITS = 32  # keep bits per int32 metadata word


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One launch configuration: BM query rows x BN keys per tile, warps and pipeline stages.

  onepass ("bwd" only): the default backward is one kernel per key block that adds dQ into an
  fp32 buffer with atomics; deterministic=True always runs the dK/dV + dQ kernel pair.
  """
  bm: int
  bn: int
  num_warps: int
  num_stages: int
  onepass: bool = False


# (kind, dtype class, head_dim) -> Tiles; head_dim 16 uses the 64 entry.  One pass (dQ by
# atomics) measured faster than the dK/dV + dQ kernels on the H100 for both dtype classes.
_DEFAULT = {
    ("fwd", "half", 32): Tiles(128, 64, 4, 3),
    ("fwd", "half", 64): Tiles(128, 64, 4, 3),
    ("fwd", "half", 128): Tiles(128, 64, 8, 2),
    ("fwd", "f32", 32): Tiles(128, 64, 4, 2),
    ("fwd", "f32", 64): Tiles(128, 64, 4, 2),
    ("fwd", "f32", 128): Tiles(64, 32, 4, 2),
    ("bwd", "half", 32): Tiles(64, 64, 4, 2, onepass=True),
    ("bwd", "half", 64): Tiles(64, 128, 8, 2, onepass=True),
    ("bwd", "half", 128): Tiles(64, 64, 8, 2, onepass=True),
    ("bwd", "f32", 32): Tiles(32, 64, 4, 2, onepass=True),
    ("bwd", "f32", 64): Tiles(32, 64, 4, 2, onepass=True),
    ("bwd", "f32", 128): Tiles(32, 32, 4, 1, onepass=True),
    ("dq", "half", 32): Tiles(128, 128, 8, 3),
    ("dq", "half", 64): Tiles(128, 128, 8, 3),
    ("dq", "half", 128): Tiles(128, 64, 8, 2),
    ("dq", "f32", 32): Tiles(64, 64, 4, 2),
    ("dq", "f32", 64): Tiles(64, 64, 4, 2),
    ("dq", "f32", 128): Tiles(64, 32, 4, 2),
    ("cmp", "half", 32): Tiles(64, 128, 4, 2),
    ("cmp", "half", 64): Tiles(64, 128, 4, 2),
    ("cmp", "half", 128): Tiles(64, 64, 4, 2),
    ("cmp", "f32", 32): Tiles(64, 64, 4, 2),
    ("cmp", "f32", 64): Tiles(64, 64, 4, 2),
    ("cmp", "f32", 128): Tiles(32, 32, 4, 1),
}

# (kind, dtype class, head_dim, M) -> Tiles, replacing the default.  2:4 half at d=64 (the
# paper's bf16 setting): 64x128 beat 128x64 by 7-8% on the H100.  M=8 raises BN to 128 (16 keys
# per sub-tile), which needs other warps / stages (no spills over ~200 bytes, shared memory
# under the 227 KiB limit).
_PER_M = {
    ("fwd", "half", 64, 4): Tiles(64, 128, 4, 2),
    ("fwd", "half", 32, 8): Tiles(128, 128, 8, 3),
    ("fwd", "half", 64, 8): Tiles(128, 128, 8, 3),
    ("fwd", "half", 128, 8): Tiles(64, 128, 8, 2),
    ("fwd", "f32", 32, 8): Tiles(64, 128, 8, 2),
    ("fwd", "f32", 64, 8): Tiles(64, 128, 8, 2),
    ("fwd", "f32", 128, 8): Tiles(64, 128, 4, 1),
    ("bwd", "half", 32, 2): Tiles(32, 128, 8, 2, onepass=True),
    ("bwd", "half", 64, 2): Tiles(32, 128, 8, 2, onepass=True),
    ("bwd", "half", 64, 8): Tiles(16, 128, 8, 2, onepass=True),
    ("bwd", "half", 128, 8): Tiles(16, 128, 8, 1, onepass=True),
    ("bwd", "f32", 32, 4): Tiles(64, 64, 4, 2, onepass=True),
    ("bwd", "f32", 32, 8): Tiles(16, 128, 8, 2, onepass=True),
    ("bwd", "f32", 64, 8): Tiles(16, 128, 8, 2, onepass=True),
    ("bwd", "f32", 128, 4): Tiles(16, 64, 8, 1, onepass=True),
    ("bwd", "f32", 128, 8): Tiles(16, 128, 8, 1, onepass=True),
    ("dq", "f32", 128, 8): Tiles(64, 128, 4, 1),
}

def dtype_class(dtype_name: str) -> str:
  """'f32' for float32, 'half' for bfloat16 / float16."""
  return "f32" if dtype_name == "float32" else "half"


def tiles(kind: str, dtype_name: str, head_dim: int, m: int,
          override: Optional[Tiles] = None) -> Tiles:
  """The launch tiles of a kernel family for dtype / head_dim / M: ``override`` when given
  (tuning), else the tables above.

  BN is raised to at least 16*M (every sub-tile product has >= 16 keys) and, for the
  compressed kernels, to a whole metadata word (32 keys).
  """
  key = (kind, dtype_class(dtype_name), head_dim)
  t = override or _PER_M.get(key + (m,)) or _DEFAULT.get(key) or _DEFAULT[
      (kind, key[1], 64)]
  return dataclasses.replace(t, bn=max(t.bn, 16 * m, META_BITS if kind == "cmp" else 0))
