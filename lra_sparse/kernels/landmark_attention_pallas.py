"""Softmax attention over a few keys (Nystromformer's F (.)), forward and backward, in Pallas.

    o = softmax(q k^T * scale) v       q [b, L, h, d]; k, v [b, m, h, d] with m small (64)

In the Nystromformer core, F pinv(A) B V is this attention with the m landmarks K~ as keys and
pinv(A) B V as values. All m keys fit one tile, so a program owns a block of query rows and
needs no running maximum: one [rows x m] score tile, its softmax, one product with v. The
backward recomputes the probabilities from the saved log-sum-exp (as flash attention does) and
writes dq per row block; dk and dv are sums over all query rows: each program sums them over
its BWD_BLOCKS row blocks in registers and writes one partial sum, added up outside
(deterministic, no atomics). No key mask: every landmark is a key
(the official code keeps empty segments too). Query rows past the length are masked in every
load and store, so nothing is padded in memory.

Products take bf16 / fp16 operands with float32 accumulation, the probabilities rounded to the
operand dtype before P V, as flash attention (cuDNN's included) multiplies them. The pure-JAX
reference is ``few_keys_attention_reference``; ``interpret=True`` runs the kernels on the CPU
(the tests use that).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Tiles: the fastest of ROWS 64 / 128 x warps 4 / 8 x BWD_BLOCKS 2 / 4 / 8 on an H200 at the
# ListOps shape (experiments/nystrom_h200_session16/tune_few_keys.md)
ROWS = 64        # query rows per block (the forward: one block per program)
BWD_BLOCKS = 8   # row blocks per backward program
NUM_WARPS = 4
HALF_DTYPES = (jnp.bfloat16, jnp.float16)


def few_keys_attention_reference(q, k, v, scale):
  """float32 softmax(q k^T * scale) v, [b, L, h, d] (the explicit formulation)."""
  logits = jnp.einsum("blhd,bmhd->bhlm", q, k, preferred_element_type=jnp.float32) * scale
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhlm,bmhd->blhd", probs, v.astype(jnp.float32))


def _compiler_params():
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _rows(ref, b, start, h, length):
  """ref[b, start:start + ROWS, h, :], rows past ``length`` read as zeros."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  inside = (start + jnp.arange(ROWS) < length)[:, None]
  return plgpu.load(ref.at[b, pl.ds(start, ROWS), h, :],
                    mask=jnp.broadcast_to(inside, (ROWS, ref.shape[-1])), other=0)


def _store_rows(ref, b, start, h, length, value):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  inside = (start + jnp.arange(ROWS) < length)[:, None]
  plgpu.store(ref.at[b, pl.ds(start, ROWS), h, :], value.astype(ref.dtype),
              mask=jnp.broadcast_to(inside, value.shape))


def _scores(q, k, scale):
  """[ROWS, m] float32 q k^T * scale."""
  return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * scale


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale: float, length: int):
  b, j, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start = j * ROWS
  k, v = k_ref[b, :, h, :], v_ref[b, :, h, :]
  s = _scores(_rows(q_ref, b, start, h, length), k, scale)
  top = jnp.max(s, axis=1)
  p = jnp.exp(s - top[:, None])
  total = jnp.sum(p, axis=1)
  o = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32) / total[:, None]
  _store_rows(o_ref, b, start, h, length, o)
  lse_ref[b, h, j, :] = top + jnp.log(total)


