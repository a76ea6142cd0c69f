"""LRA Text: IMDB sentiment classification on bytes (long-range-arena, text_classification).

Two sources give the same examples (``config.data.source``):

- ``"aclimdb"``: a local ``aclImdb/`` tree as released by Maas et al.
  (``{train,test}/{pos,neg}/*.txt``; ``unsup/`` and the other files are ignored). Files are read
  as raw bytes and stripped like the tfds builder does (``f.read().strip()``), so the tokens
  match the tfds source exactly.
- ``"tfds"``: tfds ``imdb_reviews`` read through ``tfds.data_source`` (no TensorFlow needed); it
  must be prepared locally in the ``array_record`` file format. ``config.data.data_dir`` is the
  tfds data dir ("" = the tfds default, ``~/tensorflow_datasets``).

Splits follow LRA: IMDB has no validation set, so LRA trained on ``train`` and used ``test`` both
for evaluation during training and for the final test. Here: train -> train, val -> test,
test -> test.

Tokens follow LRA's ``tfds.deprecated.text.ByteTextEncoder``: token = byte + 1 (0 is padding),
vocabulary 257; a review is truncated to ``config.data.max_length`` bytes and padded with 0.
Labels: 0 = neg, 1 = pos.

A small learnable set in the aclImdb layout for the tiny preset (not real IMDB text):
``python -m lra_sparse.generators.text --output_dir=data/text_tiny``.
"""
from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
import numpy as np

from lra_sparse.data.common import (BYTE_VOCAB_SIZE, as_bytes, check_labels, check_split_name,
                                    encode_bytes, load_tfds_source, take_first)
from lra_sparse.data.registry import TaskSpec, register_task

LABEL_NAMES = ("neg", "pos")          # label id = index (tfds ClassLabel order)
SOURCES = ("aclimdb", "tfds")
# LRA: IMDB has no validation split, so the test split doubles as validation.
_ACLIMDB_SPLIT_DIRS = {"train": "train", "val": "test", "test": "test"}
_TFDS_SPLITS = {"train": "train", "val": "test", "test": "test"}


def _review_order(name: str) -> tuple[int, str]:
  """aclImdb names reviews ``<id>_<rating>.txt``: order by numeric id (then name)."""
  review_id = name.split("_", 1)[0]
  return (int(review_id) if review_id.isdigit() else -1, name)


def _aclimdb_files(label_dir: str) -> list[str]:
  if not os.path.isdir(label_dir):
    raise FileNotFoundError(
        f"IMDB directory {label_dir} does not exist; config.data.data_dir must point at an "
        f"aclImdb/ tree with {{train,test}}/{{pos,neg}}/*.txt (from "
        f"https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz)")
  names = sorted((name for name in os.listdir(label_dir) if name.endswith(".txt")),
                 key=_review_order)
  if not names:
    raise ValueError(f"IMDB directory {label_dir} holds no *.txt review files")
  return [os.path.join(label_dir, name) for name in names]


def read_aclimdb(data_dir: str, split_dir: str) -> tuple[list[bytes], np.ndarray]:
  """Reviews (raw bytes, stripped like tfds) and labels of ``aclImdb/<split_dir>/{neg,pos}``.

  Examples alternate neg, pos, neg, ... (each class in review-id order), so a
  ``config.data.max_examples`` prefix keeps both classes.
  """
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"IMDB data directory {data_dir!r} does not exist "
                            f"(config.data.data_dir, source 'aclimdb')")
  files_per_label = [_aclimdb_files(os.path.join(data_dir, split_dir, label_name))
                     for label_name in LABEL_NAMES]
  order = sorted((rank, label, path) for label, paths in enumerate(files_per_label)
                 for rank, path in enumerate(paths))
  texts: list[bytes] = []
  for _, _, path in order:
    with open(path, "rb") as f:
      texts.append(f.read().strip())
  return texts, np.asarray([label for _, label, _ in order], dtype=np.int32)


def read_tfds_imdb(data_dir: str, tfds_split: str,
                   max_examples: int = 0) -> tuple[list[bytes], np.ndarray]:
  """Reviews and labels of a tfds ``imdb_reviews`` split (the first ``max_examples`` if > 0)."""
  source = load_tfds_source("imdb_reviews", tfds_split, data_dir,
                            hint="use --config.data.source=aclimdb with an aclImdb/ directory")
  where = f"tfds imdb_reviews/{tfds_split}"
  count = min(len(source), max_examples) if max_examples > 0 else len(source)
  texts: list[bytes] = []
  labels = np.empty(count, dtype=np.int32)
  for index in range(count):
    example = source[index]
    texts.append(as_bytes(example["text"], f"{where} example {index}"))
    labels[index] = int(example["label"])
  return texts, labels


@register_task("text")
class TextTask:
  """IMDB reviews as byte sequences, binary sentiment."""

  def spec(self, config: Any) -> TaskSpec:
    del config
    return TaskSpec(name="text", num_classes=len(LABEL_NAMES), vocab_size=BYTE_VOCAB_SIZE)

  def load_split(self, config: Any, split: str) -> dict[str, np.ndarray]:
    check_split_name(split)
    start = time.perf_counter()
    source = config.data.get("source", "aclimdb")
    if source == "aclimdb":
      texts, labels = read_aclimdb(config.data.data_dir, _ACLIMDB_SPLIT_DIRS[split])
      where = os.path.join(config.data.data_dir, _ACLIMDB_SPLIT_DIRS[split])
    elif source == "tfds":
      texts, labels = read_tfds_imdb(config.data.data_dir, _TFDS_SPLITS[split],
                                     config.data.get("max_examples", 0))
      where = f"tfds imdb_reviews/{_TFDS_SPLITS[split]}"
    else:
      raise ValueError(f"unknown config.data.source {source!r} for task 'text'; "
                       f"expected one of {SOURCES}")
    check_labels(labels, len(LABEL_NAMES), where)
    arrays = take_first({"inputs": encode_bytes(texts, config.data.max_length),
                         "targets": labels}, config.data.get("max_examples", 0))
    num_cut = sum(len(text) > config.data.max_length for text in texts[:len(arrays["targets"])])
    log = logging.warning if num_cut else logging.info
    log("text %s: %d reviews from %s in %.1f s; %d (%.1f%%) longer than max_length=%d bytes "
        "were truncated (LRA truncates at its max_length too)", split, len(arrays["targets"]),
        where, time.perf_counter() - start, num_cut, 100.0 * num_cut / len(arrays["targets"]),
        config.data.max_length)
    return arrays
