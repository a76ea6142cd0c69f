"""What keeps a run's workdir whole: its lock, checkpoints that Ctrl-C cannot cut, restores
that fall back past unusable checkpoints.

- ``run_lock``: one run at a time trains in a workdir (with several processes, process 0 holds
  the lock for all of them);
- ``sigint_after`` / ``sigint_deferred``: a checkpoint save that Ctrl-C lands in finishes
  first; ``interrupts_latched``: a Ctrl-C that Python swallowed still stops training, and
  one that follows it (a sweep forwards its own Ctrl-C to its trainers) cuts nothing;
  ``save_on_interrupt`` then checkpoints the step the interrupted run reached;
- ``restore_newest_readable``: the newest checkpoint that restores with finite parameters,
  unusable newer ones moved aside to ``corrupt_checkpoints/``; ``load_params_from`` the
  parameters of another run's checkpoint (``config.init_from``).

Nothing non-finite is saved (``all_finite``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lra_sparse import workdir as workdir_lib
from lra_sparse.distributed import is_primary, say, sync_processes
from lra_sparse.errors import WorkdirBusy, first_line

CORRUPT_DIR = "corrupt_checkpoints"


@contextlib.contextmanager
def run_lock(workdir: str):
  """The workdir's lock (``workdir.locked``) for the run's body. With several processes only
  process 0 takes it (every run has exactly one process 0, so a second run on the workdir is
  refused there, whatever its number of processes) and tells the others, which then refuse
  too, before any of them has written anything."""
  if jax.process_count() == 1:
    with workdir_lib.locked(workdir):
      yield
    return
  with contextlib.ExitStack() as stack:
    busy = None
    if is_primary():
      try:
        stack.enter_context(workdir_lib.locked(workdir))
      except WorkdirBusy as error:
        busy = error
    refused = int(multihost_utils.broadcast_one_to_all(np.int32(busy is not None)))
    if busy is not None:
      raise busy
    if refused:
      raise WorkdirBusy(f"workdir {workdir} is in use by another run (process 0 could not take "
                        f"its {workdir_lib.LOCK_FILE}); wait for it or use another directory")
    yield


@jax.jit
def all_finite(tree) -> jax.Array:
  """Whether every floating-point leaf of ``tree`` is finite (a scalar bool array)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@contextlib.contextmanager
def sigint_deferred():
  """SIGINT ignored inside (where the main thread can set handlers), so that the checkpoint an
  interrupt asked for is written whole; the old handler is back afterwards."""
  try:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  except ValueError:       # not the main thread: nothing to defer
    yield
    return
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


_interrupt_latched = threading.Event()


def _latching_int_handler(signum, frame):
  # Once latched the run is already stopping: a further Ctrl-C (the sweep's forwarded copy of
  # the one that stopped it, milliseconds later) raises nothing, since a KeyboardInterrupt
  # landing between the trainer's ``except KeyboardInterrupt`` and its ``sigint_deferred``
  # escaped the interrupt's own save (a Pathfinder-32 run lost 950 steps that way).
  if _interrupt_latched.is_set():
    return
  _interrupt_latched.set()
  signal.default_int_handler(signum, frame)     # KeyboardInterrupt, where the signal lands


@contextlib.contextmanager
def interrupts_latched():
  """Inside (a run), Ctrl-C raises KeyboardInterrupt where it lands, as Python's
  own handler does, and also sets a latch that ``raise_if_interrupted`` reads once a step.
  Python swallows an exception raised inside a gc callback, a ``__del__`` or a weakref
  finaliser ("Exception ignored in ..."): a Ctrl-C that lands there (seen in jax's
  ``_xla_gc_callback``) would leave the run training on until its sweep killed it, losing
  every step since the last checkpoint. A Ctrl-C after the latched one raises nothing: the
  run is stopping and saving already. Only where Python's own handler is installed (the
  main thread of a trainer); elsewhere nothing changes."""
  _interrupt_latched.clear()
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
    yield
    return
  previous = signal.signal(signal.SIGINT, _latching_int_handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
    _interrupt_latched.clear()


def raise_if_interrupted():
  """KeyboardInterrupt if a Ctrl-C came inside ``interrupts_latched`` (even one swallowed)."""
  if _interrupt_latched.is_set():
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_after():
  """A Ctrl-C inside interrupts only once the block is done (where the main thread can set
  handlers): a checkpoint save is never cut in half. Cut inside orbax's ``save``, a save could
  leave its background writes running into a temporary step directory that the interrupt's own
  save of that step then failed to clear ("Directory not empty"), losing the steps since the
  last checkpoint."""
  if (threading.current_thread() is not threading.main_thread()   # can't set handlers there
      or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None)):  # Ctrl-C ignored anyway
    yield
    return
  caught = []
  previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
  if caught:
    if previous is _latching_int_handler:
      _interrupt_latched.set()     # as if it had landed there: a further Ctrl-C is ignored
    raise KeyboardInterrupt


