"""The Nystromformer conv skip as one Pallas (Triton) kernel pass, forward and backward.

    out[b, l, h, :] = sum_t w[t, h] * v[b, l + t - K//2, h, :]      (zero outside [0, L))

The pure-JAX reference is ``lra_sparse.attention.nystrom.banded_length_conv`` (and the
grouped ``lax.conv`` beside it). In the model the conv runs inside one train step, where XLA's
formulations cost 2.5 ms per layer at the ListOps shape (layout copies around the products);
this kernel reads V once per output tile (the K shifted rows come from the cache) and writes
the float32 output once:

* forward: program (b, block of rows, h) accumulates its [block, d] tile over the K taps;
* backward: dV is the same conv with the taps reversed; dw[t, h] = sum over b, l, d of
  g[b, l, h, :] * v[b, l + t - K//2, h, :], one partial sum per program and tap, added up
  outside.

V is zero-padded by K//2 (and up to a whole number of blocks) before the call, so every load
is in bounds and needs no mask. Nothing here imports at module import time beyond JAX;
``interpret=True`` runs the same kernels on the CPU (the tests use that).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK = 64       # output rows per program
NUM_WARPS = 4


def _pad(values, half: int, block: int):
  """[b, L, h, d] -> [b, half + L + pad + half, h, d] with zeros; L + pad a multiple of block."""
  length = values.shape[1]
  padded = -(-length // block) * block
  return jnp.pad(values, ((0, 0), (half, padded - length + half), (0, 0), (0, 0))), padded


def _compiler_params():
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _forward_kernel(x_ref, w_ref, o_ref, *, size: int, block: int):
  b, row_block, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start = row_block * block
  acc = jnp.zeros((block, o_ref.shape[-1]), jnp.float32)
  for t in range(size):  # static: K shifted tiles, the taps as scalars
    tile = x_ref[b, pl.ds(start + t, block), h, :].astype(jnp.float32)
    acc += w_ref[t, h] * tile
  o_ref[b, pl.ds(start, block), h, :] = acc


def _taps_grad_kernel(g_ref, x_ref, o_ref, *, size: int, block: int):
  b, row_block, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start = row_block * block
  g = g_ref[b, pl.ds(start, block), h, :].astype(jnp.float32)
  for t in range(size):
    tile = x_ref[b, pl.ds(start + t, block), h, :].astype(jnp.float32)
    o_ref[b, row_block, h, t] = jnp.sum(g * tile)


def _conv(values, taps, *, interpret: bool):
  """values [b, L, h, d] (any float dtype), taps [K, h] -> float32 [b, L, h, d]."""
  batch, length, heads, dim = values.shape
  size = taps.shape[0]
  x, padded = _pad(values, size // 2, BLOCK)
  out = pl.pallas_call(
      functools.partial(_forward_kernel, size=size, block=BLOCK),
      out_shape=jax.ShapeDtypeStruct((batch, padded, heads, dim), jnp.float32),
      grid=(batch, padded // BLOCK, heads),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(x, taps.astype(jnp.float32))
  return out[:, :length]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _length_conv(values, taps, interpret):
  return _conv(values, taps, interpret=interpret)


def _length_conv_fwd(values, taps, interpret):
  return _conv(values, taps, interpret=interpret), (values, taps)


def _length_conv_bwd(interpret, residuals, grad):
  values, taps = residuals
  batch, length, heads, dim = values.shape
  size = taps.shape[0]
  grad_values = _conv(grad, taps[::-1], interpret=interpret).astype(values.dtype)
  g, padded = _pad(grad, 0, BLOCK)
  x, _ = _pad(values, size // 2, BLOCK)
  partial_sums = pl.pallas_call(
      functools.partial(_taps_grad_kernel, size=size, block=BLOCK),
      out_shape=jax.ShapeDtypeStruct((batch, padded // BLOCK, heads, size), jnp.float32),
      grid=(batch, padded // BLOCK, heads),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(g, x)
  grad_taps = jnp.transpose(jnp.sum(partial_sums, axis=(0, 1)))      # [K, h]
  return grad_values, grad_taps.astype(taps.dtype)


_length_conv.defvjp(_length_conv_fwd, _length_conv_bwd)


def length_conv(values, taps, *, interpret: bool = False):
  """Per-head conv over the length axis shared across head_dim; float32 result.

  values: [batch, length, heads, head_dim]; taps: [K, heads] with K odd. ``interpret=True``
  runs the kernels in Pallas' interpreter (CPU, tests).
  """
  if values.ndim != 4 or taps.ndim != 2 or taps.shape[1] != values.shape[2]:
    raise ValueError(f"length_conv: values must be [batch, length, heads, head_dim] and taps "
                     f"[K, heads]; got {values.shape} and {taps.shape}")
  if taps.shape[0] % 2 == 0:
    raise ValueError(f"length_conv: the number of taps must be odd, got {taps.shape[0]}")
  return _length_conv(values, taps, interpret)
