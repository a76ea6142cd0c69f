"""One trainer for every LRA task: ``train_and_evaluate(config, workdir)``.

The workdir's files (``config.json``, ``metrics.jsonl``, ``result.json``, ``checkpoints/``)
are defined in ``lra_sparse.workdir``; every metrics record also goes to TensorBoard (and W&B)
through ``lra_sparse.metric_writers``, and ``config.profile_steps`` traces steps into
``profile/``. Starting again on the same workdir resumes from the last checkpoint and ends at
the same total step count.

A run may span several processes (``lra_sparse.distributed`` joins them first): the mesh covers
every process's devices, each process puts only its rows of every global batch on its devices
(every process reads the same deterministic batch), all of them save and restore the orbax
checkpoints together, and process 0 alone takes the workdir's lock and writes config.json,
metrics.jsonl, TensorBoard, W&B, result.json and the progress bar.

The workdir's lock, checkpoint saves that Ctrl-C waits for and restores that fall back past
unusable checkpoints are ``lra_sparse.checkpointing``'s; the helpers of several processes
(process 0, barriers, global batches) are ``lra_sparse.distributed``'s.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from lra_sparse import config as config_lib
from lra_sparse import metric_writers
from lra_sparse import objectives as objectives_lib
from lra_sparse import profiling
from lra_sparse import workdir as workdir_lib
from lra_sparse.attention import AUX_LOSS, AUX_METRICS
from lra_sparse.checkpointing import (all_finite, interrupts_latched, load_params_from,
                                      raise_if_interrupted, restore_newest_readable, run_lock,
                                      save_on_interrupt, sigint_after, sigint_deferred)
from lra_sparse.data import get_task
from lra_sparse.data.pipeline import eval_batches, train_dataset
from lra_sparse.data.registry import PAD_ID, SPLITS, TaskSpec, check_split_arrays
from lra_sparse.distributed import is_primary, put_global_batch, replicate, say, sync_processes
from lra_sparse.errors import TrainingDiverged, TrainingInterrupted, first_line
from lra_sparse.models import INPUT_KEYS, build_model
from lra_sparse.ops import sharding

AUX_COLLECTIONS = (AUX_LOSS, AUX_METRICS)
# Fields a resumed run may change: they decide how long, how often and in how many pieces a
# batch is processed, or what is recorded besides the metrics (a profile trace, W&B), not what
# the weights mean. Any other difference from the workdir's config.json is refused.
RESUMABLE_FIELDS = ("num_train_steps", "eval_every_steps", "log_every_steps",
                    "checkpoint_every_steps", "num_eval_batches", "optim.grad_accum_steps",
                    "profile_steps", "wandb.project", "wandb.entity", "eval_train_mode")
# fold_in constant of the seed's key that config.eval_train_mode's evaluations draw their
# dropout from (training draws from a split of the seed's key, another stream).
TRAIN_MODE_EVAL_STREAM = 0x7E57
# The denoising objective's evaluation corruption: fold_in(key(seed), this), then the batch.
DENOISE_EVAL_STREAM = 0xDE5
CLASSIFY = objectives_lib.Classify()
# result.json / metrics.jsonl: the test metrics at the periodic evaluation with the best
# validation accuracy so far (the first such step on ties), next to the last step's "test".
BEST_SPLIT = "test_at_best_val"


class TrainState(train_state.TrainState):
  # Non-trainable variable collections (e.g. DSA's fixed random projection): saved, never updated.
  model_state: Any = None


# ----------------------------------------------------------------------------- schedules, optim
def rsqrt_schedule(learning_rate: float, warmup_steps: int) -> optax.Schedule:
  """LRA 'constant * linear_warmup * rsqrt_decay': peak learning_rate / sqrt(warmup)."""
  warmup = max(1, int(warmup_steps))

  def schedule(step):
    step = jnp.asarray(step, jnp.float32) + 1.0
    return learning_rate * jnp.minimum(1.0, step / warmup) / jnp.sqrt(jnp.maximum(step, warmup))
  return schedule


# torch.optim.lr_scheduler.OneCycleLR defaults (the Nystromformer LRA code keeps them).
ONE_CYCLE_DIV_FACTOR = 25.0             # first lr = max_lr / 25
ONE_CYCLE_FINAL_DIV_FACTOR = 1e4        # last lr = first lr / 1e4
ONE_CYCLE_BETA1 = (0.95, 0.85)          # (max_momentum, base_momentum): Adam's beta1 cycles


def one_cycle_schedules(learning_rate: float, warmup_steps: int, num_train_steps: int
                        ) -> tuple[optax.Schedule, optax.Schedule]:
  """(learning rate, Adam beta1) of torch's ``OneCycleLR(max_lr=learning_rate,
  total_steps=num_train_steps, pct_start=warmup_steps / num_train_steps,
  anneal_strategy="linear")`` with its other defaults, as the Nystromformer LRA code
  (mlpen/Nystromformer, LRA/code/run_tasks.py) runs it: the lr goes linearly from
  learning_rate / 25 to learning_rate at step warmup - 1, then linearly down to
  learning_rate / 25 / 1e4 at step num_train_steps - 1; beta1 goes from 0.95 to 0.85 and back
  (``cycle_momentum``). Step t is the t-th update (0-based), as torch steps its scheduler after
  each update. The warmup is clipped to num_train_steps - 1, as for "cosine"."""
  total = max(int(num_train_steps), 2)
  warmup = min(max(int(warmup_steps), 0), total - 1)
  peak_end = float(warmup) - 1.0           # torch: float(pct_start * total_steps) - 1
  last = float(total) - 1.0
  initial = learning_rate / ONE_CYCLE_DIV_FACTOR
  final = initial / ONE_CYCLE_FINAL_DIV_FACTOR

  def two_phase(start_value, peak_value, end_value):
    def schedule(step):
      step = jnp.asarray(step, jnp.float32)
      rising = step / max(peak_end, 1.0)
      remaining = (last - step) / max(last - peak_end, 1.0)   # 1 - torch's pct, in phase 2
      return jnp.where(step <= peak_end,
                       start_value + (peak_value - start_value) * rising,
                       end_value + (peak_value - end_value) * remaining)
    return schedule

  high, low = ONE_CYCLE_BETA1
  return two_phase(initial, learning_rate, final), two_phase(high, low, high)


SCHEDULES = ("rsqrt", "cosine", "constant", "one_cycle")


def make_schedule(optim_config, num_train_steps: int) -> optax.Schedule:
  oc = optim_config
  if oc.schedule == "rsqrt":
    return rsqrt_schedule(oc.learning_rate, oc.warmup_steps)
  if oc.schedule == "cosine":
    warmup = min(int(oc.warmup_steps), max(num_train_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, oc.learning_rate, warmup,
                                              max(num_train_steps, warmup + 1))
  if oc.schedule == "constant":
    return optax.constant_schedule(oc.learning_rate)
  if oc.schedule == "one_cycle":
    return one_cycle_schedules(oc.learning_rate, oc.warmup_steps, num_train_steps)[0]
  raise ValueError(f"config.optim.schedule={oc.schedule!r}; choose one of {SCHEDULES}")


def trainable_labels(params, pattern: str):
  """"train" for each parameter whose path ("/"-joined module and parameter names, as
  ``init_from`` reports them, e.g. ``encoder/block_0/attention/DSAAttention_0/predictor_query``)
  ``re.search``-matches ``pattern`` (``config.optim.trainable``), "frozen" for the others;
  every parameter trains when the pattern is empty. A pattern that matches no parameter is an
  error naming some paths."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  labels = {name: "train" if re.search(pattern, name) else "frozen" for name in flat}
  if "train" not in labels.values():
    names = sorted(flat)
    raise ValueError(f"config.optim.trainable={pattern!r} matches no parameter (paths look "
                     f"like {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
  return flax.traverse_util.unflatten_dict(labels, sep="/")


def make_optimizer(config) -> optax.GradientTransformation:
  """AdamW (decoupled weight decay) on the schedule; "one_cycle" also cycles beta1. With
  ``config.optim.trainable`` set, only the parameters it matches are updated (clipping and
  weight decay included); the others keep their values."""
  tx = _make_adamw(config)
  if config.optim.trainable:
    return optax.multi_transform(
        {"train": tx, "frozen": optax.set_to_zero()},
        lambda params: trainable_labels(params, config.optim.trainable))
  return tx


def _make_adamw(config) -> optax.GradientTransformation:
  oc = config.optim
  if oc.schedule == "one_cycle":
    lr, b1 = one_cycle_schedules(oc.learning_rate, oc.warmup_steps, config.num_train_steps)
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=lr, b1=b1, b2=oc.b2, eps=oc.eps, weight_decay=oc.weight_decay)
  else:
    adamw = optax.adamw(make_schedule(oc, config.num_train_steps), b1=oc.b1, b2=oc.b2,
                        eps=oc.eps, weight_decay=oc.weight_decay)
  if oc.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(oc.grad_clip_norm), adamw)
  return adamw


