"""Dynamic N:M selection: keep the n largest of every m consecutive entries.

The rank of an entry inside its group is the number of group members that beat it (greater,
or equal with a lower index), computed by m broadcast comparisons. No sort or argsort: XLA
fuses the comparisons into whatever elementwise pass reads the scores (an argsort version
measured 36-50x slower than dense attention on an H100).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_nm(n: int, m: int, *, what: str = "n:m") -> None:
  """Raises one ValueError unless n and m are integers with 0 < n <= m."""
  if isinstance(n, bool) or isinstance(m, bool) or not (isinstance(n, int) and isinstance(m, int)):
    raise ValueError(f"{what}: n and m must be integers, got n={n!r}, m={m!r}")
  if not 0 < n <= m:
    raise ValueError(f"{what}: need 0 < n <= m, got n={n}, m={m}")


def nm_mask(scores: jax.Array, n: int, m: int) -> jax.Array:
  """bool, same shape as ``scores``: True for the n largest of every m consecutive entries.

  Groups run along the LAST axis, whose size must be a multiple of m. Ties go to the lower
  index; -inf entries (padded keys) lose to every finite one. n == m keeps everything.
  """
  check_nm(n, m)
  length = scores.shape[-1]
  if length % m:
    raise ValueError(f"nm_mask: last dimension {length} is not a multiple of m={m}")
  groups = scores.reshape(scores.shape[:-1] + (length // m, m))
  position = jnp.arange(m)
  rank = jnp.zeros(groups.shape, jnp.int32)
  for i in range(m):  # m static comparisons of every member against member i
    challenger = groups[..., i:i + 1]
    beats = (challenger > groups) | ((challenger == groups) & (i < position))
    rank = rank + beats.astype(jnp.int32)
  return (rank < n).reshape(scores.shape)
