"""LRA Retrieval: AAN citation matching with a dual encoder (long-range-arena, matching).

Files: ``{config.data.data_dir}/new_aan_pairs.{train,eval,test}.tsv`` from ``lra_release/tsv_data``.
Each line has five tab-separated fields and no header: ``label, id1, id2, text1, text2``. As in
LRA's reader (``make_csv_dataset``, ``use_quote_delim=False``) quotes are ordinary characters; the
label is a float (``1.0`` / ``0.0``) that LRA casts to int32; here anything but 0 or 1 is an error.

Splits: train -> ``train.tsv``, val -> ``eval.tsv``, test -> ``test.tsv``.

Each document is byte-tokenized like LRA's ``tokenizer="char"`` (``ByteTextEncoder``): token = byte
+ 1 (0 is padding), vocabulary 257, truncated to ``config.data.max_length`` (4000 in LRA) per
document. Arrays: ``inputs1``, ``inputs2`` uint16 ``[N, max_length]`` (the input pipeline casts
batches to int32), ``targets`` int32 ``[N]``. A document with an empty text field becomes an
all-padding row (LRA's reader accepts it too).

Compact cache: ``python -m lra_sparse.data.prepare --task=retrieval`` also writes the arrays of
every split to ``{config.data.data_dir}/compact/`` (``lra_sparse.data.common``); when that
directory exists the task reads them memory-mapped instead of parsing the TSV files (AAN's
train split is ~2.4 GB as uint16 at max_length 4000, twice that as int32). The cache records
``max_length``; a run with another one is refused with an error saying how to rebuild it.

Small learnable files in this format for the tiny preset (not real AAN text):
``python -m lra_sparse.generators.retrieval --output_dir=data/retrieval_tiny``.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any

from absl import logging
import numpy as np

from lra_sparse.data.common import (BYTE_VOCAB_SIZE, COMPACT_DIR, check_split_name,
                                    fill_byte_tokens, read_compact_split, take_first,
                                    token_dtype)
from lra_sparse.data.registry import TaskSpec, register_task

FILE_PREFIX = "new_aan_pairs"
NUM_COLUMNS = 5                        # label, id1, id2, text1, text2
NUM_CLASSES = 2
_SPLIT_FILES = {"train": "train", "val": "eval", "test": "test"}


def split_path(data_dir: str, split: str) -> str:
  return os.path.join(data_dir, f"{FILE_PREFIX}.{_SPLIT_FILES[split]}.tsv")


def _parse_label(field: bytes, where: str) -> int:
  try:
    value = float(field)
  except ValueError:
    raise ValueError(f"{where}: label {field[:40]!r} is not a number") from None
  if not math.isfinite(value) or value != int(value) or not 0 <= value < NUM_CLASSES:
    raise ValueError(f"{where}: label {field.decode('utf-8', 'replace')!r} is outside the "
                     f"classes 0..{NUM_CLASSES - 1}")
  return int(value)


def read_aan_tsv(path: str, max_length: int) -> dict[str, np.ndarray]:
  """Parses one AAN pairs file into ``inputs1``, ``inputs2``, ``targets`` (blank lines skipped)."""
  if max_length < 1:
    raise ValueError(f"config.data.max_length must be >= 1, got {max_length}")
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"AAN file {path} does not exist; config.data.data_dir must hold "
        f"{FILE_PREFIX}.{{train,eval,test}}.tsv (lra_release/tsv_data from the LRA release)")
  # Two passes keep memory at the final arrays: count lines, then fill preallocated rows.
  with open(path, "rb") as f:
    max_rows = sum(1 for _ in f)
  # np.zeros (PAD_ID == 0) maps pages lazily, so rows never written cost no memory.
  inputs1 = np.zeros((max_rows, max_length), dtype=token_dtype(BYTE_VOCAB_SIZE))
  inputs2 = np.zeros((max_rows, max_length), dtype=token_dtype(BYTE_VOCAB_SIZE))
  targets = np.empty(max_rows, dtype=np.int32)
  count = 0
  with open(path, "rb") as f:
    for line_number, line in enumerate(f, start=1):
      line = line.rstrip(b"\r\n")
      if not line.strip():
        continue
      fields = line.split(b"\t")
      where = f"{path}:{line_number}"
      if len(fields) != NUM_COLUMNS:
        raise ValueError(f"{where}: expected {NUM_COLUMNS} tab-separated columns "
                         f"(label, id1, id2, text1, text2), got {len(fields)}")
      targets[count] = _parse_label(fields[0], where)
      fill_byte_tokens(inputs1[count], fields[3])
      fill_byte_tokens(inputs2[count], fields[4])
      count += 1
  if count == 0:
    raise ValueError(f"AAN file {path} holds no examples")
  return {"inputs1": inputs1[:count], "inputs2": inputs2[:count], "targets": targets[:count]}


@register_task("retrieval")
class RetrievalTask:
  """Pairs of AAN papers as byte sequences; label 1 if one cites the other."""

  def spec(self, config: Any) -> TaskSpec:
    del config
    return TaskSpec(name="retrieval", num_classes=NUM_CLASSES, vocab_size=BYTE_VOCAB_SIZE,
                    input_names=("inputs1", "inputs2"), model_kind="dual_encoder")

  # The compact cache (read by load_split, written by lra_sparse.data.prepare).
  def compact_cache_dir(self, config: Any) -> str:
    return os.path.join(config.data.data_dir, COMPACT_DIR)

  def compact_settings(self, config: Any) -> dict[str, Any]:
    """The config fields that shape the arrays (max_examples only cuts them afterwards)."""
    return {"source": config.data.get("source", "tsv"), "max_length": config.data.max_length}

  def compact_sources(self, config: Any) -> list[str]:
    return [split_path(config.data.data_dir, split) for split in _SPLIT_FILES]

  def _check_config(self, config: Any) -> None:
    source = config.data.get("source", "tsv")
    if source != "tsv":
      raise ValueError(f"unknown config.data.source {source!r} for task 'retrieval'; "
                       f"expected 'tsv'")
    if not os.path.isdir(config.data.data_dir):
      raise FileNotFoundError(f"AAN data directory {config.data.data_dir!r} does not exist "
                              f"(config.data.data_dir)")

  def load_original_split(self, config: Any, split: str) -> dict[str, np.ndarray]:
    """The split parsed from its TSV file (never the compact cache)."""
    check_split_name(split)
    self._check_config(config)
    return read_aan_tsv(split_path(config.data.data_dir, split), config.data.max_length)

  def load_split(self, config: Any, split: str) -> dict[str, np.ndarray]:
    check_split_name(split)
    self._check_config(config)
    start = time.perf_counter()
    cache_dir = self.compact_cache_dir(config)
    cached = read_compact_split(cache_dir, self.spec(config), self.compact_settings(config),
                                config.data.data_dir, split)
    if cached is not None:
      arrays = take_first(cached, config.data.get("max_examples", 0))
      logging.info("retrieval %s: %d pairs memory-mapped from the compact cache %s in %.1f s",
                   split, len(arrays["targets"]), cache_dir, time.perf_counter() - start)
      return arrays
    path = split_path(config.data.data_dir, split)
    arrays = take_first(self.load_original_split(config, split),
                        config.data.get("max_examples", 0))
    # A document filling every position was (almost surely) truncated.
    num_full = int(sum((arrays[name][:, -1] != 0).sum() for name in ("inputs1", "inputs2")))
    log = logging.warning if num_full else logging.info
    log("retrieval %s: %d pairs from %s in %.1f s; %d of %d documents reach max_length=%d "
        "bytes (truncated; LRA truncates at its max_length too)", split,
        len(arrays["targets"]), path, time.perf_counter() - start, num_full,
        2 * len(arrays["targets"]), config.data.max_length)
    return arrays
