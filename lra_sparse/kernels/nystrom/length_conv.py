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

``banded_length_conv`` is the model's form for half-precision V (bf16 / fp16), on the tensor
cores: the conv as block-banded products (as ``nystrom.banded_length_conv`` in XLA), output
block j = sum_u T_u[h] @ V[block j - 1 + u], u = 0, 1, 2, with T_u the [B x B] Toeplitz slices
of the taps. The kernel above does K FMAs per output element on the CUDA cores with K shifted
loads; this one does three [B x B] x [B x d] products per output tile from three loads (masked
at the ends, so nothing is padded in memory), and adds the attention output it is the skip of
in its epilogue. The taps stay float32-exact: T is split into two half-precision parts
(hi + lo), and so is a float32 cotangent in the backward, each pair of parts but lo x lo
multiplied (about 16 bits of mantissa per product, float32 accumulation). Backward: dV is the
same product with the bands transposed and reversed, dT_u = sum over examples and blocks of
G_j V_{j-1+u}^T (one program per head and slice of the blocks, accumulated in registers), and
dw is the transpose of the taps -> bands map (JAX's autodiff of ``toeplitz_bands``).
Measurements: experiments/reports/nystrom/README.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lra_sparse.kernels.shared.prologue import half_parts, zero_pad_head_dim

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
  _check(values, taps)
  return _length_conv(values, taps, interpret)


def _check(values, taps):
  if values.ndim != 4 or taps.ndim != 2 or taps.shape[1] != values.shape[2]:
    raise ValueError(f"length_conv: values must be [batch, length, heads, head_dim] and taps "
                     f"[K, heads]; got {values.shape} and {taps.shape}")
  if taps.shape[0] % 2 == 0:
    raise ValueError(f"length_conv: the number of taps must be odd, got {taps.shape[0]}")


# ----------------------------------------------------------------------------- banded products
def toeplitz_bands(kernel, block: int):
  """float32 [h, 3, block, block]: the slices T_u[h][i, s] = w[u * block + s - i + K//2 -
  block, h] of the banded conv (zero off the K taps), kernel [K, h]."""
  size = kernel.shape[0]
  row = jnp.arange(block)[:, None]
  col = jnp.arange(3 * block)[None, :]
  tap = col - row + size // 2 - block                              # [block, 3 * block]
  band = jnp.where((tap >= 0) & (tap < size),
                   jnp.swapaxes(kernel.astype(jnp.float32), 0, 1)[:, jnp.clip(tap, 0, size - 1)],
                   0.0)                                            # [h, i, 3 * block]
  return band.reshape(kernel.shape[1], block, 3, block).transpose(0, 2, 1, 3)



HALF_DTYPES = (jnp.bfloat16, jnp.float16)
GRAD_SPLITS = 32    # programs per head of the bands' gradient (each loops over its blocks)


def band_block(size: int) -> int:
  """B of ``banded_length_conv``: 64, or the power of two >= K//2 for longer taps."""
  return max(64, 1 << max(0, (size // 2) - 1).bit_length())


def _pairs(a_parts, b_parts):
  """Index pairs of the parts multiplied: all but lo x lo."""
  return [(i, j) for i in range(len(a_parts)) for j in range(len(b_parts)) if i + j < 2]


def _rows(ref, b, start, h, *, block: int, length: int):
  """ref[b, start:start + block, h, :], rows outside [0, length) read as zeros (masked, so V
  and the cotangents are never copied into padded arrays)."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  rows = start + jnp.arange(block)
  inside = jnp.broadcast_to(((rows >= 0) & (rows < length))[:, None], (block, ref.shape[-1]))
  return plgpu.load(ref.at[b, pl.ds(start, block), h, :], mask=inside, other=0)


def _band_product_kernel(*refs, parts, block: int, length: int, residual: bool):
  """o[b, block j, h] = sum_u sum of part products T_u[h] @ x[b, block j - 1 + u, h]
  (+ the residual's tile), stored in o's dtype; rows past the length are neither read nor
  written."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  nx, nt = parts
  x_refs, t_refs = refs[:nx], refs[nx:nx + nt]
  r_ref, o_ref = (refs[-2], refs[-1]) if residual else (None, refs[-1])
  b, j, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  load = functools.partial(_rows, b=b, h=h, block=block, length=length)
  acc = jnp.zeros((block, o_ref.shape[-1]), jnp.float32)
  for u in range(3):
    xs = [load(r, start=(j - 1 + u) * block) for r in x_refs]
    ts = [r[h, u, :, :] for r in t_refs]
    for i, k in _pairs(ts, xs):
      acc += jnp.dot(ts[i], xs[k], preferred_element_type=jnp.float32)
  if residual:
    acc += load(r_ref, start=j * block).astype(jnp.float32)
  rows = j * block + jnp.arange(block)
  inside = jnp.broadcast_to((rows < length)[:, None], acc.shape)
  plgpu.store(o_ref.at[b, pl.ds(j * block, block), h, :], acc.astype(o_ref.dtype), mask=inside)


def _band_product(x_parts, t_parts, residual=None, *, dtype, interpret: bool):
  """[b, L, h, d] in ``dtype``: the band products over x parts [b, L, h, d] with band parts
  [h, 3, B, B] (output block j reads blocks j - 1, j, j + 1), plus ``residual`` if given."""
  batch, length, heads, dim = x_parts[0].shape
  block = t_parts[0].shape[-1]
  extra = () if residual is None else (residual,)
  return pl.pallas_call(
      functools.partial(_band_product_kernel, parts=(len(x_parts), len(t_parts)), block=block,
                        length=length, residual=residual is not None),
      out_shape=jax.ShapeDtypeStruct((batch, length, heads, dim), dtype),
      grid=(batch, pl.cdiv(length, block), heads),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(*x_parts, *t_parts, *extra)


def _band_grad_kernel(*refs, parts, block: int, blocks: int, length: int, total: int,
                      splits: int):
  """o[s, h, u] = sum over the (example, block j) of this program of G_j X_{j-1+u}^T."""
  ng, nx = parts
  g_refs, x_refs, o_ref = refs[:ng], refs[ng:ng + nx], refs[-1]
  h, s = pl.program_id(0), pl.program_id(1)

  def body(it, accs):
    index = s + it * splits
    b, j = index // blocks, index % blocks
    load = functools.partial(_rows, b=b, h=h, block=block, length=length)
    gs = [load(r, start=j * block) for r in g_refs]
    out = []
    for u, acc in enumerate(accs):
      xs = [load(r, start=(j - 1 + u) * block) for r in x_refs]
      for i, k in _pairs(gs, xs):
        acc += jax.lax.dot_general(gs[i], xs[k], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
      out.append(acc)
    return tuple(out)

  zeros = jnp.zeros((block, block), jnp.float32)
  count = (total - s + splits - 1) // splits
  accs = jax.lax.fori_loop(0, count, body, (zeros,) * 3)
  for u in range(3):
    o_ref[s, h, u, :, :] = accs[u]


def _band_grad(g_parts, x_parts, *, block: int, interpret: bool):
  """float32 [h, 3, B, B]: dT_u = sum over examples and output blocks j of G_j X_{j-1+u}^T;
  g and x parts [b, L, h, d]."""
  batch, length, heads, _ = x_parts[0].shape
  blocks = pl.cdiv(length, block)
  total = batch * blocks
  splits = min(GRAD_SPLITS, total)
  partial_sums = pl.pallas_call(
      functools.partial(_band_grad_kernel, parts=(len(g_parts), len(x_parts)), block=block,
                        blocks=blocks, length=length, total=total, splits=splits),
      out_shape=jax.ShapeDtypeStruct((splits, heads, 3, block, block), jnp.float32),
      grid=(heads, splits),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(),
  )(*g_parts, *x_parts)
  return jnp.sum(partial_sums, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _banded_conv(values, bands, residual, interpret):
  return _banded_conv_fwd(values, bands, residual, interpret)[0]


def _banded_conv_fwd(values, bands, residual, interpret):
  dim = values.shape[-1]
  width = max(16, 1 << (dim - 1).bit_length())
  out = _band_product((zero_pad_head_dim(values, width),), half_parts(bands, values.dtype),
                      None if residual is None else zero_pad_head_dim(residual, width),
                      dtype=jnp.float32 if residual is None else residual.dtype,
                      interpret=interpret)
  return out[..., :dim], (values, bands, residual)


def _banded_conv_bwd(interpret, saved, grad):
  values, bands, residual = saved
  dim = values.shape[-1]
  width = max(16, 1 << (dim - 1).bit_length())
  # A float32 cotangent (no residual) is split into hi + lo parts; a half-precision one (the
  # residual's dtype) is one part.
  g_parts = tuple(zero_pad_head_dim(g, width) for g in half_parts(grad, values.dtype))
  # dV: block m of the input gets sum_u T_u^T G_{m + 1 - u}: the product with the transposed
  # bands in reverse order over G laid out as V is
  flipped = jnp.swapaxes(bands[:, ::-1], -1, -2)
  grad_values = _band_product(g_parts, half_parts(flipped, values.dtype), dtype=values.dtype,
                              interpret=interpret)[..., :dim]
  grad_bands = _band_grad(g_parts, (zero_pad_head_dim(values, width),), block=bands.shape[-1],
                          interpret=interpret)
  grad_residual = None if residual is None else grad.astype(residual.dtype)
  return grad_values, grad_bands, grad_residual


_banded_conv.defvjp(_banded_conv_fwd, _banded_conv_bwd)


def banded_length_conv(values, taps, residual=None, *, interpret: bool = False):
  """``length_conv`` for half-precision values as block-banded products on the tensor cores
  (module docstring). Without ``residual``: the float32 conv. With ``residual`` ([batch,
  length, heads, head_dim], the attention output the skip is added to): (residual in float32
  + conv) in residual's dtype, the sum made in the kernel's epilogue, so no float32
  [b, L, h, d] array is written, and a half-precision cotangent comes back (one part, not a
  hi + lo pair). Float32 values: ``length_conv``'s exact kernels (plus the residual)."""
  _check(values, taps)
  if residual is not None and residual.shape != values.shape:
    raise ValueError(f"banded_length_conv: residual must have the values' shape "
                     f"{values.shape}, got {residual.shape}")
  if values.dtype not in HALF_DTYPES:
    out = length_conv(values, taps, interpret=interpret)
    return out if residual is None else (residual.astype(jnp.float32) + out).astype(
        residual.dtype)
  bands = toeplitz_bands(taps, band_block(taps.shape[0]))
  return _banded_conv(values, bands, residual, interpret)
