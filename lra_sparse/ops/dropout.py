"""Attention dropout for every kind and every backend: one counter-based keep bit per
(example, head, query row, key), shared by the Triton kernels, the Mosaic GPU kernels and JAX.

Dropout acts on the probabilities after the softmax, A <- A * Z / (1 - rate) with Z a
Bernoulli(1 - rate) mask, as the pure-JAX path of every kind does.  The fused kernels never
store A, so the forward and the backward must draw the same Z from scratch: Z is a function of
(seed, batch*head, query row, key) only, never of tile sizes, launch order, or which keys a
sparse kind keeps.  This module computes exactly the Z the kernels compute
(``kernels.shared.philox`` for Triton; ``kernels.dfss.mosaic`` runs ``philox_rounds`` itself,
in registers), so every backend of every kind (dense, DFSS, DSA) drops the same entries for
the same seed.

The rule.  The generator is Philox-4x32 (Salmon et al., SC'11; Triton's ``tl.philox_impl``)
with ``ROUNDS`` = 7 rounds, the fewest its authors found free of statistical failures
(BigCrush); the default 10 adds margin we pay for in every tile.  One call draws the 128 bits
of eight consecutive keys of one row:

* the call for key j of query row r in (example b, head h) has counter (c0, c1, c2, c3) =
  (j // 8, r, b * heads + h, 0) and key = the seed's two 32-bit words;
* key j reads 16-bit half j % 2 (low half first) of output word (j % 8) // 2;
* it is dropped when that half is < T = round(rate * 2^16); kept ones are scaled by
  2^16 / (2^16 - T): the effective rate is T / 2^16 (0.1 -> 0.100006), and the scale makes
  the expectation exact for it (unbiased).

A sparse kind multiplies Z into probabilities that are already 0 off its kept set, so the
draw of an entry does not depend on which keys its row keeps (an earlier rule ranked an N:M
group's kept members and gave each a half by rank; runs with attention dropout recorded
before the change drew other masks, of the same law).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ROUNDS = 7
HALF_BITS = 16
KEY_GROUP = 8         # keys drawn per Philox call (four words, two 16-bit halves each)
_HALF = 1 << HALF_BITS
_MUL_A = 0xD2511F53   # Philox-4x32 multipliers and key increments (Random123, Triton)
_MUL_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85


def threshold(rate: float) -> int:
  """T of a dropout rate: a 16-bit draw below T drops the entry (0: no dropout)."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"attention dropout rate {rate} must be in [0, 1)")
  t = int(round(rate * _HALF))
  if t >= _HALF:
    raise ValueError(f"attention dropout rate {rate} rounds to 1 at 16-bit resolution")
  return t


def keep_scale(t: int) -> float:
  """The factor of a kept probability: 1 / (1 - T / 2^16)."""
  return _HALF / (_HALF - t)


def checked_seed(rate: float, seed):
  """(T, seed) of one call: T = threshold(rate) and, when T > 0, ``seed`` as int32 [2]
  (``seed_words``), else None; one error when the seed is missing or malformed."""
  t = threshold(rate)
  if not t:
    return t, None
  if seed is None:
    raise ValueError("dropout_rate > 0 needs dropout_seed (dfss_dropout.seed_words(rng))")
  seed = jnp.asarray(seed)
  if seed.shape != (2,) or seed.dtype != jnp.int32:
    raise ValueError(f"dropout_seed must be int32 [2], got {seed.dtype}{list(seed.shape)}")
  return t, seed


def seed_operand(seed) -> jax.Array:
  """The kernels' SEED operand: ``seed`` (int32 [2]), or a dummy they do not read (None)."""
  return jnp.zeros((2,), jnp.int32) if seed is None else seed


def seed_words(rng) -> jax.Array:
  """The Philox key of one call: two 32-bit words from a JAX PRNG key, as int32 [2] (the
  kernels read it from memory, so a new seed every step needs no recompilation)."""
  return jax.lax.bitcast_convert_type(jax.random.bits(rng, (2,), jnp.uint32), jnp.int32)


