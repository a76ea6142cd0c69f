"""LRA Pathfinder (32x32) and Path-X (128x128): the loader of the LRA on-disk layout.

The task (Linsley et al. 2018; Kim et al. 2020, ICLR): an image holds two long "snakes" (contours
made of short dashes, the *paddles*), shorter distractor snakes, and two circle markers. Label 1:
the markers sit on the two ends of one snake; label 0: they sit on ends of different snakes.

The generator of these files is ``lra_sparse.generators.pathfinder`` (``python -m
lra_sparse.generators.pathfinder --output_dir=DIR --resolution=32 --difficulty=hard
--num_images=N``); difficulty easy / intermediate / hard means contour length 6 / 9 / 14 in the
directories curv_baseline / curv_contour_length_9 / curv_contour_length_14. LRA's Pathfinder
is 32 px hard; Path-X is 128 px hard.

On-disk layout (what LRA's TFDS builder and input pipeline read; ``<data_dir>`` is
``config.data.data_dir``)::

  <data_dir>/<difficulty_dir>/imgs/<batch>/sample_<i>.png     8-bit grayscale, i per batch
  <data_dir>/<difficulty_dir>/metadata/<batch>.npy            text, despite the name

A metadata file has one line per image, space-separated, newline-terminated, in the published
generator's field order::

  imgs/<batch> sample_<i>.png <i> <label> <continuity> <contour_length> <distractor_length>
  <paddle_length> <paddle_thickness> <paddle_margin> <num_paddle_contrasts>

LRA reads fields 0 and 1 (the image path relative to the difficulty directory) and 3 (label).

Loader: tasks ``pathfinder`` (32x32, 1024 tokens) and ``pathx`` (128x128, 16384 tokens).
``config.data.data_dir`` is the root holding the difficulty directories and
``config.data.difficulty`` picks one. Rows are read in metadata order (files sorted by batch
number, lines in file order) and split 80/10/10 into train/val/test like LRA's
``split[:80%]``, ``[80%:90%]``, ``[90%:]``. Tokens follow ``config.data.mask_black_pixels``
(``lra_sparse.data.common``): by default the raw pixel value (uint8, vocab_size 256) with black
pixels as padding, as LRA's mask ``inputs > 0``; False gives pixel + 1 (uint16, vocab_size
257), every pixel a real token. As LRA's
pipeline does, zero-byte image files (the official 32 px release has one) are skipped with a
warning; every other problem (missing directory, missing or corrupt PNG, wrong image size,
label outside {0, 1}, malformed metadata row) is one error naming the file (and line).
Binary .npy metadata (``np.save`` of a string array, as the published generator writes it) is
read as well.

Compact cache: ``python -m lra_sparse.data.prepare --task=pathfinder|pathx`` also writes the
token arrays of every split to ``<data_dir>/compact/<difficulty_dir>/`` (``lra_sparse.data.
common``); when it exists the task reads them memory-mapped instead of decoding the PNGs
(Path-X, 200k images of 16384 tokens: 3.3 GB as uint8 on disk and in the page cache, 13 GB as
int32). The cache records mask_black_pixels and the resolution; a run with others is refused
with an error saying how to rebuild it.
"""
from __future__ import annotations

import io
import os
import time
from typing import Any

from absl import logging
import numpy as np
from PIL import Image

from lra_sparse.data.common import (COMPACT_DIR, check_split_name, mask_black_pixels,
                                    pixel_tokens, pixel_vocab_size, read_compact_split)
from lra_sparse.data.registry import TaskSpec, register_task

DIFFICULTY_DIRS = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}
NUM_CLASSES = 2
SPLIT_BOUNDS = {"train": (0.0, 0.8), "val": (0.8, 0.9), "test": (0.9, 1.0)}
METADATA_FIELDS = 11              # fields of a metadata row (LRA reads fields 0, 1 and 3)


def _metadata_sort_key(name: str) -> tuple[int, int, str]:
  stem = name[:-len(".npy")]
  return (0, int(stem), "") if stem.isdigit() else (1, 0, stem)


def _metadata_lines(path: str) -> list[str]:
  with open(path, "rb") as f:
    raw = f.read()
  if raw.startswith(b"\x93NUMPY"):
    # The published generator np.save()s a string array; LRA's release holds text files.
    try:
      array = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as e:
      raise ValueError(f"{path}: unreadable .npy metadata ({e})") from e
    if array.ndim != 2:
      raise ValueError(f"{path}: .npy metadata must be a 2-D array of rows, got shape "
                       f"{array.shape}")
    return [" ".join(str(v) for v in row) for row in array.tolist()]
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: metadata is neither UTF-8 text (LRA's format: one "
                     f"space-separated row per image) nor a .npy array ({e})") from e
  return text.split("\n")


