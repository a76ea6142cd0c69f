"""Nystromformer(+DFSS) speed: the attention core, the conv skip and the train step; one table.

  python -m benchmarks.bench_nystrom [--parts=core,conv,step] [--old=.ab/nystrom_old.py]
      [--shape=32x2000x8x64 --landmarks=64] [--config=configs/listops.py] [--out=FILE]

core: ``nystrom_attention`` forward and forward+backward (grad of <out, cotangent> w.r.t. q, k,
v) for plain and 2:4 Nystromformer, bf16 and fp32, against cuDNN (bf16) and XLA dense on the same
operands. conv: the depthwise conv skip over the length axis (forward+backward, grads w.r.t. V
and the taps) in the candidate formulations below. step: the whole train step at the task's
LRA shape (benchmarks.bench_train_step) for dense cuDNN and the Nystrom kinds; with ``--old``
(a copy of an earlier lra_sparse/attention/nystrom.py) the earlier core and conv are timed in
the same process as well, by swapping the module's functions; the conv forms of
``--step_convs`` are swapped into the first Nystrom variant's step the same way (the skip then
added to the attention output outside the conv).
Median of many timed runs after warm-up (benchmarks.harness.time_fn).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import grad_of, normal_sets, swapped, time_fn
from lra_sparse.attention import dense
from lra_sparse.attention import nystrom
from lra_sparse.attention import registry
from lra_sparse.kernels.nystrom import landmark as landmark_attention_pallas
from lra_sparse.kernels.nystrom import length_conv as length_conv_pallas

harness.define_train_step_flags()
flags.DEFINE_list("parts", ["core", "conv", "step"], "What to time.")
flags.DEFINE_string("old", "", "Path of an earlier nystrom.py to time in the same process.")
flags.DEFINE_string("shape", "32x2000x8x64", "batch x length x heads x head_dim (core, conv).")
flags.DEFINE_integer("landmarks", 64, "Landmarks (core).")
flags.DEFINE_integer("conv_kernel", 35, "Conv taps (conv).")
flags.DEFINE_bool("conv_micro", True, "conv part: time the conv alone (else only in steps).")
flags.DEFINE_list("step_convs", ["Pallas kernel"],
                  "conv part: formulations also timed inside the first Nystrom train step.")
flags.DEFINE_list("convs", [], "conv part: only these formulations (default: all).")
flags.DEFINE_list("conv_dtypes", ["bf16", "fp32"], "conv part: dtypes of V timed alone.")
flags.DEFINE_list("step_variants", ["bf16:cudnn", "bf16:kind=nystrom",
                                    "bf16:kind=nystrom+nm=2:4", "fp32:kind=nystrom"],
                  "bench_train_step variants for the step part.")
flags.adopt_module_key_flags(harness)
FLAGS = flags.FLAGS  # --config, --batch, --length, --reps, --warmup, --out: bench_train_step's

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def load_old(path):
  """Imports an earlier nystrom.py under another name (its kind is not registered again)."""
  with swapped(registry, register_attention=lambda kind, cls: lambda build: build):
    return harness.load_module(path, "nystrom_old")


def core_rows(old):
  b, l, h, d = harness.parse_shape(FLAGS.shape, dims=4)
  lm = FLAGS.landmarks
  rows = []
  for dname, dtype in DTYPES.items():
    shape = (b, l, h, d)
    sets = normal_sets([(shape, dtype)] * 3 + [(shape, jnp.float32)])
    fwd_sets = [s[:3] for s in sets]
    impls = {"XLA dense": lambda q, k, v: dense.dense_attention(q, k, v, implementation="xla")}
    if dtype == jnp.bfloat16:
      impls["cuDNN dense"] = lambda q, k, v: dense.dense_attention(q, k, v,
                                                                    implementation="cudnn")
    if dtype == jnp.bfloat16:
      impls["nystrom cuDNN"] = lambda q, k, v: nystrom.nystrom_attention(
          q, k, v, num_landmarks=lm, implementation="cudnn")
      for nm in ("", "2:4"):
        impls["nystrom Pallas" + (f"+{nm}" if nm else "")] = functools.partial(
            nystrom.nystrom_attention, num_landmarks=lm, nm=nm or None, implementation="pallas")
      # its parts: B V (m queries over L keys), F (.) (L queries over m keys), the pinv
      impls["  part: B V, cuDNN"] = lambda q, k, v: dense.cudnn_attention(q[:, :lm], k, v)
      impls["  part: F (.), cuDNN"] = lambda q, k, v: dense.cudnn_attention(q, k[:, :lm],
                                                                             v[:, :lm])
      if jax.default_backend() == "gpu":
        for nm in (None, (2, 4)):
          tag = "" if nm is None else " 2:4"
          impls[f"  part: B V{tag}, Pallas"] = functools.partial(
              lambda q, k, v, nm: landmark_attention_pallas.few_queries_attention(
                  q[:, :lm], k, v, nm=nm), nm=nm)
          impls[f"  part: F (.){tag}, Pallas"] = functools.partial(
              lambda q, k, v, nm: landmark_attention_pallas.few_keys_attention(
                  q, k[:, :lm], v[:, :lm], nm=nm), nm=nm)
      landmark_softmax = lambda q, k: jax.nn.softmax(jnp.einsum(  # noqa: E731
          "bnhd,bmhd->bhnm", q[:, :lm], k[:, :lm], preferred_element_type=jnp.float32), axis=-1)
      impls["  part: pinv of [b,h,m,m]"] = lambda q, k, v: nystrom.iterative_pinv(
          landmark_softmax(q, k), 6)
      if jax.default_backend() == "gpu":
        impls["  part: pinv of [b,h,m,m], fused"] = lambda q, k, v: nystrom.iterative_pinv(
            landmark_softmax(q, k), 6, fused=True)
    for nm in ("", "2:4"):
      label = "nystrom XLA" + (f"+{nm}" if nm else "")
      impls[label] = functools.partial(nystrom.nystrom_attention, num_landmarks=lm,
                                       nm=nm or None, implementation="xla")
      if old is not None:
        impls[label + " (old)"] = functools.partial(old.nystrom_attention, num_landmarks=lm,
                                                    nm=nm or None)
    for name, fn in impls.items():
      try:
        fwd, _ = time_fn(jax.jit(fn), fwd_sets)
        both, _ = time_fn(grad_of(fn), sets)
        rows.append(("core", dname, f"{b}x{l}x{h}x{d}", name, f"{fwd:.3f}", f"{both:.3f}"))
      except Exception as e:  # noqa: BLE001  one failing row must not hide the others
        rows.append(("core", dname, f"{b}x{l}x{h}x{d}", name, "failed",
                     str(e).splitlines()[0][:60]))
      print(rows[-1], flush=True)
  return rows


# Candidate formulations of the conv skip: out[l] = sum_t w[t, h] v[l + t - K//2] per head,
# shared across head_dim. values [b, L, h, d], taps [K, h]; float32 result.
def conv_grouped(values, taps):
  """lax.conv, one group per (head, dim) channel (the formulation before this benchmark)."""
  return nystrom.grouped_length_conv(values, taps)


def conv_shifted(values, taps):
  """Sum of K shifted copies (one elementwise fusion forward)."""
  length, size = values.shape[1], taps.shape[0]
  padded = jnp.pad(values.astype(jnp.float32), ((0, 0), (size // 2, size // 2), (0, 0), (0, 0)))
  return sum(padded[:, t:t + length] * taps[t][None, None, :, None] for t in range(size))


def conv_cases():
  cases = {"grouped lax.conv, fp32": lambda v, w: conv_grouped(v.astype(jnp.float32), w),
           "grouped lax.conv, input dtype": conv_grouped,
           "shifted sum": conv_shifted}
  cases["banded block matmul"] = nystrom.banded_length_conv
  if jax.default_backend() == "gpu":
    cases["Pallas kernel"] = length_conv_pallas.length_conv
    # the model's: half-precision V on the tensor cores (float32 V: the kernel above)
    cases["Pallas banded kernel"] = length_conv_pallas.banded_length_conv
  return {name: fn for name, fn in cases.items() if not FLAGS.convs or name in FLAGS.convs}


def conv_rows():
  b, l, h, d = harness.parse_shape(FLAGS.shape, dims=4)
  kk = FLAGS.conv_kernel
  rows = []
  for dname in FLAGS.conv_dtypes:
    dtype = DTYPES[dname]
    sets = normal_sets([((b, l, h, d), dtype), ((kk, h), jnp.float32),
                        ((b, l, h, d), jnp.float32)])
    want = None
    for name, fn in conv_cases().items():
      try:
        fwd, _ = time_fn(jax.jit(fn), [s[:2] for s in sets])
        both, _ = time_fn(grad_of(fn, argnums=(0, 1)), sets)
        out = np.asarray(jax.jit(fn)(*sets[0][:2]), np.float64)
        want = out if want is None else want
        err = np.linalg.norm(out - want) / np.linalg.norm(want)
        rows.append(("conv", dname, f"{b}x{l}x{h}x{d} K={kk}", name, f"{fwd:.3f}",
                     f"{both:.3f} (rel diff {err:.1e})"))
      except Exception as e:  # noqa: BLE001
        rows.append(("conv", dname, f"{b}x{l}x{h}x{d} K={kk}", name, "failed",
                     str(e).splitlines()[0][:60]))
      print(rows[-1], flush=True)
  return rows


def _known_kwargs(fn):
  """``fn`` called with only the keyword arguments its signature names."""
  names = inspect.signature(fn).parameters
  return lambda *args, **kwargs: fn(*args, **{k: v for k, v in kwargs.items() if k in names})


def _adding_residual(conv):
  """A float32 conv (values, taps) as the model's ``depthwise_length_conv``, which adds the
  skip to ``residual`` (the attention output) when given; convs that take ``residual``
  themselves get it."""
  if "residual" in inspect.signature(conv).parameters:
    return conv

  def fn(values, taps, residual=None):
    out = conv(values, taps)
    return out if residual is None else (residual.astype(jnp.float32) + out).astype(
        residual.dtype)
  return fn


def step_rows(old):
  rows = []
  runs = [(v, contextlib.nullcontext()) for v in FLAGS.step_variants]
  if old is not None:
    # The earlier file's functions as the model calls today's: same arguments and dtypes, only
    # keywords its signature lacks dropped (an earlier version of this harness dropped
    # `implementation` and cast the conv's input to float32, which timed another formulation).
    runs += [(v + " (old)", swapped(nystrom, nystrom_attention=_known_kwargs(
        old.nystrom_attention), depthwise_length_conv=_adding_residual(old.depthwise_length_conv)))
             for v in FLAGS.step_variants if "nystrom" in v]
  nystrom_variants = [v for v in FLAGS.step_variants if "nystrom" in v]
  if nystrom_variants and jax.default_backend() == "gpu":
    # the model's fused pseudo-inverse (Pallas) against XLA's iteration, in one process
    xla_pinv = functools.partial(nystrom.iterative_pinv, fused=False)
    runs += [(f"{v} (pinv on XLA)", swapped(nystrom, iterative_pinv=(
        lambda matrix, iters=6, fused=False: xla_pinv(matrix, iters))))
             for v in dict.fromkeys(nystrom_variants) if "implementation" not in v]
  if nystrom_variants and "conv" in FLAGS.parts:
    for name, fn in conv_cases().items():
      if name in FLAGS.step_convs:
        runs.append((f"{nystrom_variants[0]} (conv: {name})",
                     swapped(nystrom, depthwise_length_conv=_adding_residual(fn))))
  for variant, context in runs:
    try:
      with context:
        seconds, loss = harness.time_variant(
            variant.split(" (")[0], config_path=FLAGS.config, batch=FLAGS.batch,
            length=FLAGS.length, warmup=FLAGS.warmup, reps=FLAGS.reps,
            overrides=harness.step_overrides())
      rows.append(("step", variant.split(":")[0], os.path.basename(FLAGS.config), variant,
                   "", f"{seconds * 1e3:.1f} ms/step (loss {loss:.3f})"))
    except Exception as e:  # noqa: BLE001
      rows.append(("step", "", os.path.basename(FLAGS.config), variant, "failed",
                   str(e).splitlines()[0][:60]))
    print(rows[-1], flush=True)
  return rows


def main(argv):
  del argv
  old = load_old(FLAGS.old) if FLAGS.old else None
  rows = []
  if "core" in FLAGS.parts:
    rows += core_rows(old)
  if "conv" in FLAGS.parts and FLAGS.conv_micro:
    rows += conv_rows()
  if "step" in FLAGS.parts:
    rows += step_rows(old)
  harness.emit_table("Nystromformer speed; " + harness.run_header(),
                     ["part", "dtype", "shape", "what", "fwd ms", "fwd+bwd ms"], rows, FLAGS.out)


if __name__ == "__main__":
  app.run(main)
