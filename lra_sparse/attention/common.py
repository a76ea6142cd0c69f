"""What the attention kinds share beyond the math (which lives in ``lra_sparse.ops``): picking
a kernel backend that can run here, and logging a fallback once."""
from __future__ import annotations

import logging

import jax

_WARNED_ONCE: set[str] = set()


def warn_once(message: str) -> None:
  """Logs ``message`` as a warning the first time it is seen in this process (fallbacks that
  would otherwise repeat at every trace)."""
  if message not in _WARNED_ONCE:
    _WARNED_ONCE.add(message)
    logging.warning(message)


def usable_kernel(module, kind: str, required: bool, backend: str = "triton"):
  """``module`` (a kernel wrapper: ``lra_sparse.kernels.<family>.<backend>``) when its
  ``is_available()`` says it can run here; else None, or one ValueError naming the problem
  when ``required`` (the user asked for ``backend`` by name)."""
  if module.is_available():
    return module
  if required:
    label = {"triton": "Triton", "mosaic": "Mosaic GPU"}[backend]
    needs = {"triton": "a GPU with triton and jax-triton",
             "mosaic": "a Hopper GPU (sm_90) with Pallas Mosaic GPU"}[backend]
    raise ValueError(
        f"backend={backend!r} but the {kind} {label} kernel is not available here "
        f"(jax backend {jax.default_backend()!r}; it needs {needs}); use "
        "backend='reference' or 'auto'")
  return None
