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

Token arrays are held in the smallest unsigned dtype that holds the vocabulary (``token_dtype``:
uint8 up to 256 ids, else uint16), a quarter or half of int32's memory; the input pipeline
casts each batch to int32. A task whose split arrays are slow to build or large (Pathfinder,
Path-X, Retrieval) also reads them from a *compact cache* that ``python -m
lra_sparse.data.prepare`` writes: per split and array one ``.npy`` file, opened memory-mapped,
plus ``meta.json`` with the task spec, the config fields that shaped the arrays and the size
and time stamp of the files they were read from. A cache that does not match the run's config
(or whose source files changed) is refused with one error saying how to rebuild it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Optional, Sequence

import numpy as np

from lra_sparse.data.registry import PAD_ID, SPLITS, TaskSpec, check_split_arrays

BYTE_VOCAB_SIZE = 257                 # 256 byte values shifted by one + PAD_ID
PIXEL_OFFSET = 1                      # mask_black_pixels=False: token = pixel + 1, never PAD_ID
PIXEL_VOCAB_SIZE = 256 + PIXEL_OFFSET
COMPACT_DIR = "compact"               # <data_dir>/compact/: the compact cache of a task
COMPACT_META_FILE = "meta.json"
COMPACT_FORMAT = 1                    # bumped when the cache layout changes


def token_dtype(vocab_size: int) -> np.dtype:
  """The smallest unsigned dtype holding token ids ``0 .. vocab_size - 1``."""
  if vocab_size <= 1 << 8:
    return np.dtype(np.uint8)
  if vocab_size <= 1 << 16:
    return np.dtype(np.uint16)
  raise ValueError(f"vocab_size={vocab_size} needs more than 16 bits per token")


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
  """Tokens of uint8 pixels (any shape) in ``token_dtype``: the raw value as uint8 if black
  pixels are masked (black = PAD_ID, LRA; no copy), else value + PIXEL_OFFSET as uint16 (every
  pixel a real token)."""
  if pixels.dtype != np.uint8:
    raise ValueError(f"expected uint8 pixels, got {pixels.dtype}")
  if mask_black_pixels(config):
    return pixels
  return pixels.astype(token_dtype(PIXEL_VOCAB_SIZE)) + PIXEL_OFFSET


def fill_byte_tokens(row: np.ndarray, text: bytes) -> None:
  """Writes the byte tokens (byte + 1) of ``text`` into ``row``, cut at ``len(row)``.

  Positions after the text keep their value (``PAD_ID`` in a zero-filled row).
  """
  data = np.frombuffer(text[:len(row)], dtype=np.uint8)
  row[:len(data)] = data
  row[:len(data)] += 1


def encode_bytes(texts: Sequence[bytes], max_length: int) -> np.ndarray:
  """Byte tokens (byte + 1, uint16), truncated to ``max_length`` and right-padded with
  ``PAD_ID``."""
  if max_length < 1:
    raise ValueError(f"config.data.max_length must be >= 1, got {max_length}")
  tokens = np.full((len(texts), max_length), PAD_ID, dtype=token_dtype(BYTE_VOCAB_SIZE))
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


# ---------------------------------------------------------------------------------------------
# Compact cache: a task's split arrays as memory-mapped .npy files (see the module docstring).

def _spec_fields(spec: TaskSpec) -> dict[str, Any]:
  fields = dataclasses.asdict(spec)
  fields["input_names"] = list(spec.input_names)      # as JSON reads it back
  return fields


def _file_stamp(path: str) -> list[int]:
  """[size, whole-second mtime]: a changed source file changes one of them."""
  stat = os.stat(path)
  return [stat.st_size, int(stat.st_mtime)]


