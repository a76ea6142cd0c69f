"""DSA on the GPU: Triton kernels called from JAX (jax-triton), same rule as
``kernels.dsa.reference``.

Two steps, each one launch over batch*heads:

* ``select_bits``: the predictor's int8 scores on the tensor cores and each row group's kept
  keys (top-k on the 8-bit row code, or a threshold), as one bit per (row group, key):
  ``kernels.dsa.select_kernels``.  Memory: the bits (L^2 / 8 / V bytes per example and head) and the
  int8 operands; no score is stored.
* ``dsa_attention_triton``: softmax over the kept keys and the product with V, forward and
  backward (custom VJP; one pass with dQ by atomics, or dK/dV and dQ in two deterministic
  kernels), reading the bits, with attention dropout drawn inside the kernels (the per-key
  rule of ``ops.dropout``; the backward draws the same mask again):
  ``kernels.dsa.attention_kernels``.  Memory: O and a per-row log-sum-exp.
  With ``forward="gather"`` the forward first lists each 64-row block's kept keys
  (``key_lists``: int32 slots, at most L per block, so L^2 / 16 bytes per example and head)
  and then reads and multiplies those keys only.

Padding costs no work, and skipping it is exact: with a key mask, every kernel stops at each
example's key extent (one past its last real key; no key past it is valid, and no bit is set
there), and the backward also at its row extent (one past the last query row whose dO is
non-zero: a row with dO = 0 adds exactly 0 to dQ, dK and dV).  The skipped tiles would add
exactly zero, so outputs and gradients equal the full loops' exactly.  The selection's bits
past the key extent are written as zero words.

Nothing here imports triton or jax_triton at module import time: each launching function imports
its kernel source, and ``kernels.shared.launch.launch`` jax_triton, on first use.  Operands are [batch, length, heads, head_dim] as
jax.nn.dot_product_attention's, read in place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from lra_sparse.kernels.dsa import reference as dsa_reference
from lra_sparse.kernels.dsa import tiles as dsa_tiles
from lra_sparse.kernels.shared.launch import is_available, launch
from lra_sparse.kernels.shared.prologue import (cdiv, extent, kernel_head_dim, operand_reason,
                                                padded_rows, row_delta, zero_pad_head_dim)
from lra_sparse.kernels.shared.prologue import key_extent as _key_extent
from lra_sparse.ops import dropout

__all__ = ["is_available", "unsupported_reason", "select_bits", "key_lists",
           "dsa_attention_triton", "FORWARDS"]

_HEAD_DIMS = (16, 32, 64, 128)
_VECTORS = (1, 4, 8)
# The forward: "tiles" computes every key tile below the extent, masked by the bits (the
# work of dense attention at any sparsity); "gather" first lists each row block's kept keys
# (``key_lists``) and computes those only (the work of their union: it shrinks with the
# sparsity, V >= 4; see ``dsa_attention_triton``).
FORWARDS = ("tiles", "gather")
_MAX_GROUPS = 16        # row groups per gathered block: their keep bits share an int32 slot
_MAX_GATHER_LENGTH = 2 ** 15 - 1   # keys fit the slot's upper 15 bits
_COMPACT = (4, 4)       # dsa_compact: bit words per step, warps

def _tiles(kernel: str, dtype, overrides: dsa_tiles.Overrides = ()) -> tuple:
  """(BM, BN, warps, stages, skip) of ``kernel`` for operands of ``dtype``
  (``kernels.dsa.tiles``)."""
  return dataclasses.astuple(dsa_tiles.tiles(kernel, jnp.dtype(dtype).name, overrides))


def unsupported_reason(q, v, *, k=None, vector: int = 1, forward: str = "tiles",
                       tiles: dsa_tiles.Overrides = ()) -> Optional[str]:
  """None when the attention kernels can run these operands; else a short reason.

  q, v (and k) [batch, length, heads, head_dim] of one shape and dtype (float32 / bfloat16 /
  float16), head_dim <= 128 (16, 32, 64, 128 natively, others zero-padded exactly), vector in
  (1, 4, 8) dividing the length; forward "gather" also needs at most 16 row groups per
  gathered block (vector 4 or 8 at the default 64 rows) and at most 32767 keys.  Only shapes
  and dtypes are read.
  """
  reason = operand_reason(q, v, k, "the DSA kernels")
  if reason is not None:
    return reason
  if vector not in _VECTORS:
    return f"vector {vector} not in {_VECTORS}"
  if q.shape[1] % vector:
    return f"length {q.shape[1]} is not a multiple of the column-vector size {vector}"
  if forward not in FORWARDS:
    return f"DSA forward {forward!r} not in {FORWARDS}"
  if forward == "gather":
    bm = _tiles("gather", q.dtype, tiles)[0]
    if bm % vector or bm // vector > _MAX_GROUPS:
      return (f"the gathered forward lists keys per {bm} query rows, at most {_MAX_GROUPS} "
              f"row groups: vector {vector} gives {bm // vector} (use vector 4 or 8, or "
              f"forward='tiles')")
    if q.shape[1] > _MAX_GATHER_LENGTH:
      return (f"the gathered forward stores keys in 15 bits: length {q.shape[1]} > "
              f"{_MAX_GATHER_LENGTH} (use forward='tiles')")
  return None


def _check_mask(mask, shape):
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != tuple(shape):
    raise ValueError(f"mask must be bool [batch, length] = {tuple(shape)}, got {mask.shape}")
  return mask.astype(bool)


def _row_extent(do):
  """int32 [batch]: one past each example's last query row whose dO is non-zero in any head
  or column (the backward's ROWS; later rows add exactly 0 to every gradient)."""
  return extent(jnp.any(do != 0, axis=(2, 3)))


# ----------------------------------------------------------------------------- selection
def select_bits(ops: dsa_reference.SelectionOperands, mask=None, *, sparsity: float = 0.9,
                selection: str = "topk", threshold: float = 0.0, poison: bool = False,
                tiles: dsa_tiles.Overrides = ()):
  """The kept keys of each row group as bits: int32 [batch, heads, groups, ceil(L / 32)]
  (``kernels.dsa.reference.unpack_bits`` gives the bool mask of
  ``kernels.dsa.reference.reference_select``).
  ops: ``kernels.dsa.reference.selection_operands``; mask: bool [batch, length] key padding."""
  from lra_sparse.kernels.dsa import select_kernels  # imports triton
  if selection not in ("topk", "threshold"):
    raise ValueError(f"unknown DSA selection {selection!r}; choose 'topk' or 'threshold'")
  if not 0.0 <= sparsity < 1.0:
    raise ValueError(f"DSA sparsity {sparsity} must be in [0, 1)")
  b, h, g, kp = ops.q8.shape
  length = ops.k8.shape[2]
  if ops.k8.shape != (b, h, length, kp) or ops.q8.dtype != jnp.int8:
    raise ValueError(f"selection operands must be int8 q8 [batch, heads, groups, KP] and k8 "
                     f"[batch, heads, length, KP], got {ops.q8.shape} {ops.q8.dtype} and "
                     f"{ops.k8.shape}")
  mask = _check_mask(mask, (b, length))
  need = jnp.broadcast_to(dsa_reference.keep_counts(mask, sparsity, length), (b,))
  km = (jnp.zeros((1,), jnp.int32) if mask is None else mask.astype(jnp.int32))
  r, bn, warps, stages, _ = _tiles("select", jnp.int8, dsa_tiles.check_overrides(tiles))
  w = cdiv(length, 32)
  (bits,) = launch(
      select_kernels.dsa_select,
      (ops.q8.reshape(b * h, g, kp), ops.k8.reshape(b * h, length, kp), km,
       _key_extent(mask, b, length), need, ops.factor.reshape(b * h, g).astype(jnp.float32),
       float(threshold), length, g, w, h),
      (jax.ShapeDtypeStruct((b * h, g, w), jnp.int32),), (cdiv(g, r), b * h),
      num_warps=warps, num_stages=stages, poison=poison,
      KP=kp, R=r, BN=bn, TOPK=selection == "topk", HAS_MASK=mask is not None)
  return bits.reshape(b, h, g, w)


def key_lists(bits, ext, *, vector: int, block: int, poison: bool = False):
  """Each block of ``block`` query rows' kept keys as one list (``dsa_compact``): (slots int32
  [batch*heads, T, L], count int32 [batch*heads, T]), T = cdiv(L, block); slot i < count of a
  block is key << 16 | (bit j set when the block's row group j keeps the key), keys
  increasing; the slots past count are not written.  bits: ``select_bits``' [batch, heads,
  L / vector, W]; ext: int32 [batch] key extents (no bit is set past them)."""
  from lra_sparse.kernels.dsa import select_kernels  # imports triton
  b, h, g, w = bits.shape
  l = g * vector
  t = cdiv(l, block)
  words, warps = _COMPACT
  return launch(
      select_kernels.dsa_compact, (bits.reshape(b * h, g, w), ext, l, g, w, h, t),
      (jax.ShapeDtypeStruct((b * h, t, l), jnp.int32),
       jax.ShapeDtypeStruct((b * h, t), jnp.int32)),
      (t, b * h), num_warps=warps, num_stages=1, poison=poison,
      VEC=vector, BM=block, CW=words)


# ----------------------------------------------------------------------------- attention
def _tile_lists(blocks, block_size, length, rows, keys, by_keys=False):
  """(LIST, COUNT, NL, LISTS) operands of an attention kernel: the block rule's tile lists for
  its (rows x keys) tiles (``reference.tile_lists``; by_keys: each key tile's query tiles), or
  dummies the kernel does not read when ``blocks`` is None."""
  if blocks is None:
    dummy = jnp.zeros((1,), jnp.int32)
    return dummy, dummy, 1, False
  keep = jnp.swapaxes(blocks, 2, 3) if by_keys else blocks
  lists, count = dsa_reference.tile_lists(keep, block_size, length, rows, keys)
  return lists, count, lists.shape[-1], True


def _fwd(q, k, v, bits, ext, seed, blocks, vector, scale, poison, drop_t, forward, tiles,
         block_size):
  from lra_sparse.kernels.dsa import attention_kernels  # imports triton
  b, l, h, d = q.shape
  lp = padded_rows(l)
  outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b * h, lp), jnp.float32))
  if forward == "gather":
    bm, bn, warps, stages, _ = _tiles("gather", q.dtype, tiles)
    slots, count = key_lists(bits, ext, vector=vector, block=bm, poison=poison)
    t = count.shape[1]
    return launch(
      attention_kernels.dsa_fwd_gather, (q, k, v, slots, count, seed, scale, l, lp, h, t), outs,
        (t, b * h), num_warps=warps, num_stages=stages, poison=poison, D=d, VEC=vector,
        BM=bm, BN=bn, DROP_T=drop_t)
  bm, bn, warps, stages, skip = _tiles("fwd_drop" if drop_t else "fwd", q.dtype, tiles)
  g, w = bits.shape[2], bits.shape[3]
  lists, count, nl, listed = _tile_lists(blocks, block_size, l, bm, bn)
  return launch(
      attention_kernels.dsa_fwd,
      (q, k, v, bits, ext, seed, lists, count, scale, l, lp, h, g, w, nl), outs,
      (cdiv(l, bm), b * h), num_warps=warps, num_stages=stages, poison=poison,
      D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip, DROP_T=drop_t, LISTS=listed)


