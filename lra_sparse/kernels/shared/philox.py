"""Triton device functions of attention dropout: the draws of ``ops.dropout``.

The mask Z is the one ``ops.dropout.dropout_multiplier`` computes in JAX (its docstring states
the rule): Philox-4x32-7 with counter (key // 8, query row, batch*heads + head, 0) and the seed
as key; key j reads 16-bit half j % 2 of word (j % 8) // 2 and survives when that half is >= T.
``member_draws`` gives the draws of the M member tiles of an N:M key block (DFSS: [rows, groups]
in the forward and dQ kernels, [groups, rows] in the key-block backward); ``key_draws`` those of
a contiguous key block (DSA, and the DFSS kernels at 1:1, dense), ``gathered_key_draws`` those
of arbitrary keys.

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
def _half(o, key):
  """The 16-bit draw of ``key`` (int32 tile) from its Philox call's outputs ``o``: half key % 2
  of word (key % 8) // 2."""
  which = (key % 8) // 2
  word = tl.where(which == 0, o[0], tl.where(which == 1, o[1], tl.where(which == 2, o[2], o[3])))
  return (word >> ((key % 2) * 16).to(tl.uint32)) & 0xFFFF


@triton.jit
def member_draws(k0, k1, bh, rows, start, M: tl.constexpr, G: tl.constexpr,
                 TRANSPOSE: tl.constexpr):
  """Tuple of M uint32 tiles: the 16-bit draw of member i (key start + g*M + i) of every group
  g of the key block at ``start`` (a multiple of 8; M a power of two), [BM, G], or [G, BM] with
  TRANSPOSE. One Philox call per group serves all its members when M <= 8 (they share key // 8),
  M / 8 calls when M > 8; M == 1 (dense: every key its own group) is ``key_draws``, one call
  per eight keys."""
  if M == 1:
    return (key_draws(k0, k1, bh, rows, start, G, TRANSPOSE),)
  g = tl.arange(0, G)
  if TRANSPOSE:
    zero = tl.zeros([G, rows.shape[0]], tl.int32)
    first = start + g[:, None] * M + zero
    c1 = rows.to(tl.uint32)[None, :] + zero.to(tl.uint32)
  else:
    zero = tl.zeros([rows.shape[0], G], tl.int32)
    first = start + g[None, :] * M + zero
    c1 = rows.to(tl.uint32)[:, None] + zero.to(tl.uint32)
  uzero = zero.to(tl.uint32)
  c2 = uzero + bh.to(tl.uint32)
  o = tl.philox_impl((first // 8).to(tl.uint32), c1, c2, uzero, k0, k1, ROUNDS)
  out = ()
  for i in tl.static_range(M):
    if i % 8 == 0 and i > 0:
      o = tl.philox_impl(((first + i) // 8).to(tl.uint32), c1, c2, uzero, k0, k1, ROUNDS)
    out = out + (_half(o, first + i),)
  return out


@triton.jit
def survivors(keep, draws, T: tl.constexpr):
  """Tuple of M bool tiles: kept (``keep``, the N:M masks of the M member tiles) and not
  dropped (the member's draw, ``member_draws``, is >= T)."""
  out = ()
  for i in tl.static_range(len(keep)):
    out = out + (keep[i] & (draws[i] >= T),)
  return out


@triton.jit
def key_draws(k0, k1, bh, rows, start, BN: tl.constexpr, TRANSPOSE: tl.constexpr):
  """uint32 16-bit draws of every key of the block at ``start`` (BN keys, a multiple of 8):
  [BM, BN], or [BN, BM] with TRANSPOSE.  One Philox call per eight keys, its four words
  interleaved into place: key j reads half j % 2 of word (j % 8) // 2."""
  G: tl.constexpr = BN // 8
  g = (start // 8 + tl.arange(0, G)).to(tl.uint32)
  if TRANSPOSE:
    zero = tl.zeros([G, rows.shape[0]], tl.uint32)
    w = tl.philox_impl(g[:, None] + zero, rows.to(tl.uint32)[None, :] + zero,
                       zero + bh.to(tl.uint32), zero, k0, k1, ROUNDS)
  else:
    zero = tl.zeros([rows.shape[0], G], tl.uint32)
    w = tl.philox_impl(g[None, :] + zero, rows.to(tl.uint32)[:, None] + zero,
                       zero + bh.to(tl.uint32), zero, k0, k1, ROUNDS)
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