def write_compact_cache(cache_dir: str, spec: TaskSpec, settings: dict[str, Any],
                        data_dir: str, sources: Sequence[str],
                        load_split: Callable[[str], dict[str, np.ndarray]]) -> None:
  """Writes the compact cache of every split, ``load_split(split)`` giving its arrays.

  Splits are loaded one at a time (only one is ever in memory). Token arrays are stored in
  ``token_dtype(spec.vocab_size)``, labels as they are. ``settings`` are the config fields
  that shaped the arrays; ``sources`` the files they were read from (stamped by size and time
  before reading; paths relative to ``data_dir`` in the metadata). The cache is built in a
  sibling directory and renamed into place, so a reader never sees half of one.
  """
  stamps = {os.path.relpath(path, data_dir): _file_stamp(path) for path in sources}
  tmp = cache_dir + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  arrays_meta: dict[str, dict[str, Any]] = {}
  for split in SPLITS:
    arrays = load_split(split)
    check_split_arrays(arrays, spec, f"compact cache of task {spec.name!r} split {split!r}")
    arrays_meta[split] = {}
    for name, array in arrays.items():
      if name in spec.input_names:
        array = array.astype(token_dtype(spec.vocab_size), copy=False)
      np.save(os.path.join(tmp, f"{split}.{name}.npy"), np.ascontiguousarray(array))
      arrays_meta[split][name] = {"dtype": array.dtype.str, "shape": list(array.shape)}
  meta = {"format": COMPACT_FORMAT, "spec": _spec_fields(spec), "settings": settings,
          "sources": stamps,
          "arrays": arrays_meta}
  with open(os.path.join(tmp, COMPACT_META_FILE), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
  shutil.rmtree(cache_dir, ignore_errors=True)
  os.replace(tmp, cache_dir)


class CompactCacheMismatch(ValueError):
  """A compact cache that cannot serve a config; the message says why (not how to fix it)."""


def check_compact_cache(cache_dir: str, spec: TaskSpec, settings: dict[str, Any],
                        data_dir: str) -> Optional[dict[str, Any]]:
  """The metadata of the compact cache in ``cache_dir``, None when there is none.

  Raises ``CompactCacheMismatch`` for unreadable metadata, another format, a cache built for
  another spec or other ``settings``, or source files changed since it was built.
  """
  meta_path = os.path.join(cache_dir, COMPACT_META_FILE)
  if not os.path.isfile(meta_path):
    return None
  try:
    with open(meta_path, encoding="utf-8") as f:
      meta = json.load(f)
    built_spec, built_settings = meta["spec"], meta["settings"]
    sources, arrays_meta = meta["sources"], meta["arrays"]
    if sorted(arrays_meta) != sorted(SPLITS):
      raise KeyError(f"splits {sorted(arrays_meta)}")
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise CompactCacheMismatch(f"compact cache {meta_path} is unreadable ({error!r})") from None
  if meta.get("format") != COMPACT_FORMAT:
    raise CompactCacheMismatch(f"compact cache {cache_dir} has format {meta.get('format')!r}, "
                               f"this code reads format {COMPACT_FORMAT}")
  wanted = {**{f"spec.{k}": v for k, v in _spec_fields(spec).items()}, **settings}
  built = {**{f"spec.{k}": v for k, v in built_spec.items()}, **built_settings}
  show = lambda values, key: repr(values[key]) if key in values else "(absent)"
  differ = [f"{key}={show(built, key)} (this config: {show(wanted, key)})"
            for key in sorted(set(wanted) | set(built))
            if key not in built or key not in wanted or built[key] != wanted[key]]
  if differ:
    raise CompactCacheMismatch(f"compact cache {cache_dir} was built with other settings: "
                               f"{'; '.join(differ)}")
  for relative, stamp in sources.items():
    path = os.path.join(data_dir, relative)
    if os.path.exists(path) and _file_stamp(path) != stamp:
      raise CompactCacheMismatch(f"compact cache {cache_dir} is stale: {path} changed since it "
                                 f"was built (size or modification time)")
  return meta


def read_compact_split(cache_dir: str, spec: TaskSpec, settings: dict[str, Any], data_dir: str,
                       split: str) -> Optional[dict[str, np.ndarray]]:
  """The arrays of ``split`` from the compact cache in ``cache_dir``, memory-mapped read-only;
  None when there is no cache. A cache that ``check_compact_cache`` refuses, or a missing or
  damaged array file, is one error saying how to rebuild it."""
  rebuild = (f"delete {cache_dir} (the task then reads its original files) or rebuild it for "
             f"this config: delete it and run python -m lra_sparse.data.prepare --task="
             f"{spec.name} (see its --help for the settings flags)")
  try:
    meta = check_compact_cache(cache_dir, spec, settings, data_dir)
  except CompactCacheMismatch as error:
    raise ValueError(f"{error}; {rebuild}") from None
  if meta is None:
    return None
  arrays = {}
  for name, info in meta["arrays"][split].items():
    path = os.path.join(cache_dir, f"{split}.{name}.npy")
    try:
      array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
      raise ValueError(f"compact cache file {path} is unreadable ({error}); {rebuild}") from None
    if array.dtype.str != info["dtype"] or list(array.shape) != info["shape"]:
      raise ValueError(f"compact cache file {path} holds {array.dtype}{list(array.shape)}, its "
                       f"metadata says {info['dtype']}{info['shape']}; {rebuild}")
    arrays[name] = array
  return arrays
