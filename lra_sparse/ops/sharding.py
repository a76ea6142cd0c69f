"""Kernel calls on a data-parallel mesh: ``per_data_shard`` runs a custom call once per shard of
the batch, and ``shard_dropout_seed`` gives each shard its own dropout key."""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

DATA_AXIS = "data"     # the trainer's mesh axis: the batch is split along it


def data_shards() -> int:
  """How many shards ``per_data_shard`` splits a batch into here (1: no data-parallel mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA_AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[DATA_AXIS]


def per_data_shard(fn, *args, replicated: tuple[int, ...] = ()):
  """``fn(*args)``, on a data-parallel mesh once per device on its part of the batch.

  XLA cannot split a custom call (a Triton, Pallas or Mosaic GPU kernel) along the batch: on
  a mesh it gathers the whole batch onto every device and runs the kernel there, once per
  device (the same result, devices times the work). Under a mesh set by ``jax.set_mesh``
  whose ``"data"`` axis has more than one device, ``fn`` runs inside ``jax.shard_map`` instead:
  every argument and result split along axis 0 (the batch), except the arguments at the
  positions ``replicated`` (e.g. a conv's weights), which every shard gets whole (their
  gradients are summed over the shards). Without such a mesh: ``fn(*args)``. ``fn`` must act
  on each example independently; when ``data_shards() > 1``, ``jax.lax.axis_index(DATA_AXIS)``
  inside it names the shard.
  """
  if data_shards() == 1:
    return fn(*args)
  specs = tuple(PartitionSpec() if i in replicated else PartitionSpec(DATA_AXIS)
                for i in range(len(args)))
  return jax.shard_map(fn, in_specs=specs, out_specs=PartitionSpec(DATA_AXIS),
                       check_vma=False)(*args)


def shard_dropout_seed(seed):
  """Inside ``per_data_shard``: the Philox key (int32 [2] or None) of this shard's part of the
  batch. The fused kernels draw by (example, head, row, key) within their call, so each shard
  of a data-parallel batch gets its own key and no two shards share masks."""
  if seed is None or data_shards() == 1:
    return seed
  return seed.at[1].add(jax.lax.axis_index(DATA_AXIS))
