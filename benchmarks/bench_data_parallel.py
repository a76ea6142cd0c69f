"""Data-parallel training on the local devices: step speed and the loss curve; prints tables.

  python -m benchmarks.bench_data_parallel            # every local GPU, LRA ListOps shape, bf16
  python -m benchmarks.bench_data_parallel \\
      --variants=bf16:cudnn,bf16:kind=dfss+nm=2:4+backend=triton --devices=1,2 \\
      --per_device_batch=32 --curve_batch=64 --curve_steps=200 --out=FILE

The trainer's layout (``lra_sparse.train``): parameters and optimizer state replicated over a
one-axis ("data") mesh of the first n devices, each batch split along it, the step traced
under that mesh so the attention kernels run per device on its shard
(``ops.sharding.per_data_shard``).

- speed: the full train step (forward, backward, AdamW update) at a global batch of
  n x --per_device_batch on n devices, median wall time of --reps steps after --warmup; the
  last column is the throughput in steps/s against one device (with n times the examples per
  step, n = perfect scaling).
- curve: --curve_steps steps from the same initial state on the same random batches at the one
  global batch --curve_batch: on one device, on n devices, and in float32 on --fp32_devices
  devices (the rounding scale of the bf16 run: a data-parallel curve that stays as close to the
  one-device curve as the float32 one does differs by rounding alone).

Variants are ``bench_train_step``'s (dtype:attention); random tokens, so no data is needed.
"""
from __future__ import annotations

from absl import flags
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from benchmarks import harness
from lra_sparse import cli
from lra_sparse import train
from lra_sparse.data import get_task

# --variants, --config, --length, --min_real_length, --overrides, --attention_dropout, --warmup,
# --reps and --out are bench_train_step's flags (harness.define_train_step_flags); the
# variants' default is set below.
harness.define_train_step_flags()
flags.DEFINE_list("devices", [], "Device counts to compare (default: 1 and every local device).")
flags.DEFINE_bool("speed", True, "Time the steps (false: the loss curves only).")
flags.DEFINE_integer("per_device_batch", 32, "speed: examples per device and step.")
flags.DEFINE_integer("curve_batch", 64, "curve: the global batch of every curve.")
flags.DEFINE_integer("curve_steps", 200, "curve: steps per curve (0: no curves).")
flags.DEFINE_bool("fp32_curve", True, "curve: also the float32 curve of each "
                  "half-precision variant (the rounding scale).")
flags.DEFINE_integer("fp32_devices", 1, "curve: devices of the float32 curve (more where one "
                     "lacks the memory: XLA's float32 dense attention at LRA ListOps' length "
                     "asks about 80 GiB at batch 64).")
flags.adopt_module_key_flags(harness)
FLAGS = flags.FLAGS
FLAGS.set_default("variants", ["bf16:cudnn", "bf16:kind=dfss+nm=2:4+backend=triton"])

CURVE_MARKS = (1, 50, 100, 150, 200)


class DataParallelStep:
  """The trainer's step for ``variant`` on the first ``num_devices`` devices."""

  def __init__(self, variant: str, num_devices: int, global_batch: int):
    available = jax.devices()
    if not 1 <= num_devices <= len(available):
      raise ValueError(f"{num_devices} devices asked for; {len(available)} available")
    if global_batch % num_devices:
      raise ValueError(f"global batch {global_batch} does not split over {num_devices} devices")
    self.config = harness.make_config(
        variant, config_path=FLAGS.config, batch=global_batch, length=FLAGS.length,
        overrides=harness.step_overrides())
    self.spec = get_task(self.config.task).spec(self.config)
    model = train.make_model(self.config, self.spec)
    mesh = Mesh(np.array(available[:num_devices]), ("data",))
    self.batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    sample = self.batch(np.random.default_rng(0))
    self.state = jax.device_put(harness.init_state(self.config, model, sample),
                                NamedSharding(mesh, PartitionSpec()))
    self.step = train.in_mesh(jax.jit(train.make_train_step(model), donate_argnums=(0,)),
                              mesh)
    self.key = jax.random.key(1)

  def batch(self, rng: np.random.Generator) -> dict:
    data = harness.random_batch(self.spec, self.config.batch_size,
                                self.config.data.max_length, rng, FLAGS.min_real_length)
    return jax.device_put(data, self.batch_sharding)

  def __call__(self, data):
    self.state, metrics = self.step(self.state, data, self.key)
    return metrics


