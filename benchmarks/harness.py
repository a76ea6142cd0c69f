"""What the benchmarks share: timing, input sets, markdown tables, LRA train steps.

Timing (all report a median after warm-up; each benchmark keeps the method it was measured
with, so its old and new tables compare):

* ``chained_ms`` / ``interleaved_chained_ms``: ``steps`` calls of a function chained in ONE jit
  (``lax.scan`` over stacked input sets; a piece of every output of every call feeds the carry,
  so no call is dead code) and the jit timed as a whole: no per-call dispatch or launch cost.
* ``time_fn``: bursts of back-to-back calls of a jitted function, inputs rotated.
* ``median_seconds``: one call at a time, blocked on (train steps, eager attention kinds).

Inputs: ``parse_shapes`` (``--shapes=32x1024,16x2048``), ``attention_sets`` / ``stack_sets``
(random q, k, v, cotangent of [batch, length, heads, head_dim]), ``normal_sets``, key padding
masks, and the forward / forward+backward passes every attention benchmark times.

Tables: ``run_header`` (device, jax version, commit, date), ``gpu_state`` (nvidia-smi clocks),
``markdown_table``, ``emit`` / ``emit_table`` (print, and write ``--out``).

Train steps: the flags and builders of one LRA training step per ``dtype:attention`` variant
(``bench_train_step``, ``bench_nystrom``, ``bench_data_parallel``, ``profile_train_step``).

Also ``load_module`` (an older copy of a module, for A/B runs in one process) and ``swapped``
(module attributes replaced while a function traces).

Flags are defined only by the ``define_*_flags`` functions, which a benchmark calls (then
``flags.adopt_module_key_flags(harness)`` lists them in its ``--help``).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence

from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lra_sparse import train
from lra_sparse.config import load_config_file
from lra_sparse.data import get_task

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTOPS_CONFIG = os.path.join(REPO, "configs", "listops.py")

# The papers' defaults: bf16 runs DFSS 2:4, fp32 runs 1:2.
NM_DTYPES = {"bf16": (jnp.bfloat16, 2, 4), "fp32": (jnp.float32, 1, 2)}


# --------------------------------------------------------------------------- flags
def define_shape_flags(shapes: str = "32x1024,16x2048,8x4096") -> None:
  """--shapes (BATCHxLENGTH list), --heads and --dim of the attention benchmarks."""
  flags.DEFINE_string("shapes", shapes, "Comma-separated BATCHxLENGTH list.")
  flags.DEFINE_integer("heads", 4, "Attention heads.")
  flags.DEFINE_integer("dim", 64, "Head dimension.")


def define_chain_flags(steps: int = 20, rounds: int = 7) -> None:
  """--steps and --rounds of ``chained_ms``."""
  flags.DEFINE_integer("steps", steps, "Calls chained in one jit (lax.scan).")
  flags.DEFINE_integer("rounds", rounds, "Timed rounds (median).")


def define_train_step_flags() -> None:
  """The flags of ``bench_train_step`` (also read by the benchmarks built on its steps)."""
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
                       "the rest the pad id 0 (default: every token real). ListOps data "
                       "(lengths 500-2000 in a 2000 window) is about --min_real_length=500.")
  flags.DEFINE_integer("warmup", 3, "Untimed steps after compilation.")
  flags.DEFINE_integer("reps", 10, "Timed steps.")
  flags.DEFINE_string("out", "", "Also write the table here.")


# --------------------------------------------------------------------------- timing
def chained(fn: Callable, steps: int) -> Callable:
  """jit(xs -> a float32 scalar): ``fn(*xs[i])`` for i < ``steps`` in one ``lax.scan``, the
  first element of every output leaf added to the carry (so no call is dead code)."""
  def body(carry, x):
    outs = fn(*x)
    first = sum(o.reshape(-1)[0].astype(jnp.float32) for o in jax.tree_util.tree_leaves(outs))
    return carry + first, None

  return jax.jit(lambda xs: jax.lax.scan(body, jnp.float32(0), xs, length=steps)[0])


def _chained_call_ms(run: Callable, xs, steps: int) -> float:
  """ms per chained call of one timed run of ``run`` (a ``chained`` function) on ``xs``."""
  t0 = time.perf_counter()
  run(xs).block_until_ready()
  return (time.perf_counter() - t0) / steps * 1e3


def chained_ms(fn: Callable, xs, steps: int, rounds: int, warmup: int = 2) -> float:
  """Median ms per call of ``fn`` over ``rounds`` timed runs of ``chained(fn, steps)`` on the
  stacked inputs ``xs`` (after ``warmup`` untimed runs, the first of which compiles)."""
  run = chained(fn, steps)
  for _ in range(warmup):
    run(xs).block_until_ready()
  return statistics.median([_chained_call_ms(run, xs, steps) for _ in range(rounds)])


def interleaved_chained_ms(methods: Sequence[tuple[str, Callable]], xs, steps: int,
                           rounds: int, warmup: int = 2) -> dict[str, float]:
  """``chained_ms`` of each (label, fn), the timed rounds interleaved across the methods (a
  clock drift hits all alike); NaN for a method that fails to compile or launch (e.g. tiles
  beyond the shared memory), said once."""
  runs = {}
  for label, fn in methods:             # compile + warm up
    run = chained(fn, steps)
    try:
      for _ in range(warmup):
        run(xs).block_until_ready()
      runs[label] = run
    except Exception as e:  # noqa: BLE001  one failing variant must not lose the others
      print(f"{label}: failed: {str(e).splitlines()[0][:300]}", flush=True)
  times = {label: [] for label in runs}
  for _ in range(rounds):
    for label, run in runs.items():
      times[label].append(_chained_call_ms(run, xs, steps))
  return {label: statistics.median(times[label]) if label in times else float("nan")
          for label, _ in methods}


def time_fn(fn: Callable, input_sets, target_s: float = 0.4, min_samples: int = 7,
            max_samples: int = 41):
  """(median ms per call, samples) of a jitted ``fn``: bursts of back-to-back calls (~20 ms
  each), inputs rotated among ``input_sets``, blocked at the end of each burst."""
  for args in input_sets:  # warm-up (compile) on every input set
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*input_sets[0]))
  est = max(time.perf_counter() - t0, 1e-5)
  burst = int(min(max(1, 0.02 / est), 50))
  n_samples = int(min(max(min_samples, target_s / (est * burst)), max_samples))
  samples = []
  for s in range(n_samples):
    t0 = time.perf_counter()
    out = None
    for j in range(burst):
      out = fn(*input_sets[(s * burst + j) % len(input_sets)])
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / burst * 1e3)
  return statistics.median(samples), samples


def median_seconds(call: Callable[[], object], *, warmup: int, reps: int) -> float:
  """Median wall seconds of ``call()``, blocked until its result is ready, over ``reps`` calls
  after 1 + ``warmup`` untimed ones (the first compiles)."""
  for _ in range(1 + warmup):
    jax.block_until_ready(call())
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def temp_mib(fn: Callable, *args) -> float:
  """XLA's compiled temp-buffer size of ``jit(fn)(*args)`` (memory_analysis), MiB; NaN if
  unknown."""
  try:
    ma = jax.jit(fn).lower(*args).compile().memory_analysis()
    return ma.temp_size_in_bytes / 2**20
  except Exception:  # noqa: BLE001  pragma: no cover
    return float("nan")


# --------------------------------------------------------------------------- inputs
def parse_shape(entry: str, dims: int = 2) -> tuple[int, ...]:
  """'32x2000x8x64' -> (32, 2000, 8, 64); the entry must have ``dims`` numbers."""
  try:
    shape = tuple(int(x) for x in entry.strip().split("x"))
  except ValueError:
    shape = ()
  if len(shape) != dims:
    raise ValueError(f"shape {entry!r}: expected {dims} integers joined by 'x'")
  return shape


def parse_shapes(value: str | Sequence[str], dims: int = 2) -> list[tuple[int, ...]]:
  """'32x1024,16x2048' (``--shapes``, or a list of such entries) -> [(32, 1024), (16, 2048)]."""
  entries = value.split(",") if isinstance(value, str) else value
  return [parse_shape(e, dims) for e in entries if e.strip()]


def attention_sets(b: int, l: int, h: int, d: int, dtype, *, seed: int | None = None,
                   n: int = 3, count: int = 4) -> list[tuple]:
  """``n`` sets of ``count`` standard normal [b, l, h, d] arrays (q, k, v, cotangent), set i
  from ``fold_in(PRNGKey(seed), i)``; ``seed`` defaults to b * l."""
  key = jax.random.PRNGKey(b * l if seed is None else seed)
  return [tuple(jax.random.normal(kk, (b, l, h, d), dtype)
                for kk in jax.random.split(jax.random.fold_in(key, i), count))
          for i in range(n)]


def stack_sets(sets: Sequence[tuple], steps: int) -> tuple:
  """The input sets tiled to ``steps`` and stacked per argument: ``chained``'s ``xs``."""
  return tuple(jnp.stack([sets[i % len(sets)][j] for i in range(steps)])
               for j in range(len(sets[0])))


