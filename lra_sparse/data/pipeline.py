"""grain input pipelines over split arrays (in memory or memory-mapped).

Training batches form a random-access ``grain.MapDataset`` (shuffle per epoch, repeat forever,
batch): batch ``i`` is a pure function of (arrays, seed, i), so a resumed run reads exactly the
batches it would have read had it never stopped.

Loaders may hold tokens in a compact unsigned dtype (uint8 / uint16, see
``lra_sparse.data.registry``); only the rows of a batch are cast, so every batch is int32 and
a split never exists as int32 as a whole.
"""
from __future__ import annotations

from typing import Iterator

import grain
import numpy as np


class ArraySource:
  """grain random-access source over a dict of equally long integer numpy arrays (one record =
  a row, as int32)."""

  def __init__(self, arrays: dict[str, np.ndarray]):
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) != 1:
      raise ValueError(f"arrays must share their first dimension, got "
                       f"{ {k: a.shape for k, a in arrays.items()} }")
    self._arrays = arrays
    self._length = lengths.pop()

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {key: np.asarray(array[index], np.int32) for key, array in self._arrays.items()}


def train_dataset(arrays: dict[str, np.ndarray], batch_size: int, seed: int) -> grain.MapDataset:
  """Infinite shuffled batches; ``dataset[step]`` is the batch of training step ``step``."""
  if len(arrays["targets"]) < batch_size:
    raise ValueError(f"the training split has {len(arrays['targets'])} examples, fewer than "
                     f"batch_size={batch_size}")
  return (grain.MapDataset.source(ArraySource(arrays))
          .shuffle(seed=seed)
          .repeat(None)
          .batch(batch_size, drop_remainder=True))


def eval_batches(arrays: dict[str, np.ndarray], batch_size: int,
                 max_batches: int = 0) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
  """Batches in order, the last one padded with weight-0 copies so every batch is full.

  Yields ``(batch, weights)``: the batch's arrays as int32, ``weights`` float32 [batch_size]
  (1 = real example).
  """
  n = len(arrays["targets"])
  num_batches = -(-n // batch_size)
  if max_batches > 0:
    num_batches = min(num_batches, max_batches)
  for b in range(num_batches):
    index = np.arange(b * batch_size, (b + 1) * batch_size)
    weights = (index < n).astype(np.float32)
    index = np.minimum(index, n - 1)
    yield {key: np.asarray(array[index], np.int32) for key, array in arrays.items()}, weights