# ----------------------------------------------------------------------------- model plumbing
def _aux_terms(mutated) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Sums sown aux losses; averages sown aux metrics of the same name over layers."""
  aux_loss = sum((jnp.sum(jnp.asarray(x, jnp.float32))
                  for x in jax.tree.leaves(mutated.get(AUX_LOSS, {}))), jnp.float32(0.0))
  grouped: dict[str, list] = {}
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(mutated.get(AUX_METRICS, {})))
  for path, values in flat.items():
    for value in (values if isinstance(values, tuple) else (values,)):
      grouped.setdefault(path[-1], []).append(jnp.asarray(value, jnp.float32))
  return aux_loss, {name: jnp.mean(jnp.stack(v)) for name, v in grouped.items()}


def make_train_step(model: nn.Module, grad_accum_steps: int = 1, objective=CLASSIFY):
  """One optimizer update per global batch. With ``grad_accum_steps`` k > 1 the batch is
  cut into k micro-batches whose gradients (and metrics) are averaged before the update: the
  same update as the whole batch at once (equal-sized micro-batches of a mean loss), with the
  activation memory of one micro-batch. Micro-batch i takes every k-th example, so each
  device's shard of a data-parallel batch splits evenly. ``objective``: what the loss is
  (lra_sparse/objectives.py; its random draws come from the step's dropout key)."""
  def grads_and_metrics(state: TrainState, batch, dropout_rng):
    def loss_fn(params):
      variables = {"params": params, **(state.model_state or {})}
      apply = lambda b: model.apply(variables, b, deterministic=False,  # noqa: E731
                                    rngs={"dropout": dropout_rng},
                                    mutable=list(AUX_COLLECTIONS))
      weights = jnp.ones(jax.tree.leaves(batch)[0].shape[:1], jnp.float32)
      (loss_sum, correct, count), _, mutated = objective.score(apply, batch, weights,
                                                               dropout_rng)
      aux_loss, aux_metrics = _aux_terms(mutated)
      task_loss = loss_sum / count
      metrics = {"loss": task_loss, "accuracy": correct / count, "aux_loss": aux_loss,
                 **aux_metrics}
      return task_loss + aux_loss, metrics
    return jax.grad(loss_fn, has_aux=True)(state.params)

  def train_step(state: TrainState, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state.step)
    if grad_accum_steps == 1:
      grads, metrics = grads_and_metrics(state, batch, dropout_rng)
    else:
      k = grad_accum_steps
      micro = jax.tree.map(
          lambda x: jnp.moveaxis(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 1, 0), batch)

      def accumulate(total, inputs):
        index, micro_batch = inputs
        grads, metrics = grads_and_metrics(state, micro_batch,
                                           jax.random.fold_in(dropout_rng, index))
        return jax.tree.map(lambda a, b: a + b / k, total, (grads, metrics)), None

      zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
          grads_and_metrics, state, jax.tree.map(lambda x: x[0], micro), dropout_rng))
      (grads, metrics), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(k), micro))
    metrics["grad_norm"] = optax.global_norm(grads)
    return state.apply_gradients(grads=grads), metrics
  return train_step