def normal_sets(shapes_dtypes, n: int = 3, seed: int = 0) -> list[tuple]:
  """``n`` tuples of standard normal arrays, one per (shape, dtype), from numpy's ``seed``."""
  rng = np.random.default_rng(seed)
  return [tuple(jnp.asarray(rng.standard_normal(s), d) for s, d in shapes_dtypes)
          for _ in range(n)]


def prefix_mask(lengths, length: int):
  """bool [batch, length]: the first ``lengths[i]`` keys of row i are real."""
  return jnp.arange(length)[None, :] < lengths[:, None]


def random_padding_mask(key, batch: int, length: int, full_first: bool = False):
  """A key padding mask with real lengths uniform in [length / 4, length] (as LRA batches);
  with ``full_first`` the first row has no padding."""
  lengths = jax.random.randint(key, (batch,), length // 4, length + 1)
  if full_first:
    lengths = lengths.at[0].set(length)
  return prefix_mask(lengths, length)


def fwd_bwd(f: Callable) -> Callable:
  """(q, k, v, ct) -> the gradient of sum(f(q, k, v) * ct) w.r.t. q, k, v (the product in the
  output's dtype, summed in float32)."""
  def g(q, k, v, ct):
    return jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * ct).astype(jnp.float32)),
                    argnums=(0, 1, 2))(q, k, v)
  return g


