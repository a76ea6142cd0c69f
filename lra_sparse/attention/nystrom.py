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
sequence is padded at the end with masked tokens (the official code requires divisibility), and
``num_landmarks == L`` still runs the Nystrom approximation (the official code switches to
exact softmax there). Everything is computed in float32, as the official code does under AMP.

Nystrom + DFSS (``nm="n:m"``): the two non-square softmax matrices F and B are N:M-pruned along
their last axis (landmarks for F, keys for B) before their softmax, as DFSS stores them under
1:2 / 2:4 sparsity; A is kept dense.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import flax.linen as nn

from lra_sparse.attention import common
from lra_sparse.attention.nm import nm_mask, parse_nm
from lra_sparse.attention.registry import AttentionDims, KindConfig, register_attention


@dataclasses.dataclass(frozen=True)
class NystromConfig(KindConfig):
  """``config.attention.nystrom``."""
  KIND = "nystrom"
  num_landmarks: int = 64
  pinv_iters: int = 6              # iterations of the Moore-Penrose pseudo-inverse
  conv_kernel: int = 35            # depthwise conv skip on V over the length axis; 0 = none
  nm: str = ""                     # "" (plain Nystromformer) or "n:m": DFSS on F and B

  def __post_init__(self):
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


def iterative_pinv(matrix, iters: int = 6):
  """Moore-Penrose pseudo-inverse of [..., m, m] by the Nystromformer iteration."""
  identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  magnitude = jnp.abs(matrix)
  max_col_sum = jnp.max(jnp.sum(magnitude, axis=-2))
  max_row_sum = jnp.max(jnp.sum(magnitude, axis=-1))
  z = jnp.swapaxes(matrix, -1, -2) / (max_col_sum * max_row_sum)
  for _ in range(iters):
    az = matrix @ z
    z = 0.25 * z @ (13 * identity - az @ (15 * identity - az @ (7 * identity - az)))
  return z


def _softmax(logits, nm):
  """Softmax over the last axis, optionally over the N:M-kept entries only (-inf = excluded)."""
  if nm is None:
    return common.masked_softmax(logits)
  keep = nm_mask(logits, *nm)
  return common.masked_softmax(jnp.where(keep, logits, -jnp.inf), keep)


def nystrom_attention(q, k, v, *, num_landmarks: int, pinv_iters: int = 6,
                      nm: Union[None, str, tuple[int, int]] = None, mask=None,
                      dropout_rate: float = 0.0, dropout_rng=None):
  """Nystrom attention WITHOUT the conv skip (the core adds it). q, k, v: [batch, length,
  heads, head_dim]; mask: bool [batch, length] (True = real). ``nm``: None / "" (plain) or
  "n:m" / an (n, m) pair for Nystrom+DFSS; num_landmarks must then be a multiple of m.
  Dropout, when given, applies to the probability matrices F and B.
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

  # [batch, heads, length, dim] in float32, padded tokens zeroed, scaled by d^(-1/4) each.
  to_heads = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)
  real = mask[:, None, :, None].astype(jnp.float32)
  scale = jnp.float32(head_dim ** -0.25)
  qh, kh, vh = to_heads(q) * real * scale, to_heads(k) * real * scale, to_heads(v)
  key_mask = mask
  padded = -(-length // num_landmarks) * num_landmarks
  if padded != length:
    pad = ((0, 0), (0, 0), (0, padded - length), (0, 0))
    qh, kh, vh = jnp.pad(qh, pad), jnp.pad(kh, pad), jnp.pad(vh, pad)
    key_mask = jnp.pad(mask, ((0, 0), (0, padded - length)))

  segments = lambda x: x.reshape(batch, heads, num_landmarks, padded // num_landmarks,
                                 head_dim).mean(axis=3)
  q_land, k_land = segments(qh), segments(kh)
  kernel_f = _softmax(jnp.einsum("bhld,bhmd->bhlm", qh, k_land), nm)           # [L x m]
  kernel_a = _softmax(jnp.einsum("bhnd,bhmd->bhnm", q_land, k_land), None)     # [m x m]
  logits_b = jnp.einsum("bhmd,bhld->bhml", q_land, kh)
  logits_b = jnp.where(key_mask[:, None, None, :], logits_b, -jnp.inf)
  kernel_b = _softmax(logits_b, nm)                                             # [m x L]
  if dropout_rate > 0.0 and dropout_rng is not None:
    rng_f, rng_b = jax.random.split(dropout_rng)
    kernel_f = common.dropout_probabilities(kernel_f, dropout_rate, rng_f)
    kernel_b = common.dropout_probabilities(kernel_b, dropout_rate, rng_b)
  out = kernel_f @ (iterative_pinv(kernel_a, pinv_iters) @ (kernel_b @ vh))
  return jnp.swapaxes(out[:, :, :length], 1, 2).astype(q.dtype)


def depthwise_length_conv(values, kernel):
  """Per-head conv over the length axis, shared across head_dim (official Conv2d with
  groups=heads, kernel (K, 1), padding K // 2, no bias). values [b, L, h, d]; kernel [K, h]."""
  batch, length, heads, dim = values.shape
  size = kernel.shape[0]
  channels = jnp.repeat(kernel.astype(values.dtype), dim, axis=1)      # [K, h * d], head-major
  out = jax.lax.conv_general_dilated(
      values.reshape(batch, length, heads * dim), channels[:, None, :],
      window_strides=(1,), padding=[(size // 2, size // 2)],
      dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=heads * dim)
  return out.reshape(batch, length, heads, dim)


class NystromAttention(nn.Module):
  """Attention core for ``config.attention.kind = "nystrom"`` (+ DFSS with ``nm``)."""
  dims: AttentionDims
  config: NystromConfig = NystromConfig()

  @nn.compact
  def __call__(self, q, k, v, *, mask, inputs=None, deterministic=True):
    del inputs
    config = self.config
    use_dropout = self.dims.dropout_rate > 0.0 and not deterministic
    out = nystrom_attention(q, k, v, num_landmarks=config.num_landmarks,
                            pinv_iters=config.pinv_iters, nm=config.n_m, mask=mask,
                            dropout_rate=self.dims.dropout_rate if use_dropout else 0.0,
                            dropout_rng=self.make_rng("dropout") if use_dropout else None)
    if config.conv_kernel:
      # PyTorch's default Conv2d init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = K.
      bound = config.conv_kernel ** -0.5
      init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
      kernel = self.param("conv_kernel", init, (config.conv_kernel, self.dims.num_heads),
                          jnp.float32)
      real = (jnp.ones(v.shape[:2], bool) if mask is None else mask)[:, :, None, None]
      skip = depthwise_length_conv(jnp.where(real, v, 0).astype(jnp.float32), kernel)
      out = (out.astype(jnp.float32) + skip).astype(q.dtype)
    return out


@register_attention("nystrom", NystromConfig)
def _build_nystrom(config: NystromConfig, dims: AttentionDims) -> nn.Module:
  """Checks config.attention.nystrom against the model's sizes."""
  if config.num_landmarks > dims.length:
    raise config.error("num_landmarks", f"must be <= the sequence length {dims.length}")
  return NystromAttention(dims=dims, config=config)
