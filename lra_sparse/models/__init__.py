"""Models: the LRA classifier and the dual-encoder retrieval model, built through a registry."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from lra_sparse.data.registry import TaskSpec
from lra_sparse.models.encoder import (ClassifierHead, Encoder, padded_length,
                                       validate_model_config)


class Classifier(nn.Module):
  """LRA single-sequence classifier: batch["inputs"] -> logits."""
  model_config: Any
  attention_config: Any
  spec: TaskSpec
  max_length: int

  @nn.compact
  def __call__(self, batch, *, deterministic: bool):
    features = Encoder(self.model_config, self.attention_config, self.spec.vocab_size,
                       self.max_length, name="encoder")(batch["inputs"],
                                                        deterministic=deterministic)
    return ClassifierHead(self.model_config, self.spec.num_classes, name="head")(features)


class DualEncoder(nn.Module):
  """LRA retrieval: one shared encoder for both documents, features [u, v, u*v, u-v] -> MLP."""
  model_config: Any
  attention_config: Any
  spec: TaskSpec
  max_length: int

  @nn.compact
  def __call__(self, batch, *, deterministic: bool):
    encoder = Encoder(self.model_config, self.attention_config, self.spec.vocab_size,
                      self.max_length, name="encoder")
    u = encoder(batch["inputs1"], deterministic=deterministic)
    v = encoder(batch["inputs2"], deterministic=deterministic)
    combined = jnp.concatenate([u, v, u * v, u - v], axis=-1)
    return ClassifierHead(self.model_config, self.spec.num_classes, name="head")(combined)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "classifier": Classifier,
    "dual_encoder": DualEncoder,
}


def build_model(config, spec: TaskSpec) -> nn.Module:
  validate_model_config(config.model)
  if spec.model_kind not in MODELS:
    raise ValueError(f"task {spec.name!r} asks for unknown model kind {spec.model_kind!r}; "
                     f"known: {sorted(MODELS)}")
  return MODELS[spec.model_kind](config.model, config.attention, spec, config.data.max_length)


__all__ = ["Classifier", "DualEncoder", "MODELS", "build_model", "padded_length"]
