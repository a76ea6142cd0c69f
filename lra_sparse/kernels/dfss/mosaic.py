"""DFSS (dynamic N:M sparse attention) on Hopper: Pallas Mosaic GPU kernels, forward and backward.

Same semantics as ``kernels.dfss.reference.dfss_attention_reference`` (and the Triton kernels in
``kernels.dfss.triton``): S = Q K^T / sqrt(d), padded keys never beat real ones, in every group of M
consecutive keys the N largest scores are kept (ties to the lower index), softmax over the kept
entries, O = P V; a row with no real key gives zeros.

Structure (flash attention on Hopper: warpgroup MMA, TMA, a memory warpgroup that streams K/V
tiles while two compute warpgroups each own 64 query rows):

* Keys are *permuted* in HBM before the kernels (``permute_keys``): inside every block of 64
  keys, member j of group g moves from position g*M + j to j*(64/M) + g. A 64-key slice of the
  score tile then holds the M members of each group in M column slices of width 64/M, and the
  WGMMA register layout gives every thread the same rows and columns of each slice, so the
  N:M selection is elementwise work between slices (``nm_prune``), no shuffles. The product
  with V uses V permuted the same way, so O is unchanged; dK and dV come back permuted and are
  put back in order by ``unpermute_keys``.
* ``nm_prune`` sets the pruned entries of a score tile to -inf before the online softmax: the
  row maximum is unchanged (a group's largest member is always kept) and a pruned entry's
  exponential is exactly 0.
* Key padding is an additive bias (0 or ``MASKED``). It is finite, so no inf - inf appears in
  the online softmax, and moderate (-2^25): the compiler contracts ``s * c - max`` into one
  fused multiply-add, which rounds differently from the product that gave the row maximum; at
  |s * c| near 1e29 (a bias of -1e30) that difference is ~1e22 and exp2 of it overflows, which
  made every row whose running maximum was a padded key (a fully padded row, or a key tile of
  padding before the first real key, as black-pixel masks give) NaN. Near 2^25 * c the
  difference is below 1, so exp2 stays finite, and a real key's exp2 outweighs it by 2^(2^23).
  Real scores are assumed above MASKED / 2 (|q . k| < 1.6e7, far outside any trained model).
  A row whose maximum is still below ``MASKED / 2`` has no real key: its output is 0 and its
  LSE +inf, so the backward gives it zero gradients.
* Backward: a dK/dV kernel (loop over query tiles) recomputes S in the [query, key]
  orientation, prunes it as the forward and passes P and dS to the tensor cores through shared
  memory, transposed; at head dims up to 64 it also adds each step's dS K into a float32 dQ
  by the TMA's reduce-add (``Tiles.fused_backward``: scores and exponentials once per tile
  pair; dQ's last bits vary with the order of the adds). ``deterministic=True`` (and head dim
  128) runs a separate dQ kernel (loop over key tiles) instead: bit-reproducible gradients.
* Padding costs no work (as cuDNN's sequence lengths): with a key mask, each pipeline's step
  count is read per CTA (a dynamic grid), so the forward and dQ loops stop at the key tile of
  an example's last real key, the dK/dV loop at the query tile of its last row with a
  non-zero dO, and a dQ CTA whose rows all have dO = 0 (or a dK/dV CTA past the last real
  key) does no step and writes zeros. All exact: the skipped tiles add exactly 0. In a masked
  model a padded row's output reaches no loss, so its dO is 0 and the backward costs what
  the real lengths need (``_backward_steps``); the forward still computes padded query rows,
  whose outputs the semantics define.

* Attention dropout (rate > 0 with a seed): the mask ``ops.dropout`` defines, the one the
  Triton kernels and the pure-JAX paths apply for the same seed, drawn in registers by each of
  the three kernels (``_dropout_multiplier``: Philox-4x32-7 per (query row, 8 keys) in the
  layout of the member slices, the key schedule read from memory; ``Tiles.wide_products``
  makes each product's high half one 64-bit multiply, ``_mulhilo_wide``). The forward scales
  P by Z / (1 - rate) after the normalizer is summed; the backward uses dA = dP * Z / (1 - rate)
  and dV = (A * Z / (1 - rate))^T dO, with delta = rowsum(dO * O) unchanged.
* Dense attention (``dense_attention_mgpu``) is the same kernels with nothing pruned (n = m).
  With dropout its keys are permuted as for M = 8, so each column of a member slice holds the
  eight keys of one Philox call and each thread draws once per eight keys of a row; without
  dropout the permutation is the identity (M = 1).

Supported: bf16 / fp16, head_dim up to 128 (the kernels run 16, 32, 64 and 128; other head
dims, as Pathfinder's 4 and Path-X's 8, are zero-padded to the next, which is exact; the
shared-memory tiles of a head dim under 64 are swizzled at its row width, 2 * head_dim bytes,
since one wgmma takes one swizzle for both operands), M in (2, 4, 8)
(the slices of a 64-key block are 64/M >= 8 columns wide). ``unsupported_reason`` says why
not otherwise; callers then use the Triton kernels. Nothing here imports Pallas at module
import (CPU installs import it fine).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from lra_sparse.kernels.shared import prologue
from lra_sparse.kernels.shared.prologue import extent as _extent
from lra_sparse.kernels.shared.prologue import zero_pad_head_dim
from lra_sparse.ops import dropout
from lra_sparse.ops import nm as nm_rule
from lra_sparse.ops.nm import check_nm

PERM_BLOCK = 64          # keys are permuted within blocks of this many
MASKED = -float(2**25)   # bias of a padded key (finite and moderate: see the module docstring)
_LOG2E = math.log2(math.e)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)   # what the kernels run; others are zero-padded
SUPPORTED_M = (2, 4, 8)
FUSED_BACKWARD_MAX_HEAD_DIM = 64   # Tiles.fused_backward: the widest head dim whose smem fits


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes: 64 query rows per compute warpgroup (two per CTA in the forward and dQ);
  ``block_kv`` keys per pipeline step; ``stages`` tiles in flight."""
  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  bwd_block_q: int = 64
  bwd_block_kv: int = 64
  bwd_stages: int = 2
  compute_wgs_bwd: int = 2
  schedule_barrier: bool = True
  # dropout: the high halves of Philox's products as one 64-bit multiply each (PTX
  # mul.wide.u32, ``_mulhilo_wide``) instead of from 16-bit limbs in 32-bit arithmetic: the
  # same bits (GPU test), and on an H100 the dropout's extra cost falls from 2.2-2.6x to
  # 1.6-1.8x of the kernel without dropout (``bench_dfss_dropout``'s A/B columns).
  wide_products: bool = True
  # N:M selection in the score tiles (``prune_with_max``): "tournament" (1:4, 2:4) or "pairs"
  selection: str = "tournament"
  # the narrowest head dim the kernels run (one of SUPPORTED_HEAD_DIMS): 16 pads Path-X's 8
  # to 16; 64 is the kernels before they ran 16 and 32 (every small head dim padded to 64),
  # kept for the benchmarks' A/B (``--ab_tiles=min_head_dim=64``)
  min_head_dim: int = 16
  # backward in one kernel: the dK/dV kernel also forms each step's dQ share, dS K, and adds it
  # into a float32 dQ through the TMA's reduce-add, so the scores, their exponentials and dP are
  # computed once per tile pair instead of twice (dQ kernel and dK/dV kernel). dQ's last bits
  # then depend on the order of the adds (not bit-reproducible run to run), so the public
  # functions' ``deterministic=True`` (the configs' ``deterministic_kernels``) runs the two
  # kernels whatever this says. Head dims up to 64: at 128 the dK/dV kernel's shared memory has
  # no room for the float32 dQ staging (234,624 bytes > 232,448, the lowering's check), so head
  # dim 128 keeps the two kernels. Measured against them: dfss_mosaic/fused_backward_h100.md.
  fused_backward: bool = True

  def __post_init__(self):
    if self.min_head_dim not in SUPPORTED_HEAD_DIMS:
      raise ValueError(f"Tiles.min_head_dim must be one of {SUPPORTED_HEAD_DIMS}, got "
                       f"{self.min_head_dim}")


