"""Where a training step's device time goes: the GPU kernels of one step, by model scope.

  python -m benchmarks.profile_train_step --variants=bf16:cudnn,bf16:kind=dsa+vector=8 \
      [--min_real_length=500] [--steps=4] [--top=30] [--json=FILE]

Per variant (the entries of ``benchmarks.bench_train_step``; its flags --config, --batch,
--length, --overrides, --attention_dropout, --min_real_length and --warmup apply): the step is
compiled and warmed up, then ``--steps`` steps run under ``jax.profiler.trace`` (with its
Perfetto JSON).  The kernels the GPU ran are summed by name and divided by the step count.  The
trace names a kernel by its XLA fusion, not by the model code, so XLA also dumps the optimized
HLO of the train step and each fusion gets the ``op_name`` of its metadata, shortened to a scope
(``lra_sparse.profiling``): "fwd|bwd <innermost module>/<op>" (e.g. "bwd
DSAAttention_0/blhd,blhe->bhde"), or the kernel's own name for custom kernels (Triton, Mosaic
GPU, cuDNN, cuBLAS).  Prints, per variant:
the kernels' ms per step summed and the wall ms per step, the top kernels, and the ms per
scope.  --json keeps every kernel with its scope and ms per step, to compare variants off the
machine.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time

from absl import app, flags
import jax

from benchmarks import harness
from lra_sparse import profiling

harness.define_train_step_flags()
flags.DEFINE_integer("steps", 4, "Profiled steps per variant.")
flags.DEFINE_integer("top", 30, "Kernels and scopes listed per variant.")
flags.DEFINE_string("json", "", "Write every variant's kernels, scopes and ms here.")
flags.adopt_module_key_flags(harness)
FLAGS = flags.FLAGS


def profile(variant: str, steps: int, dump_dir: str):
  """(wall ms per step, ``profiling.kernel_times``) of ``steps`` traced steps of ``variant``."""
  step, state, data, key = harness.build_step(
      variant, config_path=FLAGS.config, batch=FLAGS.batch, length=FLAGS.length,
      overrides=harness.step_overrides(), min_real_length=FLAGS.min_real_length)
  for _ in range(1 + FLAGS.warmup):
    state, metrics = step(state, data, key)
  jax.block_until_ready(metrics)
  scopes = profiling.fusion_scopes(dump_dir)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      start = time.perf_counter()
      for _ in range(steps):
        state, metrics = step(state, data, key)
      jax.block_until_ready(metrics)
      wall = (time.perf_counter() - start) / steps
    return wall * 1e3, profiling.kernel_times(trace_dir, steps, scopes)


def main(argv):
  del argv
  report = {}
  with tempfile.TemporaryDirectory() as dump_dir:
    # Read when the GPU backend starts (below): the train steps' optimized HLO, for the scopes.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + profiling.xla_dump_flags(dump_dir))
    print(harness.run_header(), flush=True)
    for variant in FLAGS.variants:
      for old in glob.glob(os.path.join(dump_dir, "*")):   # the previous variant's dump
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
      wall, kernels = profile(variant, FLAGS.steps, dump_dir)
      report[variant] = {"wall_ms": wall, "kernels": kernels}
      total = sum(k["ms"] for k in kernels.values())
      top = sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])[:FLAGS.top]
      print(f"\n## {variant}: kernels {total:.2f} ms per step, wall {wall:.2f} ms per step\n")
      print(harness.markdown_table(
          ["kernel", "scope", "ms/step", "calls/step"],
          [(name[:60], k["scope"][:60], f"{k['ms']:.3f}", f"{k['calls']:g}") for name, k in top]))
      print()
      print(harness.markdown_table(["scope", "ms/step"], [
          (scope, f"{ms:.3f}")
          for scope, ms in profiling.scope_times(kernels).most_common(FLAGS.top)]))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
