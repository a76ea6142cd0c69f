"""The LRA transformer encoder (Flax Linen) with a pluggable attention core.

Follows google-research/long-range-arena's transformer_base: token embedding (initialised
normal(stddev=1.0), as LRA), position embeddings (fixed sinusoidal, or learned where LRA's task
config learns them: ``config.model.pos_emb``; or "rotary", q and k rotated by position in every
layer, not in LRA), optionally a depthwise conv on V along the sequence added to every
attention output (``config.model.value_conv_kernel``: Nystromformer's conv skip offered to every
kind; not in LRA), pre-LayerNorm blocks (attention, MLP) with dropout, final LayerNorm, CLS or
mean pooling (or, for the denoising objective, the features of every token position).

Parameters start as LRA's (``models/transformer/transformer.py``,
``models/layers/common_layers.py``): q/k/v/out projections without bias and with
xavier_uniform kernels, MLP kernels xavier_uniform with biases N(0, 1e-6), the CLS token zeros,
the classifier head in float32. Each is one ``config.model`` field away from this codebase's
earlier choices (``attention_bias``, ``kernel_init``, ``mlp_bias_init_std``, ``cls_init_std``,
``float32_head``); runs recorded before the fields existed read them back with the earlier
values (``lra_sparse.config.ADDED_FIELDS``). LRA_DIFFERENCES.md lists every remaining
difference from LRA's code.

Masking: a token equal to ``pad_id`` is masked as a key in every layer and left out of mean
pooling (the mean is over the kept positions; a row with none pools to zeros, never NaN).
Pixel tasks mask black pixels this way by default, as LRA's ``inputs > 0``
(``lra_sparse.data.common``). LRA also masks padded queries; a padded query's output never
reaches a real position (it is masked as a key everywhere, and CLS and mean pooling read real
positions only), so masking keys alone gives the same logits.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import flax.linen as nn

from lra_sparse.attention import AttentionDims, build_attention
from lra_sparse.attention.nystrom import add_conv_skip

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
POS_EMBS = ("sinusoidal", "learned", "rotary")
# config.model.kernel_init of the q/k/v/out projections and the MLP: LRA's xavier_uniform, or
# lecun_normal (Flax's Dense default, this codebase's choice before it followed LRA).
KERNEL_INITS = {"xavier_uniform": nn.initializers.xavier_uniform,
                "lecun_normal": nn.initializers.lecun_normal}


def kernel_init(model_config):
  return KERNEL_INITS[model_config.kernel_init]()


def normal_or_zeros(stddev: float):
  """N(0, stddev^2), or zeros for stddev 0."""
  return nn.initializers.normal(stddev) if stddev > 0 else nn.initializers.zeros


def sinusoidal_positions(length: int, dim: int) -> np.ndarray:
  """LRA's fixed position table [1, length, dim] (float32): even features sin(p * w_i), odd
  features cos(p * w_i), w_i = 10000^(-2i / dim) (``dim`` must be even)."""
  position = np.arange(length, dtype=np.float64)[:, None]
  frequency = np.exp(np.arange(0, dim, 2) * -(np.log(10000.0) / dim))
  table = np.zeros((length, dim), np.float64)
  table[:, 0::2] = np.sin(position * frequency)
  table[:, 1::2] = np.cos(position * frequency)
  return table[None].astype(np.float32)


def rotary(x, positions, base: float = 10000.0):
  """Rotary position embedding (Su et al., RoFormer; what Amos et al. pretrain with):
  x [batch, length, heads, head_dim] (head_dim even), each pair (x_i, x_{i + d/2}) rotated by
  the angle position * base^(-2i/d). q.k of two rotated vectors depends on their positions'
  difference only."""
  half = x.shape[-1] // 2
  freqs = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
  angles = jnp.asarray(positions, jnp.float32)[:, None] * freqs[None, :]     # [length, half]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def compute_dtype(model_config) -> Any:
  if model_config.dtype not in DTYPES:
    raise ValueError(f"config.model.dtype={model_config.dtype!r}; choose one of {list(DTYPES)}")
  return DTYPES[model_config.dtype]


def head_dtype(model_config) -> Any:
  """The classifier head's compute dtype: float32 (LRA, ``float32_head``) or the model's."""
  return jnp.float32 if model_config.float32_head else compute_dtype(model_config)


def padded_length(max_length: int, model_config) -> int:
  """Sequence length inside the encoder: tokens (+ CLS), rounded up to ``pad_multiple``."""
  length = max_length + (1 if model_config.pooling == "cls" else 0)
  multiple = max(1, int(model_config.pad_multiple))
  return -(-length // multiple) * multiple


def validate_model_config(model_config) -> None:
  mc = model_config
  if mc.qkv_dim % mc.num_heads:
    raise ValueError(f"config.model.num_heads={mc.num_heads} must divide "
                     f"config.model.qkv_dim={mc.qkv_dim}")
  if mc.pooling not in ("cls", "mean"):
    raise ValueError(f"config.model.pooling={mc.pooling!r}; choose 'cls' or 'mean'")
  for name in ("num_layers", "num_heads", "emb_dim", "qkv_dim", "mlp_dim", "classifier_dim"):
    if int(mc[name]) <= 0:
      raise ValueError(f"config.model.{name}={mc[name]} must be positive")
  for name in ("dropout_rate", "attention_dropout_rate"):
    if not 0.0 <= mc[name] < 1.0:
      raise ValueError(f"config.model.{name}={mc[name]} must be in [0, 1)")
  if mc.kernel_init not in KERNEL_INITS:
    raise ValueError(f"config.model.kernel_init={mc.kernel_init!r}; choose one of "
                     f"{list(KERNEL_INITS)}")
  for name in ("attention_bias", "float32_head"):
    if not isinstance(mc[name], bool):
      raise ValueError(f"config.model.{name}={mc[name]!r} must be True or False")
  for name in ("mlp_bias_init_std", "cls_init_std"):
    if isinstance(mc[name], bool) or not isinstance(mc[name], (int, float)) or mc[name] < 0:
      raise ValueError(f"config.model.{name}={mc[name]!r} must be a number >= 0 "
                       "(0 = zeros)")
  if mc.pos_emb not in POS_EMBS:
    raise ValueError(f"config.model.pos_emb={mc.pos_emb!r}; choose one of {POS_EMBS}")
  if mc.pos_emb == "rotary" and (mc.qkv_dim // mc.num_heads) % 2:
    raise ValueError(f"config.model.pos_emb='rotary' rotates pairs of each head's channels: "
                     f"the head dim qkv_dim / num_heads = {mc.qkv_dim // mc.num_heads} must "
                     "be even")
  if mc.pos_emb == "sinusoidal" and mc.emb_dim % 2:
    raise ValueError(f"config.model.emb_dim={mc.emb_dim} must be even for "
                     "config.model.pos_emb='sinusoidal'")
  size = mc.get("value_conv_kernel", 0)
  if isinstance(size, bool) or not isinstance(size, int) or size < 0 or (size and size % 2 == 0):
    raise ValueError(f"config.model.value_conv_kernel={size!r} must be 0 (no conv skip) or an "
                     "odd positive int (the conv's width along the sequence)")
  compute_dtype(mc)


class MultiHeadAttention(nn.Module):
  """q/k/v/out projections around the configured attention core."""
  model_config: Any
  attention_config: Any
  length: int

  @nn.compact
  def __call__(self, x, mask, deterministic):
    mc = self.model_config
    dtype = compute_dtype(mc)
    head_dim = mc.qkv_dim // mc.num_heads
    dims = AttentionDims(num_heads=mc.num_heads, head_dim=head_dim, model_dim=mc.emb_dim,
                         length=self.length, dropout_rate=mc.attention_dropout_rate,
                         dtype=dtype)
    dense = dict(dtype=dtype, use_bias=mc.attention_bias, kernel_init=kernel_init(mc))
    project = lambda name: nn.DenseGeneral((mc.num_heads, head_dim), name=name, **dense)
    q, k, v = project("query")(x), project("key")(x), project("value")(x)
    if mc.pos_emb == "rotary":     # positions of the padded sequence (CLS at 0)
      positions = jnp.arange(x.shape[1])
      q, k = rotary(q, positions), rotary(k, positions)
    out = build_attention(self.attention_config, dims)(
        q, k, v, mask=mask, inputs=x, deterministic=deterministic)
    if mc.get("value_conv_kernel", 0):   # Nystromformer's conv skip, for any kind
      out = add_conv_skip(self, "value_conv_kernel", mc.value_conv_kernel, v, mask, out)
    return nn.DenseGeneral(mc.emb_dim, axis=(-2, -1), name="out", **dense)(out)


class EncoderBlock(nn.Module):
  model_config: Any
  attention_config: Any
  length: int

  @nn.compact
  def __call__(self, x, mask, deterministic):
    mc = self.model_config
    dtype = compute_dtype(mc)
    y = nn.LayerNorm(dtype=dtype)(x)
    y = MultiHeadAttention(mc, self.attention_config, self.length, name="attention")(
        y, mask, deterministic)
    x = x + nn.Dropout(mc.dropout_rate)(y, deterministic=deterministic)
    y = nn.LayerNorm(dtype=dtype)(x)
    mlp = dict(dtype=dtype, kernel_init=kernel_init(mc),
               bias_init=normal_or_zeros(mc.mlp_bias_init_std))
    y = nn.Dense(mc.mlp_dim, **mlp)(y)
    y = nn.gelu(y)
    y = nn.Dropout(mc.dropout_rate)(y, deterministic=deterministic)
    y = nn.Dense(mc.emb_dim, **mlp)(y)
    return x + nn.Dropout(mc.dropout_rate)(y, deterministic=deterministic)


class Encoder(nn.Module):
  """tokens int [batch, max_length] (``pad_id`` = padding) -> pooled features [batch, emb_dim]
  (``pool`` False: the final-normed features of the token positions [batch, max_length,
  emb_dim]). ``vocab_size`` is the number of embedding rows."""
  model_config: Any
  attention_config: Any
  vocab_size: int
  max_length: int
  pad_id: int = 0
  pool: bool = True

  @nn.compact
  def __call__(self, tokens, *, deterministic: bool):
    mc = self.model_config
    dtype = compute_dtype(mc)
    if tokens.ndim != 2 or tokens.shape[1] != self.max_length:
      raise ValueError(f"tokens must be [batch, {self.max_length}], got {tokens.shape}")
    length = padded_length(self.max_length, mc)
    mask = tokens != self.pad_id
    x = nn.Embed(self.vocab_size, mc.emb_dim, embedding_init=nn.initializers.normal(1.0),
                 name="embed")(tokens)
    if mc.pooling == "cls":
      cls = self.param("cls", normal_or_zeros(mc.cls_init_std), (1, 1, mc.emb_dim))
      x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, mc.emb_dim)), x], axis=1)
      mask = jnp.concatenate([jnp.ones((x.shape[0], 1), bool), mask], axis=1)
    extra = length - x.shape[1]
    x = jnp.pad(x, ((0, 0), (0, extra), (0, 0)))
    mask = jnp.pad(mask, ((0, 0), (0, extra)))
    if mc.pos_emb == "learned":
      x = x + self.param("pos_embed", nn.initializers.normal(0.02), (1, length, mc.emb_dim))
    elif mc.pos_emb == "sinusoidal":
      x = x + jnp.asarray(sinusoidal_positions(length, mc.emb_dim))
    x = x.astype(dtype)            # "rotary": positions enter through q and k in every layer
    x = nn.Dropout(mc.dropout_rate)(x, deterministic=deterministic)
    for i in range(mc.num_layers):
      x = EncoderBlock(mc, self.attention_config, length, name=f"block_{i}")(
          x, mask, deterministic)
    x = nn.LayerNorm(dtype=dtype, name="final_norm")(x)
    first = 1 if mc.pooling == "cls" else 0
    if not self.pool:
      return x[:, first:first + self.max_length]
    if mc.pooling == "cls":
      return x[:, 0]
    weights = mask[..., None].astype(x.dtype)
    return jnp.sum(x * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)


class ClassifierHead(nn.Module):
  model_config: Any
  num_classes: int

  @nn.compact
  def __call__(self, features):
    dtype = head_dtype(self.model_config)
    y = nn.relu(nn.Dense(self.model_config.classifier_dim, dtype=dtype)(features))
    return nn.Dense(self.num_classes, dtype=jnp.float32)(y).astype(jnp.float32)
