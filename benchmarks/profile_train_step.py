"""Where a training step's device time goes: the GPU kernels of one step, by model scope.

  python -m benchmarks.profile_train_step --variants=bf16:cudnn,bf16:kind=dsa+vector=8 \
      [--min_real_length=500] [--steps=4] [--top=30] [--json=FILE]

Per variant (the entries of ``benchmarks.bench_train_step``; its flags --config, --batch,
--length, --overrides, --attention_dropout, --min_real_length and --warmup apply): the step is compiled and warmed
up, then ``--steps`` steps run under ``jax.profiler.trace`` (with its Perfetto JSON).  The
kernels the GPU ran are summed by name and divided by the step count.  The trace names a
kernel by its XLA fusion, not by the model code, so XLA also dumps the optimized HLO of the
train step and each fusion gets the ``op_name`` of its metadata, shortened to a scope:
"fwd|bwd <innermost module>/<op>" (e.g. "bwd DSAAttention_0/blhd,blhe->bhde"), or the
kernel's own name for custom kernels (Triton, Mosaic GPU, cuDNN, cuBLAS).  Prints, per variant:
the kernels' ms per step summed and the wall ms per step, the top kernels, and the ms per
scope.  --json keeps every kernel with its scope and ms per step, to compare variants off the
machine.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time

from absl import app, flags
import jax

from benchmarks import bench_train_step

flags.DEFINE_integer("steps", 4, "Profiled steps per variant.")
flags.DEFINE_integer("top", 30, "Kernels and scopes listed per variant.")
flags.DEFINE_string("json", "", "Write every variant's kernels, scopes and ms here.")
FLAGS = flags.FLAGS

_SUMMARY_THREADS = ("XLA Ops", "XLA Modules", "Steps")   # repeat the kernels' time


def device_events(trace_dir: str):
  """(name, duration us) of every kernel a GPU ran in the trace under ``trace_dir``."""
  paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise RuntimeError(f"jax.profiler wrote no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(sorted(paths)[-1]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
             and "/device:" in str(e.get("args", {}).get("name", ""))}
  threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in devices and not any(
        s in threads.get((e["pid"], e.get("tid")), "") for s in _SUMMARY_THREADS):
      yield e["name"], float(e.get("dur", 0.0))


def fusion_scopes(dump_dir: str) -> dict[str, str]:
  """instruction name -> scope, from the optimized HLO of the train step in ``dump_dir``."""
  paths = glob.glob(os.path.join(dump_dir, "*jit_train_step*after_optimizations.txt"))
  scopes = {}
  for path in paths:
    with open(path) as f:
      for line in f:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*metadata=\{[^}]*op_name=\"([^\"]*)\"", line)
        if m:
          scopes[m.group(1)] = scope_of(m.group(2))
  return scopes


def scope_of(op_name: str) -> str:
  """"fwd|bwd <innermost module>/<op>" of an XLA op_name such as
  jit(train_step)/transpose(jvp(Classifier))/encoder/block_1/attention/DSAAttention_0/mul
  (the op: the first part after the module that is not a nested jit, e.g. an einsum spec)."""
  parts = [p for p in op_name.split(";")[0].split("/") if p]
  direction = "bwd" if any(p.startswith("transpose(") for p in parts) else "fwd"
  plain = [i for i, p in enumerate(parts[:-1]) if "(" not in p and "->" not in p]
  if not plain:
    return f"{direction} {parts[-1] if parts else '?'}"
  module = plain[-1]
  op = next((p for p in parts[module + 1:] if not p.startswith("jit(")), parts[-1])
  return f"{direction} {parts[module]}/{op}"


def kernel_scope(name: str, scopes: dict[str, str]) -> str:
  for candidate in (name, re.sub(r"_(\d+)$", r".\1", name)):
    if candidate in scopes:
      return scopes[candidate]
  return "kernel " + re.sub(r"_\d+$", "", name)[:48]


def profile(variant: str, steps: int, dump_dir: str):
  step, state, data, key = bench_train_step.build_step(
      variant, config_path=FLAGS.config, batch=FLAGS.batch, length=FLAGS.length,
      overrides=bench_train_step.step_overrides(), min_real_length=FLAGS.min_real_length)
  for _ in range(1 + FLAGS.warmup):
    state, metrics = step(state, data, key)
  jax.block_until_ready(metrics)
  scopes = fusion_scopes(dump_dir)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      start = time.perf_counter()
      for _ in range(steps):
        state, metrics = step(state, data, key)
      jax.block_until_ready(metrics)
      wall = (time.perf_counter() - start) / steps
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for name, dur in device_events(trace_dir):
      kernels[name][0] += dur / 1e3 / steps
      kernels[name][1] += 1
  return wall * 1e3, {name: {"ms": ms, "calls": n / steps, "scope": kernel_scope(name, scopes)}
                      for name, (ms, n) in kernels.items()}


def main(argv):
  del argv
  report = {}
  with tempfile.TemporaryDirectory() as dump_dir:
    # Read when the GPU backend starts (below): the train steps' optimized HLO, for the scopes.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=train_step"
                               " --xla_dump_hlo_pass_re=NONE")
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    for variant in FLAGS.variants:
      for old in glob.glob(os.path.join(dump_dir, "*")):   # the previous variant's dump
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
      wall, kernels = profile(variant, FLAGS.steps, dump_dir)
      report[variant] = {"wall_ms": wall, "kernels": kernels}
      total = sum(k["ms"] for k in kernels.values())
      print(f"\n## {variant}: kernels {total:.2f} ms per step, wall {wall:.2f} ms per step\n\n"
            "| kernel | scope | ms/step | calls/step |\n|---|---|---|---|")
      for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])[:FLAGS.top]:
        print(f"| {name[:60]} | {k['scope'][:60]} | {k['ms']:.3f} | {k['calls']:g} |")
      by_scope = collections.Counter()
      for k in kernels.values():
        by_scope[k["scope"]] += k["ms"]
      print("\n| scope | ms/step |\n|---|---|")
      for scope, ms in by_scope.most_common(FLAGS.top):
        print(f"| {scope} | {ms:.3f} |")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
