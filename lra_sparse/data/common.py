"""Helpers shared by the task loaders: byte and pixel tokens, split names, subsets, labels, tfds.

Every loader in ``lra_sparse/data/`` imports what it shares with another loader from here (never
from another loader). Token conventions follow the registry's contract: id 0 is padding, so a byte
value v becomes the token v + 1 and the vocabulary has 257 ids.

Pixels (Image, Pathfinder, Path-X) follow ``config.data.mask_black_pixels``:

- True (default, as LRA): the token is the raw pixel value 0..255 (vocabulary 256), so a black
  pixel is token 0 = ``PAD_ID`` and the model's key mask ``tokens != 0`` is LRA's padding mask
  ``inputs > 0`` (google-research/long-range-arena, models/transformer/transformer.py): black
  pixels are neither attended to nor pooled. Masked positions then sit anywhere in a row,
  not only at its end (``TaskSpec.padding_at_end`` is False).
- False: the token is pixel + 1 (1..256, vocabulary 257): every pixel is a real token.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from lra_sparse.data.registry import PAD_ID, SPLITS

BYTE_VOCAB_SIZE = 257                 # 256 byte values shifted by one + PAD_ID
PIXEL_OFFSET = 1                      # mask_black_pixels=False: token = pixel + 1, never PAD_ID
PIXEL_VOCAB_SIZE = 256 + PIXEL_OFFSET


def mask_black_pixels(config: Any) -> bool:
  """``config.data.mask_black_pixels`` (True when absent, as LRA), checked."""
  value = config.data.get("mask_black_pixels", True)
  if not isinstance(value, bool):
    raise ValueError(f"config.data.mask_black_pixels={value!r} must be True (black pixels are "
                     "padding, as LRA's inputs > 0 mask) or False (every pixel is a token)")
  return value


def pixel_vocab_size(config: Any) -> int:
  """256 raw pixel values (black = PAD_ID) when black pixels are masked, else 257."""
  return 256 if mask_black_pixels(config) else PIXEL_VOCAB_SIZE


def pixel_tokens(pixels: np.ndarray, config: Any) -> np.ndarray:
  """int32 tokens of uint8 pixels (any shape): the raw value if black pixels are masked (black
  = PAD_ID, LRA), else value + PIXEL_OFFSET (every pixel a real token)."""
  if pixels.dtype != np.uint8:
    raise ValueError(f"expected uint8 pixels, got {pixels.dtype}")
  tokens = pixels.astype(np.int32)
  return tokens if mask_black_pixels(config) else tokens + PIXEL_OFFSET


def fill_byte_tokens(row: np.ndarray, text: bytes) -> None:
  """Writes the byte tokens (byte + 1) of ``text`` into ``row``, cut at ``len(row)``.

  Positions after the text keep their value (``PAD_ID`` in a zero-filled row).
  """
  data = np.frombuffer(text[:len(row)], dtype=np.uint8)
  row[:len(data)] = data
  row[:len(data)] += 1


def encode_bytes(texts: Sequence[bytes], max_length: int) -> np.ndarray:
  """Byte tokens (byte + 1), truncated to ``max_length`` and right-padded with ``PAD_ID``."""
  if max_length < 1:
    raise ValueError(f"config.data.max_length must be >= 1, got {max_length}")
  tokens = np.full((len(texts), max_length), PAD_ID, dtype=np.int32)
  for row, text in zip(tokens, texts):
    fill_byte_tokens(row, text)
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
  """One clear error for a split name that is not one of ``SPLITS``."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


def take_first(arrays: dict[str, np.ndarray], max_examples: int) -> dict[str, np.ndarray]:
  """``config.data.max_examples`` > 0 keeps the first examples of a split (tiny presets)."""
  if max_examples < 0:
    raise ValueError(f"config.data.max_examples must be >= 0 (0 = all), got {max_examples}")
  if max_examples == 0:
    return arrays
  return {key: value[:max_examples] for key, value in arrays.items()}


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
  """One clear error naming the first label outside ``[0, num_classes)``."""
  bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
  if bad.size:
    raise ValueError(f"{where}: example {bad[0]} has label {labels[bad[0]]}, outside the "
                     f"{num_classes} classes")


def load_tfds_source(name: str, split: str, data_dir: str, hint: str):
  """A prepared tfds dataset as a random-access source, or one clear error saying how to prepare it.

  ``data_dir`` "" is the tfds default (``~/tensorflow_datasets``); ``hint`` names the offline
  alternative in the error.
  """
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
