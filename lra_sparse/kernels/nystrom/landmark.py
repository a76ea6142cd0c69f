"""The Nystromformer's two flash attentions as Pallas kernels, forward and backward, plain or
N:M-pruned (Nystromformer + DFSS).

    F (.):  o = softmax(q k^T * scale) v   q [b, L, h, d] over few keys k, v [b, m, h, d]
    B V:    o = softmax(q k^T * scale) v   few queries q [b, m, h, d] over k, v [b, L, h, d]

In the Nystromformer core, F pinv(A) B V is the first with the m landmarks K~ as keys and
pinv(A) B V as values, and B V is the second with the m landmark queries Q~ (``m`` small: 64).

N:M (``nm=(n, M)``): before the softmax, each row keeps the n largest scores of every M
consecutive keys (ties to the lower index, -inf loses to every finite score; ``nm.nm_mask``);
pruned entries get probability 0 and no gradient. A tile holds its keys member by member: tile
j has member j of each group of M, so the selection is elementwise work across M tiles (each
member's rank is the number of members that beat it), and the rows never need shuffling.
F (.)'s m keys are reordered that way outside the kernels (they are few); B V's tiles read
member j of each group with strided loads, so K and V are never copied. ``nm=None`` is M = 1.

F (.): all m keys fit one tile, so a program owns a block of query rows and needs no running
maximum: one [rows x m] score tile, its softmax, one product with v. The backward recomputes
the probabilities from the saved log-sum-exp (as flash attention does), takes flash
attention's delta = rowsum(dO o) as rowsum(P dP) from the tiles at hand (so o is neither kept
nor read: measured faster), and writes dq per row block; dk and dv are sums over all query
rows: each program sums them over its BWD_BLOCKS row blocks in registers and writes one
partial sum, added up outside (deterministic, no atomics).
Query rows past the length are masked in every load and store, so nothing is padded in
memory. No key mask: every landmark is a key (the official code keeps empty segments too).

B V: a program owns all m query rows and a span of SPAN keys, with a running maximum over its
key blocks; the spans' partial results are combined outside (flash decoding), so the forward
has batch x heads x spans programs, not batch x heads. The backward program of a span writes
its keys' dk, dv and one partial dq. The key mask is an additive bias (0 or -inf) read with
the keys, so a mask may have holes; keys past the length are masked loads. A row with no
real key gives zeros (and zero gradients), as the XLA formulation does.

Head dims up to 128 run at the next power of two from 16, zero-padded (exact: the scale stays
the true head dim's and the padded output columns are sliced off), so Pathfinder's heads of 4
run here too. Products take bf16 / fp16 operands with float32 accumulation, the probabilities
rounded to the operand dtype before P V, as flash attention (cuDNN's included) multiplies
them. The pure-JAX reference is ``landmark_attention_reference``; ``interpret=True`` runs the
kernels on the CPU (the tests use that).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_sparse.ops.nm import check_nm, nm_mask
from lra_sparse.kernels.shared.prologue import kernel_head_dim, zero_pad_head_dim

# Tiles: the fastest at the ListOps shape (benchmarks/tune_landmark_attention.py; F (.): of
# ROWS 64 / 128 x warps 4 / 8 x BWD_BLOCKS 2 / 4 / 8 on an H200, experiments/
# reports/nystrom/tune_few_keys_h200.md, then stages 1 / 2 and BWD_BLOCKS 8 / 16 on an H100,
# plain and 2:4, experiments/reports/nystrom/tune_few_keys.md and
# ab_delta_from_probabilities.md)
ROWS = 64        # query rows per block (the forward: one block per program)
BWD_BLOCKS = 16  # row blocks per backward program
NUM_WARPS = 4
NUM_STAGES = 2   # software-pipeline stages of the backward's loop over row blocks
# B V: keys per step (at least 16 per member tile), keys per program, warps, stages: the
# fastest of 64 / 128 x 256 / 512 x 4 / 8 x 1 / 2 on an H100, plain and 2:4 (stages 2 is
# 0.01 ms faster plain and 0.01 slower 2:4; experiments/reports/nystrom/
# tune_few_queries.md)
KEY_BLOCK = 64
SPAN = 512
SPAN_WARPS = 4
SPAN_STAGES = 1
HALF_DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (16, 32, 64, 128)   # the head dims the kernels run; narrower ones zero-padded
NM = Optional[tuple[int, int]]


def landmark_attention_reference(q, k, v, scale, *, nm: NM = None, mask=None):
  """float32 softmax(q k^T * scale) v, [b, q_len, h, d], the N:M rule of ``nm_mask`` on the
  scores when ``nm`` is given; mask: bool [b, k_len] real keys; a row with no real key gives
  zeros (the explicit formulation)."""
  logits = jnp.einsum("blhd,bmhd->bhlm", q, k, preferred_element_type=jnp.float32) * scale
  if mask is not None:
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
  keep = jnp.isfinite(logits)
  if nm is not None:   # groups of M keys from key 0; keys past the length count as masked
    keys = logits.shape[-1]
    padded = jnp.pad(logits, [(0, 0)] * 3 + [(0, -keys % nm[1])], constant_values=-jnp.inf)
    keep &= nm_mask(padded, *nm)[..., :keys]
  top = jnp.max(jnp.where(keep, logits, -jnp.inf), axis=-1, keepdims=True)
  probs = jnp.where(keep, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0)), 0.0)
  total = jnp.sum(probs, axis=-1, keepdims=True)
  probs = probs / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhlm,bmhd->blhd", probs, v.astype(jnp.float32))


def _compiler_params(interpret: bool, few_queries: bool = False):
  """Triton's launch options of F (.)'s kernels, or B V's (None in the interpreter)."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  if interpret:
    return None
  if few_queries:
    return plgpu.CompilerParams(num_warps=SPAN_WARPS, num_stages=SPAN_STAGES)
  return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _load(ref, index, inside, other=0):
  """ref[index] with the entries where ``inside`` (broadcast to the tile) is False read as
  ``other``."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  view = ref.at[index]
  return plgpu.load(view, mask=jnp.broadcast_to(inside, view.shape), other=other)


def _store(ref, index, inside, value):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  plgpu.store(ref.at[index], value.astype(ref.dtype), mask=jnp.broadcast_to(inside, value.shape))


def _dot(a, b):
  """[r, c] float32 a b^T."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_t(a, b):
  """[c1, c2] float32 a^T b."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _kept(scores, n: int):
  """bool tiles: member j's entry is among the n largest of its group (scores: one tile per
  member, the group's members at the same position of each tile); None where all are kept.
  Member i beats member j if greater, or equal with i < j (``nm.nm_mask``)."""
  m = len(scores)
  if n == m:
    return [None] * m
  keep = []
  for j, s in enumerate(scores):
    rank = sum((scores[i] >= s if i < j else scores[i] > s).astype(jnp.int32)
               for i in range(m) if i != j)
    keep.append(rank < n)
  return keep


def _probabilities(scores, keep, shift):
  """exp(score - shift) on the kept entries, 0 on the pruned ones."""
  return [jnp.exp(s - shift) if kp is None else jnp.where(kp, jnp.exp(s - shift), 0.0)
          for s, kp in zip(scores, keep)]


# ------------------------------------------------------------------------------------------
# F (.): many query rows over few keys


def _few_keys_forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale: float, length: int,
                             n: int, m: int):
  b, j, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start = j * ROWS
  group = k_ref.shape[1] // m
  inside = (start + jnp.arange(ROWS) < length)[:, None]
  q = _load(q_ref, (b, pl.ds(start, ROWS), h, slice(None)), inside)
  ks = [k_ref[b, pl.ds(i * group, group), h, :] for i in range(m)]
  vs = [v_ref[b, pl.ds(i * group, group), h, :] for i in range(m)]
  scores = [_dot(q, k) * scale for k in ks]
  top = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores])  # always kept
  p = _probabilities(scores, _kept(scores, n), top[:, None])
  total = sum(jnp.sum(x, axis=1) for x in p)
  o = sum(jnp.dot(x.astype(v.dtype), v, preferred_element_type=jnp.float32)
          for x, v in zip(p, vs))
  _store(o_ref, (b, pl.ds(start, ROWS), h, slice(None)), inside, o / total[:, None])
  lse_ref[b, h, j, :] = top + jnp.log(total)


def _few_keys_backward_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dq_ref, dk_ref, dv_ref, *,
                              scale: float, length: int, n: int, m: int):
  """dq of BWD_BLOCKS row blocks, and their dk, dv terms summed in registers (one partial sum
  per program, so few partial sums to add up outside)."""
  b, program, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  group = k_ref.shape[1] // m
  ks = [k_ref[b, pl.ds(i * group, group), h, :] for i in range(m)]
  vs = [v_ref[b, pl.ds(i * group, group), h, :] for i in range(m)]

  def body(i, sums):
    j = program * BWD_BLOCKS + i
    start = j * ROWS
    rows = (b, pl.ds(start, ROWS), h, slice(None))
    inside = (start + jnp.arange(ROWS) < length)[:, None]
    q, do = _load(q_ref, rows, inside), _load(do_ref, rows, inside)
    scores = [_dot(q, k) * scale for k in ks]
    # rows past the length: q = do = 0 and p = 0 (their lse was never written)
    lse = jnp.where(inside, lse_ref[b, h, j, :][:, None], jnp.inf)
    p = _probabilities(scores, _kept(scores, n), lse)
    dp = [_dot(do, v) for v in vs]
    # delta = rowsum(dO o) = rowsum(P dP): from the tiles at hand, so o is never read
    delta = sum(jnp.sum(x * y, axis=1) for x, y in zip(p, dp))[:, None]
    ds = [(x * (y - delta)).astype(q.dtype) for x, y in zip(p, dp)]
    _store(dq_ref, rows, inside,
           sum(jnp.dot(d, k, preferred_element_type=jnp.float32) for d, k in zip(ds, ks))
           * scale)
    dk = tuple(s + _dot_t(d, q) for s, d in zip(sums[:m], ds))
    dv = tuple(s + _dot_t(x.astype(do.dtype), do) for s, x in zip(sums[m:], p))
    return dk + dv

  zeros = jnp.zeros((group, k_ref.shape[-1]), jnp.float32)
  sums = jax.lax.fori_loop(0, BWD_BLOCKS, body, (zeros,) * (2 * m))
  for i in range(m):
    dk_ref[b, program, h, pl.ds(i * group, group), :] = sums[i] * scale
    dv_ref[b, program, h, pl.ds(i * group, group), :] = sums[m + i]


def _member_major(x, m: int):
  """[b, keys, h, d] with key g * m + j moved to j * (keys / m) + g (member tiles)."""
  b, keys = x.shape[:2]
  return jnp.swapaxes(x.reshape(b, keys // m, m, *x.shape[2:]), 1, 2).reshape(x.shape)


def _group_major(x, m: int, axis: int):
  """The inverse of ``_member_major`` along ``axis``."""
  shape = x.shape
  x = x.reshape(shape[:axis] + (m, shape[axis] // m) + shape[axis + 1:])
  return jnp.swapaxes(x, axis, axis + 1).reshape(shape)


def _rows_grid(q, blocks_per_program: int = 1):
  batch, length, heads, _ = q.shape
  return batch, pl.cdiv(pl.cdiv(length, ROWS), blocks_per_program), heads


def _few_keys_forward(q, k, v, scale, nm, interpret):
  batch, length, heads, _ = q.shape
  n, m = nm
  return pl.pallas_call(
      functools.partial(_few_keys_forward_kernel, scale=scale, length=length, n=n, m=m),
      # lse for whole backward programs (the blocks past the last are never written)
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, _rows_grid(q, BWD_BLOCKS)[1] * BWD_BLOCKS,
                                       ROWS), jnp.float32)),
      grid=_rows_grid(q), interpret=interpret,
      compiler_params=_compiler_params(interpret),
  )(q, _member_major(k, m), _member_major(v, m))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _few_keys(q, k, v, scale, nm, interpret):
  return _few_keys_forward(q, k, v, scale, nm, interpret)[0]


def _few_keys_fwd(q, k, v, scale, nm, interpret):
  out, lse = _few_keys_forward(q, k, v, scale, nm, interpret)
  return out, (q, k, v, lse)


def _few_keys_bwd(scale, nm, interpret, saved, grad):
  q, k, v, lse = saved
  batch, length, heads, dim = q.shape
  n, m = nm
  grid = _rows_grid(q, BWD_BLOCKS)
  keys = k.shape[1]
  partial = jax.ShapeDtypeStruct((batch, grid[1], heads, keys, dim), jnp.float32)
  dq, dk, dv = pl.pallas_call(
      functools.partial(_few_keys_backward_kernel, scale=scale, length=length, n=n, m=m),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), partial, partial),
      grid=grid, interpret=interpret,
      compiler_params=_compiler_params(interpret),
  )(q, _member_major(k, m), _member_major(v, m), grad.astype(q.dtype), lse)
  # the partial sums [b, programs, h, m, d] added up, back in k's layout [b, m, h, d]
  def total(x, like):
    return _group_major(jnp.swapaxes(jnp.sum(x, axis=1), 1, 2), m, 1).astype(like.dtype)
  return dq, total(dk, k), total(dv, v)


_few_keys.defvjp(_few_keys_fwd, _few_keys_bwd)


# ------------------------------------------------------------------------------------------
# B V: few query rows over many keys


def _key_tiles(k_ref, v_ref, bias_ref, b, h, start, groups: int, m: int):
  """Member tiles of the key block at group ``start`` (k, v, bias viewed as [b, L / m, m, ...]):
  (k, v, bias) of member j of each of the block's groups, for each j; groups past the last
  read k = v = 0, bias -inf."""
  size = _key_block(m) // m
  index = pl.ds(start, size)
  inside = start + jnp.arange(size) < groups
  member = [jnp.int32(j) for j in range(m)]   # (arrays: the interpreter takes no int index)
  return [(_load(k_ref, (b, index, j, h, slice(None)), inside[:, None]),
           _load(v_ref, (b, index, j, h, slice(None)), inside[:, None]),
           _load(bias_ref, (b, index, j), inside, -jnp.inf)) for j in member]


def _key_block(m: int) -> int:
  """Keys per step: KEY_BLOCK, or 16 per member tile when m is larger than KEY_BLOCK / 16."""
  return max(KEY_BLOCK, 16 * m)


def _few_queries_forward_kernel(q_ref, k_ref, v_ref, bias_ref, acc_ref, top_ref, sum_ref, *,
                                scale: float, n: int):
  b, span, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  groups, m = k_ref.shape[1:3]
  q = q_ref[b, :, h, :]
  size = _key_block(m) // m

  def body(i, carry):
    acc, top, total = carry
    tiles = _key_tiles(k_ref, v_ref, bias_ref, b, h, (span * SPAN + i * size * m) // m, groups,
                       m)
    scores = [_dot(q, k) * scale + bias[None, :] for k, _, bias in tiles]
    new_top = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores], top)
    shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)      # no real key yet: no NaN
    p = _probabilities(scores, _kept(scores, n), shift[:, None])
    alpha = jnp.exp(top - shift)
    total = total * alpha + sum(jnp.sum(x, axis=1) for x in p)
    acc = acc * alpha[:, None] + sum(jnp.dot(x.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
                                     for x, (_, v, _) in zip(p, tiles))
    return acc, new_top, total

  rows = q.shape[0]
  acc, top, total = jax.lax.fori_loop(
      0, SPAN // (size * m), body, (jnp.zeros((rows, q.shape[1]), jnp.float32),
                                    jnp.full((rows,), -jnp.inf, jnp.float32),
                                    jnp.zeros((rows,), jnp.float32)))
  acc_ref[b, span, h, :, :] = acc
  top_ref[b, span, h, :] = top
  sum_ref[b, span, h, :] = total


def _few_queries_backward_kernel(q_ref, k_ref, v_ref, bias_ref, do_ref, lse_ref, delta_ref,
                                 dq_ref, dk_ref, dv_ref, *, scale: float, n: int):
  """dk, dv of the span's keys; its dq term as one partial sum."""
  b, span, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  groups, m = k_ref.shape[1:3]
  q, do = q_ref[b, :, h, :], do_ref[b, :, h, :]
  lse, delta = lse_ref[b, h, :][:, None], delta_ref[b, h, :][:, None]
  size = _key_block(m) // m

  def body(i, dq):
    start = (span * SPAN + i * size * m) // m
    tiles = _key_tiles(k_ref, v_ref, bias_ref, b, h, start, groups, m)
    scores = [_dot(q, k) * scale + bias[None, :] for k, _, bias in tiles]
    p = _probabilities(scores, _kept(scores, n), lse)
    index = pl.ds(start, size)
    inside = (start + jnp.arange(size) < groups)[:, None]
    for j, (x, (k, v, _)) in enumerate(zip(p, tiles)):
      ds = (x * (_dot(do, v) - delta)).astype(q.dtype)
      dq = dq + jnp.dot(ds, k, preferred_element_type=jnp.float32)
      j = jnp.int32(j)
      _store(dk_ref, (b, index, j, h, slice(None)), inside, _dot_t(ds, q) * scale)
      _store(dv_ref, (b, index, j, h, slice(None)), inside, _dot_t(x.astype(do.dtype), do))
    return dq

  dq = jax.lax.fori_loop(0, SPAN // (size * m), body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[b, span, h, :, :] = dq * scale


def _grouped(k, v, mask, m: int):
  """k, v as [b, L' / m, m, h, d] and the key bias (0 real, -inf masked) as [b, L' / m, m],
  L' = L rounded up to a multiple of m (the keys past L masked; a copy only then)."""
  batch, length = k.shape[:2]
  bias = jnp.zeros((batch, length), jnp.float32) if mask is None else jnp.where(
      mask, 0.0, -jnp.inf).astype(jnp.float32)
  extra = -length % m
  if extra:
    k, v = (jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0))) for x in (k, v))
    bias = jnp.pad(bias, ((0, 0), (0, extra)), constant_values=-jnp.inf)
  groups = (length + extra) // m
  return (k.reshape(batch, groups, m, *k.shape[2:]), v.reshape(batch, groups, m, *v.shape[2:]),
          jax.lax.stop_gradient(bias.reshape(batch, groups, m)))