def save_on_interrupt(manager, state, finite, last_saved) -> tuple[Optional[int], str]:
  """Lets a save in flight finish, then checkpoints the state reached when Ctrl-C stopped
  training, so that a resumed run loses no steps; returns (the step reached, as the state
  counts it, or None where unknown; what the workdir keeps, for the message).  Skipped (and
  said) when that step is already saved, when something non-finite was seen since the last
  save, when the interrupt came while a step was consuming its (donated) input state, and with
  several processes (a save is collective there and the others may not have stopped). An error
  on the way (the save in flight failed; a Ctrl-C that landed inside JAX's tracing left it
  unusable) is said in the message: the run still stops as interrupted, keeping what it has."""
  kept = (f"checkpoints up to step {last_saved} are kept" if last_saved is not None
          else "no checkpoint was written yet")
  step = None
  try:
    manager.wait_until_finished()
    if jax.process_count() > 1:
      return None, kept
    leaves = jax.tree.leaves(state)
    if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
      return None, kept + " (the interrupt came mid-step)"
    step = int(jax.device_get(state.step))
    if step == last_saved or step in manager.all_steps():
      return step, f"its checkpoint at step {step} is kept"
    if not (bool(finite) and bool(all_finite(state.params))):
      return step, kept + " (nothing non-finite is saved)"
    manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except  (the interrupt is what gets reported)
    what = f"saving step {step}" if step is not None else "the save on interrupt"
    return step, kept + f" ({what} failed: {first_line(e)})"
  return step, f"saved a checkpoint at step {step}"


def restore_newest_readable(manager: ocp.CheckpointManager, args_fn, where: str,
                            quarantine: bool = False,
                            fall_back: bool = True) -> tuple[Any, Optional[int]]:
  """(restored, step) of the newest checkpoint that restores and holds finite parameters
  (``args_fn(step)``: the restore arguments of a step); (None, None) when there is none at
  all. Each unusable newer step costs one warning line;
  with ``quarantine`` it is moved to ``<workdir>/corrupt_checkpoints/`` so that the resumed
  run can save that step again. No usable step at all is one error, and so is an unusable
  newest step when ``fall_back`` is False (fine-tuning or analysing an older step than the
  run's last would mislead)."""
  steps = sorted(manager.all_steps(), reverse=True)
  unusable = []
  for step in steps:
    try:
      restored = manager.restore(step, args=args_fn(step))
      params = restored.params if hasattr(restored, "params") else restored["params"]
      if not bool(all_finite(params)):
        raise ValueError("its parameters are not finite")
    except Exception as error:  # pylint: disable=broad-except  (orbax raises many kinds)
      if not fall_back:
        raise ValueError(f"the newest checkpoint (step {step}) in {where} is unusable "
                         f"({first_line(error)})") from None
      say(f"warning: checkpoint step {step} in {where} is unusable "
          f"({first_line(error)}); trying an older one")
      unusable.append(step)
      continue
    if quarantine and unusable:
      if is_primary():
        corrupt = os.path.join(os.path.dirname(str(manager.directory)), CORRUPT_DIR)
        os.makedirs(corrupt, exist_ok=True)
        for bad in unusable:
          source = os.path.join(str(manager.directory), str(bad))
          if os.path.exists(source):
            os.replace(source, os.path.join(corrupt, f"{bad}.{int(time.time())}"))
      sync_processes("lra_sparse: corrupt checkpoints moved")
      manager.reload()
    return restored, step
  if steps:
    raise ValueError(f"no usable checkpoint in {where}: steps {steps} are all unreadable or "
                     "non-finite")
  return None, None


def _open_checkpoints(workdir: str, what: str) -> ocp.CheckpointManager:
  ckpt_dir = os.path.join(os.path.abspath(workdir), workdir_lib.CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"{what}={workdir!r}: no checkpoints/ directory there")
  return ocp.CheckpointManager(ckpt_dir, item_handlers=ocp.StandardCheckpointHandler())


def _restore_here(manager: ocp.CheckpointManager, step: int) -> ocp.args.StandardRestore:
  """Restore arguments that put every array of checkpoint ``step`` on this process's first
  device, whatever devices wrote it: without a target orbax restores onto the saving run's
  topology and refuses a checkpoint that two GPUs wrote on a machine or slot with one."""
  meta = manager.item_metadata(step)
  tree = getattr(meta, "tree", meta)
  here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return ocp.args.StandardRestore(jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=here), tree))


def load_params_from(workdir: str, params, what: str = "config.init_from"
                     ) -> tuple[Any, list[str], list[str]]:
  """Copies every parameter of ``workdir``'s last checkpoint that this model also has.

  Returns (params, new parameter paths kept at their fresh init, unused old paths). A shared
  path with a different shape is an error.
  """
  manager = _open_checkpoints(workdir, what)
  restored, step = restore_newest_readable(manager, lambda step: _restore_here(manager, step),
                                           f"{what}={workdir!r}", fall_back=False)
  manager.close()
  if step is None:
    raise FileNotFoundError(f"{what}={workdir!r}: checkpoints/ holds no checkpoint")
  old = flax.traverse_util.flatten_dict(restored["params"], sep="/")
  new = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
  merged, fresh = {}, []
  for path, value in new.items():
    if path in old:
      if tuple(old[path].shape) != tuple(value.shape):
        raise ValueError(f"{what}: parameter {path} has shape {old[path].shape} in "
                         f"{workdir} but {value.shape} in this model")
      merged[path] = jnp.asarray(old[path], value.dtype)
    else:
      merged[path] = value
      fresh.append(path)
  unused = sorted(set(old) - set(new))
  return flax.traverse_util.unflatten_dict(merged, sep="/"), sorted(fresh), unused