def read_metadata(root: str) -> tuple[list[str], np.ndarray, list[str]]:
  """Rows of ``root/metadata/*.npy``: (image paths, labels int32, "file:line" of each row)."""
  metadata_dir = os.path.join(root, "metadata")
  if not os.path.isdir(metadata_dir):
    raise FileNotFoundError(f"Pathfinder metadata directory not found: {metadata_dir}")
  names = sorted((n for n in os.listdir(metadata_dir) if n.endswith(".npy")),
                 key=_metadata_sort_key)
  if not names:
    raise FileNotFoundError(f"no metadata files (*.npy) in {metadata_dir}")
  numbers = {int(name[:-len(".npy")]) for name in names if name[:-len(".npy")].isdigit()}
  missing = sorted(set(range(max(numbers) + 1)) - numbers) if numbers else []
  if missing:
    shown = ", ".join(f"{n}.npy" for n in missing[:10]) + (" ..." if len(missing) > 10 else "")
    logging.warning("pathfinder %s: metadata batch(es) %s missing (%d of %d): their images are "
                    "not loaded and the 80/10/10 split boundaries move (rows shift between "
                    "train, val and test)", metadata_dir, shown, len(missing), max(numbers) + 1)
  images, labels, origins = [], [], []
  for name in names:
    path = os.path.join(metadata_dir, name)
    for number, line in enumerate(_metadata_lines(path), start=1):
      fields = line.split()
      if not fields:
        continue
      if len(fields) < 4:
        raise ValueError(f"{path}:{number}: malformed row {line.strip()[:80]!r}: expected >= 4 "
                         f"space-separated fields (image_dir file_name index label ...)")
      try:
        label = int(fields[3])
      except ValueError:
        raise ValueError(f"{path}:{number}: label (field 4) must be 0 or 1, got "
                         f"{fields[3]!r}") from None
      if label not in (0, 1):
        raise ValueError(f"{path}:{number}: label {label} outside {{0, 1}}")
      images.append(os.path.join(root, fields[0], fields[1]))
      labels.append(label)
      origins.append(f"{path}:{number}")
  if not images:
    raise ValueError(f"{metadata_dir}: the metadata files list no images")
  return images, np.array(labels, np.int32), origins


def split_range(num: int, split: str) -> tuple[int, int]:
  """Row range of a split: LRA's [:80%], [80%:90%], [90%:] (TFDS rounds to the nearest row)."""
  lo, hi = SPLIT_BOUNDS[split]
  return int(round(lo * num)), int(round(hi * num))


