"""Dynamic N:M selection: keep the n largest of every m consecutive entries.

One spelling and one rule for N:M everywhere (configs, functions, kernels): the string
``"n:m"`` (or an ``(n, m)`` pair) with integers ``0 < n <= m``; ``n == m`` keeps every entry.

The rank of an entry inside its group is the number of group members that beat it (greater,
or equal with a lower index), computed by m broadcast comparisons. No sort or argsort: XLA
fuses the comparisons into whatever elementwise pass reads the scores (an argsort version
measured 36-50x slower than dense attention on an H100).
"""
from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

NMSpec = Union[str, tuple[int, int]]


def check_nm(n: int, m: int, *, what: str = "n:m") -> None:
  """Raises one ValueError unless n and m are integers with 0 < n <= m."""
  if isinstance(n, bool) or isinstance(m, bool) or not (isinstance(n, int) and isinstance(m, int)):
    raise ValueError(f"{what}: n and m must be integers, got n={n!r}, m={m!r}")
  if not 0 < n <= m:
    raise ValueError(f"{what}: need 0 < n <= m, got n={n}, m={m}")


def parse_nm(spec: NMSpec, *, what: str = "nm") -> tuple[int, int]:
  """``"2:4"`` or ``(2, 4)`` -> ``(2, 4)``, checked by ``check_nm``; anything else -> one
  ValueError naming ``what``."""
  if isinstance(spec, str):
    parts = spec.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
      raise ValueError(f"{what}={spec!r} must be 'n:m' with integers 0 < n <= m, e.g. '2:4'")
    n, m = int(parts[0]), int(parts[1])
  elif isinstance(spec, (tuple, list)) and len(spec) == 2:
    n, m = spec
  else:
    raise ValueError(f"{what}={spec!r} must be 'n:m' (a string) or an (n, m) pair")
  check_nm(n, m, what=f"{what}={spec!r}")
  return n, m


def nm_mask(scores: jax.Array, n: int, m: int) -> jax.Array:
  """bool, same shape as ``scores``: True for the n largest of every m consecutive entries.

  Groups run along the LAST axis, whose size must be a multiple of m. Ties go to the lower
  index; -inf entries (padded keys) lose to every finite one. n == m keeps everything.
  """
  check_nm(n, m, what="nm_mask")
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


TOURNAMENT_N = (1, 2)   # the N of the N:4 rules ``keep_n_of_4`` computes


def keep_n_of_4(members, n: int):
  """The N:4 rule (n in ``TOURNAMENT_N``) on groups held as four arrays, ``members[j]``
  member j of every group (the layout the fused kernels hold score tiles in): (keep masks, one
  per member, the groups' maxima).

  A tournament: pair (a, b) has winner w1 = max(a, b) and loser l1, pair (c, d) w2 and l2.
  A member beats the other pair's members it is not below (a and b win ties against c and d:
  >=) or above (c and d: >), so at 2:4 it is kept when it beats the other pair's weaker member
  if it won its own pair and the stronger one if it lost; at 1:4 only a winner can be kept,
  when it beats the other pair's winner. Exact as ``nm_mask``, ties and -inf included. Per
  group: two pair compares and four min/max, then per member one select and one compare,
  where counting ranks takes three compares per member."""
  if n not in TOURNAMENT_N or len(members) != 4:
    raise ValueError(f"keep_n_of_4 takes four members and n in {TOURNAMENT_N}, got "
                     f"{len(members)} members and n={n}")
  a, b, c, d = members
  ab, cd = a >= b, c >= d
  w1, l1 = jnp.maximum(a, b), jnp.minimum(a, b)
  w2, l2 = jnp.maximum(c, d), jnp.minimum(c, d)
  if n == 2:     # (threshold of a pair's winner, of its loser), from the other pair's members
    win1, lose1, win2, lose2 = l1, w1, l2, w2
  else:          # a loser is never kept: no member reaches +inf
    win1, lose1, win2, lose2 = w1, jnp.inf, w2, jnp.inf
  keep = [a >= jnp.where(ab, win2, lose2), b >= jnp.where(ab, lose2, win2),
          c > jnp.where(cd, win1, lose1), d > jnp.where(cd, lose1, win1)]
  return keep, jnp.maximum(w1, w2)