def passes(f: Callable) -> dict[str, Callable]:
  """{"fwd", "fwd+bwd"} -> fn(q, k, v, ct) of the attention ``f(q, k, v)``."""
  def fwd(q, k, v, ct):
    del ct
    return f(q, k, v)
  return {"fwd": fwd, "fwd+bwd": fwd_bwd(f)}


def grad_of(fn: Callable, argnums=(0, 1, 2)) -> Callable:
  """jit of fwd+bwd of fn: grads of <fn(...), cotangent> in float32 (the cotangent is the last
  argument, cut to the output's size)."""
  def loss(*args):
    *inputs, cot = args
    out = fn(*inputs).astype(jnp.float32)
    return jnp.vdot(out, cot.reshape(-1)[:out.size].reshape(out.shape))
  return jax.jit(jax.grad(loss, argnums=argnums))


# --------------------------------------------------------------------------- tables
def device_kind() -> str:
  dev = jax.devices()[0]
  return getattr(dev, "device_kind", dev.platform)


def commit() -> str:
  """HEAD's short hash (marked when tracked files differ from it); 'unknown' outside a git
  checkout."""
  try:
    head, dirty = (subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=20, check=True).stdout.strip()
                   for args in (("rev-parse", "--short", "HEAD"),
                                ("status", "--porcelain", "--untracked-files=no")))
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + (" with uncommitted changes" if dirty else "")


def run_header(*details: str) -> str:
  """'device: KIND (platform); jax V; commit C; YYYY-MM-DD HH:MM UTC' and ``details``, all
  joined by '; '."""
  now = datetime.datetime.now(datetime.timezone.utc)
  return "; ".join([f"device: {device_kind()} ({jax.devices()[0].platform})",
                    f"jax {jax.__version__}", f"commit {commit()}",
                    f"{now:%Y-%m-%d %H:%M} UTC", *details])


def gpu_state() -> str:
  """SM clock / max clock / power limit / temperature from nvidia-smi: compute-bound kernels
  (the fused DFSS ones) move with the SM clock, which differs between lent machines."""
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    return f"nvidia-smi sm clock, max sm clock, power, power limit, temp: {out}"
  except Exception as e:  # noqa: BLE001  no nvidia-smi (or no GPU): say so, do not fail
    return f"nvidia-smi unavailable ({type(e).__name__})"


def markdown_row(cells: Sequence) -> str:
  return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def markdown_table(cols: Sequence[str], rows: Sequence[Sequence], align: str = "") -> str:
  """A markdown table (no trailing newline); ``align`` has one letter per column, 'r' for a
  right-aligned one (default: all left)."""
  rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align or "l" * len(cols))
  return "\n".join([markdown_row(cols), rule] + [markdown_row(r) for r in rows])


def save(text: str, out: str | None) -> None:
  """Writes ``text`` to the file ``out``, if one is given."""
  if out:
    with open(out, "w") as f:
      f.write(text)


def emit(text: str, out: str | None) -> None:
  """Prints ``text`` and writes it to ``out`` (if given)."""
  print(text, flush=True)
  save(text, out)


def emit_table(header: str, cols: Sequence[str], rows: Sequence[Sequence], out: str | None,
               note: str = "") -> str:
  """Prints the header, the GPU state at the end of the run, ``note`` and the markdown table;
  also writes them to ``out``. Returns the text."""
  text = (header + "\nend of run, " + gpu_state() + "\n\n" + (note + "\n\n" if note else "")
          + markdown_table(cols, rows) + "\n")
  print()
  emit(text, out)
  return text


# --------------------------------------------------------------------------- modules
def load_module(path: str, name: str):
  """Imports the file ``path`` as module ``name`` (e.g. an older copy of a kernel module)."""
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod


@contextlib.contextmanager
def swapped(module, **values):
  """``module``'s attributes replaced by ``values`` inside the context (read while tracing)."""
  saved = {name: getattr(module, name) for name in values}
  for name, value in values.items():
    setattr(module, name, value)
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(module, name, value)


# --------------------------------------------------------------------------- train steps
def make_config(variant: str, *, config_path: str = LISTOPS_CONFIG, batch=None,
                length=None, overrides=()) -> ml_collections.ConfigDict:
  """The config of one ``dtype:attention[/drop=RATE]`` variant (``--variants``), with
  ``overrides``; ``/drop=RATE`` sets this variant's attention dropout rate (after them)."""
  dtype, attention = variant.split(":", 1)
  attention, _, rate = attention.partition("/drop=")
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
  if rate:
    config.model.attention_dropout_rate = float(rate)
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
  metrics: Mapping = {}

  def call():
    nonlocal state, metrics
    state, metrics = step(state, data, key)
    return metrics

  seconds = median_seconds(call, warmup=warmup, reps=reps)
  return seconds, float(metrics["loss"])