def in_mesh(step, mesh: Mesh):
  """``step`` called under ``jax.set_mesh(mesh)``: the kernels it traces see the data axis and
  run once per device on its part of the batch (``ops.sharding.per_data_shard``)."""
  def call(*args):
    with jax.set_mesh(mesh):
      return step(*args)
  return call


# eval_step's per-class logit sums (classification), which ``evaluate`` turns into
# ``logit_spread``.
LOGIT_SUMS, LOGIT_SQUARES = "logit_sums", "logit_squares"


def make_eval_step(model: nn.Module, *, train_mode: bool = False, objective=CLASSIFY):
  """Metric sums of one batch: loss, accuracy, the share of examples predicted as each class
  (``predicted_<c>``, the histogram a collapse to one class shows in; classification only)
  and aux metrics, and per class the sums of the logits and of their squares, from which
  ``evaluate`` reports ``logit_spread``. With ``train_mode`` the model runs as in training
  (dropout on, drawn from ``rng``): the diagnostic that tells a gap between training and
  evaluation mode from bad parameters. The denoising objective draws its corruption from
  ``rng`` (a fixed key per evaluation batch, so every evaluation scores the same corrupted
  positions)."""
  def eval_step(params, model_state, batch, weights, rng=None):
    variables = {"params": params, **(model_state or {})}
    rngs = {"dropout": rng} if train_mode else None
    apply = lambda b: model.apply(variables, b, deterministic=not train_mode,  # noqa: E731
                                  rngs=rngs, mutable=list(AUX_COLLECTIONS))
    (loss_sum, correct, count), logits, mutated = objective.score(
        apply, batch, weights, jax.random.key(0) if rng is None else rng)
    _, aux_metrics = _aux_terms(mutated)
    sums = {"loss": loss_sum, "accuracy": correct, "count": count}
    if objective.histogram:
      predicted = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1]) * weights[:, None]
      sums.update({f"predicted_{c}": total for c, total in enumerate(jnp.sum(predicted, 0))})
      real = logits.astype(jnp.float32) * weights[:, None]
      sums[LOGIT_SUMS] = jnp.sum(real, 0)
      sums[LOGIT_SQUARES] = jnp.sum(real * logits, 0)
    # Aux metrics are batch means: weight them by the batch's real examples.
    sums.update({name: value * count for name, value in aux_metrics.items()})
    return sums
  return eval_step


