"""Registry of attention kinds.

An attention *kind* is a factory ``(attention_config, dims) -> flax.linen.Module`` registered
under a name. The returned module is the attention *core*: it receives the already projected
``q, k, v`` of shape ``[batch, length, heads, head_dim]`` and returns the attended values of the
same shape. The surrounding ``MultiHeadAttention`` block owns the q/k/v/output projections.

Core call signature::

    core(q, k, v, *, mask, inputs, deterministic) -> [batch, length, heads, head_dim]

- ``mask``: bool ``[batch, length]`` key padding mask, True = real token (never None inside
  the model).
- ``inputs``: the block input ``x`` ``[batch, length, model_dim]`` (DSA's predictor reads it).
- ``deterministic``: False while training (attention dropout on probabilities is applied by the
  core when ``dims.dropout_rate > 0``).

Cores report extra training terms through Flax ``sow``:
- ``self.sow("aux_loss", name, scalar)``: added to the training loss as is (already weighted).
- ``self.sow("aux_metrics", name, scalar)``: averaged over layers and logged at train and eval.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn

AUX_LOSS = "aux_loss"
AUX_METRICS = "aux_metrics"


@dataclasses.dataclass(frozen=True)
class AttentionDims:
  """Static sizes an attention core may need (and validate against)."""
  num_heads: int
  head_dim: int
  model_dim: int
  length: int          # the sequence length the core sees (after CLS + padding)
  dropout_rate: float = 0.0
  dtype: Any = None    # compute dtype (jnp.float32 / jnp.bfloat16)


AttentionFactory = Callable[[Any, AttentionDims], nn.Module]
_REGISTRY: dict[str, AttentionFactory] = {}


def register_attention(kind: str) -> Callable[[AttentionFactory], AttentionFactory]:
  """Decorator: registers ``factory(attention_config, dims) -> core module`` under ``kind``."""
  def decorate(factory: AttentionFactory) -> AttentionFactory:
    if kind in _REGISTRY:
      raise ValueError(f"attention kind {kind!r} is registered twice")
    _REGISTRY[kind] = factory
    return factory
  return decorate


def attention_kinds() -> list[str]:
  return sorted(_REGISTRY)


def build_attention(attention_config: Any, dims: AttentionDims) -> nn.Module:
  """Builds the core named by ``attention_config.kind``; unknown kinds get one clear error."""
  kind = attention_config.get("kind") if hasattr(attention_config, "get") else None
  if kind not in _REGISTRY:
    raise ValueError(
        f"unknown attention kind {kind!r} (config.attention.kind); known kinds: "
        f"{', '.join(attention_kinds())}")
  return _REGISTRY[kind](attention_config, dims)