DEFAULT_TILES = Tiles()   # read at call time: a benchmark may swap it while a step traces


def parse_tiles(text: str, what: str = "tiles") -> Tiles:
  """``Tiles`` from 'field=value,...' (the benchmarks' and the lowering check's --ab_tiles /
  --tiles), each value read as its field's type (True/False, integers, names); one ValueError
  naming a bad field or value."""
  defaults = dataclasses.asdict(DEFAULT_TILES)
  values = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    kind = type(defaults.get(name))
    if name not in defaults or (kind is bool and value not in ("True", "False")) or (
        kind is int and not value.lstrip("-").isdigit()) or not value:
      raise ValueError(f"{what}: {item!r} is not field=value with a field of Tiles "
                       f"({', '.join(defaults)}) and a value of its type")
    values[name] = value == "True" if kind is bool else kind(value)
  return Tiles(**values)


def _resolved(tiles: Optional[Tiles]) -> Tiles:
  return DEFAULT_TILES if tiles is None else tiles


def is_available() -> bool:
  """True on a Hopper (sm_90) GPU with Pallas' Mosaic GPU backend importable."""
  try:
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices or not _is_hopper(devices[0]):
      return False
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401  pylint: disable=import-outside-toplevel
    return True
  except Exception:  # pragma: no cover - any import / backend failure means "no"
    return False


def _is_hopper(device) -> bool:
  capability = getattr(device, "compute_capability", None)
  if capability is not None:
    return str(capability).split(".")[0] == "9"
  return any(name in device.device_kind for name in ("H100", "H200", "H800", "H20"))


def kernel_head_dim(head_dim: int, tiles: Optional[Tiles] = None) -> Optional[int]:
  """The head dim the kernels run for ``head_dim`` (zero-padded up to it), None above 128."""
  return prologue.kernel_head_dim(
      head_dim, [w for w in SUPPORTED_HEAD_DIMS if w >= _resolved(tiles).min_head_dim])


def _operand_reason(q, v, k=None) -> Optional[str]:
  """None when the kernels take these operands (shapes, head dim, dtype), else why not."""
  if q.ndim != 4:
    return f"q must be [batch, length, heads, head_dim], got shape {tuple(q.shape)}"
  head_dim = q.shape[-1]
  if not 0 < head_dim <= SUPPORTED_HEAD_DIMS[-1]:
    return (f"the Mosaic GPU kernel needs head_dim in [1, {SUPPORTED_HEAD_DIMS[-1]}], got "
            f"{head_dim}")
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"the Mosaic GPU kernel needs bfloat16 or float16, got {jnp.dtype(q.dtype).name}"
  for name, x in (("k", k), ("v", v)):
    if x is not None and (tuple(x.shape) != tuple(q.shape) or x.dtype != q.dtype):
      return (f"{name} must match q ({q.dtype}{list(q.shape)}), got "
              f"{x.dtype}{list(x.shape)}")
  return None


def unsupported_reason(q, v, n: int, m: int, *, k=None) -> Optional[str]:
  """None when these kernels run DFSS n:m on these operands (head dims other than 16, 32, 64
  and 128 zero-padded up to one of them), else a short reason."""
  try:
    check_nm(n, m, what="dfss_mgpu")
  except ValueError as error:
    return str(error)
  if n == m:
    return (f"the Mosaic GPU DFSS kernel needs n < m, got n={n}, m={m} (dense attention: "
            "dense_attention_mgpu)")
  if m not in SUPPORTED_M:
    return f"the Mosaic GPU kernel needs m in {SUPPORTED_M}, got m={m}"
  return _operand_reason(q, v, k)


def dense_unsupported_reason(q, v, *, k=None) -> Optional[str]:
  """None when ``dense_attention_mgpu`` runs on these operands, else a short reason."""
  return _operand_reason(q, v, k)


