"""Training objectives: what the model predicts from a batch, and the loss it trains on.

``classify`` (LRA): the task's label from the pooled sequence; cross-entropy per example.

``denoise`` (self-pretraining, Amos, Berant and Gupta, "Never Train from Scratch", ICLR 2024):
the task's own inputs, labels unused. Of each row's real tokens (id != 0) every one is selected
with probability ``mask_rate``; a selected token becomes the mask token (id = the task's
vocabulary size, the embedding row ``config.model.mask_token`` adds) with probability
``mask_share``, a real token drawn uniformly from 1..vocab-1 with probability ``random_share``,
and stays itself otherwise. The model (``lra_sparse.models.Denoiser``: the same encoder, an LM
head over the vocabulary) predicts the original token at every position; the loss and
accuracy count the selected positions only. Rows of every input of the task are corrupted
independently (both documents of Retrieval). The objective is bidirectional: a causal one
would need a causal mask in every attention kind's kernels, which they do not have.

An objective's ``score`` runs the model and returns the sums a step or an evaluation needs:
(loss sum, correct count, weight count), the logits (classify: [batch, classes], for the
predicted-class histogram; denoise: None) and the model's mutated collections.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

OBJECTIVES = ("classify", "denoise")
_DENOISE_STREAM = 0x5E1F      # fold_in constant: the corruption's draws, apart from dropout's


def check_config(config) -> None:
  """One clear error for a bad ``config.objective`` or ``config.denoise`` field."""
  if config.objective not in OBJECTIVES:
    raise ValueError(f"config.objective={config.objective!r}; choose one of {OBJECTIVES}")
  d = config.denoise
  for name in ("mask_rate", "mask_share", "random_share"):
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
      raise ValueError(f"config.denoise.{name}={value!r} must be a number in [0, 1]")
  if d.mask_share + d.random_share > 1:
    raise ValueError(f"config.denoise.mask_share + random_share = "
                     f"{d.mask_share + d.random_share} must be at most 1 (the rest of the "
                     "selected tokens stay themselves)")
  if config.objective == "denoise":
    if d.mask_rate <= 0:
      raise ValueError("config.denoise.mask_rate must be > 0 for config.objective='denoise' "
                       "(nothing would be predicted)")
    if not config.model.mask_token:
      raise ValueError("config.objective='denoise' replaces tokens by a mask token: set "
                       "config.model.mask_token=True (and keep it in the fine-tune, so the "
                       "pretrained embedding loads)")


def corrupt(tokens, rng, *, vocab_size: int, mask_rate: float, mask_share: float,
            random_share: float, pad_id: int = 0):
  """tokens int [batch, length] -> (corrupted tokens, selected bool [batch, length]).

  The mask token is ``vocab_size``; random tokens are drawn from 1..vocab_size-1; padding
  (``pad_id``) is never selected nor changed."""
  k_select, k_kind, k_token = jax.random.split(rng, 3)
  selected = (tokens != pad_id) & (jax.random.uniform(k_select, tokens.shape) < mask_rate)
  kind = jax.random.uniform(k_kind, tokens.shape)
  drawn = jax.random.randint(k_token, tokens.shape, 1, vocab_size, dtype=tokens.dtype)
  corrupted = jnp.where(selected & (kind < mask_share), jnp.asarray(vocab_size, tokens.dtype),
                        jnp.where(selected & (kind < mask_share + random_share), drawn,
                                  tokens))
  return corrupted, selected


def cross_entropy_sums(logits, targets, weights):
  """(loss sum, correct sum, weight sum) of integer ``targets`` under ``logits`` [..., C]."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  return jnp.sum(losses * weights), jnp.sum(correct * weights), jnp.sum(weights)


Apply = Callable[[dict], tuple[Any, Any]]     # batch -> (model outputs, mutated collections)


@dataclasses.dataclass(frozen=True)
class Classify:
  """The task's label from the pooled sequence (weights: [batch], 1 for real examples)."""
  histogram = True

  def score(self, apply: Apply, batch, weights, rng):
    del rng
    logits, mutated = apply(batch)
    return cross_entropy_sums(logits, batch["targets"], weights), logits, mutated


@dataclasses.dataclass(frozen=True)
class Denoise:
  """Masked-token denoising of ``input_keys`` (module docstring)."""
  input_keys: tuple[str, ...]
  vocab_size: int
  mask_rate: float
  mask_share: float
  random_share: float
  histogram = False

  def score(self, apply: Apply, batch, weights, rng):
    rng = jax.random.fold_in(rng, _DENOISE_STREAM)
    corrupted, selected = dict(batch), {}
    for i, key in enumerate(self.input_keys):
      corrupted[key], selected[key] = corrupt(
          batch[key], jax.random.fold_in(rng, i), vocab_size=self.vocab_size,
          mask_rate=self.mask_rate, mask_share=self.mask_share,
          random_share=self.random_share)
    logits, mutated = apply(corrupted)
    sums = [cross_entropy_sums(logits[key], batch[key],
                               selected[key] & (weights[:, None] > 0))
            for key in self.input_keys]
    return tuple(sum(parts) for parts in zip(*sums)), None, mutated


def make_objective(config, *, input_keys: tuple[str, ...], vocab_size: int):
  """The objective of ``config`` for a task whose model reads ``input_keys``."""
  check_config(config)
  if config.objective == "classify":
    return Classify()
  d = config.denoise
  return Denoise(input_keys=tuple(input_keys), vocab_size=vocab_size,
                 mask_rate=float(d.mask_rate), mask_share=float(d.mask_share),
                 random_share=float(d.random_share))
