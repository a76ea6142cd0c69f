"""LRA Text: IMDB sentiment classification on bytes (google-research/long-range-arena, text_classification).

Two sources give the same examples (``config.data.source``):

- ``"aclimdb"``: a local ``aclImdb/`` tree as released by Maas et al. (``{train,test}/{pos,neg}/*.txt``;
  ``unsup/`` and the other files are ignored). Files are read as raw bytes and stripped like the
  tfds builder does (``f.read().strip()``), so the tokens match the tfds source exactly.
- ``"tfds"``: tfds ``imdb_reviews`` read through ``tfds.data_source`` (no TensorFlow needed); it
  must be prepared locally in the ``array_record`` file format. ``config.data.data_dir`` is the
  tfds data dir ("" = the tfds default, ``~/tensorflow_datasets``).

Splits follow LRA: IMDB has no validation set, so LRA trained on ``train`` and used ``test`` both
for evaluation during training and for the final test. Here: train -> train, val -> test,
test -> test.

Tokens follow LRA's ``tfds.deprecated.text.ByteTextEncoder``: token = byte + 1 (0 is padding),
vocabulary 257; a review is truncated to ``config.data.max_length`` bytes and padded with 0.
Labels: 0 = neg, 1 = pos.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

from absl import app
from absl import flags
from absl import logging
import numpy as np

from lra_sparse.data.registry import PAD_ID, SPLITS, TaskSpec, register_task

BYTE_VOCAB_SIZE = 257                 # 256 byte values shifted by one + PAD_ID
LABEL_NAMES = ("neg", "pos")          # label id = index (tfds ClassLabel order)
SOURCES = ("aclimdb", "tfds")
# LRA: IMDB has no validation split, so the test split doubles as validation.
_ACLIMDB_SPLIT_DIRS = {"train": "train", "val": "test", "test": "test"}
_TFDS_SPLITS = {"train": "train", "val": "test", "test": "test"}


def encode_bytes(texts: Sequence[bytes], max_length: int) -> np.ndarray:
  """Byte tokens (byte + 1), truncated to ``max_length`` and right-padded with ``PAD_ID``."""
  if max_length < 1:
    raise ValueError(f"config.data.max_length must be >= 1, got {max_length}")
  tokens = np.full((len(texts), max_length), PAD_ID, dtype=np.int32)
  for row, text in zip(tokens, texts):
    data = np.frombuffer(text[:max_length], dtype=np.uint8)
    row[:len(data)] = data
    row[:len(data)] += 1
  return tokens


def as_bytes(text: Any, where: str) -> bytes:
  """tfds yields text as ``bytes`` (or ``str`` from some readers); anything else is an error."""
  if isinstance(text, np.ndarray) and text.ndim == 0:
    text = text.item()
  if isinstance(text, str):
    return text.encode("utf-8")
  if isinstance(text, (bytes, np.bytes_)):
    return bytes(text)
  raise ValueError(f"{where}: expected text as bytes or str, got {type(text).__name__}")


def check_split_name(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def take_first(arrays: dict[str, np.ndarray], max_examples: int) -> dict[str, np.ndarray]:
  """``config.data.max_examples`` > 0 keeps the first examples of a split (tiny presets)."""
  if max_examples < 0:
    raise ValueError(f"config.data.max_examples must be >= 0 (0 = all), got {max_examples}")
  if max_examples == 0:
    return arrays
  return {key: value[:max_examples] for key, value in arrays.items()}


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


def load_tfds_source(name: str, split: str, data_dir: str, hint: str):
  """A prepared tfds dataset as a random-access source, or one clear error saying how to prepare it."""
  import tensorflow_datasets as tfds  # Imported lazily: slow, and only this source needs it.
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
  except Exception as error:  # tfds raises several types (format, missing files, version).
    builder = tfds.builder(name, data_dir=data_dir or None)
    prepare = (f"prepare it on a machine with network access: `tfds build {name} "
               f"--data_dir={data_dir or '~/tensorflow_datasets'} --file_format=array_record`")
    if not builder.is_prepared():
      raise FileNotFoundError(
          f"tfds dataset {name!r} is not prepared under {builder.data_dir}; {prepare}, "
          f"or {hint}") from error
    raise ValueError(
        f"tfds dataset {name!r} at {builder.data_dir} cannot be read without TensorFlow "
        f"({error}); {prepare}, or {hint}") from error


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


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
  bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
  if bad.size:
    raise ValueError(f"{where}: example {bad[0]} has label {labels[bad[0]]}, outside the "
                     f"{num_classes} classes")


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
    logging.info("text %s: %d reviews from %s in %.1f s; %d (%.1f%%) longer than max_length=%d "
                 "bytes were truncated", split, len(arrays["targets"]), where,
                 time.perf_counter() - start, num_cut, 100.0 * num_cut / len(arrays["targets"]),
                 config.data.max_length)
    return arrays


# `python -m lra_sparse.data.text` runs this file a second time as __main__ after the package
# import registered the library copy: register once (as lra_sparse/data/listops.py does).
if __name__ != "__main__":
  register_task("text")(TextTask)


def write_tiny_aclimdb(data_dir: str, *, num_train: int = 4000, num_test: int = 1000,
                       seed: int = 0) -> None:
  """Writes a small learnable aclImdb-layout set for the "tiny" preset (not real IMDB text).

  Each review is filler words plus 2-4 words of its label's sentiment and at most one of the
  other, so a tiny model can learn the label from bytes in minutes on a CPU.
  """
  rng = np.random.default_rng(seed)
  filler = ["the", "movie", "film", "plot", "actor", "scene", "was", "and", "a", "story",
            "really", "quite", "with", "ending", "music", "it"]
  sentiment = (["awful", "boring", "terrible", "dull", "worst"],
               ["great", "superb", "wonderful", "moving", "best"])
  for split_dir, count in (("train", num_train), ("test", num_test)):
    for label, label_name in enumerate(LABEL_NAMES):
      os.makedirs(os.path.join(data_dir, split_dir, label_name), exist_ok=True)
    for index in range(count):
      label = index % 2
      # 10-30 filler words keep a review under ~200 bytes: the tiny preset's 256 never cuts a cue.
      words = list(rng.choice(filler, size=int(rng.integers(10, 30))))
      cues = ([rng.choice(sentiment[label]) for _ in range(int(rng.integers(2, 5)))]
              + [rng.choice(sentiment[1 - label]) for _ in range(int(rng.integers(0, 2)))])
      for cue in cues:
        words.insert(int(rng.integers(0, len(words) + 1)), str(cue))
      # aclImdb names reviews <id>_<rating>.txt; ratings 1-4 are neg, 7-10 pos.
      rating = int(rng.integers(7, 11)) if label else int(rng.integers(1, 5))
      path = os.path.join(data_dir, split_dir, LABEL_NAMES[label], f"{index}_{rating}.txt")
      with open(path, "w", encoding="utf-8") as f:
        f.write(" ".join(words).capitalize() + ".\n")


# ---------------------------------------------------------------------------------------------
# CLI: python -m lra_sparse.data.text --output_dir=data/text_tiny

def _define_flags() -> None:
  flags.DEFINE_string("output_dir", None, "Directory for the aclImdb-layout demo set.")
  flags.DEFINE_integer("num_train", 4000, "Number of training reviews.")
  flags.DEFINE_integer("num_test", 1000, "Number of test reviews.")
  flags.DEFINE_integer("seed", 0, "Seed of the numpy Generator.")
  flags.mark_flag_as_required("output_dir")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  write_tiny_aclimdb(f.output_dir, num_train=f.num_train, num_test=f.num_test, seed=f.seed)
  print(f"wrote {f.output_dir}/{{train,test}}/{{pos,neg}}/*.txt")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
