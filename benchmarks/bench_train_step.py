"""Times one LRA-default training step per attention setting; prints a table.

  python -m benchmarks.bench_train_step [--variants=fp32:xla,bf16:xla,bf16:cudnn] \
      [--batch=32 --length=2000] [--out=FILE]
  python -m benchmarks.bench_train_step --variants=bf16:kind=dfss+nm=2:4,bf16:kind=dsa+sparsity=0.9
  python -m benchmarks.bench_train_step --config=configs/pathfinder.py \
      --variants=bf16:cudnn,bf16:kind=dfss   # Pathfinder-32: batch 512, 1024 pixels, head dim 4

Random tokens (no data needed; --min_real_length pads them as a loader does), the full trainer
step (forward, backward, AdamW update), median wall time of --reps steps after --warmup steps,
all variants in one process. Attention dropout is 0 unless --attention_dropout says otherwise
(the task configs' default is LRA's 0.1, which no cuDNN variant can train with).
"""
from __future__ import annotations

import os
import time

from absl import app, flags
import jax
import ml_collections
import numpy as np

from lra_sparse import train
from lra_sparse.config import load_config_file
from lra_sparse.data import get_task

LISTOPS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs",
                              "listops.py")

flags.DEFINE_list("variants", ["fp32:xla", "bf16:xla", "bf16:cudnn"],
                  "dtype:attention entries; attention is a dense implementation "
                  "(xla|cudnn|reference) or kind=<kind>[+field=value...] with fields of "
                  "config.attention.<kind> (e.g. kind=dfss+nm=1:2+backend=reference).")
flags.DEFINE_string("config", LISTOPS_CONFIG, "Config file (LRA defaults of its task).")
flags.DEFINE_integer("batch", None, "Global batch size (default: the config's).")
flags.DEFINE_integer("length", None, "Tokens per example (default: the config's max_length).")
flags.DEFINE_list("overrides", [], "key=value config overrides for every variant, e.g. "
                  "data.mask_black_pixels=false.")
flags.DEFINE_float("attention_dropout", 0.0,
                   "model.attention_dropout_rate of every variant. 0 (default): the attention "
                   "paths' speed as every recorded table measured it (cuDNN, e.g. bf16:cudnn, "
                   "has no dropout); 0.1: LRA's, the task configs' default (dense then trains "
                   "on XLA, DFSS on its fused kernels).")
flags.DEFINE_integer("min_real_length", None,
                     "Pad the batch as a loader does: real lengths uniform in [this, length], "
                     "the rest the pad id 0 (default: every token real). ListOps data (lengths "
                     "500-2000 in a 2000 window) is about --min_real_length=500.")
flags.DEFINE_integer("warmup", 3, "Untimed steps after compilation.")
flags.DEFINE_integer("reps", 10, "Timed steps.")
flags.DEFINE_string("out", "", "Also write the table here.")
FLAGS = flags.FLAGS


def make_config(variant: str, *, config_path: str = LISTOPS_CONFIG, batch=None,
                length=None, overrides=()) -> ml_collections.ConfigDict:
  dtype, attention = variant.split(":", 1)
  config = load_config_file(config_path)
  config.model.dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
  for item in overrides:
    key, value = item.split("=", 1)
    current = config
    *parents, field = key.split(".")
    for parent in parents:
      current = current[parent]
    old = current[field]
    current[field] = value.lower() == "true" if isinstance(old, bool) else type(old)(value)
  if length is not None:
    config.data.max_length = length
  if batch is not None:
    config.batch_size = batch
  if attention.startswith("kind="):
    kind, *fields = attention.split("+")
    kind = kind.split("=", 1)[1]
    config.attention.kind = kind
    for item in fields:
      key, value = item.split("=", 1)
      current = config.attention[kind][key]
      config.attention[kind][key] = (value.lower() == "true" if isinstance(current, bool)
                                     else type(current)(value))
  else:
    config.attention.dense.implementation = attention
  return config


def step_overrides() -> list[str]:
  """The overrides every variant gets from the flags: --attention_dropout, then --overrides."""
  return [f"model.attention_dropout_rate={FLAGS.attention_dropout}", *FLAGS.overrides]


