"""DSA on the GPU: Triton kernels called from JAX (jax-triton), same rule as ``dsa_reference``.

Two steps, each one launch over batch*heads:

* ``select_bits``: the predictor's int8 scores on the tensor cores and each row group's kept
  keys (top-k on the 8-bit row code, or a threshold), as one bit per (row group, key):
  ``dsa_select_kernels``.  Memory: the bits (L^2 / 8 / V bytes per example and head) and the
  int8 operands; no score is stored.
* ``dsa_attention_triton``: softmax over the kept keys and the product with V, forward and
  backward (custom VJP; one pass with dQ by atomics, or dK/dV and dQ in two deterministic
  kernels), reading the bits, with attention dropout drawn inside the kernels (the per-key
  rule of ``dfss_dropout``; the backward draws the same mask again):
  ``dsa_attention_kernels``.  Memory: O and a per-row log-sum-exp.
  With ``forward="gather"`` the forward first lists each 64-row block's kept keys
  (``key_lists``: int32 slots, at most L per block, so L^2 / 16 bytes per example and head)
  and then reads and multiplies those keys only.

Padding costs no work, and skipping it is exact: with a key mask, every kernel stops at each
example's key extent (one past its last real key; no key past it is valid, and no bit is set
there), and the backward also at its row extent (one past the last query row whose dO is
non-zero: a row with dO = 0 adds exactly 0 to dQ, dK and dV).  The skipped tiles would add
exactly zero, so outputs and gradients equal the full loops' exactly.  The selection's bits
past the key extent are written as zero words.

Nothing here imports triton or jax_triton at module import time; ``dfss_launch.launch`` imports
them and the kernel source on first use.  Operands are [batch, length, heads, head_dim] as
jax.nn.dot_product_attention's, read in place.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from lra_sparse.kernels import dfss_dropout, dsa_reference
from lra_sparse.kernels.dfss_launch import (cdiv, extent, kernel_head_dim, launch,
                                            operand_reason, padded_rows, row_delta,
                                            zero_pad_head_dim)
from lra_sparse.kernels.dfss_launch import key_extent as _key_extent
from lra_sparse.kernels.dfss_triton import is_available  # noqa: F401  (same requirements)

__all__ = ["is_available", "unsupported_reason", "select_bits", "key_lists",
           "dsa_attention_triton", "set_tiles", "FORWARDS"]

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
_SELECT = "dsa_select_kernels"
_ATTEND = "dsa_attention_kernels"
_POISONED = "dsa_poisoned_kernels"

# kernel -> (BM or R, BN, num_warps, num_stages, skip empty tiles); "half" / "f32" operands.
# H100, bf16, 16x2048, 4 heads of 64 (experiments/dsa_kernels_h100.md): testing each tile for
# emptiness cost 7% at DSA-90 (random kept sets leave no tile empty), so it is off by default;
# 8 warps, 64x128 or 128x128 tiles were no faster.  "fwd_drop": the forward with attention
# dropout, whose 128x64 tile spills (ptxas for sm_90a: 255 registers, 40 bytes of stack);
# 64x64 does not (230 registers) and was 6-8% faster at 16x2048 and 8x4096 than 128x64 with
# 4 or 8 warps (experiments/dsa_dropout_h100/README.md).
_TILES = {
    ("select", "int8"): (64, 64, 4, 2, False),
    ("fwd", "half"): (128, 64, 4, 3, False),
    ("fwd", "f32"): (64, 64, 4, 2, False),
    ("fwd_drop", "half"): (64, 64, 4, 3, False),
    ("fwd_drop", "f32"): (64, 64, 4, 2, False),
    ("gather", "half"): (64, 64, 4, 3, False),
    ("gather", "f32"): (64, 32, 4, 2, False),   # 64x64 spills at head_dim 128 (ptxas)
    ("dkdv", "half"): (64, 64, 4, 2, False),
    ("dkdv", "f32"): (32, 64, 4, 2, False),
    ("onepass", "half"): (64, 64, 4, 2, False),
    ("onepass", "f32"): (32, 64, 4, 2, False),
    ("dq", "half"): (64, 64, 4, 2, False),
    ("dq", "f32"): (32, 64, 4, 2, False),
}


def set_tiles(kernel: str, operands: str, tiles: Optional[tuple] = None):
  """Overrides (BM, BN, warps, stages, skip) of a kernel ("select", "fwd", "fwd_drop",
  "gather", "onepass", "dkdv", "dq") for an operand class ("int8", "half", "f32"); BN must be
  a multiple of 32; skip: test each tile's bits and skip the empty ones (attention kernels).
  None restores the default (tuning)."""
  key = (kernel, operands)
  if key not in _DEFAULTS:
    raise ValueError(f"unknown DSA kernel tiles {key}; choose one of {sorted(_DEFAULTS)}")
  _TILES[key] = _DEFAULTS[key] if tiles is None else tuple(tiles)


_DEFAULTS = dict(_TILES)


def _tiles(kernel: str, dtype) -> tuple:
  return _TILES[(kernel, "f32" if jnp.dtype(dtype) == jnp.float32 else "half")]


def unsupported_reason(q, v, *, k=None, vector: int = 1,
                       forward: str = "tiles") -> Optional[str]:
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
    bm = _tiles("gather", q.dtype)[0]
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
                selection: str = "topk", threshold: float = 0.0, poison: bool = False):
  """The kept keys of each row group as bits: int32 [batch, heads, groups, ceil(L / 32)]
  (``dsa_reference.unpack_bits`` gives the bool mask of ``dsa_reference.reference_select``).
  ops: ``dsa_reference.selection_operands``; mask: bool [batch, length] key padding."""
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
  r, bn, warps, stages, _ = _TILES[("select", "int8")]
  w = cdiv(length, 32)
  (bits,) = launch(
      _SELECT, "dsa_select",
      (ops.q8.reshape(b * h, g, kp), ops.k8.reshape(b * h, length, kp), km,
       _key_extent(mask, b, length), need, ops.factor.reshape(b * h, g).astype(jnp.float32),
       float(threshold), length, g, w, h),
      (jax.ShapeDtypeStruct((b * h, g, w), jnp.int32),), (cdiv(g, r), b * h),
      num_warps=warps, num_stages=stages, poison=poison, poisoned_module=_POISONED,
      KP=kp, R=r, BN=bn, TOPK=selection == "topk", HAS_MASK=mask is not None)
  return bits.reshape(b, h, g, w)


def key_lists(bits, ext, *, vector: int, block: int, poison: bool = False):
  """Each block of ``block`` query rows' kept keys as one list (``dsa_compact``): (slots int32
  [batch*heads, T, L], count int32 [batch*heads, T]), T = cdiv(L, block); slot i < count of a
  block is key << 16 | (bit j set when the block's row group j keeps the key), keys
  increasing; the slots past count are not written.  bits: ``select_bits``' [batch, heads,
  L / vector, W]; ext: int32 [batch] key extents (no bit is set past them)."""
  b, h, g, w = bits.shape
  l = g * vector
  t = cdiv(l, block)
  words, warps = _COMPACT
  return launch(
      _SELECT, "dsa_compact", (bits.reshape(b * h, g, w), ext, l, g, w, h, t),
      (jax.ShapeDtypeStruct((b * h, t, l), jnp.int32),
       jax.ShapeDtypeStruct((b * h, t), jnp.int32)),
      (t, b * h), num_warps=warps, num_stages=1, poison=poison, poisoned_module=_POISONED,
      VEC=vector, BM=block, CW=words)


# ----------------------------------------------------------------------------- attention
def _fwd(q, k, v, bits, ext, seed, vector, scale, poison, drop_t, forward):
  b, l, h, d = q.shape
  lp = padded_rows(l)
  outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b * h, lp), jnp.float32))
  if forward == "gather":
    bm, bn, warps, stages, _ = _tiles("gather", q.dtype)
    slots, count = key_lists(bits, ext, vector=vector, block=bm, poison=poison)
    t = count.shape[1]
    return launch(
        _ATTEND, "dsa_fwd_gather", (q, k, v, slots, count, seed, scale, l, lp, h, t), outs,
        (t, b * h), num_warps=warps, num_stages=stages, poison=poison,
        poisoned_module=_POISONED, D=d, VEC=vector, BM=bm, BN=bn, DROP_T=drop_t)
  bm, bn, warps, stages, skip = _tiles("fwd_drop" if drop_t else "fwd", q.dtype)
  g, w = bits.shape[2], bits.shape[3]
  return launch(
      _ATTEND, "dsa_fwd", (q, k, v, bits, ext, seed, scale, l, lp, h, g, w), outs,
      (cdiv(l, bm), b * h), num_warps=warps, num_stages=stages, poison=poison,
      poisoned_module=_POISONED, D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip, DROP_T=drop_t)


def _bwd(q, k, v, bits, ext, seed, o, lse, do, vector, scale, poison, deterministic, drop_t):
  b, l, h, d = q.shape
  do = do.astype(q.dtype)   # the rows' extent is read from the dO the kernels read
  g, w = bits.shape[2], bits.shape[3]
  args = (q, k, v, bits, do, lse, row_delta(o, do), ext, _row_extent(do), seed, scale, l,
          padded_rows(l), h, g, w)
  if not deterministic:
    bm, bn, warps, stages, skip = _tiles("onepass", q.dtype)
    dk, dv, dq = launch(
        _ATTEND, "dsa_bwd_onepass", args,
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32)),
        (cdiv(l, bn), b * h), num_warps=warps, num_stages=stages, zeroed=(2,), poison=poison,
        poisoned_module=_POISONED, D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip,
        DROP_T=drop_t)
    return (dq * scale).astype(q.dtype), dk, dv
  bm, bn, warps, stages, skip = _tiles("dkdv", q.dtype)
  dk, dv = launch(
      _ATTEND, "dsa_bwd_dkdv", args,
      (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      (cdiv(l, bn), b * h), num_warps=warps, num_stages=stages, poison=poison,
      poisoned_module=_POISONED, D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip,
        DROP_T=drop_t)
  bm, bn, warps, stages, skip = _tiles("dq", q.dtype)
  (dq,) = launch(
      _ATTEND, "dsa_bwd_dq", args, (jax.ShapeDtypeStruct(q.shape, q.dtype),),
      (cdiv(l, bm), b * h), num_warps=warps, num_stages=stages, poison=poison,
      poisoned_module=_POISONED, D=d, VEC=vector, BM=bm, BN=bn, SKIP=skip,
        DROP_T=drop_t)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _attn(q, k, v, bits, ext, seed, vector, scale, poison, deterministic, drop_t, forward):
  return _fwd(q, k, v, bits, ext, seed, vector, scale, poison, drop_t, forward)[0]


def _attn_fwd(q, k, v, bits, ext, seed, vector, scale, poison, deterministic, drop_t, forward):
  del deterministic  # backward only
  o, lse = _fwd(q, k, v, bits, ext, seed, vector, scale, poison, drop_t, forward)
  return o, (q, k, v, bits, ext, seed, o, lse)


def _attn_bwd(vector, scale, poison, deterministic, drop_t, forward, res, do):
  del forward  # both forwards give the same O and log-sum-exp
  q, k, v, bits, ext, seed, o, lse = res
  dq, dk, dv = _bwd(q, k, v, bits, ext, seed, o, lse, do, vector, scale, poison, deterministic,
                    drop_t)
  return dq, dk, dv, None, None, None


_attn.defvjp(_attn_fwd, _attn_bwd)


def dsa_attention_triton(q, k, v, bits, *, mask=None, vector: int = 1,
                         deterministic: bool = False, dropout_rate: float = 0.0,
                         dropout_seed=None, forward: str = "tiles", poison: bool = False):
  """softmax(Q K^T / sqrt(d) over the kept keys) V.  q, k, v [batch, length, heads, head_dim]
  (fp32 / bf16 / fp16, head_dim <= 128); bits int32 [batch, heads, length / vector,
  ceil(length / 32)] from ``select_bits`` (padded keys already excluded there).  mask: bool
  [batch, length] key padding (True = real; None: no padding), the one ``select_bits`` was
  given: the kernels read no key past an example's last real key (the bits keep none there)
  and so skip the padding's work, exactly.  Gradients flow to q, k, v; a row that keeps
  nothing gives zeros.  deterministic: the backward as two kernels without atomics
  (bit-reproducible dQ) instead of one pass with dQ by fp32 atomics.  dropout_rate > 0 with
  dropout_seed (int32 [2], ``dfss_dropout.seed_words``): attention dropout on the kept
  probabilities, drawn inside the kernels (``dfss_dropout.key_multiplier`` gives the same
  mask in JAX).  forward (``FORWARDS``): "tiles" computes every key tile up to the extent
  under the bits; "gather" lists each 64-row block's kept keys first and computes only those
  (vector 4 or 8; faster when the row groups of a block keep few keys in all; the same
  backward).  poison=True (tests) pre-fills every kernel output with NaN."""
  reason = unsupported_reason(q, v, k=k, vector=vector, forward=forward)
  if reason is not None:
    raise ValueError(reason)
  b, l, h, d = q.shape
  want = (b, h, l // vector, cdiv(l, 32))
  if tuple(bits.shape) != want or bits.dtype != jnp.int32:
    raise ValueError(f"bits must be int32 {want}, got {bits.dtype} {tuple(bits.shape)}")
  ext = _key_extent(_check_mask(mask, (b, l)), b, l)
  drop_t, seed = dfss_dropout.checked_seed(dropout_rate, dropout_seed)
  seed = dfss_dropout.seed_operand(seed)
  kernel_dim = kernel_head_dim(d, _HEAD_DIMS)
  scale = 1.0 / math.sqrt(d)
  flags = (bool(poison), bool(deterministic), drop_t, forward)
  if kernel_dim == d:
    return _attn(q, k, v, bits, ext, seed, vector, scale, *flags)
  q, k, v = (zero_pad_head_dim(x, kernel_dim) for x in (q, k, v))
  return _attn(q, k, v, bits, ext, seed, vector, scale, *flags)[..., :d]
