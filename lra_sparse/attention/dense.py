"""Dense softmax attention: softmax(Q K^T / sqrt(d) + padding) V.

Paths: cuDNN's flash attention (``jax.nn.dot_product_attention``), the Mosaic GPU flash kernels
of ``kernels.dfss.mosaic`` with nothing pruned (Hopper, bf16/fp16: attention dropout and key
masks with holes, both of which JAX's cuDNN entry lacks or takes only as an [L, L] bias), the
fused Triton kernels of ``kernels.dfss.triton`` at 1:1 (any GPU, float32 included: LRA's
protocol trains in float32 with attention dropout, which neither cuDNN nor the Mosaic kernels
run), and XLA's explicit attention (everywhere). Attention dropout draws the counter-based mask
of ``ops.dropout`` on every path that has it, so the kernels and XLA drop the same entries for
the same rng.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import flax.linen as nn

from lra_sparse.attention import common
from lra_sparse.attention.registry import (AttentionDims, KindConfig, derived,
                                           register_attention)
from lra_sparse.kernels.dfss import mosaic as mosaic_kernels
from lra_sparse.kernels.dfss import triton as triton_kernels
from lra_sparse.kernels.shared.prologue import zero_pad_head_dim
from lra_sparse.ops import dropout, sharding, softmax

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "cudnn_bias", "mosaic", "triton", "reference")


@dataclasses.dataclass(frozen=True)
class DenseConfig(KindConfig):
  """``config.attention.dense``."""
  KIND = "dense"
  # auto: on a GPU in half precision, the Mosaic GPU kernels (Hopper) while training with
  # attention dropout or when mask_holes, else cuDNN (as "cudnn", or "cudnn_bias" with holes
  # off Hopper); on a GPU in float32, the Triton kernels (training and evaluation); XLA
  # otherwise | xla | cudnn (key padding as sequence lengths: padding at the end of each row;
  # no dropout) | cudnn_bias (any key mask, as an additive [batch, 1, L, L] bias: L^2 bias
  # memory per example; no dropout) | mosaic (Hopper, bf16/fp16: any key mask, dropout) |
  # triton (any GPU with triton, fp32/bf16/fp16: any key mask, dropout) | reference
  # (explicit einsum/softmax, XLA; what attention dropout runs through where no kernel does)
  implementation: str = "auto"
  # The task's key masks may have holes (pixel tasks masking black pixels). Set by the model
  # builder from the task (lra_sparse.models.attention_for_masks), not by hand.
  mask_holes: bool = derived(False)
  # The Triton and Mosaic GPU kernels' backward: False = dQ summed with fp32 atomics (fastest;
  # dQ's last bits, and so a run, vary from run to run at a fixed seed; Mosaic: head dims up to
  # 64) | True = separate dK/dV and dQ kernels (bit-reproducible runs). The other paths
  # (cuDNN, XLA) are deterministic either way.
  deterministic_kernels: bool = False

  def __post_init__(self):
    self.check_choice("implementation", IMPLEMENTATIONS)
    self.check_bool("mask_holes")
    self.check_bool("deterministic_kernels")


CUDNN_HEAD_DIM_MULTIPLE = 8   # cuDNN's fused attention needs head_dim % 8 == 0
def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _half(q) -> bool:
  return q.dtype in (jnp.bfloat16, jnp.float16)


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
  """Explicit formulation (XLA; attention dropout by ``ops.dropout``'s mask; the test
  reference)."""
  probs = softmax.masked_softmax(softmax.attention_scores(q, k, mask))
  probs = softmax.dropout_probabilities(probs, dropout_rate, dropout_rng)
  return softmax.attend(probs, v)


def _mosaic_module(required: bool):
  return common.usable_kernel(mosaic_kernels, "dense", required, backend="mosaic")


def _per_shard(kernel, q, k, v, mask, dropout_rate, dropout_rng, **options):
  """``kernel(q, k, v, mask=, dropout_rate=, dropout_seed=, **options)`` once per data shard;
  attention dropout (rate > 0 with an rng) by ``ops.dropout``'s mask for the seed
  ``dropout.seed_words(rng)``, as ``dense_attention_reference`` draws it."""
  use_dropout = dropout_rate > 0.0 and dropout_rng is not None
  seed = dropout.seed_words(dropout_rng) if use_dropout else None

  def kernel_call(q, k, v, mask, seed):
    return kernel(q, k, v, mask=mask, dropout_rate=dropout_rate if use_dropout else 0.0,
                  dropout_seed=sharding.shard_dropout_seed(seed), **options)

  return sharding.per_data_shard(kernel_call, q, k, v, mask, seed, replicated=(4,))


def mosaic_attention(q, k, v, mask=None, *, dropout_rate: float = 0.0, dropout_rng=None,
                     deterministic: bool = False):
  """Dense attention on the Mosaic GPU kernels (``dense_attention_mgpu``), once per data
  shard, with attention dropout as ``_per_shard`` draws it; ``deterministic``: the backward
  without atomics."""
  return _per_shard(mosaic_kernels.dense_attention_mgpu, q, k, v, mask, dropout_rate,
                    dropout_rng, deterministic=deterministic)


def _triton_module(required: bool):
  return common.usable_kernel(triton_kernels, "dense", required, backend="triton")


def triton_attention(q, k, v, mask=None, *, dropout_rate: float = 0.0, dropout_rng=None,
                     deterministic: bool = False):
  """Dense attention on the fused Triton kernels (``dense_attention_triton``: DFSS at 1:1),
  once per data shard, with attention dropout as ``_per_shard`` draws it; ``deterministic``:
  the backward without atomics."""
  return _per_shard(triton_kernels.dense_attention_triton, q, k, v, mask, dropout_rate,
                    dropout_rng, deterministic=deterministic)


def _triton_runs(q, k, v) -> bool:
  """True when 'auto' can put this float32 call on the Triton kernels (logs once why not)."""
  if not _on_gpu() or _triton_module(required=False) is None:
    return False
  reason = triton_kernels.unsupported_reason(q, v, 1, 1, k=k)
  if reason:
    common.warn_once(f"dense attention 'auto': the Triton kernels cannot run q {q.shape} "
                     f"{q.dtype} ({reason}); using XLA")
  return not reason


def _mosaic_runs(q, k, v) -> bool:
  """True when 'auto' can put this call on the Mosaic GPU kernels (logs once why not)."""
  if not _on_gpu() or _mosaic_module(required=False) is None:
    return False
  reason = mosaic_kernels.dense_unsupported_reason(q, v, k=k)
  if reason:
    common.warn_once(f"dense attention 'auto': the Mosaic GPU kernels cannot run q {q.shape} "
                     f"{q.dtype} ({reason}); using XLA for dropout and masks with holes")
  return not reason


def _check_operands(q, k, v, mask):
  if q.ndim != 4 or k.shape != q.shape[:1] + k.shape[1:] or v.shape[:-1] != k.shape[:-1]:
    raise ValueError(f"q, k, v must be [batch, length, heads, head_dim]; got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  if mask is not None and mask.shape != k.shape[:2]:
    raise ValueError(f"mask must be bool [batch, length] = {k.shape[:2]}, got {mask.shape}")


def dense_attention(q, k, v, mask=None, *, implementation: str = "auto",
                    mask_holes: bool = False, dropout_rate: float = 0.0, dropout_rng=None,
                    deterministic_kernels: bool = False):
  """Dense attention with the semantics of ``jax.nn.dot_product_attention``, and attention
  dropout (rate > 0 with an rng) by ``ops.dropout``'s mask.

  q, k, v: ``[batch, length, heads, head_dim]``; mask: bool ``[batch, length]`` key padding
  (True = real token). ``implementation``: "xla", "cudnn" (GPU, bf16/fp16; padding must sit at
  the end of each row, as the text loaders produce), "cudnn_bias" (GPU, bf16/fp16; any mask,
  holes included, as an [batch, 1, L, L] bias), "mosaic" (Hopper, bf16/fp16; any mask,
  dropout), "triton" (GPU, fp32/bf16/fp16; any mask, dropout), "reference" (explicit
  einsum/softmax, safe for fully padded rows), or "auto" (on a GPU in half precision: Mosaic
  GPU with dropout or ``mask_holes`` where it runs, else cuDNN; on a GPU in float32: Triton;
  XLA otherwise). cuDNN has no dropout: asking for it with dropout is an error. A fully
  padded row gives zeros on the kernels, the mean of the values on XLA.
  ``deterministic_kernels``: the Triton and Mosaic paths' backward without atomics
  (bit-reproducible).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown dense attention implementation {implementation!r}; "
                     f"choose one of {IMPLEMENTATIONS}")
  _check_operands(q, k, v, mask)
  use_dropout = dropout_rate > 0.0 and dropout_rng is not None
  if use_dropout:
    dropout.threshold(dropout_rate)   # one clear error for a rate outside [0, 1)
  if implementation == "mosaic":
    _mosaic_module(required=True)
    reason = mosaic_kernels.dense_unsupported_reason(q, v, k=k)
    if reason:
      raise ValueError(f"dense attention: implementation='mosaic' cannot run this call: "
                       f"{reason}; use 'auto' or 'xla'")
    return mosaic_attention(q, k, v, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            deterministic=deterministic_kernels)
  if implementation == "triton":
    _triton_module(required=True)
    reason = triton_kernels.unsupported_reason(q, v, 1, 1, k=k)
    if reason:
      raise ValueError(f"dense attention: implementation='triton' cannot run this call: "
                       f"{reason}; use 'auto' or 'xla'")
  if implementation == "triton" or (implementation == "auto" and not _half(q)
                                    and _triton_runs(q, k, v)):
    return triton_attention(q, k, v, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                            deterministic=deterministic_kernels)
  if use_dropout:
    if implementation in ("cudnn", "cudnn_bias"):
      raise ValueError(
          f"dense attention implementation={implementation!r} cannot apply attention dropout "
          f"(rate {dropout_rate}): cuDNN has none through JAX's API; use 'auto' (the Mosaic GPU "
          "kernels on Hopper, else XLA), 'mosaic' or 'xla', or attention_dropout_rate=0")
    if implementation == "auto" and _half(q) and _mosaic_runs(q, k, v):
      return mosaic_attention(q, k, v, mask, dropout_rate=dropout_rate,
                              dropout_rng=dropout_rng, deterministic=deterministic_kernels)
    return dense_attention_reference(q, k, v, mask, dropout_rate=dropout_rate,
                                     dropout_rng=dropout_rng)
  if implementation == "reference":
    return dense_attention_reference(q, k, v, mask)
  if implementation in ("cudnn", "cudnn_bias"):
    return cudnn_attention(q, k, v, mask, any_mask=implementation == "cudnn_bias")
  if implementation == "auto" and _on_gpu() and _half(q):
    if mask_holes and mask is not None and _mosaic_runs(q, k, v):
      return mosaic_attention(q, k, v, mask, deterministic=deterministic_kernels)
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
    use_dropout = self.dims.dropout_rate > 0.0 and not deterministic
    return dense_attention(q, k, v, mask, implementation=self.config.implementation,
                           mask_holes=self.config.mask_holes,
                           dropout_rate=self.dims.dropout_rate if use_dropout else 0.0,
                           dropout_rng=self.make_rng("dropout") if use_dropout else None,
                           deterministic_kernels=self.config.deterministic_kernels)


@register_attention("dense", DenseConfig)
def _build_dense(config: DenseConfig, dims: AttentionDims) -> nn.Module:
  if config.implementation == "mosaic":
    _mosaic_module(required=True)
  if config.implementation == "triton":
    _triton_module(required=True)
  return DenseAttention(dims=dims, config=config)
