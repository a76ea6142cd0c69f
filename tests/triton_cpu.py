"""Triton kernels run on the CPU by Triton's interpreter, in place of
``kernels.shared.launch.launch``.

Triton's standard library (``tl.zeros``, ...) is itself ``@triton.jit`` code, so the whole
process must import triton with TRITON_INTERPRET=1 set: ``run_interpreted`` runs the tests it is
given in such a pytest subprocess, where they call ``interpreted_launch()``, a drop-in for
``launch`` (monkeypatch it into a wrapper module). Each launch runs on the host through
``jax.pure_callback`` with the operands as numpy arrays (whose addresses the interpreter reads
directly). Outputs start as NaN (int: -1), so an element the kernel does not write shows up.
Slow: small shapes only. Needs triton (no GPU).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One kernel at a time: the interpreter keeps the grid position in a global, and XLA may run
# independent callbacks on several threads at once.
_ONE_KERNEL = threading.Lock()

# numpy's dtype names of the operands the kernels take, which torch spells the same way
_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int32", "int8", "uint8", "int64")


class _DType:
  """What Triton's argument specialisation reads of a tensor's dtype: torch's spelling. One
  object per name (``_DTYPES``): Triton caches the specialisation by the dtype object."""

  def __init__(self, name):
    self.name = name

  def __str__(self):
    return "torch." + self.name


_DTYPES = {name: _DType(name) for name in _DTYPE_NAMES}


class _HostArray:
  """A contiguous numpy array as the interpreter sees a tensor: an address and a dtype."""

  def __init__(self, array):
    self.array = array
    self.dtype = _DTYPES[array.dtype.name]

  def data_ptr(self):
    return self.array.ctypes.data


def interpreting() -> bool:
  """True in the subprocess that ``run_interpreted`` starts."""
  return os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(test_file: str, selection: str, timeout_s: int = 900) -> None:
  """Runs the tests of ``test_file`` matching ``-k selection`` in a pytest subprocess with
  TRITON_INTERPRET=1 on the CPU; fails with its output unless all of them pass (skips where
  triton is not installed)."""
  if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed")
  # JAX_DISABLE_MOST_OPTIMIZATIONS: XLA compiles without LLVM's optimisation passes. The
  # programs there are small and run once or twice each, while each new shape compiles anew:
  # compiling took more time than running (a quarter less time in all at -O0). And no
  # compilation cache (tests/conftest.py): its programs call back into this process.
  env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1", JAX_ENABLE_COMPILATION_CACHE="false")
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       test_file, "-k", selection], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=timeout_s, check=False)
  tail = result.stdout[-6000:] + result.stderr[-3000:]
  assert result.returncode == 0, tail
  assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], tail


def _bf16_as_f32(handle, dtype):
  import triton.language as tl   # pylint: disable=import-outside-toplevel,redefined-outer-name
  if dtype == tl.bfloat16:   # the interpreter keeps bf16 as its uint16 bits
    return (handle.astype(np.uint32) << 16).view(np.float32)
  return handle


@contextlib.contextmanager
def _interpreter_patches():
  """Two mends to Triton 3.6's interpreter while a kernel runs: (1) it copies torch tensors to
  and from the host around a launch; numpy arrays already are there, so both copies are
  skipped; (2) its tl.dot multiplies bf16 operands as their raw uint16 bits; they are widened
  to fp32 first (exact products, fp32 sums: the tensor cores' bf16 arithmetic)."""
  import triton.language as tl   # pylint: disable=import-outside-toplevel
  from triton.runtime import interpreter   # pylint: disable=import-outside-toplevel
  executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
  saved = (executor._init_args_hst, executor._restore_args_dev,  # pylint: disable=protected-access
           builder.create_dot)

  def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
      return saved[2](self, a, b, d, input_precision, max_num_imprecise_acc)
    product = np.matmul(_bf16_as_f32(a.data, a.dtype.scalar),
                        _bf16_as_f32(b.data, b.dtype.scalar), dtype=d.data.dtype)
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

  executor._init_args_hst = lambda self, args, kwargs: (args, kwargs)
  executor._restore_args_dev = lambda self, *unused: None
  builder.create_dot = create_dot
  try:
    yield
  finally:
    executor._init_args_hst, executor._restore_args_dev, builder.create_dot = saved


def interpreted_launch():
  """A ``launch(kernel, args, out_shapes, grid, *, num_warps, num_stages, zeroed=(),
  **constexprs)`` that runs the kernel source under Triton's interpreter."""
  assert interpreting(), "the interpreter needs TRITON_INTERPRET=1 from the start (run_interpreted)"

  def launch(fn, args, out_shapes, grid, *, num_warps, num_stages, zeroed=(), poison=False,
             **constexprs):
    del num_warps, num_stages, poison
    arrays = [i for i, a in enumerate(args) if not isinstance(a, (int, float, np.floating))]

    def host(*values):
      operands = list(args)
      for i, v in zip(arrays, values):
        operands[i] = _HostArray(np.ascontiguousarray(v))
      outs = []
      for j, s in enumerate(out_shapes):
        fill = 0 if j in zeroed else (np.nan if np.issubdtype(s.dtype, np.floating) else -1)
        outs.append(np.full(s.shape, fill, s.dtype))
      with _ONE_KERNEL, _interpreter_patches():
        fn[grid](*operands, *[_HostArray(o) for o in outs], **constexprs)
      return tuple(outs)

    return jax.pure_callback(host, tuple(out_shapes), *[args[i] for i in arrays])

  return launch
