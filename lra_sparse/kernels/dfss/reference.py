"""Pure-JAX reference of DFSS (dynamic N:M sparse attention) and its compressed form.

Semantics (the same as ``lra_sparse.attention.dfss``; 0 < n <= m, n == m keeps every key):
  S = Q K^T / sqrt(d); padded keys -> -inf.  In every group of ``m`` consecutive keys
  of a row keep the ``n`` largest (signed; ties go to the LOWER index; padded keys
  never beat real ones; ``lra_sparse.ops.nm.nm_mask``); softmax over the kept
  entries only (``lra_sparse.ops.softmax.masked_softmax``); O = A V.  A row (or a
  group) with nothing real in it yields zeros, never NaN.  Gradients are those of the
  masked softmax (pruned entries get zero gradient).

If the key length is not a multiple of ``m`` the keys are padded internally with
padded (masked) keys, exactly like the Triton kernels pad to their tile size.

Compressed form (what the kernels store):
  values  [..., R, K*n/m]  the kept entries of each group, in ascending in-group order
  meta    int32 [..., R, ceil(K/32)]  a keep bitmask, bit (j % 32) of word j // 32 is
          key j.  That is m bits per group: 2 bits for 1:2, 4 bits for 2:4 (the least
          2:4 metadata can take), 8 bits for M=8; one bit per key = 1/32 of an fp32 score.

The selection never sorts a row: the rank of an element is the number of group
members that beat it (greater, or equal with a lower index), computed by m
elementwise comparisons.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from lra_sparse.ops import dropout
from lra_sparse.ops.nm import check_nm, nm_mask
from lra_sparse.ops.softmax import attend, attention_scores, masked_softmax

__all__ = [
    "nm_prune_compress",
    "decompress",
    "pack_keep_bits",
    "unpack_keep_bits",
    "compressed_softmax_reference",
    "spmm_reference",
    "dfss_scores",
    "dfss_attention_reference",
    "dfss_attention_xla",
    "dfss_probabilities",
]

META_BITS = 32  # keys per metadata word


def pack_keep_bits(keep: jax.Array) -> jax.Array:
  """bool [..., K] -> int32 [..., ceil(K/32)] bitmask (bit j%32 of word j//32)."""
  k = keep.shape[-1]
  w = -(-k // META_BITS)
  pad = w * META_BITS - k
  kb = jnp.pad(keep, [(0, 0)] * (keep.ndim - 1) + [(0, pad)])
  kb = kb.reshape(kb.shape[:-1] + (w, META_BITS)).astype(jnp.uint32)
  words = jnp.sum(kb << jnp.arange(META_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  return lax.bitcast_convert_type(words, jnp.int32)


def unpack_keep_bits(meta: jax.Array, k: int) -> jax.Array:
  """int32 [..., W] -> bool [..., k]."""
  words = lax.bitcast_convert_type(meta, jnp.uint32)
  bits = (words[..., None] >> jnp.arange(META_BITS, dtype=jnp.uint32)) & 1
  bits = bits.reshape(meta.shape[:-1] + (meta.shape[-1] * META_BITS,))
  return bits[..., :k].astype(bool)


def _slot_of(keep_g: jax.Array) -> jax.Array:
  """[..., G, m] bool -> exclusive prefix count (slot of each kept element)."""
  c = jnp.cumsum(keep_g.astype(jnp.int32), axis=-1)
  return c - keep_g.astype(jnp.int32)


def nm_prune_compress(scores: jax.Array, n: int, m: int) -> Tuple[jax.Array, jax.Array]:
  """Dense scores [..., K] (K % m == 0) -> (values [..., K*n/m], meta int32)."""
  keep = nm_mask(scores, n, m)
  k = scores.shape[-1]
  g = k // m
  s = scores.reshape(scores.shape[:-1] + (g, m))
  kg = keep.reshape(s.shape)
  slot = _slot_of(kg)
  idx = jnp.arange(m, dtype=jnp.int32)
  cols = []
  for t in range(n):
    # in-group index of the t-th kept element (exactly one matches)
    pos = jnp.sum(jnp.where(kg & (slot == t), idx, 0), axis=-1, keepdims=True)
    cols.append(jnp.take_along_axis(s, pos, axis=-1))
  values = jnp.concatenate(cols, axis=-1).reshape(scores.shape[:-1] + (g * n,))
  return values, pack_keep_bits(keep)


def decompress(values: jax.Array, meta: jax.Array, n: int, m: int, k: Optional[int] = None,
               fill=0.0) -> jax.Array:
  """(values [..., G*n], meta) -> dense [..., K]; pruned entries get ``fill``."""
  check_nm(n, m, what="decompress")
  g = values.shape[-1] // n
  k = g * m if k is None else k
  keep = unpack_keep_bits(meta, g * m)
  kg = keep.reshape(keep.shape[:-1] + (g, m))
  slot = jnp.clip(_slot_of(kg), 0, n - 1)
  vg = values.reshape(values.shape[:-1] + (g, n))
  dense = jnp.take_along_axis(vg, slot, axis=-1)
  dense = jnp.where(kg, dense, jnp.asarray(fill, values.dtype))
  return dense.reshape(dense.shape[:-2] + (g * m,))[..., :k]


def compressed_softmax_reference(values: jax.Array) -> jax.Array:
  """Softmax over the kept entries of each compressed row (padded = -inf; a row with no
  finite entry gives zeros)."""
  return masked_softmax(values.astype(jnp.promote_types(values.dtype, jnp.float32)))


def spmm_reference(probs: jax.Array, meta: jax.Array, v: jax.Array, n: int, m: int) -> jax.Array:
  """Compressed probs [..., R, G*n] + meta times v [..., K, D] -> [..., R, D]."""
  dense = decompress(probs, meta, n, m, k=v.shape[-2])
  # HIGHEST: a reference must not run float32 products at TF32 on a GPU.
  return jnp.einsum("...rk,...kd->...rd", dense.astype(v.dtype), v,
                    precision=jax.lax.Precision.HIGHEST)


def _pad_keys(l: int, m: int) -> int:
  return -(-l // m) * m


def dfss_scores(q, k, *, mask=None, m: int = 1, precision=None):
  """S = QK^T/sqrt(d) as fp32 (or f64) [B, H, L, Lk_pad], padded keys -> -inf.

  Keys are padded up to a multiple of ``m`` with padded (masked) keys."""
  lk = k.shape[1]
  s = attention_scores(q, k, None if mask is None else mask.astype(bool), precision=precision)
  kp = _pad_keys(lk, m)
  if kp != lk:
    s = jnp.pad(s, [(0, 0), (0, 0), (0, 0), (0, kp - lk)], constant_values=-jnp.inf)
  return s


def dfss_attention_reference(q, k, v, *, n: int, m: int, mask=None, precision=None,
                             dropout_rate: float = 0.0, dropout_seed=None):
  """DFSS attention, q/k/v [batch, length, heads, head_dim], mask bool [batch, length]
  (True = real key).  Returns [batch, length, heads, head_dim] in q's dtype.
  dropout_rate > 0 with dropout_seed (int32 [2]): attention dropout on the kept probabilities
  with the kernels' mask (``dropout.dropout_multiplier``)."""
  check_nm(n, m, what="dfss_attention_reference")
  lk = k.shape[1]
  s = dfss_scores(q, k, mask=mask, m=m, precision=precision)
  keep = nm_mask(lax.stop_gradient(s), n, m)
  p = masked_softmax(s, keep)
  if dropout_rate > 0.0:
    if dropout_seed is None:
      raise ValueError("dropout_rate > 0 needs dropout_seed (dropout.seed_words(rng))")
    p = p * dropout.dropout_multiplier(dropout_seed, keep, dropout_rate)
  p = p[..., :lk]
  out = jnp.einsum("bhlk,bkhd->blhd", p.astype(v.dtype), v,
                   preferred_element_type=p.dtype, precision=precision)
  return out.astype(q.dtype)


def dfss_probabilities(q, k, *, n: int, m: int, mask=None):
  """The DFSS attention matrix A [batch, heads, q_len, k_len] (float32), for analysis."""
  scores = attention_scores(q, k, mask)
  return masked_softmax(scores, nm_mask(scores, n, m))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def dfss_attention_xla(q, k, v, mask, n, m):
  """DFSS attention in one dense score pass (``dfss_attention_reference`` without dropout), the
  pure-JAX training path: the custom VJP reuses the stored probabilities, so the backward costs
  what dense attention's does. mask: bool [batch, length] (every key real: all True)."""
  out, _ = _dfss_xla_fwd(q, k, v, mask, n, m)
  return out


def _dfss_xla_fwd(q, k, v, mask, n, m):
  probs = dfss_probabilities(q, k, n=n, m=m, mask=mask)
  return attend(probs, v, q.dtype), (q, k, v, mask, probs)


def _dfss_xla_bwd(n, m, residuals, d_out):
  """Masked-softmax backward: probs are 0 at pruned/padded keys, so dS is 0 there too."""
  del n, m
  q, k, v, mask, probs = residuals
  d_out = d_out.astype(jnp.float32)
  d_v = jnp.einsum("bhqk,bqhd->bkhd", probs, d_out)
  d_probs = jnp.einsum("bqhd,bkhd->bhqk", d_out, v.astype(jnp.float32))
  d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
  d_scores = d_scores * jnp.float32(q.shape[-1] ** -0.5)
  d_q = jnp.einsum("bhqk,bkhd->bqhd", d_scores, k.astype(jnp.float32))
  d_k = jnp.einsum("bhqk,bqhd->bkhd", d_scores, q.astype(jnp.float32))
  return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


dfss_attention_xla.defvjp(_dfss_xla_fwd, _dfss_xla_bwd)
