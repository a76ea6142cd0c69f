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

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from lra_sparse.attention.dfss import masked_softmax
from lra_sparse.attention.nm import check_nm, nm_mask
from lra_sparse.attention.registry import AttentionDims, register_attention


def parse_nm(nm: Optional[str]) -> Optional[Tuple[int, int]]:
  """"" / None -> None; "n:m" -> (n, m) with 0 < n < m; anything else -> ValueError."""
  if nm is None or nm == "":
    return None
  parts = str(nm).split(":")
  if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
    raise ValueError(f"nm={nm!r} must be '' or 'n:m' with integers, e.g. '2:4'")
  n, m = int(parts[0]), int(parts[1])
  if not 0 < n < m:
    raise ValueError(f"nm={nm!r} needs 0 < n < m")
  return n, m


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
  if nm is not None:
    keep = nm_mask(logits, *nm)
  else:
    keep = jnp.isfinite(logits)
  return masked_softmax(jnp.where(keep, logits, -jnp.inf), keep)


def _dropout(probs, rate, rng):
  if rate <= 0.0 or rng is None:
    return probs
  keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
  return jnp.where(keep, probs / (1.0 - rate), 0.0)


def nystrom_attention(q, k, v, *, num_landmarks: int, pinv_iters: int = 6, nm=None, mask=None,
                      dropout_rate: float = 0.0, dropout_rng=None):
  """Nystrom attention WITHOUT the conv skip (the core adds it). q, k, v: [batch, length,
  heads, head_dim]; mask: bool [batch, length] (True = real). ``nm``: None / "" or "n:m" (or an
  (n, m) tuple) for Nystrom+DFSS; num_landmarks must then be a multiple of m. Dropout, when
  given, applies to the probability matrices F and B.
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
  if isinstance(nm, tuple):
    check_nm(*nm, what="nystrom_attention nm")
    if nm[0] >= nm[1]:
      raise ValueError(f"nystrom_attention: nm={nm} needs n < m")
  else:
    nm = parse_nm(nm)
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
    kernel_f = _dropout(kernel_f, dropout_rate, rng_f)
    kernel_b = _dropout(kernel_b, dropout_rate, rng_b)
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
  num_landmarks: int = 64
  pinv_iters: int = 6
  conv_kernel: int = 35
  nm: str = ""

  @nn.compact
  def __call__(self, q, k, v, *, mask, inputs=None, deterministic=True):
    del inputs
    use_dropout = self.dims.dropout_rate > 0.0 and not deterministic
    out = nystrom_attention(q, k, v, num_landmarks=self.num_landmarks,
                            pinv_iters=self.pinv_iters, nm=self.nm, mask=mask,
                            dropout_rate=self.dims.dropout_rate if use_dropout else 0.0,
                            dropout_rng=self.make_rng("dropout") if use_dropout else None)
    if self.conv_kernel:
      # PyTorch's default Conv2d init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = K.
      bound = self.conv_kernel ** -0.5
      init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
      kernel = self.param("conv_kernel", init, (self.conv_kernel, self.dims.num_heads),
                          jnp.float32)
      real = (jnp.ones(v.shape[:2], bool) if mask is None else mask)[:, :, None, None]
      skip = depthwise_length_conv(jnp.where(real, v, 0).astype(jnp.float32), kernel)
      out = (out.astype(jnp.float32) + skip).astype(q.dtype)
    return out


@register_attention("nystrom")
def _build_nystrom(config, dims: AttentionDims) -> nn.Module:
  """Validates config.attention.{num_landmarks, pinv_iters, conv_kernel, nm} against dims."""
  num_landmarks = config.get("num_landmarks", 64)
  pinv_iters = config.get("pinv_iters", 6)
  conv_kernel = config.get("conv_kernel", 35)
  nm = config.get("nm", "")
  if isinstance(num_landmarks, bool) or not isinstance(num_landmarks, int) or not (
      0 < num_landmarks <= dims.length):
    raise ValueError(f"config.attention.num_landmarks={num_landmarks!r} must be an integer in "
                     f"[1, sequence length {dims.length}]")
  if isinstance(pinv_iters, bool) or not isinstance(pinv_iters, int) or pinv_iters < 1:
    raise ValueError(f"config.attention.pinv_iters={pinv_iters!r} must be an integer >= 1")
  if (isinstance(conv_kernel, bool) or not isinstance(conv_kernel, int) or conv_kernel < 0
      or (conv_kernel and conv_kernel % 2 == 0)):
    raise ValueError(f"config.attention.conv_kernel={conv_kernel!r} must be 0 (no conv skip) "
                     f"or an odd positive integer")
  try:
    parsed = parse_nm(nm)
  except ValueError as error:
    raise ValueError(f"config.attention.{error}") from None
  if parsed is not None and num_landmarks % parsed[1]:
    raise ValueError(f"config.attention.num_landmarks={num_landmarks} must be a multiple of "
                     f"m={parsed[1]} from config.attention.nm={nm!r}")
  return NystromAttention(dims=dims, num_landmarks=num_landmarks, pinv_iters=pinv_iters,
                          conv_kernel=conv_kernel, nm=nm or "")
