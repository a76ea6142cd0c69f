"""The Nystromformer's iterative pseudo-inverse as one Pallas (Triton) kernel per direction.

The pure-JAX reference is ``lra_sparse.attention.nystrom.iterative_pinv``:

    Z_0     = A^T / (max_j sum_i |A_ij| * max_i sum_j |A_ij|)      (maxima over the whole batch)
    Z_{k+1} = 1/4 Z_k T3,   T3 = 13 I - A Z_k T2,   T2 = 15 I - A Z_k T1,   T1 = 7 I - A Z_k

on [..., m, m] matrices.  At the ListOps shape (32 x 8 matrices of 64 x 64, 6 iterations) XLA
runs it as 24 batched [64 x 64] products forward, and more backward, each a kernel launch on
tiny operands: 0.16 ms forward and 0.62 ms forward + backward per layer on an H100.  Here one
program per matrix runs every iteration with the matrix in registers:

* forward: Z from A and Z_0 (the scale, a reduction over the batch, stays in XLA, so its
  gradient is JAX's); the iterates Z_0 .. Z_{n-1} are also written, for the backward;
* backward (reverse mode through the same iterations, not the analytic inverse's gradient):
  per iteration from the last, with G = dL/dZ_{k+1} and the iterate's products recomputed,

      dZ_k  = 1/4 G T3^T + A^T dAZ,    dT3 = 1/4 Z_k^T G,    dT2 = -(AZ)^T dT3,
      dT1   = -(AZ)^T dT2,             dAZ = -dT3 T2^T - dT2 T1^T - dT1,
      dA   += dAZ Z_k^T,

  and dZ_0 goes back to XLA's autodiff of Z_0 = A^T * scale.

Products take float32 operands at the default precision (the reference's precision in XLA on
a GPU: TF32 on the tensor cores; exact in the interpreter).  ``interpret=True`` runs the same
kernels on the CPU (the tests use that).  A candidate: the model keeps ``iterative_pinv`` until
``benchmarks/bench_nystrom.py`` times both in one process.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# 8 warps: a 64 x 64 float32 matrix is 16 registers a thread, and the backward holds about ten
NUM_WARPS = 8


def _compiler_params():
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _dot(a, b, contract=((1,), (0,))):
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _nt(a, b):   # a @ b^T
  return _dot(a, b, ((1,), (1,)))


def _tn(a, b):   # a^T @ b
  return _dot(a, b, ((0,), (0,)))


def _eye(m: int):
  rows = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
  return jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)


def _step(a, z, eye):
  """(AZ, T1, T2, T3) of one iteration."""
  az = _dot(a, z)
  t1 = 7.0 * eye - az
  t2 = 15.0 * eye - _dot(az, t1)
  t3 = 13.0 * eye - _dot(az, t2)
  return az, t1, t2, t3


def _forward_kernel(a_ref, z0_ref, z_ref, iterates_ref, *, iters: int):
  a, z = a_ref[...], z0_ref[...]
  eye = _eye(a.shape[-1])
  for k in range(iters):
    iterates_ref[k] = z
    z = 0.25 * _dot(z, _step(a, z, eye)[3])
  z_ref[...] = z


def _backward_kernel(a_ref, iterates_ref, g_ref, da_ref, dz0_ref, *, iters: int):
  a, g = a_ref[...], g_ref[...]
  eye = _eye(a.shape[-1])
  da = jnp.zeros_like(a)
  for k in reversed(range(iters)):
    z = iterates_ref[k]
    az, t1, t2, t3 = _step(a, z, eye)
    dt3 = 0.25 * _tn(z, g)
    daz = -_nt(dt3, t2)
    dt2 = -_tn(az, dt3)
    daz -= _nt(dt2, t1)
    daz += _tn(az, dt2)           # - dT1, dT1 = -(AZ)^T dT2
    da += _nt(daz, z)
    g = 0.25 * _nt(g, t3) + _tn(a, daz)
  da_ref[...] = da
  dz0_ref[...] = g


def _specs(count: int, m: int):
  """``count`` block specs of one [m, m] matrix per program."""
  return [pl.BlockSpec((None, m, m), lambda i: (i, 0, 0))] * count


def _iterates_spec(iters: int, m: int):
  return pl.BlockSpec((iters, None, m, m), lambda i: (0, i, 0, 0))


def _forward(a, z0, iters: int, interpret: bool):
  n, m, _ = a.shape
  return pl.pallas_call(
      functools.partial(_forward_kernel, iters=iters),
      out_shape=(jax.ShapeDtypeStruct((n, m, m), jnp.float32),
                 jax.ShapeDtypeStruct((iters, n, m, m), jnp.float32)),
      grid=(n,),
      in_specs=_specs(2, m),
      out_specs=(*_specs(1, m), _iterates_spec(iters, m)),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(a, z0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _iterate(a, z0, iters, interpret):
  return _forward(a, z0, iters, interpret)[0]


def _iterate_fwd(a, z0, iters, interpret):
  z, iterates = _forward(a, z0, iters, interpret)
  return z, (a, iterates)


def _iterate_bwd(iters, interpret, residuals, g):
  a, iterates = residuals
  n, m, _ = a.shape
  return tuple(pl.pallas_call(
      functools.partial(_backward_kernel, iters=iters),
      out_shape=(jax.ShapeDtypeStruct((n, m, m), jnp.float32),) * 2,
      grid=(n,),
      in_specs=(*_specs(1, m), _iterates_spec(iters, m), *_specs(1, m)),
      out_specs=tuple(_specs(2, m)),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(a, iterates, g.astype(jnp.float32)))


_iterate.defvjp(_iterate_fwd, _iterate_bwd)


def iterative_pinv(matrix, iters: int = 6, *, interpret: bool = False):
  """``nystrom.iterative_pinv`` of float32 [..., m, m] (m a power of two >= 16), fused."""
  matrix = jnp.asarray(matrix)
  if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2]:
    raise ValueError(f"iterative_pinv: need [..., m, m] matrices, got {matrix.shape}")
  m = matrix.shape[-1]
  if m < 16 or m & (m - 1):
    raise ValueError(f"iterative_pinv: the fused kernels take m a power of two >= 16, got {m}")
  if matrix.dtype != jnp.float32:
    raise ValueError(f"iterative_pinv: the fused kernels take float32, got {matrix.dtype}")
  if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
    raise ValueError(f"iterative_pinv: iters={iters!r} must be an integer >= 1")
  magnitude = jnp.abs(matrix)
  max_col_sum = jnp.max(jnp.sum(magnitude, axis=-2))
  max_row_sum = jnp.max(jnp.sum(magnitude, axis=-1))
  z0 = jnp.swapaxes(matrix, -1, -2) / (max_col_sum * max_row_sum)
  flat = lambda x: x.reshape((-1, m, m))  # noqa: E731
  return _iterate(flat(matrix), flat(z0), iters, interpret).reshape(matrix.shape)
