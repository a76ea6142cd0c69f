"""Nystromformer attention (Xiong et al. 2021) and its combination with DFSS (DFSS App. A.7).

Follows the official LRA code (mlpen/Nystromformer, LRA/code/attention_nystrom.py):

    Q, K <- Q * mask / d^(1/4), K * mask / d^(1/4)      (padded tokens zeroed)
    Q~, K~ = segment means of Q, K over num_landmarks equal segments
    F = softmax(Q K~^T)   [L x m]    A = softmax(Q~ K~^T)   [m x m]
    B = softmax(Q~ K^T)   [m x L]    (padded keys masked)
    O = F pinv(A) (B V)  (+ depthwise conv of V * mask over the length axis, in the core)

pinv: ``pinv_iters`` steps of Z <- 0.25 Z (13I - AZ (15I - AZ (7I - AZ))) from
Z0 = A^T / (max column sum of |A| * max row sum of |A|), maxima over the whole batch and all
heads as in the official code (its "original" init; A's rows sum to 1, so this is exactly
its 1 / max column sum).

Differences from the official code, all documented: if L is not a multiple of num_landmarks the
sequence is padded at the end with masked tokens (the official code requires divisibility);
``num_landmarks == L`` still runs the Nystrom approximation (the official code switches to
exact softmax there); a bf16 / fp16 model multiplies in half precision with float32
accumulation (the official code runs its attention in float32 under AMP; the softmaxes and the
pseudo-inverse stay float32 here too), on a GPU as flash attentions (Pallas kernels: F (.)
holds all m landmark keys in one tile, B V runs the m landmark queries over spans of keys)
with the pseudo-inverse in one Pallas program per matrix.
The conv skip is block-banded matrix products (a Pallas kernel on a GPU, which also adds the
skip to the attention output).

Nystrom + DFSS (``nm="n:m"``): the two non-square softmax matrices F and B are N:M-pruned along
their last axis (landmarks for F, keys for B) before their softmax, as DFSS stores them under
1:2 / 2:4 sparsity; A is kept dense. The flash kernels prune inside their score tiles, so
neither matrix is written.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import flax.linen as nn

from lra_sparse.attention import common
from lra_sparse.attention import dense
from lra_sparse.attention.registry import (AttentionDims, KindConfig, derived,
                                           register_attention)
from lra_sparse.kernels.nystrom import landmark as landmark_kernels
from lra_sparse.kernels.nystrom import length_conv as length_conv_kernel
from lra_sparse.kernels.nystrom import pinv as pinv_kernel
from lra_sparse.kernels.nystrom.length_conv import toeplitz_bands
from lra_sparse.ops import sharding, softmax
from lra_sparse.ops.nm import nm_mask, parse_nm


IMPLEMENTATIONS = ("auto", "xla", "pallas", "cudnn")


@dataclasses.dataclass(frozen=True)
class NystromConfig(KindConfig):
  """``config.attention.nystrom``."""
  KIND = "nystrom"
  num_landmarks: int = 64
  pinv_iters: int = 6              # iterations of the Moore-Penrose pseudo-inverse
  conv_kernel: int = 35            # depthwise conv skip on V over the length axis; 0 = none
  nm: str = ""                     # "" (plain Nystromformer) or "n:m": DFSS on F and B
  # The official Nystromformer has no attention dropout (its LRA code drops attention only in
  # softmax attention), so config.model.attention_dropout_rate does not act here unless this is
  # True: then it drops F and B, on the XLA formulation (the flash kernels have no dropout).
  attention_dropout: bool = False
  # auto: on a GPU in half precision without attention dropout, F (.) and B V as flash
  # attentions (the Pallas kernels, plain or N:M; cuDNN for a plain part they cannot take),
  # else XLA | xla | pallas (both on the Pallas kernels) | cudnn (both on cuDNN; plain only)
  implementation: str = "auto"
  # The task's key masks may have holes (pixel tasks masking black pixels): cuDNN's B V then
  # takes the key mask as a [batch, 1, m, L] bias. Set by the model builder, not by hand.
  mask_holes: bool = derived(False)

  def __post_init__(self):
    self.check_choice("implementation", IMPLEMENTATIONS)
    self.check_bool("mask_holes")
    self.check_bool("attention_dropout")
    self.check_int("num_landmarks", 1)
    self.check_int("pinv_iters", 1)
    self.check_int("conv_kernel", 0)
    if self.conv_kernel and self.conv_kernel % 2 == 0:
      raise self.error("conv_kernel", "must be 0 (no conv skip) or odd")
    if self.nm:
      _, m = parse_nm(self.nm, what="config.attention.nystrom.nm")
      if self.num_landmarks % m:
        raise self.error("num_landmarks", f"must be a multiple of m={m} from "
                                          f"config.attention.nystrom.nm={self.nm!r}")

  @property
  def n_m(self) -> Optional[tuple[int, int]]:
    return parse_nm(self.nm) if self.nm else None


def iterative_pinv(matrix, iters: int = 6, *, fused: bool = False):
  """Moore-Penrose pseudo-inverse of [..., m, m] by the Nystromformer iteration. ``fused``:
  the iterations in one Pallas program per matrix (``kernels/nystrom/pinv.py``; float32, m in 16,
  32, 64, else XLA), the interpreter off a GPU."""
  identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  magnitude = jnp.abs(matrix)
  max_col_sum = jnp.max(jnp.sum(magnitude, axis=-2))
  max_row_sum = jnp.max(jnp.sum(magnitude, axis=-1))
  z = jnp.swapaxes(matrix, -1, -2) / (max_col_sum * max_row_sum)
  if fused:
    if pinv_kernel.supports(matrix):   # (Z_0's maxima stay over the whole batch)
      return sharding.per_data_shard(functools.partial(
          pinv_kernel.iterate, iters=iters, interpret=jax.default_backend() != "gpu"), matrix, z)
  for _ in range(iters):
    az = matrix @ z
    z = 0.25 * z @ (13 * identity - az @ (15 * identity - az @ (7 * identity - az)))
  return z


def segment_means(x, num_landmarks: int):
  """float32 [b, m, h, d]: the means of x [b, L, h, d] over num_landmarks segments of
  ceil(L / m) tokens (a shorter or empty last one counts the missing tokens as zeros).

  Forward: one product with the 0/1 [m, L] segment-membership matrix (exact in any dtype;
  float32 sums, then / size): on a GPU a tensor-core product reading x once, where the
  [b, m, size, h, d] mean over the middle axis (fused with a pad) took 0.26 ms per ListOps
  layer in a profile of the train step on an H100. Backward: each token's gradient is its
  segment's, / size, a broadcast XLA fuses into the consumer (the same numbers as the
  product's transpose, which cost a [L x m] x [m x h d] product per call). (Batched over b:
  XLA's CPU backend lacks the unbatched bf16 x bf16 -> f32 product.)"""
  return _segment_means(x, num_landmarks, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _segment_means(x, num_landmarks, dtype):
  return _segment_means_fwd(x, num_landmarks, dtype)[0]


def _segment_means_fwd(x, num_landmarks, dtype):
  batch, length = x.shape[:2]
  size = -(-length // num_landmarks)
  member = (jnp.arange(length) // size)[None, :] == jnp.arange(num_landmarks)[:, None]
  member = jnp.broadcast_to(member.astype(x.dtype), (batch,) + member.shape)
  half = x.dtype in (jnp.bfloat16, jnp.float16)
  sums = jnp.einsum("bml,blhd->bmhd", member, x, preferred_element_type=jnp.float32,
                    precision=None if half else jax.lax.Precision.HIGHEST)
  return sums / jnp.float32(size), jnp.zeros((length, 0), dtype)


def _segment_means_bwd(num_landmarks, dtype, saved, grad):
  length = saved.shape[0]       # (a zero-size array: residuals are arrays)
  size = -(-length // num_landmarks)
  spread = jnp.repeat(grad / jnp.float32(size), size, axis=1)[:, :length]
  return (spread.astype(dtype),)


_segment_means.defvjp(_segment_means_fwd, _segment_means_bwd)


def _flash_plan(implementation: str, dtype, head_dim: int, num_landmarks: int, nm,
                dropout: bool):
  """How F (.) and B V run: ("pallas" | "cudnn", "pallas" | "cudnn"), or None for the explicit
  XLA formulation; one ValueError where a named implementation cannot run the call."""
  if implementation == "xla":
    return None
  half = dtype in (jnp.bfloat16, jnp.float16)
  fits = (half and landmark_kernels.supports(dtype, head_dim, num_landmarks, nm=nm),
          half and landmark_kernels.supports_few_queries(dtype, head_dim, num_landmarks, nm=nm))
  why = (f"nm={nm}{', dropout_rate > 0' if dropout else ''}, dtype={jnp.dtype(dtype).name}, "
         f"head dim {head_dim}, {num_landmarks} landmarks")
  if implementation == "pallas":
    if dropout or not all(fits):
      raise ValueError("nystrom_attention: implementation='pallas' runs bf16/fp16 without "
                       "attention dropout, with the kernels' shapes (landmark_attention_pallas."
                       f"supports); got {why}; use 'xla' (or 'auto')")
    return "pallas", "pallas"
  if implementation == "cudnn":
    if nm is not None or dropout or not half:
      raise ValueError("nystrom_attention: implementation='cudnn' runs plain Nystromformer in "
                       f"bf16/fp16 without attention dropout; got {why}; use 'xla' (or 'auto')")
    return "cudnn", "cudnn"
  if not half or jax.default_backend() != "gpu":
    return None
  if dropout:
    common.warn_once("Nystromformer implementation='auto': attention dropout trains on the XLA "
                     "formulation (the flash attentions have no dropout); evaluation stays on "
                     "them")
    return None
  if nm is None:
    return tuple("pallas" if fit else "cudnn" for fit in fits)
  if all(fits):
    return "pallas", "pallas"
  common.warn_once(f"Nystromformer implementation='auto': the N:M kernels cannot take {why}; "
                   "using the XLA formulation")
  return None


def _softmax(logits, nm):
  """Softmax over the last axis, optionally over the N:M-kept entries only (-inf = excluded)."""
  if nm is None:
    return softmax.masked_softmax(logits)
  keep = nm_mask(logits, *nm)
  return softmax.masked_softmax(jnp.where(keep, logits, -jnp.inf), keep)


def _flash_nystrom(plan, qz, kz, v, mask, q_land, k_land, pinv_a, nm, mask_holes: bool):
  """F (pinv(A) B V) with F (.) and B V as flash attentions (``plan``: where each runs)."""
  interpret = jax.default_backend() != "gpu"     # (CPU: the tests)
  if plan[1] == "pallas":
    b_v = sharding.per_data_shard(functools.partial(landmark_kernels.few_queries_attention, nm=nm,
                                                  interpret=interpret), q_land, kz, v, mask)
  else:
    b_v = dense.cudnn_attention(q_land, kz, v, mask, any_mask=mask_holes)       # [b,m,h,d]
    b_v = jnp.where(jnp.any(mask, axis=1)[:, None, None, None], b_v, 0)         # no keys: 0
  right = jnp.einsum("bhnm,bmhd->bnhd", pinv_a, b_v.astype(jnp.float32)).astype(q_land.dtype)
  if plan[0] == "pallas":
    return sharding.per_data_shard(functools.partial(landmark_kernels.few_keys_attention, nm=nm,
                                                   interpret=interpret), qz, k_land, right)
  return dense.cudnn_attention(qz, k_land, right)


def nystrom_attention(q, k, v, *, num_landmarks: int, pinv_iters: int = 6,
                      nm: Union[None, str, tuple[int, int]] = None, mask=None,
                      dropout_rate: float = 0.0, dropout_rng=None,
                      implementation: str = "xla", mask_holes: bool = False):
  """Nystrom attention WITHOUT the conv skip (the core adds it). q, k, v: [batch, length,
  heads, head_dim]; mask: bool [batch, length] (True = real). ``nm``: None / "" (plain) or
  "n:m" / an (n, m) pair for Nystrom+DFSS; num_landmarks must then be a multiple of m.
  Dropout, when given, applies to the probability matrices F and B.

  Precision: the landmarks, the logits, the three softmaxes and the pseudo-inverse are
  float32. The products with the [L x m] / [m x L] matrices take their operands in the input
  dtype (bf16 / fp16 inputs: half-precision operands with float32 accumulation, as flash
  attention multiplies P V), so a float32 model computes everything in float32.

  ``implementation``: "xla" (the explicit formulation), "pallas", "cudnn" or "auto"
  (``_flash_plan``). F (pinv(A) B V) and B V are softmax attentions with other lengths --
  queries Q over the m keys K~ with values pinv(A) B V, and the m queries Q~ over the L keys K
  with values V -- so flash attentions compute both without writing F or B, forward and
  backward: the Pallas kernels of ``kernels/nystrom/landmark.py`` (plain or N:M, which
  they prune inside their score tiles) or cuDNN (plain only). ``mask_holes``: the mask may
  have holes (not only padding at the end of each row), so cuDNN's B V takes it as a bias
  (the Pallas kernel always does).
  """
  if q.ndim != 4 or k.shape != q.shape or v.shape[:-1] != k.shape[:-1]:
    raise ValueError(f"nystrom_attention: q, k, v must be [batch, length, heads, head_dim] "
                     f"with equal q/k shapes; got {q.shape}, {k.shape}, {v.shape}")
  batch, length, heads, head_dim = q.shape
  if isinstance(num_landmarks, bool) or not isinstance(num_landmarks, int) or not (
      0 < num_landmarks <= length):
    raise ValueError(f"nystrom_attention: num_landmarks={num_landmarks!r} must be an integer "
                     f"in [1, length={length}]")
  if isinstance(pinv_iters, bool) or not isinstance(pinv_iters, int) or pinv_iters < 1:
    raise ValueError(f"nystrom_attention: pinv_iters={pinv_iters!r} must be an integer >= 1")
  nm = parse_nm(nm, what="nystrom_attention: nm") if nm not in (None, "") else None
  if nm is not None and num_landmarks % nm[1]:
    raise ValueError(f"nystrom_attention: num_landmarks={num_landmarks} must be a multiple of "
                     f"m={nm[1]} for N:M pruning along the landmark axis")
  if mask is None:
    mask = jnp.ones((batch, length), bool)
  elif mask.shape != (batch, length):
    raise ValueError(f"nystrom_attention: mask must be bool [batch, length] = "
                     f"{(batch, length)}, got {mask.shape}")
  mask = mask.astype(bool)
  f32 = jnp.float32
  half = q.dtype in (jnp.bfloat16, jnp.float16)
  operand = q.dtype if half else f32
  dropout = dropout_rate > 0.0 and dropout_rng is not None
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"nystrom_attention: implementation={implementation!r} not in "
                     f"{IMPLEMENTATIONS}")
  plan = _flash_plan(implementation, q.dtype, head_dim, num_landmarks, nm, dropout)

  def product(spec, x, y):
    return jnp.einsum(spec, x.astype(operand), y.astype(operand), preferred_element_type=f32)

  # Padded tokens zeroed (exact in any dtype); layout stays [batch, length, heads, dim].
  # The official d^(-1/4) on Q and on K is applied as d^(-1/2) on every logit (same value).
  real = mask[:, :, None, None]
  qz, kz = jnp.where(real, q, 0), jnp.where(real, k, 0)
  logit_scale = f32(head_dim ** -0.5)
  # Segments of ceil(L / m) tokens (a shorter last one counts the missing tokens as zeros).
  q_land = segment_means(qz.astype(operand), num_landmarks)                      # Q~, K~
  k_land = segment_means(kz.astype(operand), num_landmarks)
  kernel_a = _softmax(jnp.einsum("bnhd,bmhd->bhnm", q_land, k_land) * logit_scale,  # [m x m]
                      None)
  pinv_a = iterative_pinv(kernel_a, pinv_iters, fused=plan is not None and "pallas" in plan)
  if plan is not None:
    return _flash_nystrom(plan, qz, kz, v, mask, q_land.astype(operand),
                          k_land.astype(operand), pinv_a, nm, mask_holes).astype(q.dtype)
  # The explicit form: N:M pruning of B along the keys needs the length padded with masked
  # zeros to a multiple of m (its groups of m keys), in memory.
  key_mask = mask
  if nm is not None and length % nm[1]:
    pad = ((0, 0), (0, -length % nm[1]), (0, 0), (0, 0))
    qz, kz, v = jnp.pad(qz, pad), jnp.pad(kz, pad), jnp.pad(v, pad)
    key_mask = jnp.pad(mask, ((0, 0), (0, -length % nm[1])))
  kernel_f = _softmax(product("blhd,bmhd->bhlm", qz, k_land) * logit_scale, nm)     # [L x m]
  logits_b = product("bmhd,blhd->bhml", q_land, kz) * logit_scale
  logits_b = jnp.where(key_mask[:, None, None, :], logits_b, -jnp.inf)
  kernel_b = _softmax(logits_b, nm)                                                 # [m x L]
  if dropout:
    rng_f, rng_b = jax.random.split(dropout_rng)
    kernel_f = softmax.dropout_probabilities(kernel_f, dropout_rate, rng_f)
    kernel_b = softmax.dropout_probabilities(kernel_b, dropout_rate, rng_b)
  right = pinv_a @ product("bhml,blhd->bhmd", kernel_b, v)
  out = product("bhlm,bhmd->blhd", kernel_f, right)
  return out[:, :length].astype(q.dtype)


def grouped_length_conv(values, kernel):
  """Per-head conv over the length axis, shared across head_dim (official Conv2d with
  groups=heads, kernel (K, 1), padding K // 2, no bias), as one grouped ``lax.conv`` with a
  channel per (head, dim). values [b, L, h, d]; kernel [K, h]; float32 result."""
  batch, length, heads, dim = values.shape
  size = kernel.shape[0]
  operand = values.dtype if values.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
  channels = jnp.repeat(kernel.astype(operand), dim, axis=1)      # [K, h * d], head-major
  out = jax.lax.conv_general_dilated(
      values.astype(operand).reshape(batch, length, heads * dim), channels[:, None, :],
      window_strides=(1,), padding=[(size // 2, size // 2)],
      dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=heads * dim,
      preferred_element_type=jnp.float32)
  return out.reshape(batch, length, heads, dim)


def banded_length_conv(values, kernel, block: int = 64):
  """The same conv as block-banded matrix products on the tensor cores.

  The length axis is cut into blocks of ``block`` tokens; output block j is
  sum_{u=0,1,2} T_u[h] @ V[block j - 1 + u] with T_u the [block x block] Toeplitz slices of
  the taps (T_u[h][i, s] = w[u * block + s - i + K//2 - block, h], zero off the band), so the
  conv is three batched [block x block] x [block x d] products per block. Needs K//2 <= block.
  Operands in the input dtype (half precision stays half), float32 accumulation and result.
  """
  batch, length, heads, dim = values.shape
  size = kernel.shape[0]
  half = size // 2
  if half > block:
    raise ValueError(f"banded_length_conv: kernel size {size} needs K//2 <= block={block}")
  operand = values.dtype if values.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
  blocks = -(-length // block)
  x = jnp.pad(values.astype(operand),
              ((0, 0), (block, blocks * block - length + block), (0, 0), (0, 0)))
  x = x.reshape(batch, blocks + 2, block, heads, dim)
  band = toeplitz_bands(kernel, block).astype(operand)            # [h, u, i, s]
  out = sum(jnp.einsum("his,bjshd->bjihd", band[:, u], x[:, u:u + blocks],
                       preferred_element_type=jnp.float32) for u in range(3))
  return out.reshape(batch, blocks * block, heads, dim)[:, :length]


def depthwise_length_conv(values, kernel, residual=None):
  """The conv skip of the Nystromformer core: values [b, L, h, d], kernel [K, h] -> the float32
  conv; with ``residual`` (the attention output, [b, L, h, d]): residual + conv, summed in
  float32 and returned in residual's dtype.

  On a GPU (head_dim a power of two) a Pallas kernel, ``lra_sparse.kernels.nystrom.length_conv``:
  block-banded products on the tensor cores for bf16 / fp16 values, with the residual added in
  the kernel; the one-pass kernel for float32 values. Elsewhere the block-banded products
  above."""
  dim = values.shape[-1]
  if jax.default_backend() == "gpu" and dim & (dim - 1) == 0:
    extra = () if residual is None else (residual,)
    return sharding.per_data_shard(length_conv_kernel.banded_length_conv, values, kernel,
                                 *extra, replicated=(1,))
  conv = banded_length_conv(values, kernel, block=max(64, -(-(kernel.shape[0] // 2) // 16) * 16))
  return conv if residual is None else (residual.astype(jnp.float32) + conv).astype(
      residual.dtype)


class NystromAttention(nn.Module):
  """Attention core for ``config.attention.kind = "nystrom"`` (+ DFSS with ``nm``)."""
  dims: AttentionDims
  config: NystromConfig = NystromConfig()

  @nn.compact
  def __call__(self, q, k, v, *, mask, inputs=None, deterministic=True):
    del inputs
    config = self.config
    use_dropout = config.attention_dropout and self.dims.dropout_rate > 0.0 and not deterministic
    out = nystrom_attention(q, k, v, num_landmarks=config.num_landmarks,
                            pinv_iters=config.pinv_iters, nm=config.n_m, mask=mask,
                            dropout_rate=self.dims.dropout_rate if use_dropout else 0.0,
                            dropout_rng=self.make_rng("dropout") if use_dropout else None,
                            implementation=config.implementation,
                            mask_holes=config.mask_holes)
    if config.conv_kernel:
      out = add_conv_skip(self, "conv_kernel", config.conv_kernel, v, mask, out)
    return out


def add_conv_skip(module: nn.Module, name: str, size: int, v, mask, out):
  """``out`` + the conv skip: a per-head depthwise conv of size ``size`` over the length axis
  of V (padded keys zeroed), its kernel the parameter ``name`` of ``module`` ([size, heads],
  PyTorch's default Conv2d init U(-1/sqrt(K), 1/sqrt(K)) as Nystromformer's code). Call from
  ``module``'s compact ``__call__``."""
  bound = size ** -0.5
  init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
  kernel = module.param(name, init, (size, v.shape[2]), jnp.float32)
  real = (jnp.ones(v.shape[:2], bool) if mask is None else mask)[:, :, None, None]
  return depthwise_length_conv(jnp.where(real, v, 0), kernel, residual=out)


@register_attention("nystrom", NystromConfig)
def _build_nystrom(config: NystromConfig, dims: AttentionDims) -> nn.Module:
  """Checks config.attention.nystrom against the model's sizes."""
  if config.num_landmarks > dims.length:
    raise config.error("num_landmarks", f"must be <= the sequence length {dims.length}")
  if dims.dropout_rate > 0.0 and not config.attention_dropout:
    common.warn_once(f"Nystromformer: no attention dropout, as in the official code "
                     f"(config.model.attention_dropout_rate={dims.dropout_rate} acts on the other "
                     f"kinds); config.attention.nystrom.attention_dropout=True applies it to F "
                     f"and B")
  return NystromAttention(dims=dims, config=config)
