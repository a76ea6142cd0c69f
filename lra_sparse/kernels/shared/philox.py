"""Triton device functions of DFSS attention dropout: the draws of ``ops.dropout``.

The mask Z is the one ``ops.dropout.dropout_multiplier`` computes in JAX (its docstring states
the rule): Philox-4x32 with counter (group, query row, batch*heads + head, t // 4) and the seed
as key gives word t of a (row, group); the kept member of rank j in its group reads 16-bit half
j % 2 of word j // 2 and survives when that half is >= T.  Tiles are [rows, groups] of one key
block (forward and dQ kernels) or [groups, rows] (key-block backward).  ``key_draws`` gives the
per-key draws of kinds that keep arbitrary key sets (DSA): the same words with n = m = 8.

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
  """The factor of a surviving probability, 1 / (1 - T / 2^16) (``ops.dropout.keep_scale``)."""
  return 65536.0 / (65536 - T)


@triton.jit
def block_words(k0, k1, bh, rows, start, M: tl.constexpr, G: tl.constexpr,
                NKEEP: tl.constexpr, TRANSPOSE: tl.constexpr):
  """The W = ceil(NKEEP / 2) word tiles of the key block at ``start`` (G groups of M keys;
  ``rows`` [BM] the query rows): [BM, G], or [G, BM] with TRANSPOSE (the key-block backward),
  each drawn in its own layout: word t is output t % 4 of Philox((group, row, bh, t // 4))."""
  g = (start // M + tl.arange(0, G)).to(tl.uint32)
  r = rows.to(tl.uint32)
  if TRANSPOSE:
    zero = tl.zeros([G, rows.shape[0]], tl.uint32)
    c0 = g[:, None] + zero
    c1 = r[None, :] + zero
  else:
    zero = tl.zeros([rows.shape[0], G], tl.uint32)
    c0 = g[None, :] + zero
    c1 = r[:, None] + zero
  c2 = zero + bh.to(tl.uint32)
  W: tl.constexpr = (NKEEP + 1) // 2
  words = ()
  for call in tl.static_range((W + 3) // 4):
    o = tl.philox_impl(c0, c1, c2, zero + call, k0, k1, ROUNDS)
    for t in tl.static_range(min(4, W - 4 * call)):
      words = words + (o[t],)
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


@triton.jit
def key_draws(k0, k1, bh, rows, start, BN: tl.constexpr, TRANSPOSE: tl.constexpr):
  """uint32 16-bit draws of every key of the block at ``start`` (BN keys, a multiple of 8):
  [BM, BN], or [BN, BM] with TRANSPOSE.  Key j is member j % 8 of group j // 8 with all eight
  members ranked (``ops.dropout.key_multiplier``): half j % 2 of word (j % 8) // 2."""
  G: tl.constexpr = BN // 8
  w = block_words(k0, k1, bh, rows, start, 8, G, 8, TRANSPOSE)   # 4 tiles [BM, G] / [G, BM]
  slot = tl.arange(0, 8)
  if TRANSPOSE:
    which = (slot // 2)[None, :, None]
    shift = ((slot % 2) * 16)[None, :, None].to(tl.uint32)
    w0, w1, w2, w3 = w[0][:, None, :], w[1][:, None, :], w[2][:, None, :], w[3][:, None, :]
  else:
    which = (slot // 2)[None, None, :]
    shift = ((slot % 2) * 16)[None, None, :].to(tl.uint32)
    w0, w1, w2, w3 = w[0][:, :, None], w[1][:, :, None], w[2][:, :, None], w[3][:, :, None]
  word = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
  draws = (word >> shift) & 0xFFFF
  if TRANSPOSE:
    out = tl.reshape(draws, [BN, rows.shape[0]])
  else:
    out = tl.reshape(draws, [rows.shape[0], BN])
  return out


@triton.jit
def gathered_key_draws(k0, k1, bh, rows, keys):
  """``key_draws`` at arbitrary keys (int32 [BN], the gathered forward): [BM, BN], the draw of
  each (row, key) that its contiguous key block gets.  One Philox call per entry instead of
  one per eight keys: word (key % 8) // 2 of (key // 8, row, bh, 0), half key % 2."""
  zero = tl.zeros([rows.shape[0], keys.shape[0]], tl.uint32)
  o = tl.philox_impl((keys // 8).to(tl.uint32)[None, :] + zero, rows.to(tl.uint32)[:, None] + zero,
                     zero + bh.to(tl.uint32), zero, k0, k1, ROUNDS)
  which = ((keys % 8) // 2)[None, :]
  word = tl.where(which == 0, o[0], tl.where(which == 1, o[1], tl.where(which == 2, o[2], o[3])))
  return (word >> ((keys % 2) * 16).to(tl.uint32)[None, :]) & 0xFFFF