def seed_keys(seed: int):
  """(parameter initialisation key, dropout key) of a run with ``config.seed = seed``."""
  return jax.random.split(jax.random.key(seed))


def evaluate(eval_step, params, model_state, arrays, batch_size, batch_sharding,
             max_batches: int = 0, rng=None) -> dict[str, float]:
  """Metric means over ``arrays`` (the first ``max_batches`` batches; 0 = all). With several
  processes each puts its rows of every batch on its devices; the sums are global. ``rng``:
  for an ``eval_step`` in train mode (batch b draws its dropout from ``fold_in(rng, b)``).
  Classification adds ``logit_spread``: the standard deviation of each class's logit over the
  examples, averaged over classes. It is 0 (to float32 rounding) when the model gives every
  input the same logits (e.g. a classifier head whose ReLU units are all dead), where no
  gradient reaches the encoder any more."""
  totals: dict[str, Any] = {}
  for b, (batch, weights) in enumerate(eval_batches(arrays, batch_size, max_batches)):
    batch = put_global_batch(batch, batch_sharding)
    weights = put_global_batch(weights, batch_sharding)
    extra = () if rng is None else (jax.random.fold_in(rng, b),)
    sums = jax.device_get(eval_step(params, model_state, batch, weights, *extra))
    for key, value in sums.items():
      value = np.asarray(value, np.float64)
      totals[key] = totals.get(key, 0.0) + (value if value.ndim else float(value))
  count = totals.pop("count")
  means = {key: value / count for key, value in totals.items()
           if key not in (LOGIT_SUMS, LOGIT_SQUARES)}
  if LOGIT_SUMS in totals:
    mean = totals[LOGIT_SUMS] / count
    variance = np.maximum(totals[LOGIT_SQUARES] / count - mean ** 2, 0.0)
    means["logit_spread"] = float(np.sqrt(variance).mean())
  return means


class _NoWriter:
  """``metric_writers.RunWriter``'s stand-in on processes other than 0: writes nothing."""

  def write(self, step, split, metrics) -> None:
    del step, split, metrics

  def __enter__(self) -> "_NoWriter":
    return self

  def __exit__(self, exc_type, exc, traceback) -> None:
    pass


# ----------------------------------------------------------------------------- main entry
def make_model(config, spec: TaskSpec) -> nn.Module:
  """The model of ``config`` for the task ``spec`` describes."""
  return build_model(ml_collections.FrozenConfigDict(config), model_kind=spec.model_kind,
                     vocab_size=spec.vocab_size, num_classes=spec.num_classes, pad_id=PAD_ID,
                     padding_at_end=spec.padding_at_end)


# What ``config.deterministic`` needs in XLA_FLAGS before JAX starts its backend.
DETERMINISTIC_XLA_FLAG = "--xla_gpu_deterministic_ops=true"