# ----------------------------------------------------------------------------- key permutation
def permute_keys(x: jax.Array, m: int) -> jax.Array:
  """[B, L, ...] with L % 64 == 0: inside each 64-key block, key g*m + j -> j*(64/m) + g."""
  b, l = x.shape[:2]
  g = PERM_BLOCK // m
  y = x.reshape((b, l // PERM_BLOCK, g, m) + x.shape[2:])
  return jnp.swapaxes(y, 2, 3).reshape(x.shape)


def unpermute_keys(x: jax.Array, m: int) -> jax.Array:
  """The inverse of ``permute_keys``."""
  b, l = x.shape[:2]
  g = PERM_BLOCK // m
  y = x.reshape((b, l // PERM_BLOCK, m, g) + x.shape[2:])
  return jnp.swapaxes(y, 2, 3).reshape(x.shape)


# ----------------------------------------------------------------------------- selection
def _total(terms):
  return functools.reduce(lambda a, b: a + b, terms)


def _member_slices(s, m: int, block: int):
  """The M member slices (each [rows, 64/M]) of 64-key block ``block`` of the tile ``s``."""
  width = PERM_BLOCK // m
  start = block * PERM_BLOCK
  return [s[:, start + j * width: start + (j + 1) * width] for j in range(m)]


def _keep_by_pairs(x, n: int, m: int):
  """Keep masks of the members ``x`` (M slices): each pair compared once, counted in floats."""
  one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
  f = {(i, j): jnp.where(x[i] >= x[j], one, zero) for i in range(m) for j in range(i + 1, m)}
  keep = []
  for i in range(m):
    later = [f[(i, j)] for j in range(i + 1, m)]
    earlier = [f[(j, i)] for j in range(i)]
    if not later:                       # the last member: no negation needed
      keep.append(_total(earlier) <= i - (m - n))
    else:
      net = _total(later)
      for term in earlier:
        net = net - term
      keep.append(net >= m - n - i)
  return keep


SELECTIONS = ("pairs", "tournament")


def prune_with_max(s, n: int, m: int, selection: str = DEFAULT_TILES.selection):
  """(the [rows, cols] score tile ``s`` with every entry the N:M rule prunes set to -inf, the
  row maxima f32 [rows]); cols a multiple of 64, keys permuted by ``permute_keys``.

  Member j of a group lies in column slice j of its 64-key block. Member i beats member j when
  s_i > s_j, or s_i == s_j with i < j (ties to the lower index); an entry is kept when fewer
  than n members beat it. Two exact formulations (``selection``):

  * "pairs", any N:M: with f_ij = [s_i >= s_j] for i < j (each pair compared once, as float
    0/1), member i's wins are sum_{j>i} f_ij + sum_{j<i} (1 - f_ji), so it is kept when
    sum_{j>i} f_ij - sum_{j<i} f_ji >= m - n - i. Float selects and adds only: Mosaic GPU
    cannot lower boolean ``~`` on register arrays, and on an H100 this form was the fastest of
    four A/B'd in one process (int32 counts, and/or logic of the "beats" predicates, every
    ordered pair compared: 0-25% slower forward).
  * "tournament", 1:4 and 2:4 (``nm.keep_n_of_4``); other N:M use "pairs". On an H100 it
    made the forward kernel 8-13% faster than "pairs" at 2:4 (``bench_dfss_mgpu``'s
    variants), as fast as an inexact bound that keeps every member at or above the group's
    second largest.

  The row maximum of the pruned tile is that of ``s`` (a group's largest member is kept)."""
  if selection not in SELECTIONS:
    raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
  if n == m:                              # dense attention: nothing pruned
    return s, s.max(axis=1)
  tournament = selection == "tournament" and m == 4 and n in nm_rule.TOURNAMENT_N
  pieces, maxima = [], []
  for block in range(s.shape[1] // PERM_BLOCK):
    x = _member_slices(s, m, block)
    if tournament:
      keep, group_max = nm_rule.keep_n_of_4(x, n)
      maxima.append(group_max)
    else:
      keep = _keep_by_pairs(x, n, m)
    pieces.extend(jnp.where(k, xi, -jnp.inf) for k, xi in zip(keep, x))
  pruned = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
  if not maxima:
    return pruned, pruned.max(axis=1)
  return pruned, functools.reduce(jnp.maximum, maxima).max(axis=1)


def nm_prune(s, n: int, m: int, selection: str = DEFAULT_TILES.selection):
  """The pruned tile of ``prune_with_max``."""
  return prune_with_max(s, n, m, selection)[0]


# ----------------------------------------------------------------------------- dropout
def _add_key_bias(s, key_bias):
  """The score tile with the key bias (0 or MASKED per key) added."""
  return s + lax.broadcast_in_dim(key_bias, s.shape, [1])


def _mulhilo_wide(a: int, b):
  """(high, low) 32-bit halves of a * b for a constant a and b uint32: on a register array (the
  WGMMA layout), the high half is one 64-bit product of the zero-extended words (which ptxas
  makes a single mul.wide.u32) inlined as Mosaic GPU code, the low half Pallas' 32-bit product;
  on a scalar, ``ops.dropout``'s 16-bit limbs. Uniform arrays (a splat layout) must not reach
  it: the inlined code takes the WGMMA layout, and a splat cast to it failed to compile (LLVM
  "unrealized_conversion_cast", H100, jax 0.11.2), so the uniform counters stay scalars."""
  if jnp.ndim(b) == 0:
    return dropout.mulhilo_limbs(a, b)
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith  # pylint: disable=import-outside-toplevel
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout,),
                     return_type=plgpu.ShapeDtypeStruct(b.shape, jnp.uint32, layout=layout))
  def high(ctx, x):
    del ctx

    def product_high(word):
      i64 = ir.IntegerType.get_signless(64)
      if isinstance(word.type, ir.VectorType):
        wide = ir.VectorType.get(ir.VectorType(word.type).shape, i64)
        const = lambda v: arith.constant(  # noqa: E731
            wide, ir.DenseElementsAttr.get_splat(wide, ir.IntegerAttr.get(i64, v)))
      else:
        wide, const = i64, lambda v: arith.constant(i64, v)  # noqa: E731
      product = arith.muli(arith.extui(wide, word), const(a))
      return arith.trunci(word.type, arith.shrui(product, const(32)))

    return x._pointwise(product_high)  # pylint: disable=protected-access

  return high(b), jnp.uint32(a) * b


def _dropout_multiplier(s, rows, first_key, bh, keys, m: int, t: int,
                        mulhilo=dropout.mulhilo_limbs):
  """f32 [rows, cols]: Z / (1 - rate) of every entry of the score tile ``s`` (keys permuted by
  ``permute_keys``), 0 where dropped: the rule of ``ops.dropout`` (the mask every backend
  applies for the same seed). Pruned entries may get any value: their probability is 0.

  ``rows`` (uint32, the tile's query rows, [rows, 64/M]), ``first_key`` (int32, the tile's
  first key, a multiple of 64) and ``bh`` (int32, batch * heads + head) give the Philox
  counters (key // 8, row, bh, 0), ``keys`` the seed's Philox key schedule
  (``dropout.round_keys``, computed once outside the kernel, its uint32 scalars read from
  memory). The two uniform counters stay scalars (in round 1 their product is a scalar's, and
  what they give later is XORed into arrays); ``mulhilo`` computes the products
  (``_mulhilo_wide`` in the kernels). Column c of member slice j of a 64-key block holds key
  c * M + j of the block, so the M members of a group share one Philox call (8 % M == 0), drawn
  in the slices' own layout: member j reads word ((c * M) % 8 + j) // 2, half j % 2."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  width = PERM_BLOCK // m
  shape = (s.shape[0], width)
  column = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  as_u32 = lambda x: lax.bitcast_convert_type(x, jnp.uint32)
  # bh >= 0, so a conversion is its bit pattern; a scalar must not go through bitcast_convert
  # (Mosaic GPU's warpgroup lowering makes it a 0-d vector, which fails: jax 0.11.2, H100).
  head, counter3 = bh.astype(jnp.uint32), jnp.uint32(0)
  scale = jnp.float32(dropout.keep_scale(t))
  zero = jnp.zeros((), jnp.float32)
  low_t, high_t = jnp.uint32(t), jnp.uint32(t << 16)
  pieces = []
  for block in range(s.shape[1] // PERM_BLOCK):
    first = column * m + (first_key + block * PERM_BLOCK)   # each group's first key
    words = dropout.philox_rounds(as_u32(first >> 3), rows, head, counter3, keys,
                                  mulhilo=mulhilo)
    base = None if m == dropout.KEY_GROUP else (first & 7) >> 1   # word of the group's member 0
    for j in range(m):
      if base is None:
        word = words[j // 2]
      else:
        offset = j // 2
        word = words[offset]
        for w in range(offset + 1, 4):
          word = jnp.where(base + offset == w, words[w], word)
      keep = (word & jnp.uint32(0xFFFF)) >= low_t if j % 2 == 0 else word >= high_t
      pieces.append(jnp.where(keep, scale, zero))
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


# ----------------------------------------------------------------------------- kernels
def _swizzle_bytes(head_dim: int, dtype) -> int:
  """The swizzle of every shared-memory tile of a kernel: a q/k/v row's width in bytes up to
  128 (32 at head dim 16, 64 at 32, 128 from 64 on). One wgmma takes one swizzle for both
  operands, so the P and dS tiles of the dK/dV kernel follow the head dim's too."""
  return min(128, head_dim * jnp.dtype(dtype).itemsize)


def _smem_transforms(head_dim: int, dtype):
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  swizzle = _swizzle_bytes(head_dim, dtype)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _inputs(refs, has_bias, has_seed):
  """((q, k, v, bias, steps, seed), the other refs): bias and steps are None without a bias,
  seed without dropout."""
  refs = list(refs)
  qkv, refs = refs[:3], refs[3:]
  bias_steps, refs = (refs[:2], refs[2:]) if has_bias else ([None, None], refs)
  seed, refs = (refs[0], refs[1:]) if has_seed else (None, refs)
  return tuple(qkv + bias_steps + [seed]), refs


def _operands(q, k, v, bias, steps, seed):
  return (q, k, v) + ((bias, steps) if bias is not None else ()) + (
      (seed,) if seed is not None else ())


def _dropout_draws(seed_ref, t, m, heads, wide_products: bool):
  """None without dropout, else ``draw(s, first_row, first_key)`` for the kernels' loop
  bodies: the multiplier of the score tile ``s`` whose first query row and first key are
  given (int32 scalars)."""
  if not t:
    return None

  def draw(s, first_row, first_key):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    shape = (s.shape[0], PERM_BLOCK // m)
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + first_row
    bh = lax.axis_index("batch") * heads + lax.axis_index("heads")
    keys = [(seed_ref[2 * r], seed_ref[2 * r + 1]) for r in range(dropout.ROUNDS)]
    return _dropout_multiplier(s, lax.bitcast_convert_type(rows, jnp.uint32), first_key,
                               bh, keys, m, t,
                               _mulhilo_wide if wide_products else dropout.mulhilo_limbs)

  return draw


def _forward(q, k, v, bias, steps, seed, *, n: int, m: int, scale: float, tiles: Tiles,
             t: int = 0):
  """(O [B, L, H, D], LSE f32 [B, H, L], base 2 of the scaled scores) on permuted k, v and
  bias (f32 [B, L] or None); L a multiple of 2 * block_q and of block_kv. With a bias,
  ``steps`` (int32 [B]) is the number of key tiles each example needs (those up to its last
  real key): later tiles are all padding and are neither loaded nor computed. With ``t`` > 0
  (``dropout.threshold``), attention dropout by the seed (uint32 [2]): the normalizer and
  the LSE are those of the kept probabilities before dropout, O = (A * Z / (1 - rate)) V."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  batch, length, heads, head_dim = q.shape
  dtype = q.dtype
  block_q, block_kv = tiles.block_q, tiles.block_kv
  compute_wgs = 2
  num_kv = length // block_kv
  stages = min(tiles.stages, num_kv)
  has_bias = bias is not None
  c = scale * _LOG2E
  transforms = _smem_transforms(head_dim, dtype)

  def kernel(*refs):
    (q_ref, k_ref, v_ref, bias_ref, steps_ref, seed_ref), rest = _inputs(refs, has_bias,
                                                                          bool(t))
    o_ref, lse_ref, (qo_smem2, lse_smem2), q_barriers, schedule = rest
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    draw = _dropout_draws(seed_ref, t, m, heads, tiles.wide_products)

    def q_start():                        # this warpgroup's first query row
      return (lax.axis_index("q_seq") * (compute_wgs * block_q)
              + lax.axis_index("wg") * block_q)

    def schedule_barrier():
      if tiles.schedule_barrier:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def compute(pipeline):
      qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
      q_base = q_start()
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, block_q), h], qo_smem,
                              q_barriers.at[wg])
      plgpu.barrier_wait(q_barriers.at[wg])
      m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA)
      pl.when(wg == 1)(schedule_barrier)
      acc, m_i, l_i = pipeline((acc, m_i, l_i))
      pl.when(wg == 0)(schedule_barrier)
      real = m_i > 0.5 * MASKED * c          # m_i is scaled by c
      inv_l = jnp.where(real, 1.0 / l_i, 0.0)
      acc = acc * lax.broadcast_in_dim(inv_l, (block_q, head_dim), [0])
      qo_smem[...] = acc.astype(dtype)
      lse_smem[...] = jnp.where(real, m_i + jnp.log2(l_i), jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(q_base, block_q), h])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_base, block_q)])
      plgpu.wait_smem_to_gmem(0)

    def step(idx, k_smem, v_smem, *rest):
      if has_bias:
        bias_smem, k_done, v_done, bias_done, carry = rest
      else:
        k_done, v_done, carry = rest
      acc, m_i, l_i = carry
      qo_smem = qo_smem2.at[wg]

      def qk_product(acc_ref):
        plgpu.wgmma(acc_ref, qo_smem, k_smem.transpose((1, 0)))
        schedule_barrier()
        return acc_ref[...]

      s = pl.run_scoped(qk_product, plgpu.ACC((block_q, block_kv), jnp.float32))
      plgpu.barrier_arrive(k_done)
      if has_bias:
        key_bias = plgpu.load(bias_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        plgpu.barrier_arrive(bias_done)
        s = _add_key_bias(s, key_bias)
      s, row_max = prune_with_max(s, n, m, tiles.selection)
      m_new = jnp.maximum(m_i, row_max * c)
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l_i = l_i * alpha + p.sum(axis=1)
      if draw is not None:
        p = p * draw(s, q_start(), idx[0] * block_kv)
      p16 = p.astype(dtype)
      schedule_barrier()

      def pv_product(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem)

      acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_done)
      return acc, m_new, l_i

    in_specs = [plgpu.BlockSpec(block_shape=(block_kv, head_dim), index_map=lambda i: (i, 0),
                                transforms=transforms)] * 2
    if has_bias:
      in_specs.append(plgpu.BlockSpec(block_shape=(block_kv,), index_map=lambda i: (i,)))
    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(steps_ref[b] if has_bias else num_kv,), max_concurrent_steps=stages,
        num_compute_wgs=compute_wgs,
        memory_registers=40, wg_axis="wg", manual_consumed_barriers=True,
        compute_context=compute, in_specs=in_specs)
    operands = [k_ref.at[b, :, h, :], v_ref.at[b, :, h, :]]
    if has_bias:
      operands.append(bias_ref.at[b])
    pipeline(*operands)

  out_type = (jax.ShapeDtypeStruct(q.shape, dtype),
              jax.ShapeDtypeStruct((batch, heads, length), jnp.float32))
  scratch = ((plgpu.SMEM((compute_wgs, block_q, head_dim), dtype, transforms=transforms),
              plgpu.SMEM((compute_wgs, block_q), jnp.float32)),
             plgpu.Barrier(num_barriers=compute_wgs),
             plgpu.Barrier(num_arrivals=compute_wgs))
  call = plgpu.kernel(
      kernel, out_type=out_type, scratch_types=scratch,
      grid=(heads, length // (compute_wgs * block_q), batch),
      grid_names=("heads", "q_seq", "batch"), num_threads=compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))
  return call(*_operands(q, k, v, bias, steps, seed))


def _backward_dq(q, k, v, bias, steps, seed, do, lse, delta, *, n, m, scale, tiles: Tiles,
                 t: int = 0):
  """dQ on permuted k, v, bias: one CTA per 2 x block_q query rows, looping over key tiles
  (with a bias, the first ``steps[b, i]`` of them for the i-th CTA of example b)."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  batch, length, heads, head_dim = q.shape
  dtype = q.dtype
  block_q, block_kv = tiles.bwd_block_q, tiles.bwd_block_kv
  compute_wgs = tiles.compute_wgs_bwd
  has_bias = bias is not None
  c = scale * _LOG2E
  transforms = _smem_transforms(head_dim, dtype)

  def kernel(*refs):
    (q_ref, k_ref, v_ref, bias_ref, steps_ref, seed_ref), rest = _inputs(refs, has_bias,
                                                                          bool(t))
    do_ref, lse_ref, delta_ref, dq_ref, smem, barriers = rest
    q_smem2, do_smem2, lse_smem2, delta_smem2 = smem
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    draw = _dropout_draws(seed_ref, t, m, heads, tiles.wide_products)

    def q_start():                        # this warpgroup's first query row
      return (lax.axis_index("q_seq") * (compute_wgs * block_q)
              + lax.axis_index("wg") * block_q)

    def compute(pipeline):
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
      rows = (b, pl.ds(q_start(), block_q), h)
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, barriers[0].at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, barriers[1].at[wg])
      plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(q_start(), block_q)], lse_smem,
                              barriers[2].at[wg])
      plgpu.copy_gmem_to_smem(delta_ref.at[b, h, pl.ds(q_start(), block_q)], delta_smem,
                              barriers[3].at[wg])
      for barrier in barriers:
        plgpu.barrier_wait(barrier.at[wg])
      lse = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
      delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))
      dq = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32),
                             plgpu.Layout.WGMMA)
      dq, _, _ = pipeline((dq, lse, delta))
      q_smem[...] = (dq * scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
      plgpu.wait_smem_to_gmem(0)

    def step(idx, k_smem, v_smem, *rest):
      if has_bias:
        bias_smem, k_done, v_done, bias_done, carry = rest
      else:
        k_done, v_done, carry = rest
      dq, lse, delta = carry
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]

      def qk_product(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(qk_product, plgpu.ACC((block_q, block_kv), jnp.float32))
      if has_bias:
        key_bias = plgpu.load(bias_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        plgpu.barrier_arrive(bias_done)
        s = _add_key_bias(s, key_bias)
      s = nm_prune(s, n, m, tiles.selection)
      p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, s.shape, [0]))

      def dp_product(acc_ref):
        plgpu.wgmma(acc_ref, do_smem, v_smem.transpose((1, 0)))
        return acc_ref[...]

      dp = pl.run_scoped(dp_product, plgpu.ACC((block_q, block_kv), jnp.float32))
      plgpu.barrier_arrive(v_done)
      if draw is not None:                # dA = dP * Z / (1 - rate)
        dp = dp * draw(s, q_start(), idx[0] * block_kv)
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))

      def dq_product(acc_ref):
        plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem)

      dq = pl.run_state(dq_product)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(k_done)
      return dq, lse, delta

    in_specs = [plgpu.BlockSpec(block_shape=(block_kv, head_dim), index_map=lambda i: (i, 0),
                                transforms=transforms)] * 2
    if has_bias:
      in_specs.append(plgpu.BlockSpec(block_shape=(block_kv,), index_map=lambda i: (i,)))
    num_steps = steps_ref[b, lax.axis_index("q_seq")] if has_bias else length // block_kv
    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(num_steps,), max_concurrent_steps=min(tiles.bwd_stages,
                                                          length // block_kv),
        num_compute_wgs=compute_wgs, memory_registers=40, wg_axis="wg",
        manual_consumed_barriers=True, compute_context=compute, in_specs=in_specs)
    operands = [k_ref.at[b, :, h, :], v_ref.at[b, :, h, :]]
    if has_bias:
      operands.append(bias_ref.at[b])
    pipeline(*operands)

  tile = plgpu.SMEM((compute_wgs, block_q, head_dim), dtype, transforms=transforms)
  vector = plgpu.SMEM((compute_wgs, block_q), jnp.float32)
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=((tile, tile, vector, vector),
                     (plgpu.Barrier(num_barriers=compute_wgs),) * 4),
      grid=(heads, length // (compute_wgs * block_q), batch),
      grid_names=("heads", "q_seq", "batch"), num_threads=compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))
  return call(*_operands(q, k, v, bias, steps, seed), do, lse, delta)


