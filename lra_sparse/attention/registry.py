"""Registry of attention kinds and their configs.

An attention *kind* registers three things under its name, all in its own file:

- a config class: a frozen dataclass (subclass of ``KindConfig``) whose fields are the kind's
  settings with their defaults, and whose ``__post_init__`` checks them. It is the one
  declaration of the kind's config: the base config's ``config.attention.<kind>`` block is
  built from it, a run's ``config.json`` holds the block of the kind it uses, and
  ``--config.attention.<kind>.<field>=...`` sets a field from the command line.
- a builder ``(kind_config, dims) -> flax.linen.Module`` that checks the config against the
  model's sizes (``dims``) and returns the attention *core*.

The core receives the already projected ``q, k, v`` of shape ``[batch, length, heads,
head_dim]`` and returns the attended values of the same shape. The surrounding
``MultiHeadAttention`` block owns the q/k/v/output projections. Core call signature::

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
import math
from typing import Any, Callable, ClassVar, Mapping

import flax.linen as nn
import ml_collections

AUX_LOSS = "aux_loss"
AUX_METRICS = "aux_metrics"
DEFAULT_KIND = "dense"


@dataclasses.dataclass(frozen=True)
class AttentionDims:
  """Static sizes an attention core may need (and validate against)."""
  num_heads: int
  head_dim: int
  model_dim: int
  length: int          # the sequence length the core sees (after CLS + padding)
  dropout_rate: float = 0.0
  dtype: Any = None    # compute dtype (jnp.float32 / jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class KindConfig:
  """Base of every kind's config dataclass: field checks with messages that name the field as
  the user writes it (``config.attention.<kind>.<field>``)."""
  KIND: ClassVar[str] = ""

  def error(self, field: str, requirement: str) -> ValueError:
    return ValueError(f"config.attention.{self.KIND}.{field}={getattr(self, field)!r} "
                      f"{requirement}")

  def check_choice(self, field: str, choices) -> None:
    value = getattr(self, field)
    if isinstance(value, bool) or value not in choices:
      raise self.error(field, f"is not one of {tuple(choices)}")

  def check_bool(self, field: str) -> None:
    if not isinstance(getattr(self, field), bool):
      raise self.error(field, "must be True or False")

  def check_int(self, field: str, low: int, high: float = math.inf) -> None:
    value = getattr(self, field)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
      bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
      raise self.error(field, f"must be an integer {bound}")

  def check_float(self, field: str, *, low: float = -math.inf, high: float = math.inf,
                  low_open: bool = False, high_open: bool = False) -> None:
    """A finite number in the interval; ints are accepted (and stored as float)."""
    value = getattr(self, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise self.error(field, "must be a finite number")
    if value < low or value > high or (low_open and value == low) or (
        high_open and value == high):
      interval = (("(" if low_open else "[") + f"{low:g}, {high:g}" + (")" if high_open else "]"))
      raise self.error(field, f"must be in {interval}")
    object.__setattr__(self, field, float(value))


KindBuilder = Callable[[Any, AttentionDims], nn.Module]


@dataclasses.dataclass(frozen=True)
class _Kind:
  config_class: type
  build: KindBuilder


_REGISTRY: dict[str, _Kind] = {}


def register_attention(kind: str, config_class: type) -> Callable[[KindBuilder], KindBuilder]:
  """Decorator on ``build(kind_config, dims) -> core``: registers ``kind`` with its config
  class (a frozen ``KindConfig`` dataclass with a default for every field)."""
  if not (isinstance(config_class, type) and issubclass(config_class, KindConfig)
          and dataclasses.is_dataclass(config_class)):
    raise TypeError(f"attention kind {kind!r}: config_class must be a KindConfig dataclass")
  if config_class.KIND != kind:
    raise ValueError(f"attention kind {kind!r}: {config_class.__name__}.KIND is "
                     f"{config_class.KIND!r}")

  def decorate(build: KindBuilder) -> KindBuilder:
    if kind in _REGISTRY:
      raise ValueError(f"attention kind {kind!r} is registered twice")
    _REGISTRY[kind] = _Kind(config_class, build)
    return build
  return decorate


def attention_kinds() -> list[str]:
  return sorted(_REGISTRY)


def _check_kind(kind: Any) -> str:
  if kind not in _REGISTRY:
    raise ValueError(f"unknown attention kind {kind!r} (config.attention.kind); known kinds: "
                     f"{', '.join(attention_kinds())}")
  return kind


def config_class(kind: str) -> type:
  return _REGISTRY[_check_kind(kind)].config_class


def derived(default):
  """A kind-config field the model builder sets from the task (not a ``config.attention``
  field: configs, config.json files and their resume checks never see it)."""
  return dataclasses.field(default=default, metadata={"derived": True})


def _config_fields(cls) -> list[str]:
  return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived")]


def kind_fields(kind: str) -> dict[str, Any]:
  """The default value of every (configurable) field of ``kind``'s config."""
  defaults = config_class(kind)()
  return {name: getattr(defaults, name) for name in _config_fields(config_class(kind))}


def default_attention_config(kind: str = DEFAULT_KIND) -> ml_collections.ConfigDict:
  """``config.attention`` of the base config: ``kind`` and one block of defaults per kind."""
  config = ml_collections.ConfigDict()
  config.kind = _check_kind(kind)
  for name in attention_kinds():
    config[name] = ml_collections.ConfigDict(kind_fields(name))
  return config


def parse_attention_config(attention: Any) -> KindConfig:
  """The checked config object of the selected kind, from ``config.attention`` (a mapping with
  ``kind`` and a ``<kind>`` block; the other kinds' blocks are ignored) or a ``KindConfig``."""
  if isinstance(attention, KindConfig):
    return attention
  if not isinstance(attention, (Mapping, ml_collections.ConfigDict)):
    raise ValueError(f"config.attention must be a ConfigDict, got {type(attention).__name__}")
  kind = _check_kind(attention.get("kind"))
  block = attention.get(kind)
  if block is None:
    block = {}
  block = block.to_dict() if hasattr(block, "to_dict") else dict(block)
  cls = _REGISTRY[kind].config_class
  known = set(_config_fields(cls))
  unknown = sorted(set(block) - known)
  if unknown:
    raise ValueError(f"config.attention.{kind} has no field(s) {unknown}; its fields: "
                     f"{sorted(known)}")
  return cls(**block)


def build_attention(attention: Any, dims: AttentionDims) -> nn.Module:
  """The core of the selected kind (``config.attention`` or a kind's config object)."""
  kind_config = parse_attention_config(attention)
  return _REGISTRY[kind_config.KIND].build(kind_config, dims)