def validate_config(config) -> None:
  """Checks of the run-level fields, before any data is read or anything compiles."""
  flat = config_lib.flatten_config(config.to_dict())
  for name in ("batch_size", "num_train_steps", "eval_every_steps", "log_every_steps",
               "checkpoint_every_steps", "optim.grad_accum_steps"):
    value = flat[name]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"config.{name}={value!r} must be a positive integer")
  if config.num_eval_batches < 0:
    raise ValueError(f"config.num_eval_batches={config.num_eval_batches} must be >= 0 "
                     "(0 = the whole split)")
  try:
    re.compile(config.optim.trainable)
  except re.error as e:
    raise ValueError(f"config.optim.trainable={config.optim.trainable!r} is not a regular "
                     f"expression: {e}") from None
  if config.eval_dtype not in ("", "float32", "bfloat16"):
    raise ValueError(f"config.eval_dtype={config.eval_dtype!r}; choose '', 'float32' or "
                     "'bfloat16'")
  if config.init_from and not os.path.isdir(config.init_from):
    raise FileNotFoundError(f"config.init_from={config.init_from!r} is not a directory")
  profile_steps = profiling.parse_profile_steps(config.profile_steps)
  if profile_steps is not None and profile_steps[0] >= config.num_train_steps:
    raise ValueError(f"config.profile_steps={config.profile_steps!r} starts at or after "
                     f"config.num_train_steps={config.num_train_steps}: nothing would be "
                     "traced")
  metric_writers.check_config(config)
  objectives_lib.check_config(config)
  if not isinstance(config.deterministic, bool):
    raise ValueError(f"config.deterministic={config.deterministic!r} must be True or False")
  if config.deterministic and DETERMINISTIC_XLA_FLAG not in os.environ.get(
      "XLA_FLAGS", "").split():
    raise ValueError(
        f"config.deterministic=True needs XLA_FLAGS to hold {DETERMINISTIC_XLA_FLAG} "
        "before JAX starts (python -m lra_sparse.main sets it; from Python, set it before "
        "importing jax)")


def enable_deterministic_xla() -> None:
  """Adds DETERMINISTIC_XLA_FLAG to XLA_FLAGS; effective only before JAX starts its backend
  (``lra_sparse.main`` calls it before any device is used)."""
  words = os.environ.get("XLA_FLAGS", "").split()
  if DETERMINISTIC_XLA_FLAG not in words:
    os.environ["XLA_FLAGS"] = " ".join(words + [DETERMINISTIC_XLA_FLAG])


def _load_splits(config, spec) -> dict[str, dict[str, np.ndarray]]:
  task = get_task(config.task)
  splits = {}
  for split in SPLITS:
    arrays = task.load_split(config, split)
    check_split_arrays(arrays, spec, f"task {config.task!r} split {split!r}")
    splits[split] = arrays
  return splits


def _best_so_far(workdir: str, start_step: int) -> Optional[dict[str, Any]]:
  """The last ``test_at_best_val`` record up to ``start_step`` (later ones belong to steps the
  resumed run does again), as {"step", "val_accuracy", test metrics}; None if there is none."""
  best = None
  for _, record in workdir_lib.read_metrics(workdir):
    if record.get("split") == BEST_SPLIT and isinstance(record.get("step"), int) \
        and record["step"] <= start_step:
      best = {key: value for key, value in record.items() if key not in ("split", "time")}
  return best


def check_resume_config(stored: dict, config: ml_collections.ConfigDict,
                        workdir: str) -> list[str]:
  """Compares the workdir's config.json with the config of the run about to resume it.

  Returns the changes of ``RESUMABLE_FIELDS`` as text; any other difference is one error that
  names the fields (with both values).
  """
  old = config_lib.flatten_config(stored)
  new = config_lib.flatten_config(json.loads(config.to_json_best_effort()))
  missing = object()
  changed = sorted(key for key in set(old) | set(new)
                   if old.get(key, missing) != new.get(key, missing))
  show = lambda flat, key: repr(flat[key]) if key in flat else "(absent)"
  refused = [f"{key}: {show(old, key)} -> {show(new, key)}" for key in changed
             if key not in RESUMABLE_FIELDS]
  if refused:
    raise ValueError(
        f"workdir {workdir} holds a run with another config ({'; '.join(refused)}): resuming "
        f"it would mix two runs. Use another --workdir (a resumed run may change only "
        f"{', '.join(RESUMABLE_FIELDS)})")
  return [f"{key}: {show(old, key)} -> {show(new, key)}" for key in changed]