def _backward_dkv(q, k, v, bias, steps, seed, do, lse, delta, *, n, m, scale, tiles: Tiles,
                  t: int = 0, dq_acc=None):
  """(dK, dV) on permuted k, v, bias: one CTA per compute_wgs x block_kv keys, looping over
  query tiles (with a bias, the first ``steps[b, j]`` of them for the j-th CTA of example b).
  S is recomputed as [query, key] (so the N:M slices are column slices); P^T dO and dS^T Q
  take P and dS from shared memory, transposed. With ``dq_acc`` (a float32 [B, L, H, D] ref of
  zeros, ``jax.new_ref``), each step also adds its share of dQ / scale, dS K over this
  warpgroup's keys, into the query rows of the step by the TMA's reduce-add."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  batch, length, heads, head_dim = q.shape
  dtype = q.dtype
  block_q, block_kv = tiles.bwd_block_q, tiles.bwd_block_kv
  compute_wgs = tiles.compute_wgs_bwd
  has_bias = bias is not None
  fused = dq_acc is not None
  c = scale * _LOG2E
  transforms = _smem_transforms(head_dim, dtype)

  def kernel(*refs):
    (q_ref, k_ref, v_ref, bias_ref, steps_ref, seed_ref), rest = _inputs(refs, has_bias,
                                                                          bool(t))
    if fused:
      do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, smem, barriers = rest
      k_smem2, v_smem2, bias_smem2, p_smem2, ds_smem2, dq_smem2 = smem
    else:
      do_ref, lse_ref, delta_ref, dk_ref, dv_ref, smem, barriers = rest
      k_smem2, v_smem2, bias_smem2, p_smem2, ds_smem2 = smem
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    draw = _dropout_draws(seed_ref, t, m, heads, tiles.wide_products)

    def kv_start():                       # this warpgroup's first key
      return (lax.axis_index("kv_seq") * (compute_wgs * block_kv)
              + lax.axis_index("wg") * block_kv)

    def compute(pipeline):
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      keys = (b, pl.ds(kv_start(), block_kv), h)
      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, barriers[0].at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, barriers[1].at[wg])
      if has_bias:
        plgpu.copy_gmem_to_smem(bias_ref.at[b, pl.ds(kv_start(), block_kv)], bias_smem2.at[wg],
                                barriers[2].at[wg])
        plgpu.barrier_wait(barriers[2].at[wg])
        key_bias = plgpu.load(bias_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
      else:
        key_bias = None
      plgpu.barrier_wait(barriers[0].at[wg])
      plgpu.barrier_wait(barriers[1].at[wg])
      zeros = jnp.full((block_kv, head_dim), 0.0, jnp.float32)
      dk = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
      dv = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
      if has_bias:
        dk, dv, _ = pipeline((dk, dv, key_bias))
      else:
        dk, dv = pipeline((dk, dv))
      k_smem[...] = (dk * scale).astype(dtype)
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys], commit_group=False)
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    def step(idx, q_smem, do_smem, lse_smem, delta_smem, q_done, do_done, lse_done,
             delta_done, carry):
      if has_bias:
        dk, dv, key_bias = carry
      else:
        dk, dv = carry
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      p_smem, ds_smem = p_smem2.at[wg], ds_smem2.at[wg]

      def qk_product(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(qk_product, plgpu.ACC((block_q, block_kv), jnp.float32))
      if has_bias:
        s = _add_key_bias(s, key_bias)
      s = nm_prune(s, n, m, tiles.selection)
      lse = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
      plgpu.barrier_arrive(lse_done)
      p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, s.shape, [0]))

      def dp_product(acc_ref):
        plgpu.wgmma(acc_ref, do_smem, v_smem.transpose((1, 0)))
        return acc_ref[...]

      dp = pl.run_scoped(dp_product, plgpu.ACC((block_q, block_kv), jnp.float32))
      delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))
      plgpu.barrier_arrive(delta_done)
      if draw is not None:                # dV takes the dropped A, dA = dP * Z / (1 - rate)
        mult = draw(s, idx[0] * block_q, kv_start())
        dp = dp * mult
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
      if draw is not None:
        p = p * mult
      p_smem[...] = p.astype(dtype)
      ds_smem[...] = ds.astype(dtype)
      plgpu.commit_smem()

      def grads(refs):
        dv_ref, dk_ref = refs
        plgpu.wgmma(dv_ref, p_smem.transpose((1, 0)), do_smem)
        plgpu.wgmma(dk_ref, ds_smem.transpose((1, 0)), q_smem)

      dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
      if fused:                           # this step's share of dQ / scale: dS K
        def dq_product(acc_ref):
          plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem)
          return acc_ref[...]

        dq_part = pl.run_scoped(dq_product, plgpu.ACC((block_q, head_dim), jnp.float32))
        dq_smem = dq_smem2.at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last step's add has read it
        dq_smem[...] = dq_part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[b, pl.ds(idx[0] * block_q, block_q), h],
                                reduction_op="add")
      plgpu.barrier_arrive(q_done)
      plgpu.barrier_arrive(do_done)
      return (dk, dv, key_bias) if has_bias else (dk, dv)

    num_steps = steps_ref[b, lax.axis_index("kv_seq")] if has_bias else length // block_q
    pipeline = plgpu.emit_pipeline_warp_specialized(
        step, grid=(num_steps,),
        max_concurrent_steps=min(tiles.bwd_stages, length // block_q),
        num_compute_wgs=compute_wgs, memory_registers=40, wg_axis="wg",
        manual_consumed_barriers=True, compute_context=compute,
        in_specs=[plgpu.BlockSpec(block_shape=(block_q, head_dim), index_map=lambda i: (i, 0),
                                  transforms=transforms)] * 2
        + [plgpu.BlockSpec(block_shape=(block_q,), index_map=lambda i: (i,))] * 2)
    pipeline(q_ref.at[b, :, h, :], do_ref.at[b, :, h, :], lse_ref.at[b, h, :],
             delta_ref.at[b, h, :])

  kv_tile = plgpu.SMEM((compute_wgs, block_kv, head_dim), dtype, transforms=transforms)
  pq_tile = plgpu.SMEM((compute_wgs, block_q, block_kv), dtype, transforms=transforms)
  bias_buf = plgpu.SMEM((compute_wgs, block_kv), jnp.float32)
  smem = (kv_tile, kv_tile, bias_buf, pq_tile, pq_tile)
  if fused:
    smem += (plgpu.SMEM((compute_wgs, block_q, head_dim), jnp.float32),)
  out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
  scratch = (smem, (plgpu.Barrier(num_barriers=compute_wgs),) * 3)
  grid = dict(grid=(heads, length // (compute_wgs * block_kv), batch),
              grid_names=("heads", "kv_seq", "batch"), num_threads=compute_wgs + 1,
              thread_name="wg")
  params = plgpu.CompilerParams(approx_math=True)
  operands = _operands(q, k, v, bias, steps, seed) + (do, lse, delta)
  if not fused:
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch,
                        compiler_params=params, **grid)(*operands)

  # A ref operand (dq_acc, which the kernel adds into) cannot pass plgpu.kernel's batching
  # wrapper (its jaxpr loses the ref's write effect: traced on jax 0.10.2), so the fused
  # kernel is launched as plgpu.kernel does it underneath: pl.kernel on the warpgroup mesh,
  # the scratch allocated by run_scoped across the warpgroups.
  def body(*refs):
    pl.run_scoped(functools.partial(kernel, *refs), *scratch, collective_axes="wg")

  return pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(**grid),
                   compiler_params=params)(*operands, dq_acc)


# ----------------------------------------------------------------------------- wrapper
def _padded_length(length: int, tiles: Tiles) -> int:
  multiple = math.lcm(2 * tiles.block_q, tiles.block_kv, PERM_BLOCK,
                      tiles.compute_wgs_bwd * tiles.bwd_block_q,
                      tiles.compute_wgs_bwd * tiles.bwd_block_kv)
  return -(-length // multiple) * multiple


def _prepare(q, k, v, mask, m, tiles):
  """Pads to the tile multiple, permutes k, v and the key bias; also gives each example's
  key extent (int32 [B]: one past its last real key, 0 when it has none). Bias and extent
  are None when no key is padded or masked."""
  batch, length = q.shape[:2]
  lp = _padded_length(length, tiles)
  pad = [(0, 0), (0, lp - length), (0, 0), (0, 0)]
  if lp != length:
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  bias = extent = None
  if mask is not None or lp != length:
    real = jnp.ones((batch, length), bool) if mask is None else mask.astype(bool)
    real = jnp.pad(real, [(0, 0), (0, lp - length)])
    bias = permute_keys(jnp.where(real, 0.0, MASKED).astype(jnp.float32), m)
    extent = _extent(real)
  return q, permute_keys(k, m), permute_keys(v, m), bias, extent


def _tiles_up_to(extent, block: int):
  """The number of ``block``-sized tiles that hold positions [0, extent)."""
  return (extent + block - 1) // block


def _backward_steps(extent, do, tiles: Tiles):
  """Per-CTA step counts of the two backward kernels with key padding (the kernels skip the
  rest, which is exact): a dQ CTA loops over the key tiles up to the last real key, or none
  when dO is 0 on all its rows (rows whose output reaches no loss: padded positions of a
  masked model); a dK/dV CTA loops over the query tiles up to the last row with a non-zero
  dO (a row with dO = 0 adds nothing: dV += P^T dO and dS = P (dP - rowsum(dO O)) vanish),
  or none when its keys are all past the last real key (P = 0 there)."""
  batch, length = do.shape[:2]
  live = jnp.any(do != 0, axis=(2, 3))                                     # [B, L]
  q_cta = tiles.compute_wgs_bwd * tiles.bwd_block_q
  live_cta = jnp.any(live.reshape(batch, length // q_cta, q_cta), axis=2)
  dq_steps = jnp.where(live_cta, _tiles_up_to(extent, tiles.bwd_block_kv)[:, None], 0)
  kv_cta = tiles.compute_wgs_bwd * tiles.bwd_block_kv
  cta_start = jnp.arange(length // kv_cta, dtype=jnp.int32) * kv_cta
  dkv_steps = jnp.where(cta_start[None, :] < extent[:, None],
                        _tiles_up_to(_extent(live), tiles.bwd_block_q)[:, None], 0)
  return dq_steps, dkv_steps


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attn(q, k, v, mask, seed, n, m, scale, tiles, t):
  return _attn_fwd(q, k, v, mask, seed, n, m, scale, tiles, t)[0]


def _kernel_seed(seed):
  """The kernels' seed operand (None without dropout): the seed's Philox key schedule,
  uint32 [2 * ROUNDS] (k0, k1 of round 0, then of round 1, ...)."""
  if seed is None:
    return None
  words = lax.bitcast_convert_type(seed, jnp.uint32)
  return jnp.stack([k for pair in dropout.round_keys(words[0], words[1]) for k in pair])


def _attn_fwd(q, k, v, mask, seed, n, m, scale, tiles, t):
  length = q.shape[1]
  qp, kp, vp, bias, extent = _prepare(q, k, v, mask, m, tiles)
  steps = None if bias is None else _tiles_up_to(extent, tiles.block_kv)
  kseed = _kernel_seed(seed)
  o, lse = _forward(qp, kp, vp, bias, steps, kseed, n=n, m=m, scale=scale, tiles=tiles, t=t)
  return o[:, :length], (qp, kp, vp, bias, extent, o, lse, mask, seed, kseed)


def _attn_bwd(n, m, scale, tiles, t, res, do):
  qp, kp, vp, bias, extent, o, lse, mask, seed, kseed = res
  length = do.shape[1]
  do = jnp.pad(do.astype(qp.dtype), [(0, 0), (0, qp.shape[1] - length), (0, 0), (0, 0)])
  # rowsum(dO * O) = rowsum(dA * A) also with dropout, as O = (A * Z / (1 - rate)) V
  delta = jnp.einsum("blhd,blhd->bhl", o.astype(jnp.float32), do.astype(jnp.float32))
  kw = dict(n=n, m=m, scale=scale, tiles=tiles, t=t)
  dq_steps, dkv_steps = (None, None) if bias is None else _backward_steps(extent, do, tiles)
  if tiles.fused_backward and qp.shape[-1] <= FUSED_BACKWARD_MAX_HEAD_DIM:
    # a dK/dV CTA's skipped query tiles and keys add nothing to dQ (dS = 0 there), so the
    # rows no CTA reaches keep the zeros they start from, as the dQ kernel gives them
    dq_acc = jax.new_ref(jnp.zeros(qp.shape, jnp.float32))
    dk, dv = _backward_dkv(qp, kp, vp, bias, dkv_steps, kseed, do, lse, delta, dq_acc=dq_acc,
                           **kw)
    dq = (dq_acc[...] * scale).astype(qp.dtype)
  else:
    dq = _backward_dq(qp, kp, vp, bias, dq_steps, kseed, do, lse, delta, **kw)
    dk, dv = _backward_dkv(qp, kp, vp, bias, dkv_steps, kseed, do, lse, delta, **kw)
  dk, dv = unpermute_keys(dk, m), unpermute_keys(dv, m)
  dmask = None if mask is None else jnp.zeros(mask.shape, jax.dtypes.float0)
  dseed = None if seed is None else jnp.zeros(seed.shape, jax.dtypes.float0)
  return dq[:, :length], dk[:, :length], dv[:, :length], dmask, dseed


_attn.defvjp(_attn_fwd, _attn_bwd)


def _checked_mask(mask, q):
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != q.shape[:2]:
    raise ValueError(f"mask must be [batch, length] = {q.shape[:2]}, got {mask.shape}")
  return mask.astype(bool)


def _run(q, k, v, mask, seed, n, m, tiles, t, deterministic):
  if deterministic and tiles.fused_backward:   # the two-kernel backward: no atomic adds
    tiles = dataclasses.replace(tiles, fused_backward=False)
  head_dim = q.shape[-1]
  width = kernel_head_dim(head_dim, tiles)
  q, k, v = (zero_pad_head_dim(x, width) for x in (q, k, v))
  out = _attn(q, k, v, mask, seed, n, m, 1.0 / math.sqrt(head_dim), tiles, t)
  return out[..., :head_dim]


def dfss_attention_mgpu(q, k, v, *, n: int, m: int, mask=None,
                        tiles: Optional[Tiles] = None, dropout_rate: float = 0.0,
                        dropout_seed=None, deterministic: bool = False):
  """DFSS attention with the Mosaic GPU kernels. q, k, v: [batch, length, heads, head_dim]
  (bf16 / fp16, head_dim <= 128: 16, 32, 64 and 128 run as they are, others zero-padded to
  the next with the true head dim's softmax scale, exactly), mask: bool [batch, length] key
  padding (True = real).
  Attention dropout: rate in [0, 1) and, when > 0, ``dropout_seed`` (int32 [2],
  ``dropout.seed_words``): the mask ``ops.dropout`` defines, the same as the Triton
  kernels and the pure-JAX path draw for that seed.
  ``deterministic``: the backward in two kernels (dQ, then dK/dV) without atomic adds, so
  gradients are bit-reproducible; otherwise head dims up to 64 run ``Tiles.fused_backward``.
  Raises ValueError(``unsupported_reason``) for operands the kernels do not handle."""
  reason = unsupported_reason(q, v, n, m, k=k)
  if reason is not None:
    raise ValueError(reason)
  t, seed = dropout.checked_seed(dropout_rate, dropout_seed)
  return _run(q, k, v, _checked_mask(mask, q), seed, n, m, _resolved(tiles), t, deterministic)


DENSE_DROPOUT_M = dropout.KEY_GROUP   # dense with dropout: keys permuted as for M = 8


def dense_attention_mgpu(q, k, v, *, mask=None, tiles: Optional[Tiles] = None,
                         dropout_rate: float = 0.0, dropout_seed=None,
                         deterministic: bool = False):
  """Dense softmax attention with the Mosaic GPU kernels (the DFSS kernels with nothing
  pruned): softmax(Q K^T / sqrt(d)) V over the real keys, with attention dropout by the rule of
  ``ops.dropout`` (the mask XLA's dense path draws for the same seed). Operands as
  ``dfss_attention_mgpu``; the key mask may have holes (any bool [batch, length]); a row with
  no real key gives zeros; ``deterministic`` as there. Raises
  ValueError(``dense_unsupported_reason``) otherwise."""
  reason = dense_unsupported_reason(q, v, k=k)
  if reason is not None:
    raise ValueError(reason)
  t, seed = dropout.checked_seed(dropout_rate, dropout_seed)
  m = DENSE_DROPOUT_M if t else 1
  return _run(q, k, v, _checked_mask(mask, q), seed, m, m, _resolved(tiles), t, deterministic)
