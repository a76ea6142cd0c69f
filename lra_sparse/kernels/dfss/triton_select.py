"""Triton device functions shared by the DFSS kernels: key sub-tiles and N:M selection.

A key block of BN keys is handled as M sub-tiles of G = BN/M keys: sub-tile i holds keys
``g*M + i`` (g = 0..G-1), the Triton analogue of the paper's column interleaving (Fig. 9).  Each
sub-tile is its own tensor-core product, so the M members of every group sit at the same
position of the M score tiles, and the N:M choice is elementwise across a tuple of M tiles.

Selection rule (the one of ``lra_sparse.ops.nm.nm_mask``): in each group of M scores keep
the N largest; a member beats another when it is greater, or equal with a lower index.  Padded
keys score -inf and so never beat a real key.

This module imports triton: only the kernel launchers import it, on first use.
"""

import triton
import triton.language as tl


@triton.jit
def key_subtiles(start, offs_g, L, KM, b, M: tl.constexpr, HAS_MASK: tl.constexpr):
  """Key indices of the M sub-tiles of the key block at ``start``.

  Returns tuples (kp, kin, kv) of M [G] tiles: kp[i] = start + g*M + i, kin[i] = kp[i] < L
  (inside the sequence), kv[i] = kin[i] and, with HAS_MASK, the key-padding mask KM of batch
  row b (a real key).
  """
  kp = ()
  kin = ()
  kv = ()
  for i in tl.static_range(M):
    kp_i = start + offs_g * M + i
    kin_i = kp_i < L
    kv_i = kin_i
    if HAS_MASK:
      kv_i = kv_i & (tl.load(KM + b * L + kp_i, mask=kin_i, other=0) != 0)
    kp = kp + (kp_i,)
    kin = kin + (kin_i,)
    kv = kv + (kv_i,)
  return kp, kin, kv


@triton.jit
def group_max(s):
  """Elementwise maximum over the tuple of M score tiles: the largest score of each group."""
  mx = s[0]
  for i in tl.static_range(1, len(s)):
    mx = tl.maximum(mx, s[i])
  return mx


@triton.jit
def _add_at(t, j: tl.constexpr, x):
  """The tuple t with x added to its element j."""
  return t[:j] + (t[j] + x,) + t[j + 1:]


@triton.jit
def _at_most_one(x, y, z):
  """True where at most one of the three bools is set: not majority(x, y, z)."""
  return ~((x & y) | (z & (x | y)))


@triton.jit
def nm_keep(s, NKEEP: tl.constexpr):
  """N:M keep masks of a tuple of M score tiles (tile i = member i of every group).

  Returns a tuple of M bool tiles: keep[i] is True where member i is among the NKEEP largest
  of its group (rank < NKEEP, rank = number of members that beat it).
  * M == 1 (1:1, dense attention): all True.
  * NKEEP == 1: the first arg-max of the group (one max and one compare per member).
  * M == 4, NKEEP in (2, 3): the six pairwise "i beats j" predicates combined with boolean logic
    (2:4: at most one beater; 3:4: not all three beat it): one LOP3 per member on the GPU
    instead of integer rank counters.
  * otherwise: integer rank counters from the M(M-1)/2 pairwise compares.
  """
  M: tl.constexpr = len(s)
  if M == 1:  # 1:1, dense: every key is kept (padded ones score -inf and weigh 0)
    keep = (tl.full(s[0].shape, 1, tl.int1),)
  elif NKEEP == 1:
    gmax = group_max(s)
    taken = s[0] == gmax
    keep = (taken,)
    for i in tl.static_range(1, M):
      keep_i = (s[i] == gmax) & (taken == 0)
      keep = keep + (keep_i,)
      if i < M - 1:
        taken = taken | keep_i
  elif M == 4 and (NKEEP == 2 or NKEEP == 3):
    b01 = s[0] >= s[1]
    b02 = s[0] >= s[2]
    b03 = s[0] >= s[3]
    b12 = s[1] >= s[2]
    b13 = s[1] >= s[3]
    b23 = s[2] >= s[3]
    # beaters of member k: j < k where b_jk, j > k where not b_kj
    if NKEEP == 2:
      keep = (_at_most_one(~b01, ~b02, ~b03), _at_most_one(b01, ~b12, ~b13),
              _at_most_one(b02, b12, ~b23), _at_most_one(b03, b13, b23))
    else:
      keep = (~(~b01 & ~b02 & ~b03), ~(b01 & ~b12 & ~b13), ~(b02 & b12 & ~b23),
              ~(b03 & b13 & b23))
  else:
    rank = ()
    for i in tl.static_range(M):
      rank = rank + (tl.full(s[0].shape, 0, tl.int32),)
    for i in tl.static_range(M):
      for j in tl.static_range(i + 1, M):
        c = (s[i] >= s[j]).to(tl.int32)
        rank = _add_at(rank, j, c)
        rank = _add_at(rank, i, 1 - c)
    keep = ()
    for i in tl.static_range(M):
      keep = keep + (rank[i] < NKEEP,)
  return keep