def time_steps(variant: str, num_devices: int) -> float:
  """Median seconds per step at n x --per_device_batch on n devices (one batch, reused)."""
  run = DataParallelStep(variant, num_devices, num_devices * FLAGS.per_device_batch)
  data = run.batch(np.random.default_rng(0))
  return harness.median_seconds(lambda: run(data), warmup=FLAGS.warmup, reps=FLAGS.reps)


def loss_curve(variant: str, num_devices: int) -> np.ndarray:
  """Train losses of --curve_steps steps; batch i is drawn from seed i, the same for every run."""
  run = DataParallelStep(variant, num_devices, FLAGS.curve_batch)
  losses = []
  for i in range(FLAGS.curve_steps):
    losses.append(run(run.batch(np.random.default_rng(1000 + i)))["loss"])
  return np.asarray(jax.device_get(losses), np.float64)


def speed_rows(variant: str, counts) -> list[tuple]:
  rows, base = [], None
  for n in counts:
    seconds = time_steps(variant, n)
    base = base or seconds
    rows.append((variant, str(n), str(n * FLAGS.per_device_batch), f"{seconds * 1e3:.1f}",
                 f"{1 / seconds:.2f}", f"{n * base / seconds:.2f}"))
    print(rows[-1], flush=True)
  return rows


def curve_rows(variant: str, counts) -> list[tuple]:
  curves = {"1 device": loss_curve(variant, 1)}
  for n in counts:
    if n > 1:
      curves[f"{n} devices"] = loss_curve(variant, n)
  dtype, attention = variant.split(":", 1)
  if FLAGS.fp32_curve and dtype != "fp32":   # the rounding scale: the same run in float32
    # cuDNN attention takes half precision only; in float32 the same attention runs on XLA.
    fp32_attention = "xla" if attention in ("cudnn", "cudnn_bias") else attention
    n = FLAGS.fp32_devices
    curves[f"{n} device{'s' if n > 1 else ''}, fp32"] = loss_curve("fp32:" + fp32_attention, n)
  reference = curves["1 device"]
  rows = []
  for name, curve in curves.items():
    diff = np.abs(curve - reference)
    marks = [f"{curve[m - 1]:.4f}" for m in CURVE_MARKS if m <= len(curve)]
    rows.append((variant, name, *marks, f"{diff.max():.2e}", f"{diff.mean():.2e}"))
    print(rows[-1], flush=True)
  return rows


def main(argv):
  del argv
  counts = sorted({int(n) for n in FLAGS.devices} or {1, jax.local_device_count()})
  if not FLAGS.speed and not FLAGS.curve_steps:
    raise ValueError("--speed=false with --curve_steps=0: nothing to measure")
  if counts[0] != 1:
    raise ValueError(f"--devices={','.join(FLAGS.devices)} must include 1 (the baseline)")
  speed, curves = [], []
  for variant in FLAGS.variants:
    if FLAGS.speed:
      speed += speed_rows(variant, counts)
    if FLAGS.curve_steps:
      curves += curve_rows(variant, counts)
  text = (f"Data-parallel training; {len(jax.devices())} devices; {harness.run_header()}; "
          f"{harness.gpu_state()}\n")
  if speed:
    text += (f"\nSpeed (global batch = devices x {FLAGS.per_device_batch}):\n\n" +
             harness.markdown_table(("variant", "devices", "global batch", "ms/step", "steps/s",
                                     "examples/s vs 1 device"), speed) + "\n")
  if curves:
    marks = tuple(f"loss @{m}" for m in CURVE_MARKS if m <= FLAGS.curve_steps)
    text += (f"\nLoss curves ({FLAGS.curve_steps} steps, global batch {FLAGS.curve_batch}, "
             "same batches; differences against the one-device run):\n\n" +
             harness.markdown_table(("variant", "run", *marks, "max |diff|", "mean |diff|"),
                                    curves) + "\n")
  harness.emit(text, FLAGS.out)


if __name__ == "__main__":
  cli.run(main)