def _decode_png(path: str, origin: str, resolution: int) -> np.ndarray | None:
  """Pixels uint8 [res, res]; None for a zero-byte file (skipped, as LRA's pipeline does)."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except FileNotFoundError:
    raise FileNotFoundError(f"Pathfinder image not found: {path} (listed in {origin})") from None
  if not raw:
    return None
  try:
    with Image.open(io.BytesIO(raw)) as image:
      image.load()
      image_format, size = image.format, image.size
      pixels = np.asarray(image if image.mode == "L" else image.convert("L"), dtype=np.uint8)
  except (OSError, SyntaxError, ValueError) as e:
    raise ValueError(f"{path}: not a readable PNG image ({e}) (listed in {origin})") from e
  if image_format != "PNG":
    raise ValueError(f"{path}: a {image_format} image, expected a PNG (listed in {origin})")
  if size != (resolution, resolution):
    raise ValueError(f"{path}: image is {size[0]}x{size[1]}, expected {resolution}x{resolution} "
                     f"(listed in {origin})")
  return pixels


def load_pathfinder_split(data_dir: str, difficulty: str, resolution: int, split: str,
                          config: Any) -> dict[str, np.ndarray]:
  """``{"inputs": [N, res*res], "targets": int32 [N]}`` of one split, decoded from the PNGs;
  inputs are the ``pixel_tokens`` (uint8 or uint16) that ``config.data.mask_black_pixels``
  asks for."""
  check_split_name(split)
  if difficulty not in DIFFICULTY_DIRS:
    raise ValueError(f"unknown difficulty {difficulty!r} (config.data.difficulty); expected "
                     f"one of {', '.join(DIFFICULTY_DIRS)}")
  if not data_dir or not os.path.isdir(data_dir):
    raise FileNotFoundError(
        f"Pathfinder data directory not found: {data_dir!r} (config.data.data_dir); generate "
        f"it with: python -m lra_sparse.generators.pathfinder --output_dir={data_dir or 'DIR'} "
        f"--resolution={resolution} --difficulty={difficulty} --num_images=N")
  root = os.path.join(data_dir, DIFFICULTY_DIRS[difficulty])
  if not os.path.isdir(root):
    raise FileNotFoundError(f"Pathfinder difficulty directory not found: {root} "
                            f"(config.data.difficulty={difficulty!r})")
  start = time.perf_counter()
  images, labels, origins = read_metadata(root)
  lo, hi = split_range(len(images), split)
  if hi <= lo:
    raise ValueError(f"{root}: {len(images)} images leave the {split} split empty "
                     f"(80/10/10 split; 10 images give 8/1/1)")
  inputs = np.empty((hi - lo, resolution * resolution), np.uint8)
  targets = np.empty(hi - lo, np.int32)
  kept, empty = 0, []
  for row in range(lo, hi):
    pixels = _decode_png(images[row], origins[row], resolution)
    if pixels is None:
      empty.append(images[row])
      continue
    inputs[kept] = pixels.reshape(-1)
    targets[kept] = labels[row]
    kept += 1
  if empty:
    logging.warning("pathfinder %s: skipped %d zero-byte image(s), e.g. %s", split, len(empty),
                    empty[0])
  if kept == 0:
    raise ValueError(f"{root}: every image of the {split} split is an empty file")
  inputs, targets = inputs[:kept], targets[:kept]
  inputs = pixel_tokens(inputs, config)
  logging.info("pathfinder %dx%d %s %s: %d images (%.1f%% label 1) from %s in %.1f s",
               resolution, resolution, difficulty, split, kept, 100.0 * targets.mean(), root,
               time.perf_counter() - start)
  return {"inputs": inputs, "targets": targets}


class _PathfinderTaskBase:
  """Images of ``config.data.data_dir/<difficulty dir>``; one token per pixel."""
  name = ""
  resolution = 0

  def spec(self, config: Any) -> TaskSpec:
    return TaskSpec(name=self.name, num_classes=NUM_CLASSES, vocab_size=pixel_vocab_size(config),
                    padding_at_end=not mask_black_pixels(config))

  def _difficulty(self, config: Any) -> str:
    difficulty = config.data.get("difficulty", "hard")
    if difficulty not in DIFFICULTY_DIRS:
      raise ValueError(f"unknown difficulty {difficulty!r} (config.data.difficulty); expected "
                       f"one of {', '.join(DIFFICULTY_DIRS)}")
    return difficulty

  def _check_max_length(self, config: Any) -> None:
    length = self.resolution * self.resolution
    max_length = config.data.get("max_length", length)
    if max_length != length:
      raise ValueError(f"config.data.max_length={max_length!r}, but task {self.name!r} has "
                       f"{self.resolution}x{self.resolution} = {length} tokens per image")

  # The compact cache (read by load_split, written by lra_sparse.data.prepare).
  def compact_cache_dir(self, config: Any) -> str:
    return os.path.join(config.data.data_dir, COMPACT_DIR,
                        DIFFICULTY_DIRS[self._difficulty(config)])

  def compact_settings(self, config: Any) -> dict[str, Any]:
    return {"difficulty": self._difficulty(config), "resolution": self.resolution,
            "mask_black_pixels": mask_black_pixels(config)}

  def compact_sources(self, config: Any) -> list[str]:
    """The metadata files (the images they list are checked when the cache is built)."""
    metadata_dir = os.path.join(config.data.data_dir, DIFFICULTY_DIRS[self._difficulty(config)],
                                "metadata")
    return [os.path.join(metadata_dir, name) for name in sorted(os.listdir(metadata_dir))
            if name.endswith(".npy")]

  def load_original_split(self, config: Any, split: str) -> dict[str, np.ndarray]:
    """The split decoded from its PNGs (never the compact cache)."""
    self._check_max_length(config)
    return load_pathfinder_split(config.data.data_dir, self._difficulty(config),
                                 self.resolution, split, config)

  def load_split(self, config: Any, split: str) -> dict[str, np.ndarray]:
    check_split_name(split)
    self._check_max_length(config)
    if config.data.data_dir:
      start = time.perf_counter()
      cache_dir = self.compact_cache_dir(config)
      cached = read_compact_split(cache_dir, self.spec(config), self.compact_settings(config),
                                  config.data.data_dir, split)
      if cached is not None:
        logging.info("%s %s: %d images memory-mapped from the compact cache %s in %.1f s",
                     self.name, split, len(cached["targets"]), cache_dir,
                     time.perf_counter() - start)
        return cached
    return self.load_original_split(config, split)


@register_task("pathfinder")
class PathfinderTask(_PathfinderTaskBase):
  name = "pathfinder"
  resolution = 32


@register_task("pathx")
class PathXTask(_PathfinderTaskBase):
  name = "pathx"
  resolution = 128
