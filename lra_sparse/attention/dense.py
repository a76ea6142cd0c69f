"""Dense softmax attention: softmax(Q K^T / sqrt(d) + padding) V.

Attention dropout runs through the explicit formulation (XLA): ``jax.nn.dot_product_attention``,
the supported JAX entry to cuDNN's fused attention, has no dropout argument.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import flax.linen as nn

from lra_sparse.attention import common
from lra_sparse.attention.registry import (AttentionDims, KindConfig, derived,
                                           register_attention)
from lra_sparse.kernels.shared.prologue import zero_pad_head_dim
from lra_sparse.ops import softmax

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "cudnn_bias", "reference")


@dataclasses.dataclass(frozen=True)
class DenseConfig(KindConfig):
  """``config.attention.dense``."""
  KIND = "dense"
  # auto: cuDNN on a GPU for half precision (as "cudnn", or as "cudnn_bias" when mask_holes),
  # else XLA | xla | cudnn (key padding as sequence lengths: padding at the end of each row) |
  # cudnn_bias (any key mask, as an additive [batch, 1, L, L] bias: holes allowed, L^2 bias
  # memory per example) | reference (explicit einsum/softmax; also what attention dropout
  # runs through)
  implementation: str = "auto"
  # The task's key masks may have holes (pixel tasks masking black pixels). Set by the model
  # builder from the task (lra_sparse.models.attention_for_masks), not by hand.
  mask_holes: bool = derived(False)

  def __post_init__(self):
    self.check_choice("implementation", IMPLEMENTATIONS)
    self.check_bool("mask_holes")


CUDNN_HEAD_DIM_MULTIPLE = 8   # cuDNN's fused attention needs head_dim % 8 == 0
def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def cudnn_attention(q, k, v, mask=None, *, any_mask: bool = False):
  """cuDNN flash attention; q may have another length than k and v; mask: bool [batch,
  k_len], real keys first, given to cuDNN as sequence lengths (so padded keys cost no work);
  with ``any_mask`` the mask may have holes and goes in as an additive bias instead (cuDNN
  takes a bias only at full [batch, 1, q_len, k_len], no broadcast over queries: L^2 bias
  memory per example; a masked key's bias is JAX's own large negative for cuDNN masks,
  -2^41 in bf16 and -2^15 in fp16, finite, so a row with no real key averages all values, as
  XLA's masked path does). A head dim that is not a multiple of 8 (LRA Pathfinder-32 has 4)
  is zero-padded to one, with the softmax scale of the true head dim: the padded q/k columns
  add 0 to every score and the padded v columns are sliced off, so the result is exact."""
  head_dim = q.shape[-1]
  padded = -(-head_dim // CUDNN_HEAD_DIM_MULTIPLE) * CUDNN_HEAD_DIM_MULTIPLE
  if padded != head_dim:
    q, k, v = (zero_pad_head_dim(x, padded) for x in (q, k, v))
  if any_mask and mask is not None:
    masked = -float(2**15) if q.dtype == jnp.float16 else -float(2**41)
    bias = jnp.where(mask, 0.0, masked).astype(q.dtype)[:, None, None, :]
    padding = {"bias": jax.lax.stop_gradient(
        jnp.broadcast_to(bias, (q.shape[0], 1, q.shape[1], k.shape[1])))}
  else:  # cuDNN refuses a broadcast [B,1,1,L] mask: key padding goes in as sequence lengths
    padding = {"key_value_seq_lengths":
               None if mask is None else jnp.sum(mask, axis=-1, dtype=jnp.int32)}
  out = jax.nn.dot_product_attention(q, k, v, scale=head_dim ** -0.5, implementation="cudnn",
                                     **padding)
  return out[..., :head_dim]


def dense_attention_reference(q, k, v, mask=None, *, dropout_rate=0.0, dropout_rng=None):
  """Explicit formulation (used for attention dropout and as the test reference)."""
  probs = softmax.masked_softmax(softmax.attention_scores(q, k, mask))
  probs = softmax.dropout_probabilities(probs, dropout_rate, dropout_rng)
  return softmax.attend(probs, v)


def dense_attention(q, k, v, mask=None, *, implementation: str = "auto",
                    mask_holes: bool = False):
  """Dense attention with the semantics of ``jax.nn.dot_product_attention``.

  q, k, v: ``[batch, length, heads, head_dim]``; mask: bool ``[batch, length]`` key padding
  (True = real token). ``implementation``: "xla", "cudnn" (GPU, bf16/fp16; padding must sit at
  the end of each row, as the text loaders produce), "cudnn_bias" (GPU, bf16/fp16; any mask,
  holes included, as an [batch, 1, L, L] bias), "reference" (explicit einsum/softmax, safe
  for fully padded rows), or "auto" (cuDNN on a GPU for half precision, else XLA; with
  ``mask_holes`` cuDNN takes the mask as "cudnn_bias" does, else as "cudnn" does).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown dense attention implementation {implementation!r}; "
                     f"choose one of {IMPLEMENTATIONS}")
  if q.ndim != 4 or k.shape != q.shape[:1] + k.shape[1:] or v.shape[:-1] != k.shape[:-1]:
    raise ValueError(f"q, k, v must be [batch, length, heads, head_dim]; got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  if mask is not None and mask.shape != k.shape[:2]:
    raise ValueError(f"mask must be bool [batch, length] = {k.shape[:2]}, got {mask.shape}")
  if implementation == "reference":
    return dense_attention_reference(q, k, v, mask)
  if implementation in ("cudnn", "cudnn_bias"):
    return cudnn_attention(q, k, v, mask, any_mask=implementation == "cudnn_bias")
  if implementation == "auto" and _on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16):
    try:
      return cudnn_attention(q, k, v, mask, any_mask=mask_holes)
    except Exception as error:  # noqa: BLE001  cuDNN refuses at trace time: XLA runs it
      common.warn_once(f"dense attention: cuDNN cannot run q {q.shape} {q.dtype} "
                 f"({str(error).splitlines()[0][:120]}); using XLA")
  bias_mask = None if mask is None else mask[:, None, None, :]
  return jax.nn.dot_product_attention(q, k, v, mask=bias_mask, implementation="xla")


class DenseAttention(nn.Module):
  """Attention core for ``config.attention.kind = "dense"``."""
  dims: AttentionDims
  config: DenseConfig = DenseConfig()

  @nn.compact
  def __call__(self, q, k, v, *, mask, inputs=None, deterministic=True):
    del inputs
    if self.dims.dropout_rate > 0.0 and not deterministic:
      implementation = self.config.implementation
      if implementation in ("cudnn", "cudnn_bias"):
        raise ValueError(
            f"config.attention.dense.implementation={implementation!r} cannot apply attention "
            f"dropout (model.attention_dropout_rate={self.dims.dropout_rate}): cuDNN has none "
            "through JAX's API; use implementation='auto' (XLA while training with dropout) "
            "or attention_dropout_rate=0")
      if implementation == "auto" and _on_gpu():
        common.warn_once("dense attention: attention dropout runs on XLA's explicit attention "
                         "(cuDNN has no dropout through JAX); evaluation stays on cuDNN")
      return dense_attention_reference(q, k, v, mask, dropout_rate=self.dims.dropout_rate,
                                       dropout_rng=self.make_rng("dropout"))
    return dense_attention(q, k, v, mask, implementation=self.config.implementation,
                           mask_holes=self.config.mask_holes)


@register_attention("dense", DenseConfig)
def _build_dense(config: DenseConfig, dims: AttentionDims) -> nn.Module:
  return DenseAttention(dims=dims, config=config)
