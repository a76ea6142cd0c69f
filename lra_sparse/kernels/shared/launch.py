"""Launching a Triton kernel from JAX (jax-triton).

``launch`` takes the ``@triton.jit`` function itself: a wrapper imports its kernel source module
(which imports triton) inside the function that launches, so importing a wrapper never imports
triton or jax_triton; the first launch does.

Tests pre-fill every output with NaN (int32: -1) to catch an element a kernel does not write:
``launch(..., poison=True)`` runs the kernel's poisoned entry point instead, registered by the
tests (``register_poisoned``; the entry points live beside the tests, not in the library).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# kernel -> its poisoned entry point (the same kernel taking a NaN-filled, aliased copy of each
# output first). Filled by the tests' entry-point module when it is imported; empty otherwise.
_POISONED: dict = {}


def register_poisoned(kernel, poisoned) -> None:
  """Tests: ``launch(kernel, ..., poison=True)`` runs ``poisoned`` with the filled outputs."""
  _POISONED[kernel] = poisoned


def is_available() -> bool:
  """True when a GPU backend is present and triton and jax_triton import (what every Triton
  wrapper needs)."""
  try:
    if not any(d.platform == "gpu" for d in jax.devices()):
      return False
    import triton  # noqa: F401  pylint: disable=import-outside-toplevel
    import jax_triton  # noqa: F401  pylint: disable=import-outside-toplevel
    return True
  except Exception:  # pylint: disable=broad-except  (any import / backend failure means "no")
    return False


def launch(kernel, args, out_shapes, grid, *, num_warps: int, num_stages: int, zeroed=(),
           poison: bool = False, **constexprs):
  """Runs the ``@triton.jit`` function ``kernel`` through jax_triton.triton_call.

  args: the kernel's operands in its parameter order (arrays and runtime scalars; Python
  floats go as fp32), then the outputs out_shapes follow, then the constexprs.  Outputs listed
  in ``zeroed`` (indices into out_shapes) are zeroed before the launch (atomic accumulators).
  poison=True (tests) runs the registered poisoned entry point instead, with every other output
  pre-filled with NaN (int32: -1) and aliased in, so an element the kernel does not write
  shows up in the result.
  """
  import jax_triton as jt  # pylint: disable=import-outside-toplevel

  # jax-triton 0.3.1 types a Python float as fp64
  args = [np.float32(a) if isinstance(a, float) else a for a in args]
  fills, aliases = [], {}
  if poison:
    if kernel not in _POISONED:
      raise ValueError(f"poison=True is a test hook: no poisoned entry point is registered for "
                       f"{getattr(kernel, '__name__', kernel)} (import tests/poisoned_kernels.py)")
    kernel = _POISONED[kernel]
    n_arrays = sum(not isinstance(a, (int, np.floating)) for a in args)  # aliases count arrays
    for j, s in enumerate(out_shapes):
      if j not in zeroed:
        aliases[n_arrays + len(fills)] = j
        fill = jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -1
        fills.append(jnp.full(s.shape, fill, s.dtype))
  return jt.triton_call(
      *args, *fills, kernel=kernel, out_shape=out_shapes, grid=grid, num_warps=num_warps,
      num_stages=num_stages, input_output_aliases=aliases or None,
      zeroed_outputs=tuple(zeroed), **constexprs)