def _eval_config(config) -> ml_collections.ConfigDict:
  eval_config = ml_collections.ConfigDict(config.to_dict())
  if config.eval_dtype:
    eval_config.model.dtype = config.eval_dtype
  return eval_config


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it holds checkpoints) and returns result.json.

  The workdir is locked for the whole run. Resuming checks the stored config.json first (only
  ``RESUMABLE_FIELDS`` may change); config.json is written once the run is accepted. Nothing
  non-finite is checkpointed: a diverged run stops with ``TrainingDiverged`` and keeps its last
  finite checkpoint. Restore falls back to the newest usable checkpoint.
  """
  validate_config(config)
  config = config_lib.run_config(config)
  workdir = os.path.abspath(workdir)
  # The latch: a Ctrl-C that Python swallows (inside a gc callback) still stops the loop.
  with run_lock(workdir), interrupts_latched():
    return _train_locked(config, workdir)


def _train_locked(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  changes = []
  if os.path.exists(os.path.join(workdir, workdir_lib.CONFIG_FILE)):
    try:
      stored = workdir_lib.read_config(workdir)
    except (OSError, ValueError) as error:
      raise ValueError(f"workdir {workdir}: its {workdir_lib.CONFIG_FILE} is unreadable "
                       f"({first_line(error)}); use another --workdir") from None
    changes = check_resume_config(stored, config, workdir)

  task = get_task(config.task)
  spec = task.spec(config)
  splits = _load_splits(config, spec)
  model = make_model(config, spec)
  eval_model = make_model(_eval_config(config), spec)

  devices = jax.devices()          # every process's: the data axis spans all of them
  accum = config.optim.grad_accum_steps
  if config.batch_size % (len(devices) * accum):
    processes = f"{jax.process_count()} processes x " if jax.process_count() > 1 else ""
    raise ValueError(f"config.batch_size={config.batch_size} must be divisible by the "
                     f"{processes}{jax.local_device_count()} local devices x "
                     f"config.optim.grad_accum_steps={accum}")
  mesh = Mesh(np.array(devices), (sharding.DATA_AXIS,))
  batch_sharding = NamedSharding(mesh, PartitionSpec(sharding.DATA_AXIS))
  replicated = NamedSharding(mesh, PartitionSpec())

  init_rng, dropout_rng = seed_keys(config.seed)
  sample = {key: value[:1] for key, value in splits["train"].items()}
  variables = jax.jit(lambda r: model.init(r, sample, deterministic=True))(init_rng)
  variables = flax.core.unfreeze(variables)
  for name in AUX_COLLECTIONS:
    variables.pop(name, None)
  params = variables.pop("params")
  init_from_record = None
  if config.init_from:
    params, fresh, unused = load_params_from(config.init_from, params)
    say(f"init_from {config.init_from}: {len(fresh)} new parameters freshly "
        f"initialised {fresh}; {len(unused)} unused {unused}")
    init_from_record = {"fresh_params": len(fresh), "unused_params": len(unused)}
  state = TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(config),
                            model_state=variables or None)
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
  trained = ""
  if config.optim.trainable:
    labels = trainable_labels(params, config.optim.trainable)
    count = sum(int(np.prod(p.shape)) for p, label in zip(jax.tree.leaves(params),
                                                           jax.tree.leaves(labels))
                if label == "train")
    trained = f" ({count:,} trained: config.optim.trainable={config.optim.trainable!r})"
  say(f"model: {num_params:,} parameters{trained}; {len(devices)} device(s){processes}: "
      f"{devices[0].platform}")

  manager = ocp.CheckpointManager(
      os.path.join(workdir, workdir_lib.CHECKPOINT_DIR),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  if jax.process_count() > 1:     # every process restores its part of the global arrays
    state = replicate(state, replicated)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored, start_step = restore_newest_readable(
      manager, lambda step: ocp.args.StandardRestore(abstract), f"workdir {workdir}",
      quarantine=True)
  if restored is None:
    start_step = 0
  else:
    state = restored
    if start_step > config.num_train_steps:
      raise ValueError(f"workdir {workdir} holds a checkpoint at step {start_step}, beyond "
                       f"config.num_train_steps={config.num_train_steps}: a run cannot be "
                       "shortened after the fact; use another --workdir")
    say(f"resumed from {workdir} at step {start_step}")
  state = replicate(state, replicated)

  # The run is accepted: open its writers (W&B, the one that can refuse, first), record its
  # config, and its changes if it resumes. Only process 0 writes files; the others wait until
  # every process has read the workdir's config.json.
  sync_processes("lra_sparse: run accepted")
  primary = is_primary()
  with (metric_writers.RunWriter(workdir, config, start_step) if primary
        else _NoWriter()) as writer:
    if primary:
      workdir_lib.write_json(os.path.join(workdir, workdir_lib.CONFIG_FILE),
                             json.loads(config.to_json_best_effort()))
    for change in changes:
      say(f"resume: {change}")
    if changes:
      writer.write(start_step, "resume", {"changed_fields": len(changes)})
    if init_from_record is not None:
      writer.write(0, "init_from", init_from_record)
    result_path = os.path.join(workdir, workdir_lib.RESULT_FILE)
    if primary and os.path.exists(result_path) and start_step < config.num_train_steps:
      os.remove(result_path)       # the run trains on: its old result no longer describes it
      say(f"resume: training on from step {start_step} to {config.num_train_steps}; "
          "removed the earlier result.json")
    objective = objectives_lib.make_objective(
        config, input_keys=INPUT_KEYS[spec.model_kind], vocab_size=spec.vocab_size)
    return _train_accepted_run(
        config, workdir, writer, state=state, start_step=start_step,
        resumed=restored is not None, manager=manager, model=model, eval_model=eval_model,
        splits=splits, batch_sharding=batch_sharding, dropout_rng=dropout_rng,
        num_params=num_params, objective=objective)


def _train_accepted_run(config, workdir, writer, *, state, start_step, resumed, manager, model,
                        eval_model, splits, batch_sharding, dropout_rng,
                        num_params, objective) -> dict[str, Any]:
  """The training loop and the final evaluation of ``_train_locked``'s accepted run."""
  mesh = batch_sharding.mesh
  train_step = in_mesh(jax.jit(make_train_step(model, config.optim.grad_accum_steps,
                                               objective), donate_argnums=(0,)), mesh)
  eval_step = in_mesh(jax.jit(make_eval_step(eval_model, objective=objective)), mesh)
  eval_cast = (lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)) \
      if config.eval_dtype == "bfloat16" else (lambda p: p)
  eval_rng = (jax.random.fold_in(jax.random.key(config.seed), DENOISE_EVAL_STREAM)
              if isinstance(objective, objectives_lib.Denoise) else None)
  run_eval = lambda split, max_batches: evaluate(
      eval_step, eval_cast(state.params), state.model_state, splits[split], config.batch_size,
      batch_sharding, max_batches, rng=eval_rng)
  # config.eval_train_mode: the validation split once more as in training (dropout on, a
  # fixed key per evaluation step), recorded as split "val_train_mode".
  train_mode_eval = in_mesh(jax.jit(make_eval_step(model, train_mode=True,
                                                   objective=objective)), mesh) \
      if config.eval_train_mode else None
  check_rng = jax.random.fold_in(jax.random.key(config.seed), TRAIN_MODE_EVAL_STREAM)
  learning_rate = make_schedule(config.optim, config.num_train_steps)
  profile_steps = profiling.parse_profile_steps(config.profile_steps)
  if profile_steps is not None:     # a window past the run's end stops after its last step
    profile_steps = (profile_steps[0], min(profile_steps[1], config.num_train_steps))
  # Process 0 traces its devices (processes on one host would write the same trace files).
  profile = profiling.ProfileWindow(profile_steps if is_primary() else None,
                          os.path.join(workdir, workdir_lib.PROFILE_DIR))

  batches = train_dataset(splits["train"], config.batch_size, config.seed)
  best = _best_so_far(workdir, start_step)
  window: list[dict] = []
  last_saved = start_step if resumed else None
  finite = jnp.array(True)       # every loss and grad norm since the last save was finite
  # Training seconds of the log window (for steps_per_sec): evaluation and saving excluded.
  window_started = time.perf_counter()

  def diverged(first_step: int, done: int) -> TrainingDiverged:
    kept = (f"the last finite checkpoint is step {last_saved}" if last_saved is not None
            else "no checkpoint was written")
    return TrainingDiverged(
        f"training diverged: non-finite loss or gradient norm between steps {first_step} and "
        f"{done}; nothing non-finite was checkpointed, {kept} (lower config.optim."
        "learning_rate or set config.optim.grad_clip_norm)")

  progress = tqdm(range(start_step, config.num_train_steps), initial=start_step,
                  total=config.num_train_steps, desc=f"{config.task}/{config.attention.kind}",
                  dynamic_ncols=True, mininterval=2.0, disable=not is_primary())
  done = start_step
  try:
    for step in progress:
      raise_if_interrupted()
      profile.before_step(step, state)
      batch = put_global_batch(batches[step], batch_sharding)
      # A Ctrl-C inside the call (it blocks while the device queue is full) would land after
      # the step consumed its donated input and before its output is bound: nothing left to
      # checkpoint, every step since the last save lost. It waits for the assignment instead.
      with sigint_after():
        state, metrics = train_step(state, batch, dropout_rng)
      profile.after_step(step, (state, metrics))
      finite = finite & jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
      window.append(metrics)
      done = step + 1
      if done % config.log_every_steps == 0 or done == config.num_train_steps:
        fetched = jax.device_get(window)
        means = {k: float(np.mean([float(m[k]) for m in fetched])) for k in window[0]}
        # The window's worst step: a spike the mean smooths away.
        means.update({f"{k}_max": float(np.max([float(m[k]) for m in fetched]))
                      for k in ("loss", "grad_norm")})
        now = time.perf_counter()
        means["steps_per_sec"] = len(window) / max(now - window_started, 1e-9)
        means["learning_rate"] = float(learning_rate(done - 1))   # of the window's last update
        window, window_started = [], now
        if not (math.isfinite(means["loss"]) and math.isfinite(means["grad_norm"])):
          raise diverged((last_saved or 0) + 1, done)
        writer.write(done, "train", means)
        progress.set_postfix(loss=f"{means['loss']:.4f}", acc=f"{means['accuracy']:.3f}")
      evaluates = done % config.eval_every_steps == 0 or done == config.num_train_steps
      saves = done % config.checkpoint_every_steps == 0 or done == config.num_train_steps
      if evaluates or saves:
        jax.block_until_ready(metrics)       # the window's training time ends here
        paused = time.perf_counter()
      if evaluates:
        val = run_eval("val", config.num_eval_batches)
        writer.write(done, "val", val)
        if train_mode_eval is not None:
          writer.write(done, "val_train_mode", evaluate(
              train_mode_eval, state.params, state.model_state, splits["val"],
              config.batch_size, batch_sharding, config.num_eval_batches,
              rng=jax.random.fold_in(check_rng, done)))
        shares = [v for k, v in val.items() if k.startswith("predicted_")]
        say(f"step {done}: val " + " ".join(f"{k}={v:.4f}" for k, v in val.items()
                                            if not k.startswith("predicted_"))
            + (f" (most predicted class: {max(shares):.1%} of examples)" if shares else ""))
        if best is None or val["accuracy"] > best["val_accuracy"]:
          best = {"step": done, "val_accuracy": val["accuracy"], **run_eval("test", 0)}
          writer.write(done, BEST_SPLIT, {k: v for k, v in best.items() if k != "step"})
      if saves:
        # A Ctrl-C waits for the check (its first call compiles: an interrupt landing inside
        # JAX's tracing could leave it unusable for the interrupt's own save) and the save.
        with sigint_after():
          if not (bool(finite) and bool(all_finite(state.params))):
            raise diverged((last_saved or 0) + 1, done)
          manager.save(done, args=ocp.args.StandardSave(state))
          last_saved, finite = done, jnp.array(True)
      if evaluates or saves:
        window_started += time.perf_counter() - paused
  except KeyboardInterrupt:
    with sigint_deferred():           # a second Ctrl-C (a sweep forwards its own) waits
      progress.close()                 # a save in flight completes (or fails) first:
      reached, kept = save_on_interrupt(manager, state, finite, last_saved)
      try:
        manager.close()
      except Exception as error:  # pylint: disable=broad-except  (said; the saves are done)
        kept += f" (closing the checkpoints failed: {first_line(error)})"
    raise TrainingInterrupted(f"interrupted at step {reached or done}; {kept}; run the same "
                              "command to resume") from None
  except TrainingDiverged:
    progress.close()
    manager.wait_until_finished()
    manager.close()
    raise
  finally:
    profile.stop()            # a trace left running by a failed step ends here
  manager.wait_until_finished()

  final_step = int(state.step)
  val = run_eval("val", 0)
  test = run_eval("test", 0)
  writer.write(final_step, "test", test)
  majority = float(np.mean(splits["test"]["targets"] ==
                           np.bincount(splits["train"]["targets"]).argmax()))
  result = {"step": final_step, "val": val, "test": test, BEST_SPLIT: best,
            "majority_class_accuracy": majority, "num_params": num_params}
  if is_primary():
    workdir_lib.write_json(os.path.join(workdir, workdir_lib.RESULT_FILE), result)
  manager.close()
  return result
