"""Profiles: tracing train steps of a run (``ProfileWindow``, ``config.profile_steps``), and where
a jitted step's device time goes: the GPU kernels of a ``jax.profiler`` trace, by name and by
model scope.

A trace names a kernel by its XLA fusion, not by the model code. With the optimized HLO of the
jitted function dumped next to it (``xla_dump_flags``, set in ``XLA_FLAGS`` before the backend
starts), each fusion gets the ``op_name`` of its metadata, shortened to a scope:
"fwd|bwd <innermost module>/<op>" (e.g. "bwd DSAAttention_0/blhd,blhe->bhde"), or
"kernel <name>" for custom kernels (Triton, Mosaic GPU, cuDNN, cuBLAS) that carry no HLO
metadata. Used by ``benchmarks/profile_train_step.py``; also reads the trace a training run
writes with ``config.profile_steps`` (``<workdir>/profile/``; its scopes need the HLO dump).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from typing import Iterator, Optional

import jax

from lra_sparse.distributed import say

# Threads of a device's trace that repeat its kernels' time as summaries.
_SUMMARY_THREADS = ("XLA Ops", "XLA Modules", "Steps")


def xla_dump_flags(dump_dir: str, module: str = "train_step") -> str:
  """``XLA_FLAGS`` words that dump the optimized HLO of the jitted ``module`` (a function's
  name) into ``dump_dir``, as ``fusion_scopes`` reads it."""
  return (f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re={module}"
          " --xla_dump_hlo_pass_re=NONE")


def device_events(trace_dir: str) -> Iterator[tuple[str, float]]:
  """(name, duration us) of every kernel a GPU ran in the trace under ``trace_dir`` (the
  newest ``perfetto_trace.json.gz``, as ``jax.profiler.trace(create_perfetto_trace=True)``
  writes it)."""
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


def fusion_scopes(dump_dir: str, module: str = "train_step") -> dict[str, str]:
  """instruction name -> scope, from the optimized HLO of the jitted ``module`` in
  ``dump_dir``."""
  paths = glob.glob(os.path.join(dump_dir, f"*jit_{module}*after_optimizations.txt"))
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
  """The scope of the kernel ``name`` (a fusion of ``scopes``, or 'kernel <name>')."""
  for candidate in (name, re.sub(r"_(\d+)$", r".\1", name)):
    if candidate in scopes:
      return scopes[candidate]
  return "kernel " + re.sub(r"_\d+$", "", name)[:48]


def kernel_times(trace_dir: str, steps: int, scopes: dict[str, str]) -> dict[str, dict]:
  """kernel name -> {"ms", "calls", "scope"}: its time and launches per step, over a trace
  of ``steps`` steps."""
  kernels = collections.defaultdict(lambda: [0.0, 0])
  for name, dur in device_events(trace_dir):
    kernels[name][0] += dur / 1e3 / steps
    kernels[name][1] += 1
  return {name: {"ms": ms, "calls": n / steps, "scope": kernel_scope(name, scopes)}
          for name, (ms, n) in kernels.items()}


def scope_times(kernels: dict[str, dict]) -> collections.Counter:
  """scope -> ms per step, summed over ``kernel_times``' kernels."""
  by_scope = collections.Counter()
  for k in kernels.values():
    by_scope[k["scope"]] += k["ms"]
  return by_scope


# ----------------------------------------------------------------------------- tracing a run
def parse_profile_steps(text: str) -> Optional[tuple[int, int]]:
  """``config.profile_steps`` ``"START:STOP"`` -> (START, STOP); ``""`` -> None (no trace)."""
  if text == "":
    return None
  match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text) if isinstance(text, str) else None
  if match is None:
    problem = "it is not two integers separated by ':'"
  elif int(match.group(1)) >= int(match.group(2)):
    problem = f"START={int(match.group(1))} is not below STOP={int(match.group(2))}"
  else:
    return int(match.group(1)), int(match.group(2))
  raise ValueError(f"config.profile_steps={text!r}: {problem}; use 'START:STOP' with integers "
                   "0 <= START < STOP (train steps START..STOP-1 are traced), or '' (no trace)")


class ProfileWindow:
  """A ``jax.profiler`` trace of train steps [start, stop) (0-based update indices) in
  ``log_dir`` (``plugins/profile/<time>/``, as TensorBoard's profile plugin reads it).

  The trainer calls ``before_step`` and ``after_step`` around each train step: the device work
  before the window is finished before the trace starts, and the outputs of its last step
  before it stops. A run resumed inside the window traces the rest of it. ``stop`` ends a trace
  still running (given outputs, it waits for them first): the trainer calls it when a step
  failed inside the window.
  """

  def __init__(self, steps: Optional[tuple[int, int]], log_dir: str):
    self.steps = steps
    self.log_dir = log_dir
    self._first: Optional[int] = None      # the first traced step while a trace runs
    self._last: Optional[int] = None

  def before_step(self, step: int, state) -> None:
    if self.steps is None or self._first is not None:
      return
    start, stop = self.steps
    if start <= step < stop:
      jax.block_until_ready(state)
      jax.profiler.start_trace(self.log_dir)
      self._first = step
      say(f"profile: tracing train steps {step}..{stop - 1} into {self.log_dir}")

  def after_step(self, step: int, outputs) -> None:
    if self._first is None:
      return
    self._last = step
    if step + 1 >= self.steps[1]:
      self.stop(outputs)

  def stop(self, outputs=None) -> None:
    if self._first is None:
      return
    try:
      if outputs is not None:
        jax.block_until_ready(outputs)
    finally:
      jax.profiler.stop_trace()
      traced = (f"steps {self._first}..{self._last}" if self._last is not None
                else "no complete step")
      self._first = self._last = None
      say(f"profile: trace of train {traced} written to {self.log_dir}")
