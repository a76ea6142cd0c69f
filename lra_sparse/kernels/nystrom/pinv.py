"""The Nystromformer's iterative pseudo-inverse as one Pallas (Triton) program per matrix.

The pure-JAX reference is ``lra_sparse.attention.nystrom.iterative_pinv``:

    Z_0     = A^T / (max_j sum_i |A_ij| * max_i sum_j |A_ij|)      (maxima over the whole batch)
    X_k     = A Z_k,   T1 = 7 I - X_k,   T2 = 15 I - X_k T1,   T3 = 13 I - X_k T2
    Z_{k+1} = 1/4 Z_k T3

on [..., m, m] matrices. At the ListOps shape (32 x 8 matrices of 64 x 64, 6 iterations) XLA
runs it as about 70 small batched products and elementwise kernels forward and more backward,
each limited by its launch and its trip through memory: 0.15 ms forward, 0.44 ms forward +
backward per layer on an H100. Here one program per matrix runs every iteration (a loop, so
Triton compiles one iteration's code) with its matrices in registers: 0.05 and 0.14 ms.

* forward: Z from A and Z_0 (the scale, a reduction over the batch, stays in XLA, so its
  gradient is JAX's); Z_k, X_k, T2 and T3 of every iteration are written for the backward, so
  it recomputes no product;
* backward: reverse mode through the same iterations (not the analytic inverse's gradient),
  written for the TRANSPOSED cotangents, so that every product is a plain one (no transposed
  operands in the kernel). With G = (dL/dZ_{k+1})^T:

      D3 = 1/4 G Z_k,   D2 = -D3 X_k,   D1 = -D2 X_k                 (D_i = dT_i^T)
      E  = -(T2 D3 + T1 D2 + D1)                                     (E = dX_k^T)
      (dL/dA)^T += Z_k E,   G <- 1/4 T3 G + E A                      (G <- dZ_k^T)

  The cotangent comes in transposed and dA and dZ_0 go out transposed (XLA transposes them).

Products take float32 operands at the default precision (the reference's precision in XLA on
a GPU: TF32 on the tensor cores; exact in the interpreter). ``interpret=True`` runs the same
kernels on the CPU (the tests use that).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# warps: the fastest of 4, 8, 16 on an H100 (experiments/reports/nystrom/ab_pinv.md)
NUM_WARPS = 4


def supports(matrix) -> bool:
  """Whether the kernels take [..., m, m] float32 matrices: m a power of two from 16 to 64
  (one matrix per program, in registers)."""
  m = matrix.shape[-1]
  return (matrix.ndim >= 2 and matrix.shape[-2] == m and matrix.dtype == jnp.float32
          and m in (16, 32, 64))


def _compiler_params(interpret: bool):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return None if interpret else plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _eye(m: int):
  rows = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
  return jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)


def _forward_kernel(a_ref, z0_ref, z_ref, saved_ref, *, iters: int):
  a = a_ref[...]
  eye = _eye(a.shape[-1])

  def iteration(k, z):
    x = _dot(a, z)
    t2 = 15.0 * eye - _dot(x, 7.0 * eye - x)
    t3 = 13.0 * eye - _dot(x, t2)
    for i, value in enumerate((z, x, t2, t3)):
      saved_ref[k, i] = value
    return 0.25 * _dot(z, t3)

  # a loop, not unrolled: Triton compiles one iteration's code (unrolled, the backward took
  # minutes to compile)
  z_ref[...] = jax.lax.fori_loop(0, iters, iteration, z0_ref[...])


def _backward_kernel(a_ref, saved_ref, g_ref, da_ref, dz0_ref, *, iters: int):
  a = a_ref[...]
  eye = _eye(a.shape[-1])

  def iteration(i, carry):
    g, da = carry                  # the cotangent of Z_{k+1} and (dL/dA)^T so far, transposed
    k = iters - 1 - i
    x = saved_ref[k, 1]
    d3 = 0.25 * _dot(g, saved_ref[k, 0])
    d2 = -_dot(d3, x)
    d1 = -_dot(d2, x)
    e = -(_dot(saved_ref[k, 2], d3) + _dot(7.0 * eye - x, d2) + d1)
    return 0.25 * _dot(saved_ref[k, 3], g) + _dot(e, a), da + _dot(saved_ref[k, 0], e)

  g, da = jax.lax.fori_loop(0, iters, iteration, (g_ref[...], jnp.zeros_like(a)))
  da_ref[...] = da
  dz0_ref[...] = g


def _matrix_spec(m: int):
  return pl.BlockSpec((None, m, m), lambda i: (i, 0, 0))


def _saved_spec(iters: int, m: int):
  return pl.BlockSpec((iters, 4, None, m, m), lambda i: (0, 0, i, 0, 0))


def _forward(a, z0, iters: int, interpret: bool):
  n, m, _ = a.shape
  return pl.pallas_call(
      functools.partial(_forward_kernel, iters=iters),
      out_shape=(jax.ShapeDtypeStruct((n, m, m), jnp.float32),
                 jax.ShapeDtypeStruct((iters, 4, n, m, m), jnp.float32)),
      grid=(n,),
      in_specs=[_matrix_spec(m)] * 2,
      out_specs=(_matrix_spec(m), _saved_spec(iters, m)),
      interpret=interpret, compiler_params=_compiler_params(interpret),
  )(a, z0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _iterate(a, z0, iters, interpret):
  return _forward(a, z0, iters, interpret)[0]


def _iterate_fwd(a, z0, iters, interpret):
  z, saved = _forward(a, z0, iters, interpret)
  return z, (a, saved)


def _iterate_bwd(iters, interpret, residuals, g):
  a, saved = residuals
  n, m, _ = a.shape
  da_t, dz0_t = pl.pallas_call(
      functools.partial(_backward_kernel, iters=iters),
      out_shape=(jax.ShapeDtypeStruct((n, m, m), jnp.float32),) * 2,
      grid=(n,),
      in_specs=[_matrix_spec(m), _saved_spec(iters, m), _matrix_spec(m)],
      out_specs=(_matrix_spec(m),) * 2,
      interpret=interpret, compiler_params=_compiler_params(interpret),
  )(a, saved, jnp.swapaxes(g, 1, 2).astype(jnp.float32))
  return jnp.swapaxes(da_t, 1, 2), jnp.swapaxes(dz0_t, 1, 2)


_iterate.defvjp(_iterate_fwd, _iterate_bwd)


def iterate(matrix, z0, iters: int, *, interpret: bool = False):
  """Z after ``iters`` iterations from Z_0 = ``z0``, float32 [..., m, m] (``supports``), with
  the gradients of reverse mode through the iterations."""
  if not supports(matrix) or z0.shape != matrix.shape or z0.dtype != matrix.dtype:
    raise ValueError(f"pinv_pallas.iterate: needs float32 [..., m, m] matrices with m in 16, 32 "
                     f"or 64 and Z_0 of the same shape; got {matrix.dtype}{list(matrix.shape)}, "
                     f"{z0.dtype}{list(z0.shape)}")
  if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
    raise ValueError(f"pinv_pallas.iterate: iters={iters!r} must be an integer >= 1")
  shape = matrix.shape
  flat = lambda x: x.reshape((-1,) + shape[-2:])  # noqa: E731
  return _iterate(flat(matrix), flat(z0), iters, interpret).reshape(shape)