def _bwd(q, k, v, bits, ext, seed, blocks, o, lse, do, vector, scale, poison, deterministic,
         drop_t, tiles, block_size):
  from lra_sparse.kernels.dsa import attention_kernels  # imports triton
  b, l, h, d = q.shape
  do = do.astype(q.dtype)   # the rows' extent is read from the dO the kernels read
  g, w = bits.shape[2], bits.shape[3]
  head = (q, k, v, bits, do, lse, row_delta(o, do), ext, _row_extent(do), seed)
  tail = (scale, l, padded_rows(l), h, g, w)

  def args(bm, bn, by_keys):
    lists, count, nl, listed = _tile_lists(blocks, block_size, l, *((bn, bm) if by_keys
                                                                     else (bm, bn)), by_keys)
    return head + (lists, count) + tail + (nl,), listed

  if not deterministic:
    bm, bn, warps, stages, skip = _tiles("onepass", q.dtype, tiles)
    operands, listed = args(bm, bn, True)
    dk, dv, dq = launch(
      attention_kernels.dsa_bwd_onepass, operands,
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        (cdiv(l, bn), b * h), num_warps=warps, num_stages=stages, zeroed=(2,), poison=poison,
      D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip, DROP_T=drop_t, LISTS=listed)
    return (dq * scale).astype(q.dtype), dk, dv
  bm, bn, warps, stages, skip = _tiles("dkdv", q.dtype, tiles)
  operands, listed = args(bm, bn, True)
  dk, dv = launch(
      attention_kernels.dsa_bwd_dkdv, operands,
      (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      (cdiv(l, bn), b * h), num_warps=warps, num_stages=stages, poison=poison,
      D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip, DROP_T=drop_t, LISTS=listed)
  bm, bn, warps, stages, skip = _tiles("dq", q.dtype, tiles)
  operands, listed = args(bm, bn, False)
  (dq,) = launch(
      attention_kernels.dsa_bwd_dq, operands, (jax.ShapeDtypeStruct(q.shape, q.dtype),),
      (cdiv(l, bm), b * h), num_warps=warps, num_stages=stages, poison=poison,
      D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip, DROP_T=drop_t, LISTS=listed)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13, 14))