def _spans(k) -> int:
  return pl.cdiv(k.shape[1] * k.shape[2], SPAN)


def _few_queries_forward(q, k, v, bias, scale, n, interpret):
  batch, rows, heads, dim = q.shape
  spans = _spans(k)
  partial = lambda *shape: jax.ShapeDtypeStruct((batch, spans, heads, rows) + shape,  # noqa: E731
                                                jnp.float32)
  acc, top, total = pl.pallas_call(
      functools.partial(_few_queries_forward_kernel, scale=scale, n=n),
      out_shape=(partial(dim), partial(), partial()),
      grid=(batch, spans, heads), interpret=interpret,
      compiler_params=_compiler_params(interpret, few_queries=True),
  )(q, k, v, bias)
  # The spans' partial softmaxes combined (a span or a row with no real key has top -inf)
  best = jnp.max(top, axis=1, keepdims=True)
  weight = jnp.exp(top - jnp.where(best == -jnp.inf, 0.0, best))
  total = jnp.sum(total * weight, axis=1)                                   # [b, h, rows]
  out = jnp.sum(acc * weight[..., None], axis=1)                            # [b, h, rows, d]
  out = out / jnp.where(total > 0, total, 1.0)[..., None]
  lse = jnp.where(total > 0, best[:, 0] + jnp.log(total), jnp.inf)          # no key: p = 0
  return jnp.swapaxes(out, 1, 2).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _few_queries(q, k, v, bias, scale, n, interpret):
  return _few_queries_forward(q, k, v, bias, scale, n, interpret)[0]


