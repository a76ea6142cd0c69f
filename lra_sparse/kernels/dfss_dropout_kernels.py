"""Triton device functions of DFSS attention dropout: the draws of ``dfss_dropout``.

The mask Z is the one ``dfss_dropout.dropout_multiplier`` computes in JAX (its docstring states
the rule): Philox-4x32 with counter (group // 4, query row, batch*heads + head, word t) and the
seed as key; the kept member of rank j in its group reads 16-bit half j % 2 of word j // 2 and
survives when that half is >= T.  Tiles here are [rows, groups] of one key block (the layout of
the forward and dQ kernels); the key-block backward transposes them.

This module imports triton: only the kernel launchers import it, on first use.
"""

import triton
import triton.language as tl

ROUNDS = tl.constexpr(7)  # dfss_dropout.ROUNDS


@triton.jit
def seed_key(SEED):
  """The two Philox key words, from int32 [2] in memory."""
  return (tl.load(SEED).to(tl.uint32, bitcast=True),
          tl.load(SEED + 1).to(tl.uint32, bitcast=True))


@triton.jit
def kept_scale(T: tl.constexpr):
  """The factor of a surviving probability, 1 / (1 - T / 2^16) (``dfss_dropout.keep_scale``)."""
  return 65536.0 / (65536 - T)


@triton.jit
def group_words(k0, k1, bh, rows, start, t, M: tl.constexpr, G: tl.constexpr):
  """uint32 [BM, G]: word t of each (row, group) of the key block at ``start`` (G groups of M
  keys; ``rows`` [BM] the query rows).  With G % 4 == 0 one Philox call covers four groups and
  its words are interleaved into place (column 4x + k = word k of quad x)."""
  BM: tl.constexpr = rows.shape[0]
  g0 = start // M
  zero = tl.zeros([BM, G // 4 if G % 4 == 0 else G], tl.uint32)
  c1 = rows.to(tl.uint32)[:, None] + zero
  c2 = zero + bh.to(tl.uint32)
  c3 = zero + t
  if G % 4 == 0:  # block starts are multiples of BN = G*M, so g0 % 4 == 0 here
    c0 = (g0 // 4 + tl.arange(0, G // 4)).to(tl.uint32)[None, :] + zero
    o0, o1, o2, o3 = tl.philox_impl(c0, c1, c2, c3, k0, k1, ROUNDS)
    words = tl.interleave(tl.interleave(o0, o2), tl.interleave(o1, o3))
  else:
    g = g0 + tl.arange(0, G)
    c0 = (g // 4).to(tl.uint32)[None, :] + zero
    o0, o1, o2, o3 = tl.philox_impl(c0, c1, c2, c3, k0, k1, ROUNDS)
    k = (g % 4)[None, :]
    words = tl.where(k == 0, o0, tl.where(k == 1, o1, tl.where(k == 2, o2, o3)))
  return words


@triton.jit
def block_words(k0, k1, bh, rows, start, M: tl.constexpr, G: tl.constexpr,
                NKEEP: tl.constexpr, TRANSPOSE: tl.constexpr):
  """The W = ceil(NKEEP / 2) word tiles of a key block: [BM, G], or [G, BM] with TRANSPOSE."""
  words = ()
  for t in tl.static_range((NKEEP + 1) // 2):
    w = group_words(k0, k1, bh, rows, start, t, M, G)
    if TRANSPOSE:
      w = tl.trans(w)
    words = words + (w,)
  return words


@triton.jit
def survivors(keep, words, T: tl.constexpr):
  """Tuple of M bool tiles: kept (``keep``, the N:M masks of the M member tiles) and not
  dropped.  The member of rank j among its group's kept members reads 16-bit half j % 2 of
  word j // 2 and survives when it is >= T."""
  M: tl.constexpr = len(keep)
  W: tl.constexpr = len(words)
  out = ()
  if W == 1:  # at most two kept members: the first takes the low half, the second the high
    lo = (words[0] & 0xFFFF) >= T
    hi = (words[0] >> 16) >= T
    taken = keep[0]
    out = (keep[0] & lo,)
    for i in tl.static_range(1, M):
      out = out + (keep[i] & tl.where(taken, hi, lo),)
      if i < M - 1:
        taken = taken | keep[i]
  else:
    rank = tl.zeros(keep[0].shape, tl.int32)
    for i in tl.static_range(M):
      word = words[0]
      for t in tl.static_range(1, W):
        word = tl.where(rank // 2 == t, words[t], word)
      half = tl.where(rank % 2 == 0, word & 0xFFFF, word >> 16)
      out = out + (keep[i] & (half >= T),)
      rank += keep[i].to(tl.int32)
  return out
