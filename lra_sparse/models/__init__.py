"""Models: the LRA classifier and the dual-encoder retrieval model, built through a registry.

Models know nothing about tasks or data files: the trainer passes the vocabulary size, the
number of classes and the padding token id as plain values.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from lra_sparse.attention import parse_attention_config
from lra_sparse.models.encoder import (ClassifierHead, Encoder, padded_length,
                                       validate_model_config)


class Classifier(nn.Module):
  """LRA single-sequence classifier: batch["inputs"] -> logits."""
  model_config: Any
  attention_config: Any       # the selected kind's config object (lra_sparse.attention)
  vocab_size: int
  num_classes: int
  max_length: int
  pad_id: int = 0

  @nn.compact
  def __call__(self, batch, *, deterministic: bool):
    features = Encoder(self.model_config, self.attention_config, self.vocab_size,
                       self.max_length, self.pad_id, name="encoder")(
                           batch["inputs"], deterministic=deterministic)
    return ClassifierHead(self.model_config, self.num_classes, name="head")(features)


class DualEncoder(nn.Module):
  """LRA retrieval: one shared encoder for both documents, features [u, v, u*v, u-v] -> MLP."""
  model_config: Any
  attention_config: Any
  vocab_size: int
  num_classes: int
  max_length: int
  pad_id: int = 0

  @nn.compact
  def __call__(self, batch, *, deterministic: bool):
    encoder = Encoder(self.model_config, self.attention_config, self.vocab_size,
                      self.max_length, self.pad_id, name="encoder")
    u = encoder(batch["inputs1"], deterministic=deterministic)
    v = encoder(batch["inputs2"], deterministic=deterministic)
    combined = jnp.concatenate([u, v, u * v, u - v], axis=-1)
    return ClassifierHead(self.model_config, self.num_classes, name="head")(combined)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "classifier": Classifier,
    "dual_encoder": DualEncoder,
}


def build_model(config, *, model_kind: str, vocab_size: int, num_classes: int,
                pad_id: int = 0) -> nn.Module:
  """The model ``model_kind`` for ``config`` (its ``model``, ``attention`` and
  ``data.max_length``); the attention config is checked here, once."""
  validate_model_config(config.model)
  if model_kind not in MODELS:
    raise ValueError(f"unknown model kind {model_kind!r}; known: {sorted(MODELS)}")
  return MODELS[model_kind](config.model, parse_attention_config(config.attention),
                            vocab_size=vocab_size, num_classes=num_classes,
                            max_length=config.data.max_length, pad_id=pad_id)


__all__ = ["Classifier", "DualEncoder", "MODELS", "build_model", "padded_length"]