def _few_queries_fwd(q, k, v, bias, scale, n, interpret):
  out, lse = _few_queries_forward(q, k, v, bias, scale, n, interpret)
  return out, (q, k, v, bias, out, lse)


def _few_queries_bwd(scale, n, interpret, saved, grad):
  q, k, v, bias, out, lse = saved
  batch, rows, heads, dim = q.shape
  spans = _spans(k)
  grad = grad.astype(q.dtype)
  delta = jnp.swapaxes(jnp.sum(grad.astype(jnp.float32) * out.astype(jnp.float32), axis=-1),
                       1, 2)                                                 # [b, h, rows]
  dq, dk, dv = pl.pallas_call(
      functools.partial(_few_queries_backward_kernel, scale=scale, n=n),
      out_shape=(jax.ShapeDtypeStruct((batch, spans, heads, rows, dim), jnp.float32),
                 jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(batch, spans, heads), interpret=interpret,
      compiler_params=_compiler_params(interpret, few_queries=True),
  )(q, k, v, bias, grad, lse, delta)
  dq = jnp.swapaxes(jnp.sum(dq, axis=1), 1, 2).astype(q.dtype)
  return dq, dk, dv, None


_few_queries.defvjp(_few_queries_fwd, _few_queries_bwd)


# ------------------------------------------------------------------------------------------
# Entry points


def _pow2(x: int) -> bool:
  return x >= 16 and x & (x - 1) == 0


def _widened(scale, head_dim: int, *arrays):
  """(scale, arrays zero-padded to the kernels' head dim): the scale stays the true head dim's
  (``kernels.shared.prologue.zero_pad_head_dim``: zero columns add nothing to q k^T, and the
  output's
  padded columns are zero, sliced off by the caller)."""
  scale = float(head_dim ** -0.5 if scale is None else scale)
  width = kernel_head_dim(head_dim, HEAD_DIMS)
  return scale, [zero_pad_head_dim(x, width) if width != head_dim else x for x in arrays]


def _nm_pair(nm, who: str) -> tuple[int, int]:
  if nm is None:
    return 1, 1
  n, m = nm
  check_nm(n, m, what=who)
  return n, m


def supports(dtype, head_dim: int, keys: int, *, nm: NM = None) -> bool:
  """Whether F (.)'s kernels take these shapes: half precision, head dim up to 128 (run at the
  next power of two from 16, zero-padded), a key count that is a power of two from 16 (the
  tensor-core products' sizes), and with N:M at least 16 keys per member tile (keys / M a
  power of two >= 16)."""
  m = 1 if nm is None else nm[1]
  return (dtype in HALF_DTYPES and 0 < head_dim <= HEAD_DIMS[-1] and _pow2(keys)
          and keys % m == 0 and _pow2(keys // m))


def supports_few_queries(dtype, head_dim: int, queries: int, *, nm: NM = None) -> bool:
  """Whether B V's kernels take these shapes: half precision, head dim up to 128 (as F (.)'s),
  a query count that is a power of two from 16 to 128, and M a power of two up to SPAN / 16
  (member tiles of a power of two keys)."""
  m = 1 if nm is None else nm[1]
  return (dtype in HALF_DTYPES and 0 < head_dim <= HEAD_DIMS[-1] and _pow2(queries)
          and queries <= 128 and m & (m - 1) == 0 and SPAN % _key_block(m) == 0)


def _check(q, k, v, who: str, keys_axis_name: str):
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or (
      k.shape[2:] != q.shape[2:]):
    raise ValueError(f"{who}: q must be [b, {keys_axis_name}] and k, v of one shape with q's "
                     f"batch, heads and head dim; got {q.shape}, {k.shape}, {v.shape}")
  if not k.dtype == v.dtype == q.dtype:
    raise ValueError(f"{who}: q, k, v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def few_keys_attention(q, k, v, *, nm: NM = None, scale=None, interpret: bool = False):
  """F (.): softmax(q k^T * scale) v in q's dtype; q [b, L, h, d], k and v [b, m, h, d], all
  of q's half-precision dtype, d <= 128, m a power of two >= 16 (``supports``); ``nm``: an
  (n, M) pair for N:M pruning along the m keys (m / M a power of two >= 16). ``scale``
  defaults to d^-1/2."""
  _check(q, k, v, "few_keys_attention", "L, h, d]; k, v [b, m, h, d")
  n, m = _nm_pair(nm, "few_keys_attention: nm")
  if not supports(q.dtype, q.shape[-1], k.shape[1], nm=nm):
    raise ValueError(f"few_keys_attention: needs bf16 / fp16 q, k, v, a head dim up to 128, a "
                     f"key count that is a power of two >= 16, and with N:M a power of two "
                     f">= 16 keys per member; got {q.dtype}, head dim {q.shape[-1]}, "
                     f"{k.shape[1]} keys, nm={nm}")
  head_dim = q.shape[-1]
  scale, (q, k, v) = _widened(scale, head_dim, q, k, v)
  return _few_keys(q, k, v, scale, (n, m), interpret)[..., :head_dim]


def few_queries_attention(q, k, v, mask=None, *, nm: NM = None, scale=None,
                          interpret: bool = False):
  """B V: softmax(q k^T * scale) v in q's dtype; q [b, m, h, d] (m a power of two from 16 to
  128), k and v [b, L, h, d], all of q's half-precision dtype, d <= 128
  (``supports_few_queries``); mask: bool [b, L] real keys (any pattern); ``nm``: an (n, M)
  pair for N:M pruning along the L keys (M a power of two; groups of M keys from key 0, keys
  past L count as masked). A row with no real key gives zeros. ``scale`` defaults to
  d^-1/2."""
  _check(q, k, v, "few_queries_attention", "m, h, d]; k, v [b, L, h, d")
  n, m = _nm_pair(nm, "few_queries_attention: nm")
  if not supports_few_queries(q.dtype, q.shape[-1], q.shape[1], nm=nm):
    raise ValueError(f"few_queries_attention: needs bf16 / fp16 q, k, v, a head dim up to 128, "
                     f"a query count that is a power of two from 16 to 128, and M a power of "
                     f"two; got {q.dtype}, head dim {q.shape[-1]}, {q.shape[1]} queries, "
                     f"nm={nm}")
  if mask is not None and mask.shape != k.shape[:2]:
    raise ValueError(f"few_queries_attention: mask must be bool [b, L] = {k.shape[:2]}, got "
                     f"{mask.shape}")
  head_dim = q.shape[-1]
  scale, (q, k, v) = _widened(scale, head_dim, q, k, v)
  # (autodiff carries dk, dv of the grouped view back through the reshape and any padding)
  return _few_queries(q, *_grouped(k, v, mask, m), scale, n, interpret)[..., :head_dim]
