"""Multi-process runs: whether and how to call ``jax.distributed.initialize``.

One run may span several processes (hosts, or several processes on one host), each owning
its local devices; together they train one data-parallel model (``lra_sparse.train``). The
processes are joined before any other use of JAX, in one of three ways:

- explicitly: ``--coordinator_address=HOST:PORT --num_processes=N --process_id=I`` on every
  process (all three or none), the same address and N everywhere, I from 0 to N-1;
- under SLURM: ``srun`` with more than one task (``SLURM_NTASKS`` > 1 inside a job step);
  ``jax.distributed.initialize()`` reads the coordinator, count and rank from SLURM's
  variables itself;
- otherwise one process, and ``jax.distributed`` is not used at all.

On CPU the processes' collectives go over gloo (JAX's default for CPU with a distributed
client).

Once joined, the processes of a run share the helpers below: which process writes and prints
(process 0), barriers, and putting a global batch (the same numpy rows on every process) or
replicated values on the mesh, each process transferring only what its devices hold.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Optional

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
import numpy as np
from tqdm import tqdm

# The variables jax's SLURM detection reads (jax._src.clusters.slurm_cluster); the step ones are
# set by srun only, so a plain `python` in a batch script of an N-task job is one process.
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                   "SLURM_LOCALID")
FLAG_NAMES = ("--coordinator_address", "--num_processes", "--process_id")


@dataclasses.dataclass(frozen=True)
class Setup:
  """How this process joins a run: ``source`` is "flags", "slurm" or "single"."""
  source: str
  coordinator_address: Optional[str] = None
  num_processes: int = 1
  process_id: int = 0

  def initialize_kwargs(self) -> Optional[dict]:
    """The arguments of ``jax.distributed.initialize``; None when it must not be called."""
    if self.source == "flags":
      return {"coordinator_address": self.coordinator_address,
              "num_processes": self.num_processes, "process_id": self.process_id}
    if self.source == "slurm":
      return {}          # jax detects SLURM itself
    return None


def _int_variable(environ: Mapping[str, str], name: str) -> int:
  value = environ[name]
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def decide(coordinator_address: Optional[str], num_processes: Optional[int],
           process_id: Optional[int], environ: Mapping[str, str] = os.environ) -> Setup:
  """The setup the flags (None = not given) and the environment ask for; a ValueError with one
  line for an incomplete or inconsistent request."""
  given = [value is not None for value in (coordinator_address, num_processes, process_id)]
  if any(given):
    if not all(given):
      missing = [name for name, present in zip(FLAG_NAMES, given) if not present]
      raise ValueError(f"{', '.join(missing)} missing: a multi-process run needs all of "
                       f"{', '.join(FLAG_NAMES)} (or none, for one process or SLURM)")
    if not re.fullmatch(r"[^\s:]+:\d+|\[[0-9a-fA-F:.]+\]:\d+", coordinator_address) \
        or not 0 < int(coordinator_address.rsplit(":", 1)[1]) < 65536:
      raise ValueError(f"--coordinator_address={coordinator_address!r} must be HOST:PORT "
                       "(the address of process 0 and a free port, e.g. localhost:12345)")
    if num_processes < 1:
      raise ValueError(f"--num_processes={num_processes} must be at least 1")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} must be in 0..{num_processes - 1} "
                       f"(--num_processes={num_processes})")
    return Setup("flags", coordinator_address, num_processes, process_id)
  if "SLURM_NTASKS" not in environ:
    return Setup("single")
  tasks = _int_variable(environ, "SLURM_NTASKS")
  if tasks <= 1 or "SLURM_STEP_NODELIST" not in environ:
    return Setup("single")        # one task, or not launched by srun: one process
  missing = [name for name in SLURM_VARIABLES if name not in environ]
  if missing:
    raise ValueError(f"SLURM_NTASKS={tasks} inside an srun step, but {', '.join(missing)} "
                     "unset: cannot join the other tasks (launch with srun, or pass "
                     f"{', '.join(FLAG_NAMES)})")
  rank = _int_variable(environ, "SLURM_PROCID")
  if not 0 <= rank < tasks:
    raise ValueError(f"SLURM_PROCID={rank} is not in 0..{tasks - 1} (SLURM_NTASKS={tasks})")
  return Setup("slurm", None, tasks, rank)


def initialize(setup: Setup) -> None:
  """Joins the other processes of ``setup`` (nothing for one process). Must run before any
  other JAX call; a failure (no coordinator within JAX's timeout, say) is one ValueError."""
  kwargs = setup.initialize_kwargs()
  if kwargs is None:
    return
  where = (f"--coordinator_address={setup.coordinator_address} "
           f"--num_processes={setup.num_processes} --process_id={setup.process_id}"
           if setup.source == "flags" else
           f"SLURM (SLURM_NTASKS={setup.num_processes}, SLURM_PROCID={setup.process_id})")
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as error:  # pylint: disable=broad-except  (XLA raises its own kinds)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raise ValueError(f"jax.distributed.initialize failed for {where}: "
                     f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]) from None


# ----------------------------------------------------------------------------- processes
def is_primary() -> bool:
  """Whether this is the process that writes the run's files and prints (process 0)."""
  return jax.process_index() == 0


def say(message: str) -> None:
  """A line for the user, printed by process 0 only (above a progress bar)."""
  if is_primary():
    tqdm.write(message)


def sync_processes(name: str) -> None:
  """A barrier of all processes (nothing with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def process_rows(sharding: NamedSharding, batch_size: int) -> slice:
  """The rows of a global batch that live on this process's devices under ``sharding``
  (contiguous: the mesh lists each process's devices together)."""
  indices = sharding.addressable_devices_indices_map((batch_size,)).values()
  rows = sorted({(index[0].start or 0, batch_size if index[0].stop is None else index[0].stop)
                 for index in indices})
  for (_, stop), (start, _) in zip(rows, rows[1:]):
    if stop != start:
      raise ValueError(f"this process's rows of the batch are not contiguous: {rows}")
  return slice(rows[0][0], rows[-1][1])


def put_global_batch(tree, sharding: NamedSharding):
  """Numpy arrays of one global batch (the same on every process) as global arrays sharded by
  ``sharding`` along their first axis: each process transfers only its own rows."""
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  leaves = jax.tree.leaves(tree)
  rows = process_rows(sharding, len(leaves[0]))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
      sharding, np.asarray(x[rows]), x.shape), tree)


def replicate(tree, sharding: NamedSharding):
  """``tree`` (the same values on every process) as global arrays replicated by ``sharding``."""
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)

  def put(x):
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
  return jax.tree.map(put, tree)
