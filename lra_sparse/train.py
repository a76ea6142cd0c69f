"""One trainer for every LRA task: ``train_and_evaluate(config, workdir)``.

The workdir's files (``config.json``, ``metrics.jsonl``, ``result.json``, ``checkpoints/``)
are defined in ``lra_sparse.workdir``. Starting again on the same workdir resumes from the last
checkpoint and ends at the same total step count.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

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
from lra_sparse import workdir as workdir_lib
from lra_sparse.attention import AUX_LOSS, AUX_METRICS
from lra_sparse.data import get_task
from lra_sparse.data.pipeline import eval_batches, train_dataset
from lra_sparse.data.registry import PAD_ID, SPLITS, TaskSpec, check_split_arrays
from lra_sparse.models import build_model

AUX_COLLECTIONS = (AUX_LOSS, AUX_METRICS)


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
  raise ValueError(f"config.optim.schedule={oc.schedule!r}; choose rsqrt, cosine or constant")


def make_optimizer(config) -> optax.GradientTransformation:
  oc = config.optim
  adamw = optax.adamw(make_schedule(oc, config.num_train_steps), b1=oc.b1, b2=oc.b2, eps=oc.eps,
                      weight_decay=oc.weight_decay)
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


def _cross_entropy(logits, targets, weights):
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return jnp.sum(losses * weights), jnp.sum(correct * weights), jnp.sum(weights)


def make_train_step(model: nn.Module):
  def train_step(state: TrainState, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state.step)

    def loss_fn(params):
      variables = {"params": params, **(state.model_state or {})}
      logits, mutated = model.apply(variables, batch, deterministic=False,
                                    rngs={"dropout": dropout_rng},
                                    mutable=list(AUX_COLLECTIONS))
      weights = jnp.ones(logits.shape[:1], jnp.float32)
      loss_sum, correct, count = _cross_entropy(logits, batch["targets"], weights)
      aux_loss, aux_metrics = _aux_terms(mutated)
      task_loss = loss_sum / count
      metrics = {"loss": task_loss, "accuracy": correct / count, "aux_loss": aux_loss,
                 **aux_metrics}
      return task_loss + aux_loss, metrics

    grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params)
    metrics["grad_norm"] = optax.global_norm(grads)
    return state.apply_gradients(grads=grads), metrics
  return train_step


def make_eval_step(model: nn.Module):
  def eval_step(params, model_state, batch, weights):
    variables = {"params": params, **(model_state or {})}
    logits, mutated = model.apply(variables, batch, deterministic=True,
                                  mutable=list(AUX_COLLECTIONS))
    loss_sum, correct, count = _cross_entropy(logits, batch["targets"], weights)
    _, aux_metrics = _aux_terms(mutated)
    sums = {"loss": loss_sum, "accuracy": correct, "count": count}
    # Aux metrics are batch means: weight them by the batch's real examples.
    sums.update({name: value * count for name, value in aux_metrics.items()})
    return sums
  return eval_step


def evaluate(eval_step, params, model_state, arrays, batch_size, batch_sharding,
             max_batches: int = 0) -> dict[str, float]:
  totals: dict[str, float] = {}
  for batch, weights in eval_batches(arrays, batch_size, max_batches):
    batch = jax.device_put(batch, batch_sharding)
    weights = jax.device_put(weights, batch_sharding)
    sums = jax.device_get(eval_step(params, model_state, batch, weights))
    for key, value in sums.items():
      totals[key] = totals.get(key, 0.0) + float(value)
  count = totals.pop("count")
  return {key: value / count for key, value in totals.items()}


# ----------------------------------------------------------------------------- init_from
def _latest_checkpoint(workdir: str) -> tuple[ocp.CheckpointManager, int]:
  ckpt_dir = os.path.join(os.path.abspath(workdir), workdir_lib.CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"config.init_from={workdir!r}: no checkpoints/ directory there")
  manager = ocp.CheckpointManager(ckpt_dir)
  step = manager.latest_step()
  if step is None:
    raise FileNotFoundError(f"config.init_from={workdir!r}: checkpoints/ holds no checkpoint")
  return manager, step


def load_params_from(workdir: str, params) -> tuple[Any, list[str], list[str]]:
  """Copies every parameter of ``workdir``'s last checkpoint that this model also has.

  Returns (params, new parameter paths kept at their fresh init, unused old paths). A shared
  path with a different shape is an error.
  """
  manager, step = _latest_checkpoint(workdir)
  restored = manager.restore(step, args=ocp.args.StandardRestore())
  old = flax.traverse_util.flatten_dict(restored["params"], sep="/")
  new = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  merged, fresh = {}, []
  for path, value in new.items():
    if path in old:
      if tuple(old[path].shape) != tuple(value.shape):
        raise ValueError(f"config.init_from: parameter {path} has shape {old[path].shape} in "
                         f"{workdir} but {value.shape} in this model")
      merged[path] = jnp.asarray(old[path], value.dtype)
    else:
      merged[path] = value
      fresh.append(path)
  unused = sorted(set(old) - set(new))
  return flax.traverse_util.unflatten_dict(merged, sep="/"), sorted(fresh), unused


# ----------------------------------------------------------------------------- main entry
def make_model(config, spec: TaskSpec) -> nn.Module:
  """The model of ``config`` for the task ``spec`` describes."""
  return build_model(ml_collections.FrozenConfigDict(config), model_kind=spec.model_kind,
                     vocab_size=spec.vocab_size, num_classes=spec.num_classes, pad_id=PAD_ID)


def validate_config(config) -> None:
  if config.batch_size <= 0 or config.num_train_steps <= 0:
    raise ValueError("config.batch_size and config.num_train_steps must be positive")
  if config.eval_dtype not in ("", "float32", "bfloat16"):
    raise ValueError(f"config.eval_dtype={config.eval_dtype!r}; choose '', 'float32' or "
                     "'bfloat16'")
  if config.init_from and not os.path.isdir(config.init_from):
    raise FileNotFoundError(f"config.init_from={config.init_from!r} is not a directory")


def _load_splits(config, spec) -> dict[str, dict[str, np.ndarray]]:
  task = get_task(config.task)
  splits = {}
  for split in SPLITS:
    arrays = task.load_split(config, split)
    check_split_arrays(arrays, spec, f"task {config.task!r} split {split!r}")
    splits[split] = arrays
  return splits


def _eval_config(config) -> ml_collections.ConfigDict:
  eval_config = ml_collections.ConfigDict(config.to_dict())
  if config.eval_dtype:
    eval_config.model.dtype = config.eval_dtype
  return eval_config


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it holds checkpoints) and returns result.json."""
  validate_config(config)
  config = config_lib.run_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.write_json(os.path.join(workdir, workdir_lib.CONFIG_FILE),
                         json.loads(config.to_json_best_effort()))
  writer = workdir_lib.MetricsWriter(workdir)

  task = get_task(config.task)
  spec = task.spec(config)
  splits = _load_splits(config, spec)
  model = make_model(config, spec)
  eval_model = make_model(_eval_config(config), spec)

  devices = jax.local_devices()
  if config.batch_size % len(devices):
    raise ValueError(f"config.batch_size={config.batch_size} must be divisible by the "
                     f"{len(devices)} local devices")
  mesh = Mesh(np.array(devices), ("data",))
  batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
  replicated = NamedSharding(mesh, PartitionSpec())

  rng = jax.random.key(config.seed)
  init_rng, dropout_rng = jax.random.split(rng)
  sample = {key: value[:1] for key, value in splits["train"].items()}
  variables = jax.jit(lambda r: model.init(r, sample, deterministic=True))(init_rng)
  variables = flax.core.unfreeze(variables)
  for name in AUX_COLLECTIONS:
    variables.pop(name, None)
  params = variables.pop("params")
  if config.init_from:
    params, fresh, unused = load_params_from(config.init_from, params)
    tqdm.write(f"init_from {config.init_from}: {len(fresh)} new parameters freshly "
               f"initialised {fresh}; {len(unused)} unused {unused}")
    writer.write(0, "init_from", {"fresh_params": len(fresh), "unused_params": len(unused)})
  state = TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(config),
                            model_state=variables or None)
  num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  tqdm.write(f"model: {num_params:,} parameters; {len(devices)} device(s): "
             f"{devices[0].platform}")

  manager = ocp.CheckpointManager(
      os.path.join(workdir, workdir_lib.CHECKPOINT_DIR),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
  start_step = 0
  if manager.latest_step() is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    start_step = int(state.step)
    tqdm.write(f"resumed from {workdir} at step {start_step}")
  state = jax.device_put(state, replicated)

  train_step = jax.jit(make_train_step(model), donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(eval_model))
  eval_cast = (lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)) \
      if config.eval_dtype == "bfloat16" else (lambda p: p)
  run_eval = lambda split, max_batches: evaluate(
      eval_step, eval_cast(state.params), state.model_state, splits[split], config.batch_size,
      batch_sharding, max_batches)

  batches = train_dataset(splits["train"], config.batch_size, config.seed)
  window: list[dict] = []
  progress = tqdm(range(start_step, config.num_train_steps), initial=start_step,
                  total=config.num_train_steps, desc=f"{config.task}/{config.attention.kind}",
                  dynamic_ncols=True, mininterval=2.0)
  for step in progress:
    batch = jax.device_put(batches[step], batch_sharding)
    state, metrics = train_step(state, batch, dropout_rng)
    window.append(metrics)
    done = step + 1
    if done % config.log_every_steps == 0 or done == config.num_train_steps:
      means = {k: float(np.mean([float(m[k]) for m in jax.device_get(window)]))
               for k in window[0]}
      window = []
      if not math.isfinite(means["loss"]):
        raise FloatingPointError(f"training loss became {means['loss']} at step {done}")
      writer.write(done, "train", means)
      progress.set_postfix(loss=f"{means['loss']:.4f}", acc=f"{means['accuracy']:.3f}")
    if done % config.eval_every_steps == 0 or done == config.num_train_steps:
      val = run_eval("val", config.num_eval_batches)
      writer.write(done, "val", val)
      progress.write(f"step {done}: val " + " ".join(f"{k}={v:.4f}" for k, v in val.items()))
    if done % config.checkpoint_every_steps == 0 or done == config.num_train_steps:
      manager.save(done, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()

  final_step = int(state.step)
  val = run_eval("val", 0)
  test = run_eval("test", 0)
  writer.write(final_step, "test", test)
  majority = float(np.mean(splits["test"]["targets"] ==
                           np.bincount(splits["train"]["targets"]).argmax()))
  result = {"step": final_step, "val": val, "test": test,
            "majority_class_accuracy": majority, "num_params": num_params}
  workdir_lib.write_json(os.path.join(workdir, workdir_lib.RESULT_FILE), result)
  manager.close()
  return result