def _attn(q, k, v, bits, ext, seed, blocks, vector, scale, poison, deterministic, drop_t,
          forward, tiles, block_size):
  return _fwd(q, k, v, bits, ext, seed, blocks, vector, scale, poison, drop_t, forward, tiles,
              block_size)[0]


def _attn_fwd(q, k, v, bits, ext, seed, blocks, vector, scale, poison, deterministic, drop_t,
              forward, tiles, block_size):
  del deterministic  # backward only
  o, lse = _fwd(q, k, v, bits, ext, seed, blocks, vector, scale, poison, drop_t, forward,
                tiles, block_size)
  return o, (q, k, v, bits, ext, seed, blocks, o, lse)


def _attn_bwd(vector, scale, poison, deterministic, drop_t, forward, tiles, block_size, res,
              do):
  del forward  # both forwards give the same O and log-sum-exp
  q, k, v, bits, ext, seed, blocks, o, lse = res
  dq, dk, dv = _bwd(q, k, v, bits, ext, seed, blocks, o, lse, do, vector, scale, poison,
                    deterministic, drop_t, tiles, block_size)
  return dq, dk, dv, None, None, None, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def dsa_attention_triton(q, k, v, bits, *, mask=None, vector: int = 1,
                         deterministic: bool = False, dropout_rate: float = 0.0,
                         dropout_seed=None, forward: str = "tiles", poison: bool = False,
                         tiles: dsa_tiles.Overrides = (), blocks=None, block_size: int = 0):
  """softmax(Q K^T / sqrt(d) over the kept keys) V.  q, k, v [batch, length, heads, head_dim]
  (fp32 / bf16 / fp16, head_dim <= 128); bits int32 [batch, heads, length / vector,
  ceil(length / 32)] from ``select_bits`` (padded keys already excluded there).  mask: bool
  [batch, length] key padding (True = real; None: no padding), the one ``select_bits`` was
  given: the kernels read no key past an example's last real key (the bits keep none there)
  and so skip the padding's work, exactly.  Gradients flow to q, k, v; a row that keeps
  nothing gives zeros.  deterministic: the backward as two kernels without atomics
  (bit-reproducible dQ) instead of one pass with dQ by fp32 atomics.  dropout_rate > 0 with
  dropout_seed (int32 [2], ``dropout.seed_words``): attention dropout on the kept
  probabilities, drawn inside the kernels (``dropout.key_multiplier`` gives the same
  mask in JAX).  forward (``FORWARDS``): "tiles" computes every key tile up to the extent
  under the bits; "gather" lists each 64-row block's kept keys first and computes only those
  (vector 4 or 8; faster when the row groups of a block keep few keys in all; the same
  backward).  blocks (the block rule, forward "tiles"): its kept block pairs bool [batch,
  heads, L / block_size, L / block_size] (``reference.block_select``), of which ``bits`` are
  the ``block_bits``: every kernel then visits only the tiles that meet a kept pair
  (``reference.tile_lists``), in the order of the full loop, so the result is that of the
  bits alone.  tiles: per-kernel tile overrides (``kernels.dsa.tiles``; tuning).
  poison=True (tests) pre-fills every kernel output with NaN."""
  tiles = dsa_tiles.check_overrides(tiles)
  reason = unsupported_reason(q, v, k=k, vector=vector, forward=forward, tiles=tiles)
  if reason is not None:
    raise ValueError(reason)
  b, l, h, d = q.shape
  want = (b, h, l // vector, cdiv(l, 32))
  if tuple(bits.shape) != want or bits.dtype != jnp.int32:
    raise ValueError(f"bits must be int32 {want}, got {bits.dtype} {tuple(bits.shape)}")
  if blocks is not None:
    blocks_want = (b, h, cdiv(l, block_size or 1), cdiv(l, block_size or 1))
    if block_size <= 0 or tuple(blocks.shape) != blocks_want or forward != "tiles":
      raise ValueError(f"blocks must be bool {blocks_want} with block_size > 0 (got "
                       f"{tuple(blocks.shape)}, block_size {block_size}) and forward 'tiles' "
                       f"(got {forward!r})")
    blocks = blocks.astype(bool)
  ext = _key_extent(_check_mask(mask, (b, l)), b, l)
  drop_t, seed = dropout.checked_seed(dropout_rate, dropout_seed)
  seed = dropout.seed_operand(seed)
  kernel_dim = kernel_head_dim(d, _HEAD_DIMS)
  scale = 1.0 / math.sqrt(d)
  flags = (bool(poison), bool(deterministic), drop_t, forward, tiles,
           int(block_size) if blocks is not None else 0)
  if kernel_dim == d:
    return _attn(q, k, v, bits, ext, seed, blocks, vector, scale, *flags)
  q, k, v = (zero_pad_head_dim(x, kernel_dim) for x in (q, k, v))
  return _attn(q, k, v, bits, ext, seed, blocks, vector, scale, *flags)[..., :d]