def mulhilo_limbs(a: int, b):
  """(high, low) 32-bit halves of the 64-bit product a * b, a a constant, b uint32: from 16-bit
  limbs, so that no 64-bit integers are needed (JAX runs without x64 by default)."""
  a_hi, a_lo = jnp.uint32(a >> 16), jnp.uint32(a & 0xFFFF)
  b_hi, b_lo = b >> 16, b & 0xFFFF
  lo_lo = a_lo * b_lo
  mid = a_hi * b_lo + (lo_lo >> 16)
  mid2 = a_lo * b_hi + (mid & 0xFFFF)
  hi = a_hi * b_hi + (mid >> 16) + (mid2 >> 16)
  return hi, jnp.uint32(a) * b


def round_keys(k0, k1, rounds: int = ROUNDS):
  """The Philox-4x32 key schedule: the (k0, k1) of each round, uint32 (the key words are
  bumped by constants after every round)."""
  k0 = jnp.asarray(k0, jnp.uint32)
  k1 = jnp.asarray(k1, jnp.uint32)
  keys = []
  for _ in range(rounds):
    keys.append((k0, k1))
    k0 = k0 + jnp.uint32(_KEY_A)
    k1 = k1 + jnp.uint32(_KEY_B)
  return keys


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS):
  """Philox-4x32 on uint32 arrays (broadcast together): the four output words."""
  c0, c1, c2, c3 = jnp.broadcast_arrays(*(jnp.asarray(c, jnp.uint32) for c in (c0, c1, c2, c3)))
  return philox_rounds(c0, c1, c2, c3, round_keys(k0, k1, rounds))


def philox_rounds(c0, c1, c2, c3, keys, mulhilo=mulhilo_limbs):
  """The rounds of Philox-4x32 on uint32 counter arrays of one shape, ``keys`` the schedule
  (``round_keys``); ``mulhilo(a, b)`` gives the (high, low) halves of a * b. The Mosaic GPU
  kernels call this in registers with the schedule computed outside the kernel (and, as an
  option, the high halves as one 64-bit product each: ``kernels.dfss.mosaic._mulhilo_wide``)."""
  for k0, k1 in keys:
    hi_b, lo_b = mulhilo(_MUL_B, c2)
    hi_a, lo_a = mulhilo(_MUL_A, c0)
    c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
  return c0, c1, c2, c3


def key_draws(seed, batch_heads: int, rows: int, keys: int) -> jax.Array:
  """uint32 [batch*heads, rows, keys]: the 16-bit draw of every (row, key), as the kernels draw
  them (module docstring)."""
  seed = jax.lax.bitcast_convert_type(jnp.asarray(seed, jnp.int32), jnp.uint32)
  calls = -(-keys // KEY_GROUP)
  out = philox4x32(jnp.arange(calls, dtype=jnp.uint32)[None, None, :],
                   jnp.arange(rows, dtype=jnp.uint32)[None, :, None],
                   jnp.arange(batch_heads, dtype=jnp.uint32)[:, None, None],
                   jnp.uint32(0), seed[0], seed[1])
  words = jnp.stack(out, axis=-1)                                  # [BH, rows, calls, 4]
  halves = jnp.stack([words & 0xFFFF, words >> HALF_BITS], axis=-1)  # [..., 4, 2]
  return halves.reshape(batch_heads, rows, calls * KEY_GROUP)[..., :keys]


def key_multiplier(seed, batch: int, heads: int, rows: int, keys: int, rate: float) -> jax.Array:
  """float32 [batch, heads, rows, keys]: Z / (1 - rate) for every entry (0 where dropped).
  A sparse kind multiplies it into probabilities that are already 0 off its kept set."""
  t = threshold(rate)
  draws = key_draws(seed, batch * heads, rows, keys).reshape(batch, heads, rows, keys)
  return jnp.where(draws >= t, np.float32(keep_scale(t)), np.float32(0.0))


def dropout_multiplier(seed, keep, rate: float) -> jax.Array:
  """float32 [batch, heads, q_len, k_len]: ``key_multiplier`` on the kept entries, 0 elsewhere.

  seed: int32 [2] (``seed_words``); keep: bool [batch, heads, q_len, k_len], the entries the
  kind keeps."""
  return jnp.where(keep, key_multiplier(seed, *keep.shape, rate), np.float32(0.0))