def random_batch(spec, batch: int, length: int, rng: np.random.Generator,
                 min_real_length=None) -> dict:
  """Random tokens and labels; padded with 0 after a real length uniform in
  [min_real_length, length] when that is given (as a loader pads)."""
  data = {"inputs": rng.integers(1, spec.vocab_size, (batch, length), np.int32),
          "targets": rng.integers(0, spec.num_classes, (batch,), np.int32)}
  if min_real_length is not None:
    if not 1 <= min_real_length <= length:
      raise ValueError(f"--min_real_length={min_real_length} must be in [1, {length}]")
    real = rng.integers(min_real_length, length + 1, (batch,))
    data["inputs"] = np.where(np.arange(length)[None] < real[:, None], data["inputs"], 0)
  return data


def init_state(config: ml_collections.ConfigDict, model, data) -> train.TrainState:
  """The trainer's state of ``model`` (initialised from key 0 on ``data``'s shapes)."""
  variables = dict(jax.jit(lambda r: model.init(r, data, deterministic=True))(
      jax.random.key(0)))
  variables.pop("aux_loss", None)
  variables.pop("aux_metrics", None)
  params = variables.pop("params")
  return train.TrainState.create(apply_fn=model.apply, params=params,
                                 tx=train.make_optimizer(config), model_state=variables or None)


def build_step(variant: str, *, config_path: str = LISTOPS_CONFIG, batch=None, length=None,
               overrides=(), min_real_length=None):
  """(jitted train step, its state, a random batch, an rng key) of one variant: random tokens,
  padded with 0 after a real length uniform in [min_real_length, length] when that is given."""
  config = make_config(variant, config_path=config_path, batch=batch, length=length,
                       overrides=overrides)
  spec = get_task(config.task).spec(config)
  model = train.make_model(config, spec)
  data = random_batch(spec, config.batch_size, config.data.max_length,
                      np.random.default_rng(0), min_real_length)
  state = init_state(config, model, data)
  step = jax.jit(train.make_train_step(model), donate_argnums=(0,))
  return step, state, data, jax.random.key(1)


def time_variant(variant: str, *, warmup: int, reps: int, config_path: str = LISTOPS_CONFIG,
                 batch=None, length=None, overrides=(),
                 min_real_length=None) -> tuple[float, float]:
  """(median seconds per train step, last loss) of one variant (``build_step``)."""
  step, state, data, key = build_step(variant, config_path=config_path, batch=batch,
                                      length=length, overrides=overrides,
                                      min_real_length=min_real_length)
  for _ in range(1 + warmup):
    state, metrics = step(state, data, key)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    state, metrics = step(state, data, key)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return float(np.median(times)), float(metrics["loss"])


def main(argv):
  del argv
  rows = []
  for variant in FLAGS.variants:
    try:
      seconds, loss = time_variant(variant, config_path=FLAGS.config, batch=FLAGS.batch,
                                   length=FLAGS.length, warmup=FLAGS.warmup, reps=FLAGS.reps,
                                   overrides=step_overrides(),
                                   min_real_length=FLAGS.min_real_length)
      rows.append((variant, f"{seconds * 1e3:.1f}", f"{1 / seconds:.2f}", f"{loss:.3f}"))
    except Exception as e:  # one failing variant must not hide the others
      rows.append((variant, "failed", type(e).__name__, str(e).splitlines()[0][:80]))
    print(rows[-1], flush=True)
  device = jax.devices()[0]
  config = make_config("bf16:xla", config_path=FLAGS.config, batch=FLAGS.batch,
                       length=FLAGS.length, overrides=step_overrides())
  model = config.model
  header = (f"{config.task} train step ({os.path.relpath(FLAGS.config)}): batch "
            f"{config.batch_size}, length {config.data.max_length}, {model.num_layers} layers, "
            f"{model.emb_dim} wide, {model.num_heads} heads of "
            f"{model.qkv_dim // model.num_heads}; device {device.device_kind}; jax "
            f"{jax.__version__}; attention dropout {model.attention_dropout_rate:g}; median of "
            f"{FLAGS.reps} after {FLAGS.warmup} warm-up"
            + (f"; real lengths uniform in [{FLAGS.min_real_length}, "
               f"{config.data.max_length}], then padding" if FLAGS.min_real_length else "")
            + "\n\n")
  table = ("| variant | ms/step | steps/s | loss |\n|---|---|---|---|\n" +
           "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n")
  print(header + table)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(header + table)


if __name__ == "__main__":
  app.run(main)
