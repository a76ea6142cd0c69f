"""DSA selection and attention in pure JAX: the reference the Triton kernels
(``kernels.dsa.triton``)
are tested against, and the path that runs everywhere else.

The selection rule (one rule for both paths)
--------------------------------------------
The predictor's Q~, K~ are float.  Which keys a query keeps is decided on integers:

    q8_g = round(127 * q~_g / max|q~_g|)       per query row (or vector group g), per head
    k8_j = round(127 * k~_j / max|k~|)          one scale per (example, head), real keys only
    s_gj = q8_g . k8_j                           exact int32 (order-free: kernel == reference)

* top-k: each row's s is mapped to an 8-bit code, code_gj = (s_gj - lo_g) >> shift_g, with lo_g
  the row's smallest real-key value and shift_g the smallest shift that brings the row's span
  below 256; the row keeps its ``need`` (ceil((1 - sparsity) * n_real)) largest codes, ties to
  the lower key index.
* threshold: keep s_gj * factor_g >= threshold, factor_g = max|q~_g| max|k~| / 127^2 /
  sqrt(head_dim): S~ with int8-rounded operands, one fp32 multiply.

Why not the float S~: a float dot product's last bits depend on the summation order, so a
tensor-core kernel and XLA would disagree on near-ties; on integers they agree exactly, which
is what lets tests compare the kernel's chosen set with this one bit for bit.  Per-row scaling
of q~ does not change a row's order; the 8-bit code is what the paper's GPU pipeline does too
(low-precision predictor, selection on its output) and is what makes a fused, sort-free
selection cheap.  Ranking on the code instead of s merges values closer than 2^shift_g into
one tie (the lower key index wins); rounding q~, k~ to int8 perturbs S~ by about 1% of its
spread.  Padded keys are never selected; a row with no real key keeps nothing (zeros out).

Vector granularity V: V consecutive query rows share their keys, chosen from the mean of q~
over the group's real rows (the mean of S~ over the rows, since S~ is linear in q~).

Everything is [batch, heads, groups, ...] with groups = length / V; masks are bool.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from lra_sparse.kernels.shared.prologue import extent
from lra_sparse.ops import dropout, softmax

QMAX = 127            # int8 range of the selection operands
CODE_LEVELS = 256     # top-k ranks an 8-bit code of each row's scores
_SENTINEL = 2 ** 30   # above any |s| (|s| <= 127 * 127 * 1024 < 2^24)
MAX_RANK = 1024       # widest predictor (or oracle head dim) the int32 scores allow


def keep_counts(mask, sparsity: float, length: int):
  """Per-example number of kept keys ceil((1 - sparsity) * n_real), at least 1: int32 [batch]
  (or [1] without a mask)."""
  n_real = (jnp.full((1,), length, jnp.float32) if mask is None
            else jnp.sum(mask, axis=-1).astype(jnp.float32))
  # - 1e-6 so that e.g. 0.1 * 30 = 3.0000000000000004 keeps 3, not 4.
  return jnp.maximum(jnp.ceil((1.0 - sparsity) * n_real - 1e-6), 1.0).astype(jnp.int32)


def static_keep(sparsity: float, length: int) -> int:
  """The largest per-row keep count."""
  return max(1, min(length, math.ceil((1.0 - sparsity) * length - 1e-6)))


def padded_rank(rank: int) -> int:
  """The selection operands' last axis: the rank zero-padded to a power of two >= 32 (Triton
  tiles are powers of two; 32 is the int8 tensor-core K step); zeros add nothing to s."""
  return max(32, 1 << (rank - 1).bit_length())


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q8", "k8", "factor"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SelectionOperands:
  """q8 int8 [batch, heads, groups, KP], k8 int8 [batch, heads, length, KP] (padded keys 0),
  factor fp32 [batch, heads, groups] (threshold selection's int -> S~ scale)."""
  q8: jax.Array
  k8: jax.Array
  factor: jax.Array


def _quantize(x, axes, valid=None):
  """(round(127 x / max|x|) as int8, max|x|) over ``axes``; an all-zero slice stays 0."""
  magnitude = jnp.abs(x) if valid is None else jnp.where(valid, jnp.abs(x), 0.0)
  amax = jnp.max(magnitude, axis=axes, keepdims=True)
  q = jnp.round(x / jnp.where(amax > 0, amax, 1.0) * QMAX)
  return jnp.clip(q, -QMAX, QMAX).astype(jnp.int8), amax


def group_queries(q, mask, vector: int):
  """[batch, length, heads, k] -> [batch, length / vector, heads, k]: the mean of each group
  of ``vector`` consecutive rows over its real rows (all rows when none is real)."""
  q = q.astype(jnp.float32)
  if vector == 1:
    return q
  b, l, h, r = q.shape
  if l % vector:
    raise ValueError(f"sequence length {l} is not a multiple of the column-vector size {vector}")
  w = jnp.ones((b, l), jnp.float32) if mask is None else mask.astype(jnp.float32)
  w = w.reshape(b, l // vector, vector, 1, 1)
  w = jnp.where(jnp.sum(w, axis=2, keepdims=True) > 0, w, 1.0)
  grouped = q.reshape(b, l // vector, vector, h, r)
  return jnp.sum(grouped * w, axis=2) / jnp.sum(w, axis=2)


def selection_operands(q_pred, k_pred, mask=None, *, vector: int = 1,
                       scale: float = 1.0) -> SelectionOperands:
  """The integer operands of the selection rule from the predictor's Q~, K~ [batch, length,
  heads, k] (any float dtype; no gradient flows), or their ``LowRank`` factors (x w): a factored
  Q~ is grouped before it is projected, (mean of x over the group's real rows) w, which is the
  group mean of Q~ (linear) without forming Q~ [batch, length, heads, k] in fp32.
  ``scale``: the 1/sqrt(head_dim) that S~ carries (threshold selection compares scaled
  scores)."""
  if isinstance(k_pred, LowRank):
    k_pred = jnp.einsum("blr,hrk->blhk", k_pred.x, k_pred.w)
  grouped = isinstance(q_pred, LowRank)       # then q_pred becomes [batch, groups, heads, k]
  if grouped:
    x = group_queries(jax.lax.stop_gradient(q_pred.x)[:, :, None, :], mask, vector)[:, :, 0]
    q_pred = jnp.einsum("bgr,hrk->bghk", x, jax.lax.stop_gradient(q_pred.w))
  rows = k_pred.shape[1] // vector if grouped else k_pred.shape[1]
  if q_pred.ndim != 4 or q_pred.shape != (k_pred.shape[0], rows) + k_pred.shape[2:]:
    raise ValueError(f"q_pred and k_pred must both be [batch, length, heads, k], got "
                     f"{q_pred.shape} and {k_pred.shape}")
  rank = q_pred.shape[-1]
  if not 1 <= rank <= MAX_RANK:
    raise ValueError(f"predictor rank {rank} not in [1, {MAX_RANK}]")
  q_pred = jax.lax.stop_gradient(q_pred)
  k_pred = jax.lax.stop_gradient(k_pred).astype(jnp.float32)
  qg = (q_pred.astype(jnp.float32) if grouped                          # [B, G, H, k]
        else group_queries(q_pred, mask, vector))
  q8, q_amax = _quantize(qg, axes=(-1,))                             # per row, per head
  real = None if mask is None else mask[:, :, None, None]
  k8, k_amax = _quantize(k_pred, axes=(1, 3), valid=real)            # per (example, head)
  if real is not None:
    k8 = jnp.where(real, k8, 0)
  pad = padded_rank(rank) - rank
  to_bhlk = lambda x: jnp.pad(jnp.transpose(x, (0, 2, 1, 3)),       # noqa: E731
                              ((0, 0),) * 3 + ((0, pad),))
  factor = q_amax[..., 0] * k_amax[..., 0] * jnp.float32(scale / QMAX ** 2)   # [B, G, H]
  return SelectionOperands(to_bhlk(q8), to_bhlk(k8), jnp.transpose(factor, (0, 2, 1)))


def integer_scores(ops: SelectionOperands):
  """s = q8 k8^T, exact int32 [batch, heads, groups, length] (reference only: L^2 memory)."""
  return jnp.einsum("bhgk,bhlk->bhgl", ops.q8, ops.k8, preferred_element_type=jnp.int32)


def row_codes(s, valid):
  """The 8-bit code (s - lo) >> shift of each row (-1 at invalid keys), int32, same shape."""
  lo = jnp.min(jnp.where(valid, s, _SENTINEL), axis=-1, keepdims=True)
  hi = jnp.max(jnp.where(valid, s, -_SENTINEL), axis=-1, keepdims=True)
  span = hi - lo            # negative for a row without a valid key: shift 0, codes unused
  shift = sum(((span >> t) >= CODE_LEVELS).astype(jnp.int32) for t in range(32))
  return jnp.where(valid, (s - lo) >> shift, -1)


_RADIX_BITS = 4


def _order_keys(x):
  """float32 -> uint32 keys with the same order (-0.0 and +0.0 share a key)."""
  x = x.astype(jnp.float32)
  x = jnp.where(x == 0, jnp.float32(0), x)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _digit_search(count_fn, total_bits: int, need):
  """Largest v < 2**total_bits with count_fn(v) >= need, found MSB first, _RADIX_BITS per pass
  (count_fn is non-increasing in v and count_fn(0) >= need). count_fn maps candidates
  [..., 1, D] to counts [..., D]; each pass is one fused compare-and-count over the rows."""
  prefix = jnp.zeros(need.shape, jnp.uint32)
  digits = jnp.arange(1, 2 ** _RADIX_BITS, dtype=jnp.uint32)
  top = -(-total_bits // _RADIX_BITS) * _RADIX_BITS
  for shift in range(top - _RADIX_BITS, -1, -_RADIX_BITS):
    counts = count_fn(prefix | (digits << shift))
    digit = jnp.sum(counts >= need, axis=-1, keepdims=True, dtype=jnp.uint32)
    prefix = prefix | (digit << shift)
  return prefix


def _topk_mask_radix(scores, need):
  """Radix select of each row's need-th largest value t (8 passes of 15 compares per entry),
  then keep s > t and the lowest-index entries equal to t (index passes only if ties demand)."""
  keys = _order_keys(scores)
  count_ge = lambda c: jnp.sum(keys[..., :, None] >= c[..., None, :], axis=-2, dtype=jnp.int32)
  threshold = _digit_search(count_ge, 32, need)
  greater, equal = keys > threshold, keys == threshold
  n_greater = jnp.sum(greater, axis=-1, keepdims=True, dtype=jnp.int32)
  n_equal = jnp.sum(equal, axis=-1, keepdims=True, dtype=jnp.int32)
  length = scores.shape[-1]
  position = jnp.arange(length, dtype=jnp.uint32)

  def cut_ties(_):
    want = need - n_greater       # equal entries to keep, lowest index first
    # want - #(equal entries before v) is >= 1 exactly for v <= the want-th equal position.
    remaining = lambda c: want - jnp.sum(
        equal[..., :, None] & (position[:, None] < c[..., None, :]), axis=-2, dtype=jnp.int32)
    last = _digit_search(remaining, max(1, (length - 1).bit_length()), jnp.ones_like(want))
    return greater | (equal & (position <= last))

  return jax.lax.cond(jnp.any(n_greater + n_equal > need), cut_ties,
                      lambda _: keys >= threshold, None)


def _topk_mask_lax(scores, need, max_keep: int):
  """lax.top_k (a sort on GPU for large k) gives t; the mask is one elementwise pass."""
  values, indices = jax.lax.top_k(scores, max_keep)
  chosen = jnp.arange(max_keep) < need
  last = jnp.take_along_axis(values, jnp.minimum(need - 1, max_keep - 1), axis=-1)
  tied = chosen & (values == last)
  last_tied_index = jnp.max(jnp.where(tied, indices, -1), axis=-1, keepdims=True)
  position = jnp.arange(scores.shape[-1])
  return (scores > last) | ((scores == last) & (position <= last_tied_index))


TOPK_ALGORITHMS = ("radix", "top_k")
TOPK_ALGORITHM = "top_k"  # lax.top_k: 1.5x faster per train step than radix on an H100


def topk_mask(scores, counts, *, algorithm: Optional[str] = None,
              max_keep: Optional[int] = None):
  """bool, same shape as ``scores`` [batch, ..., L]: the ``counts[b]`` largest of every row,
  ties to the lower index.

  Entries that must never be chosen should be -inf and counts (int [batch] or [1]) must lie
  in [1, number of finite entries]. ``algorithm`` (default TOPK_ALGORITHM): "top_k" uses
  lax.top_k with the static ``max_keep`` (>= every count; default: the row length) and no
  scatter; "radix" selects each row's threshold with fused compare-and-count passes, no sort.
  """
  algorithm = algorithm or TOPK_ALGORITHM
  need = counts.reshape(counts.shape + (1,) * (scores.ndim - 1)).astype(jnp.int32)
  need = jnp.broadcast_to(need, scores.shape[:-1] + (1,))
  if algorithm == "radix":
    return _topk_mask_radix(scores, need)
  if algorithm == "top_k":
    return _topk_mask_lax(scores, need, max_keep or scores.shape[-1])
  raise ValueError(f"unknown top-k algorithm {algorithm!r}; choose one of {TOPK_ALGORITHMS}")



def topk_rows(values, counts, valid, *, algorithm: Optional[str] = None,
              max_keep: Optional[int] = None):
  """bool: the ``counts`` largest ``values`` (int, |values| < 2^9) of each row among ``valid``,
  ties to the lower index; counts int [batch] broadcast over the other row axes."""
  length = values.shape[-1]
  # A unique float key per entry (larger value first, then lower index; exact below 2^24):
  # the top-k has no ties left to break.
  key = values.astype(jnp.float32) * length + (length - 1 - jnp.arange(length, dtype=jnp.float32))
  key = jnp.where(valid, key, -jnp.inf)
  return valid & topk_mask(key, counts, algorithm=algorithm, max_keep=max_keep)


def reference_select(ops: SelectionOperands, mask=None, *, sparsity: float = 0.9,
                     selection: str = "topk", threshold: float = 0.0,
                     topk_algorithm: Optional[str] = None):
  """The kept keys of each row group: bool [batch, heads, groups, length].

  Padded keys are never kept, and a row group that lies wholly past its example's last real
  token (trailing padding) keeps nothing: its rows' outputs are zero.  Such rows reach no loss
  (a padded token is masked out of every later softmax and never pooled), so the kernels skip
  their work instead of ranking keys for them."""
  s = integer_scores(ops)
  groups, length = s.shape[-2:]
  valid = (jnp.ones(s.shape, bool) if mask is None
           else jnp.broadcast_to(mask[:, None, None, :], s.shape)
           & live_groups(mask, groups)[:, None, :, None])
  if selection == "threshold":
    return valid & (s.astype(jnp.float32) * ops.factor[..., None] >= jnp.float32(threshold))
  if selection != "topk":
    raise ValueError(f"unknown DSA selection {selection!r}; choose 'topk' or 'threshold'")
  return topk_rows(row_codes(s, valid), keep_counts(mask, sparsity, length), valid,
                   algorithm=topk_algorithm, max_keep=static_keep(sparsity, length))


def live_groups(mask, groups: int):
  """bool [batch, groups]: the row groups (``groups`` of L / groups rows each) that start
  before their example's last real token ends; the later ones are trailing padding."""
  vector = mask.shape[1] // groups
  return jnp.arange(groups)[None, :] * vector < extent(mask)[:, None]


def expand_groups(keep_groups, vector: int):
  """[batch, heads, groups, length] -> [batch, heads, length, length] (rows of a group share)."""
  return keep_groups if vector == 1 else jnp.repeat(keep_groups, vector, axis=2)


# ----------------------------------------------------------------------------- block
# granularity: the same rule on (query block, key block) pairs
def pool_blocks(x, mask, block_size: int):
  """[batch, length, r] -> (the mean of each block of ``block_size`` positions over its real
  ones (all of them when none is real) [batch, blocks, r] fp32, bool [batch, blocks]: the
  block holds a real position). A last partial block counts its positions only."""
  b, length, _ = x.shape
  blocks = -(-length // block_size)
  pad = blocks * block_size - length
  real = jnp.ones((b, length), bool) if mask is None else mask.astype(bool)
  real = jnp.pad(real, ((0, 0), (0, pad)))
  x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0)))
  pooled = group_queries(x[:, :, None, :], real, block_size)[:, :, 0]
  return pooled, jnp.any(real.reshape(b, blocks, block_size), axis=-1)


def block_select(q_pred: "LowRank", k_pred: "LowRank", mask=None, *, block_size: int,
                 sparsity: float = 0.9, selection: str = "topk", threshold: float = 0.0,
                 scale: float = 1.0, topk_algorithm: Optional[str] = None):
  """The kept key blocks of each query block: bool [batch, heads, blocks, blocks].

  A block pair's predicted score is the mean of S~ over its real (query, key) pairs, which is
  (block mean of Q~) . (block mean of K~) since S~ is bilinear: the factored predictor applied
  to block means of XP (``pool_blocks``), no [L, L] array. The fine-grained rule then runs on
  blocks (``selection_operands`` and ``reference_select``): each query block keeps
  ceil((1 - sparsity) * real key blocks) key blocks (top-k) or those whose mean predicted score
  reaches ``threshold``; key blocks without a real key are never kept and query blocks past the
  last real token keep none."""
  xq, real_blocks = pool_blocks(q_pred.x, mask, block_size)
  xk, _ = pool_blocks(k_pred.x, mask, block_size)
  ops = selection_operands(LowRank(xq, q_pred.w), LowRank(xk, k_pred.w), real_blocks,
                           vector=1, scale=scale)
  return reference_select(ops, real_blocks, sparsity=sparsity, selection=selection,
                          threshold=threshold, topk_algorithm=topk_algorithm)


def expand_blocks(keep_blocks, block_size: int, length: int, mask=None):
  """bool [batch, heads, blocks, blocks] -> [batch, heads, length, length]: every (query, key)
  of a kept block pair, padded keys excluded (rows of a block share its keys)."""
  keep = jnp.repeat(jnp.repeat(keep_blocks, block_size, axis=2), block_size, axis=3)
  keep = keep[:, :, :length, :length]
  return keep if mask is None else keep & mask.astype(bool)[:, None, None, :]


def block_vector(length: int) -> int:
  """The row-group size the block rule's kernel bits use: 8 (block sizes are multiples of 8,
  so a group never straddles two blocks) when it divides ``length``, else 1."""
  return 8 if length % 8 == 0 else 1


def block_bits(keep_blocks, block_size: int, length: int, mask=None, *, vector: int = 1):
  """The keep bits of the block rule, as ``pack_bits`` of ``expand_blocks`` grouped by
  ``vector`` rows (what the attention kernels read): int32 [batch, heads, length / vector,
  ceil(length / 32)], built from [batch, heads, blocks, length] without an [L, L] array.
  ``vector`` must divide ``block_size`` and ``length``."""
  if block_size % vector or length % vector:
    raise ValueError(f"vector {vector} must divide block_size {block_size} and length {length}")
  keys = jnp.repeat(keep_blocks, block_size, axis=3)[..., :length]
  if mask is not None:
    keys = keys & mask.astype(bool)[:, None, None, :]
  words = pack_bits(keys)                                  # [batch, heads, blocks, W]
  return jnp.repeat(words, block_size // vector, axis=2)[:, :, :length // vector]


def tile_lists(keep_blocks, block_size: int, length: int, rows: int, keys: int):
  """The block rule's tiles as the attention kernels' lists: for each tile of ``rows`` query
  rows, the tiles of ``keys`` keys that meet a kept (query block, key block) pair (a tile that
  meets none has no keep bit set, so visiting only these is the empty-tile skip without
  testing the others).  (int32 [batch*heads, cdiv(length, rows), cdiv(length, keys)]: tile
  indices, increasing, then unspecified; int32 [batch*heads, cdiv(length, rows)]: how many.)
  With ``swapaxes(keep_blocks, 2, 3)`` and (keys, rows): each key tile's query tiles."""
  b, h, q_blocks, k_blocks = keep_blocks.shape

  def meets(size, blocks):           # float [tiles, blocks]: tile i overlaps block a
    tile = jnp.arange(-(-length // size))[:, None]
    block = jnp.arange(blocks)[None, :]
    return ((block * block_size < (tile + 1) * size)
            & ((block + 1) * block_size > tile * size)).astype(jnp.float32)

  hits = jnp.einsum("ia,bhac,jc->bhij", meets(rows, q_blocks),
                    keep_blocks.astype(jnp.float32), meets(keys, k_blocks)) > 0
  order = jnp.argsort(jnp.logical_not(hits), axis=-1, stable=True).astype(jnp.int32)
  count = hits.sum(-1, dtype=jnp.int32)
  return order.reshape((b * h,) + order.shape[2:]), count.reshape(b * h, -1)


def attention_under_keep(q, k, v, keep, *, dropout_rate: float = 0.0, dropout_seed=None,
                         scores=None):
  """softmax(S over ``keep`` [batch, heads, L, L]) V with S = Q K^T / sqrt(d); a row that keeps
  nothing gives zeros.  ``keep`` must already exclude padded keys.  dropout_rate > 0 with
  dropout_seed (int32 [2], ``dropout.seed_words``): attention dropout on the kept
  probabilities by the kernels' per-key rule (``dropout.key_multiplier``), so this path
  and ``kernels.dsa.triton`` drop the same entries for the same seed."""
  if scores is None:
    scores = softmax.attention_scores(q, k)
  probs = softmax.masked_softmax(jnp.where(keep, scores, -jnp.inf), keep)
  if dropout.checked_seed(dropout_rate, dropout_seed)[0]:
    b, h, rows, keys = probs.shape
    probs = probs * dropout.key_multiplier(dropout_seed, b, h, rows, keys, dropout_rate)
  return softmax.attend(probs, v, q.dtype)


def _gram_precision():
  """The Gram matmuls' precision: on a GPU, fp32 as three bf16 passes on the tensor cores
  (about 16 mantissa bits per product, fp32 accumulation); elsewhere full fp32."""
  if jax.default_backend() == "gpu":
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
  return jax.lax.Precision.HIGHEST


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "w"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LowRank:
  """A predictor operand in factored form: Q~_h = x w_h, x [batch, length, r] shared by the
  heads, w [heads, r, k] (DSA: x = X P, w = W~).  ``prediction_mse`` then never forms Q~."""
  x: jax.Array
  w: jax.Array

  @property
  def shape(self):
    return self.x.shape[:2] + (self.w.shape[0], self.w.shape[2])


def _gram(a, b):
  """a^T b over the real tokens per (example, head): [batch, heads, da, db], for a, b each
  [batch, length, heads, d] (masked, fp32) or ``LowRank`` (x masked)."""
  dot = functools.partial(jnp.einsum, precision=_gram_precision(),
                          preferred_element_type=jnp.float32)
  if isinstance(a, LowRank) and isinstance(b, LowRank):      # w_a^T (x_a^T x_b) w_b
    return dot("bhrk,hrj->bhkj", dot("hrk,brs->bhsk", a.w, dot("blr,bls->brs", a.x, b.x)),
               b.w)
  if isinstance(a, LowRank):
    return jnp.swapaxes(_gram(b, a), -1, -2)
  if isinstance(b, LowRank):                                 # (a^T x_b) w_b
    return dot("bhdr,hrk->bhdk", dot("blhd,blr->bhdr", a, b.x), b.w)
  return dot("blhd,blhe->bhde", a, b)


def prediction_mse(q, k, q_pred, k_pred, mask=None, *, normalization: str = "eq6"):
  """L_MSE between S = Q K^T / sqrt(d) and S~ = Q~ K~^T / sqrt(d) over the pairs of two real
  tokens, without any [L, L] array: with a_ij = q_i . k_j and b_ij = q~_i . k~_j,

      sum_ij (a_ij - b_ij)^2 = <Q^T Q, K^T K> - 2 <Q^T Q~, K^T K~> + <Q~^T Q~, K~^T K~>

  (Frobenius products of d x d, d x k and k x k Gram matrices, per example and head), so the
  cost is O(L (d + k)^2) instead of O(L^2 (d + k)), forward and backward.  Padded tokens are
  zeroed, which removes exactly their pairs.  q_pred, k_pred are [batch, length, heads, k]
  arrays or ``LowRank`` factors: DSA's Q~_h = (X P) W~_h gives Q~^T Q~ = W~^T (XP)^T (XP) W~
  from one k x k Gram per example shared by the heads, and Q^T Q~ = (Q^T XP) W~, so neither
  Q~ nor K~ ([batch, length, heads, k] in fp32) is formed or read (H100, ListOps shape: 5.5
  ms for value and gradients per layer from Q~, K~ arrays, 2x cuDNN's whole attention).

  Precision: the terms cancel when S~ ~ S.  The matmuls run in fp32 at full precision on the
  CPU and as three bf16 passes on a GPU's tensor cores (``_gram_precision``; H100, ListOps
  shape: 2.1 ms for value and gradients against 3.8 ms in fp32 on the CUDA cores).  The value
  is off by about 1e-5 of sum_ij a_ij^2 on the GPU whatever the matmul algorithm (the fp32 sum
  of the Frobenius products), the gradients by 5e-4 relative when S~ ~ S (fp32: 2e-5), well
  below what the bf16 model's own gradients carry.

  "eq6": the paper's ||Q K^T - Q~ K~^T||^2 / batch (unscaled scores, summed over heads and
  real pairs); "scaled_mean": the mean over heads and real pairs of (S - S~)^2.
  """
  check_normalization(normalization)
  tokens = None if mask is None else mask.astype(jnp.float32)

  def real(a):
    if isinstance(a, LowRank):
      x = a.x.astype(jnp.float32)
      return LowRank(x if tokens is None else x * tokens[:, :, None], a.w.astype(jnp.float32))
    a = a.astype(jnp.float32)
    return a if tokens is None else a * tokens[:, :, None, None]

  q, k, q_pred, k_pred = real(q), real(k), real(q_pred), real(k_pred)
  frob = lambda a, b, c, d: jnp.sum(_gram(a, b) * _gram(c, d))          # noqa: E731
  total = (frob(q, q, k, k) - 2.0 * frob(q, q_pred, k, k_pred)
           + frob(q_pred, q_pred, k_pred, k_pred))
  return normalize_mse(jnp.maximum(total, 0.0), mask, q.shape, normalization)


def check_normalization(normalization: str) -> None:
  if normalization not in ("eq6", "scaled_mean"):
    raise ValueError(f"unknown DSA MSE normalization {normalization!r}; choose 'eq6' or "
                     "'scaled_mean'")


def normalize_mse(total, mask, shape, normalization: str):
  """L_MSE from ``total`` (the squared error summed over heads and real pairs) for q of
  ``shape`` [batch, length, heads, head_dim]: total / batch ("eq6") or its mean over head_dim,
  heads and real pairs ("scaled_mean")."""
  batch, length, heads, head_dim = shape
  if normalization == "eq6":
    return total / batch
  count = (jnp.float32(batch * length * length * heads) if mask is None else
           jnp.sum(jnp.sum(mask, axis=-1, dtype=jnp.float32) ** 2) * heads)
  return total / head_dim / jnp.maximum(count, 1.0)


def pack_bits(keep):
  """bool [..., L] -> int32 [..., ceil(L / 32)]: bit j % 32 of word j // 32 is keep[..., j]."""
  length = keep.shape[-1]
  words = -(-length // 32)
  keep = jnp.pad(keep, [(0, 0)] * (keep.ndim - 1) + [(0, words * 32 - length)])
  bits = keep.reshape(keep.shape[:-1] + (words, 32)).astype(jnp.uint32)
  packed = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(packed, jnp.int32)


def unpack_bits(words, length: int):
  """int32 [..., W] -> bool [..., length] (inverse of ``pack_bits``)."""
  u = jax.lax.bitcast_convert_type(words, jnp.uint32)
  bits = (u[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  return bits.reshape(words.shape[:-1] + (-1,))[..., :length].astype(bool)


# ----------------------------------------------------------------------------- predictor and
# analysis
def fake_quantize(x, bits: int, valid=None):
  """Symmetric per-tensor fake quantisation to ``bits`` (0 = identity), straight-through.

  ``valid`` (broadcastable bool) restricts the entries that set the scale (real tokens).
  """
  if bits == 0:
    return x
  levels = 2 ** (bits - 1) - 1          # INT2 -> {-1, 0, 1}, INT4 -> [-7, 7], INT8 -> [-127, 127]
  magnitude = jnp.abs(x) if valid is None else jnp.where(valid, jnp.abs(x), 0.0)
  scale = jax.lax.stop_gradient(jnp.max(magnitude)) / levels
  scale = jnp.where(scale > 0, scale, 1.0)
  quantized = jnp.clip(jnp.round(x / scale), -levels, levels) * scale
  return x + jax.lax.stop_gradient(quantized - x)


def predicted_mask(predicted_scores, *, mask=None, sparsity: float = 0.9, vector: int = 1,
                   selection: str = "topk", threshold: float = 0.0,
                   topk_algorithm: Optional[str] = None):
  """A DSA-style mask from a float score matrix S~ [batch, heads, L, L] (bool, same shape;
  padded keys never kept), for analysis (``lra_sparse.analysis.dsa_ticket``): the top-k or
  threshold of the float scores themselves.  The core ranks int8-rounded predictor operands
  instead (``kernels.dsa.reference``), so on near-ties the two can keep different keys."""
  batch, heads, length, _ = predicted_scores.shape
  scores = jax.lax.stop_gradient(predicted_scores.astype(jnp.float32))
  if vector > 1:
    if length % vector:
      raise ValueError(f"sequence length {length} is not a multiple of the column-vector "
                       f"size {vector}")
    rows = (jnp.ones((batch, length), jnp.float32) if mask is None
            else mask.astype(jnp.float32))
    rows = rows.reshape(batch, 1, length // vector, vector, 1)
    grouped = scores.reshape(batch, heads, length // vector, vector, length)
    scores = (jnp.sum(grouped * rows, axis=3)
              / jnp.maximum(jnp.sum(rows, axis=3), 1.0))          # [b, h, L/V, L]
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  if selection == "topk":
    keep = topk_mask(scores, keep_counts(mask, sparsity, length), algorithm=topk_algorithm,
                     max_keep=static_keep(sparsity, length))
  elif selection == "threshold":
    keep = scores >= threshold
  else:
    raise ValueError(f"unknown DSA selection {selection!r}; choose 'topk' or 'threshold'")
  if vector > 1:
    keep = jnp.repeat(keep, vector, axis=2)
  if mask is not None:
    keep = keep & mask[:, None, None, :]
  return keep


def hit_rate(predicted_bits, oracle_bits, *, mask=None, vector: int = 1):
  """Share of predicted keys (over real query rows) that the oracle (the same rule on the real
  scores, one row at a time) keeps too.  Bits as ``kernels.dsa.triton.select_bits`` returns them:
  predicted [batch, heads, L / vector, W], oracle [batch, heads, L, W]."""
  rows = jnp.repeat(predicted_bits, vector, axis=2)
  if mask is not None:
    rows = jnp.where(mask[:, None, :, None], rows, 0)
  count = lambda x: jnp.sum(jax.lax.population_count(x), dtype=jnp.float32)  # noqa: E731
  return count(rows & oracle_bits) / jnp.maximum(count(rows), 1.0)


def oracle_topk_mask(scores, *, mask=None, sparsity: float):
  """Exact top-k of float scores S per row, the same counts as the predictor (analysis: the
  float oracle of a score matrix)."""
  length = scores.shape[-1]
  scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
  if mask is not None:
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  keep = topk_mask(scores, keep_counts(mask, sparsity, length),
                   max_keep=static_keep(sparsity, length))
  return keep if mask is None else keep & mask[:, None, None, :]
