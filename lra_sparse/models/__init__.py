"""Models: the LRA classifier and the dual-encoder retrieval model, built through a registry.

Models know nothing about tasks or data files: the trainer passes the vocabulary size, the
number of classes, the padding token id and whether padding sits only at the end of a row as
plain values.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from lra_sparse.attention import parse_attention_config
from lra_sparse.models.encoder import (ClassifierHead, Encoder, head_dtype, padded_length,
                                       validate_model_config)

# config.model.dual_head (configs/retrieval.py): how the dual encoder combines its two pooled
# documents u, v into logits.
#   "lra": LRA's classifier_head_dual as its matching task calls it (no interaction argument,
#     google-research/long-range-arena models/layers/common_layers.py, matching/train.py):
#     concat[u, v] -> Dense(classifier_dim) -> ReLU -> Dense(classifier_dim // 2) -> ReLU ->
#     Dense(classes).
#   "nli_one_hidden": [u, v, u * v, u - v] -> Dense(classifier_dim) -> ReLU -> Dense(classes),
#     this repository's earlier head (the Nystromformer LRA code's SCHeadDual has this shape).
DUAL_HEADS = ("lra", "nli_one_hidden")


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


class DualClassifierHead(nn.Module):
  """LRA's classifier_head_dual (``dual_head="lra"``): [u, v] -> two ReLU layers -> logits."""
  model_config: Any
  num_classes: int

  @nn.compact
  def __call__(self, u, v):
    dtype = head_dtype(self.model_config)
    width = self.model_config.classifier_dim
    y = jnp.concatenate([u, v], axis=-1)
    y = nn.relu(nn.Dense(width, dtype=dtype, name="mlp")(y))
    y = nn.relu(nn.Dense(width // 2, dtype=dtype, name="mlp2")(y))
    return nn.Dense(self.num_classes, dtype=jnp.float32, name="logits")(y).astype(jnp.float32)


class DualEncoder(nn.Module):
  """LRA retrieval: one shared encoder for both documents, then ``model_config.dual_head``."""
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
    if self.model_config.dual_head == "lra":
      return DualClassifierHead(self.model_config, self.num_classes, name="head")(u, v)
    combined = jnp.concatenate([u, v, u * v, u - v], axis=-1)
    return ClassifierHead(self.model_config, self.num_classes, name="head")(combined)


class Denoiser(nn.Module):
  """The denoising objective's model (``config.objective="denoise"``, lra_sparse/objectives.py):
  the task's encoder under the classifier's parameter path ("encoder", so a fine-tune loads
  it) and an LM head ("lm_head", which the fine-tune drops): for each of ``input_keys``,
  logits [batch, max_length, vocab_size] over the original tokens at every position. The
  embedding has ``vocab_size + 1`` rows (the mask token, ``config.model.mask_token``)."""
  model_config: Any
  attention_config: Any
  vocab_size: int
  max_length: int
  input_keys: tuple[str, ...]
  pad_id: int = 0

  @nn.compact
  def __call__(self, batch, *, deterministic: bool):
    encoder = Encoder(self.model_config, self.attention_config, self.vocab_size + 1,
                      self.max_length, self.pad_id, pool=False, name="encoder")
    head = nn.Dense(self.vocab_size, dtype=head_dtype(self.model_config), name="lm_head")
    return {key: head(encoder(batch[key], deterministic=deterministic)).astype(jnp.float32)
            for key in self.input_keys}


MODELS: dict[str, Callable[..., nn.Module]] = {
    "classifier": Classifier,
    "dual_encoder": DualEncoder,
}
# The batch keys each model reads (what the denoising objective corrupts and predicts).
INPUT_KEYS = {"classifier": ("inputs",), "dual_encoder": ("inputs1", "inputs2")}


def attention_for_masks(attention_config, padding_at_end: bool):
  """The attention config to run with key masks that may have holes (``padding_at_end``
  False: pixel tasks masking black pixels). cuDNN (dense attention, and the Nystromformer's
  B V) takes key padding as sequence lengths, which is only right when padding sits at the
  end of each row: with holes "auto" gives cuDNN the mask as a bias instead (``mask_holes``;
  H100, Pathfinder-32 train step: 59.7 ms against 134.0 on XLA), and an explicit "cudnn" is
  refused ("cudnn_bias" and "xla" take any mask)."""
  if padding_at_end or attention_config.KIND not in ("dense", "nystrom"):
    return attention_config
  if attention_config.implementation == "cudnn":
    kind = attention_config.KIND
    raise ValueError(f"config.attention.{kind}.implementation='cudnn' takes key padding as "
                     "sequence lengths (padding at the end of each row), but this task masks "
                     "black pixels anywhere in the image (config.data.mask_black_pixels=True): "
                     "use 'auto', 'cudnn_bias' (dense) or 'xla', or set "
                     "config.data.mask_black_pixels=False")
  return dataclasses.replace(attention_config, mask_holes=True)


def build_model(config, *, model_kind: str, vocab_size: int, num_classes: int,
                pad_id: int = 0, padding_at_end: bool = True) -> nn.Module:
  """The model ``model_kind`` for ``config`` (its ``model``, ``attention``,
  ``data.max_length`` and ``objective``: ``Denoiser`` for "denoise"); the attention config is
  checked here, once. ``padding_at_end`` False:
  the task's key masks may have holes (``attention_for_masks``)."""
  validate_model_config(config.model)
  if model_kind not in MODELS:
    raise ValueError(f"unknown model kind {model_kind!r}; known: {sorted(MODELS)}")
  if model_kind == "dual_encoder":
    head = config.model.get("dual_head")
    if head not in DUAL_HEADS:
      raise ValueError(f"config.model.dual_head={head!r}; choose one of {DUAL_HEADS} "
                       "(configs/retrieval.py sets it)")
  if (config.model.get("value_conv_kernel", 0) and config.attention.kind == "nystrom"
      and config.attention.nystrom.conv_kernel):
    raise ValueError(
        f"config.model.value_conv_kernel={config.model.value_conv_kernel} adds a conv skip to "
        "every attention kind, and Nystromformer has its own (config.attention.nystrom."
        f"conv_kernel={config.attention.nystrom.conv_kernel}): set one of them to 0")
  attention = attention_for_masks(parse_attention_config(config.attention), padding_at_end)
  if config.get("objective", "classify") == "denoise":
    return Denoiser(config.model, attention, vocab_size=vocab_size,
                    max_length=config.data.max_length, input_keys=INPUT_KEYS[model_kind],
                    pad_id=pad_id)
  embed_rows = vocab_size + (1 if config.model.get("mask_token", False) else 0)
  return MODELS[model_kind](config.model, attention,
                            vocab_size=embed_rows, num_classes=num_classes,
                            max_length=config.data.max_length, pad_id=pad_id)


__all__ = ["Classifier", "DUAL_HEADS", "Denoiser", "DualClassifierHead", "DualEncoder",
           "INPUT_KEYS", "MODELS",
           "attention_for_masks", "build_model", "padded_length"]