def _backward_kernel(q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, dq_ref, dk_ref, dv_ref, *,
                     scale: float, length: int):
  """dq of BWD_BLOCKS row blocks, and their dk, dv terms summed in registers (one partial sum
  per program, so few partial sums to add up outside)."""
  b, group, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k, v = k_ref[b, :, h, :], v_ref[b, :, h, :]

  def body(i, sums):
    j = group * BWD_BLOCKS + i
    start = j * ROWS
    q = _rows(q_ref, b, start, h, length)
    do = _rows(do_ref, b, start, h, length)
    # rows past the length: q = do = o = 0 and p = 0 (their lse was never written)
    inside = (start + jnp.arange(ROWS) < length)[:, None]
    p = jnp.where(inside, jnp.exp(_scores(q, k, scale) - lse_ref[b, h, j, :][:, None]), 0.0)
    delta = jnp.sum(do.astype(jnp.float32) *
                    _rows(o_ref, b, start, h, length).astype(jnp.float32), axis=1)
    dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[:, None])).astype(q.dtype)
    _store_rows(dq_ref, b, start, h, length,
                jnp.dot(ds, k, preferred_element_type=jnp.float32) * scale)
    dk = sums[0] + jax.lax.dot_general(ds, q, (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
    dv = sums[1] + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)
    return dk, dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, BWD_BLOCKS, body, (zeros, zeros))
  dk_ref[b, group, h, :, :] = dk * scale
  dv_ref[b, group, h, :, :] = dv


def _grid(q, blocks_per_program: int = 1):
  batch, length, heads, _ = q.shape
  return batch, pl.cdiv(pl.cdiv(length, ROWS), blocks_per_program), heads


def _forward(q, k, v, scale, interpret):
  batch, length, heads, dim = q.shape
  grid = _grid(q)
  return pl.pallas_call(
      functools.partial(_forward_kernel, scale=scale, length=length),
      # lse for whole backward programs (the blocks past the last are never written)
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, _grid(q, BWD_BLOCKS)[1] * BWD_BLOCKS,
                                       ROWS), jnp.float32)),
      grid=grid, interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, scale, interpret):
  return _forward(q, k, v, scale, interpret)[0]


def _attention_fwd(q, k, v, scale, interpret):
  out, lse = _forward(q, k, v, scale, interpret)
  return out, (q, k, v, out, lse)


def _attention_bwd(scale, interpret, saved, grad):
  q, k, v, out, lse = saved
  batch, length, heads, dim = q.shape
  grid = _grid(q, BWD_BLOCKS)
  keys = k.shape[1]
  partial = jax.ShapeDtypeStruct((batch, grid[1], heads, keys, dim), jnp.float32)
  dq, dk, dv = pl.pallas_call(
      functools.partial(_backward_kernel, scale=scale, length=length),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), partial, partial),
      grid=grid, interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(q, k, v, out, grad.astype(q.dtype), lse)
  # the partial sums [b, programs, h, m, d] added up, back in k's layout [b, m, h, d]
  total = lambda x, like: jnp.swapaxes(jnp.sum(x, axis=1), 1, 2).astype(like.dtype)  # noqa: E731
  return dq, total(dk, k), total(dv, v)


_attention.defvjp(_attention_fwd, _attention_bwd)


def supports(q, k) -> bool:
  """Whether the kernels take these shapes: half precision, head dim and key count powers of
  two from 16 (the tensor-core products' sizes)."""
  pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
  return q.dtype in HALF_DTYPES and pow2(q.shape[-1]) and pow2(k.shape[1])


def few_keys_attention(q, k, v, *, scale=None, interpret: bool = False):
  """softmax(q k^T * scale) v in q's dtype; q [b, L, h, d], k and v [b, m, h, d], all of q's
  half-precision dtype, d and m powers of two >= 16 (``supports``). ``scale`` defaults to
  d^-1/2."""
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or (
      k.shape[2:] != q.shape[2:]):
    raise ValueError(f"few_keys_attention: q must be [b, L, h, d] and k, v [b, m, h, d]; got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  if not (k.dtype == v.dtype == q.dtype) or not supports(q, k):
    raise ValueError(f"few_keys_attention: needs bf16 / fp16 q, k, v of one dtype and a head "
                     f"dim and key count that are powers of two >= 16; got {q.dtype}, "
                     f"{k.dtype}, {v.dtype}, head dim {q.shape[-1]}, {k.shape[1]} keys")
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  return _attention(q, k, v, scale, interpret)
