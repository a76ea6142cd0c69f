"""LRA Image: 10-class image classification on a sequence of 1024 gray pixels (LRA image, cifar10).

Sources (``config.data.source``):

- ``"tfds"`` (default): CIFAR-10 as in LRA, read through ``tfds.data_source("cifar10")`` (no
  TensorFlow needed; the dataset must be prepared locally in the ``array_record`` file format;
  ``config.data.data_dir`` is the tfds data dir, "" = ``~/tensorflow_datasets``). RGB becomes gray
  with the arithmetic of ``tf.image.rgb_to_grayscale`` (see ``rgb_to_grayscale``).
- ``"fashion_mnist"``: Fashion-MNIST IDX files as installed by the Debian package
  ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,
  labels-idx1}-ubyte[.gz]``; ``config.data.data_dir`` overrides the directory). The 28x28 images
  are zero-padded by 2 pixels on each side to 32x32, so the sequence is 1024 long like CIFAR-10.
  Real data that works offline: a stand-in for CIFAR-10 only when asked for (a run on it is
  not LRA's Image task; specs label such rows).

Splits follow LRA's image input pipeline (``tfds.load('cifar10', split='train[:90%]')`` for train,
``'train[90%:]'`` for validation, ``'test'`` for test): the first 90% of the official train split
in file order is train, the last 10% is val (45000/5000 for CIFAR-10, 54000/6000 for
Fashion-MNIST), and the official test split is test. ``config.data.max_examples`` > 0 keeps the
first examples of each split (tiny presets).

Tokens (``config.data.mask_black_pixels``, see ``lra_sparse.data.common``): by default the raw
gray value 0..255 as LRA feeds it, with black (0) as padding, so LRA's mask ``inputs > 0`` holds
(Fashion-MNIST's zero border is masked too); False gives pixel + 1 and keeps every pixel a token.
"""
from __future__ import annotations

import gzip
import os
import struct
import zlib
from typing import Any

import numpy as np

from lra_sparse.data.common import (check_labels, check_split_name, load_tfds_source,
                                    mask_black_pixels, pixel_tokens, pixel_vocab_size, take_first)
from lra_sparse.data.registry import TaskSpec, register_task

NUM_CLASSES = 10
IMAGE_SIZE = 32
SEQUENCE_LENGTH = IMAGE_SIZE * IMAGE_SIZE
SOURCES = ("tfds", "fashion_mnist")
DEFAULT_SOURCE = "tfds"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
TRAIN_FRACTION_NUMERATOR = 9          # LRA: train[:90%] / train[90%:]
_FASHION_MNIST_PREFIX = {"train": "train", "val": "train", "test": "t10k"}
_CIFAR_TFDS_SPLITS = {"train": "train[:90%]", "val": "train[90%:]", "test": "test"}

# IDX type codes (http://yann.lecun.com/exdb/mnist/): data are big-endian.
_IDX_DTYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str) -> np.ndarray:
  """Reads an IDX file (gzipped or not): checks magic number, type code, dims and data size."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"IDX file {path} does not exist")
  with open(path, "rb") as f:
    raw = f.read()
  if raw[:2] == b"\x1f\x8b":          # gzip magic: the Debian package ships *.gz
    try:
      raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
      raise ValueError(f"IDX file {path}: corrupt or truncated gzip data ({error})") from None
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
    raise ValueError(f"IDX file {path}: bad magic number {raw[:4].hex() or '(empty file)'}; "
                     f"expected 0000<type code><ndim> with a type code in "
                     f"{sorted(hex(code) for code in _IDX_DTYPES)}")
  dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
  header_size = 4 + 4 * ndim
  if len(raw) < header_size:
    raise ValueError(f"IDX file {path}: truncated header ({len(raw)} bytes, {ndim} dims need "
                     f"{header_size})")
  dims = struct.unpack(f">{ndim}I", raw[4:header_size])
  expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
  if len(raw) - header_size != expected:
    raise ValueError(f"IDX file {path}: {len(raw) - header_size} data bytes, but dims {dims} of "
                     f"{dtype.name} need {expected} (truncated or corrupt file)")
  data = np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(dims)
  return data.astype(dtype.newbyteorder("="))


def _find_idx(data_dir: str, name: str) -> str:
  candidates = [os.path.join(data_dir, name), os.path.join(data_dir, name + ".gz")]
  for path in candidates:
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(f"Fashion-MNIST file missing: none of {candidates} exists")


def read_fashion_mnist(data_dir: str, prefix: str) -> tuple[np.ndarray, np.ndarray]:
  """uint8 images ``[N, H, W]`` and int32 labels ``[N]`` of ``{prefix}-*-idx?-ubyte[.gz]``."""
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(
        f"Fashion-MNIST directory {data_dir} does not exist; install it with "
        f"`apt-get install -y dataset-fashion-mnist` or set config.data.data_dir")
  images_path = _find_idx(data_dir, f"{prefix}-images-idx3-ubyte")
  labels_path = _find_idx(data_dir, f"{prefix}-labels-idx1-ubyte")
  images, labels = read_idx(images_path), read_idx(labels_path)
  if images.ndim != 3 or images.dtype != np.uint8:
    raise ValueError(f"IDX file {images_path}: expected uint8 images [N, H, W], got "
                     f"{images.dtype}{list(images.shape)}")
  if labels.ndim != 1 or labels.dtype != np.uint8:
    raise ValueError(f"IDX file {labels_path}: expected uint8 labels [N], got "
                     f"{labels.dtype}{list(labels.shape)}")
  if len(images) != len(labels):
    raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} holds "
                     f"{len(labels)} labels")
  labels = labels.astype(np.int32)
  check_labels(labels, NUM_CLASSES, labels_path)
  return images, labels


def pad_to_square(images: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
  """Zero-pads ``[N, H, W]`` images evenly on all sides to ``[N, size, size]`` (28 -> 2+28+2)."""
  height, width = images.shape[1:]
  if height > size or width > size:
    raise ValueError(f"images of {height}x{width} do not fit in {size}x{size}")
  top, left = (size - height) // 2, (size - width) // 2
  return np.pad(images, ((0, 0), (top, size - height - top), (left, size - width - left)))


def rgb_to_grayscale(images: np.ndarray) -> np.ndarray:
  """uint8 ``[..., 3]`` -> uint8 ``[...]`` with the arithmetic of ``tf.image.rgb_to_grayscale``.

  TF: to float32 as ``x * (1/255)``, dot with (0.2989, 0.5870, 0.1140), back to uint8 as
  ``cast(g * 255.5)`` (truncation). Done in float32 like TF; a value within an ulp of an integer
  could round differently if TF sums in another order.
  """
  if images.dtype != np.uint8 or images.shape[-1] != 3:
    raise ValueError(f"expected uint8 RGB images [..., 3], got {images.dtype}{images.shape}")
  weights = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
  scaled = images.astype(np.float32) * np.float32(1.0 / 255)
  gray = scaled @ weights
  return (gray * np.float32(255.5)).astype(np.uint8)


def _train_val_slice(split: str, num_examples: int) -> slice:
  boundary = num_examples * TRAIN_FRACTION_NUMERATOR // 10
  return {"train": slice(0, boundary), "val": slice(boundary, num_examples),
          "test": slice(0, num_examples)}[split]


def read_tfds_cifar10(data_dir: str, split: str,
                      max_examples: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Gray CIFAR-10 images ``[N, 32, 32]`` and labels of one LRA split (the first max_examples)."""
  tfds_split = _CIFAR_TFDS_SPLITS[split]
  source = load_tfds_source("cifar10", tfds_split, data_dir,
                            hint="use --config.data.source=fashion_mnist for offline work")
  count = min(len(source), max_examples) if max_examples > 0 else len(source)
  images = np.empty((count, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
  labels = np.empty(count, dtype=np.int32)
  for index in range(count):
    example = source[index]
    image = np.asarray(example["image"])
    if image.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
      raise ValueError(f"tfds cifar10/{tfds_split} example {index}: expected a 32x32x3 image, "
                       f"got {image.dtype}{image.shape}")
    images[index] = rgb_to_grayscale(image)
    labels[index] = int(example["label"])
  check_labels(labels, NUM_CLASSES, f"tfds cifar10/{tfds_split}")
  return images, labels


@register_task("image")
class ImageTask:
  """Gray images as pixel sequences (row-major), 10 classes."""

  def spec(self, config: Any) -> TaskSpec:
    return TaskSpec(name="image", num_classes=NUM_CLASSES, vocab_size=pixel_vocab_size(config),
                    padding_at_end=not mask_black_pixels(config))

  def load_split(self, config: Any, split: str) -> dict[str, np.ndarray]:
    check_split_name(split)
    if config.data.max_length != SEQUENCE_LENGTH:
      raise ValueError(f"task 'image' has sequences of {IMAGE_SIZE}x{IMAGE_SIZE} = "
                       f"{SEQUENCE_LENGTH} pixels; set config.data.max_length={SEQUENCE_LENGTH} "
                       f"(got {config.data.max_length})")
    source = config.data.get("source", DEFAULT_SOURCE)
    if source == "fashion_mnist":
      data_dir = config.data.data_dir or FASHION_MNIST_DIR
      images, labels = read_fashion_mnist(data_dir, _FASHION_MNIST_PREFIX[split])
      part = _train_val_slice(split, len(labels))
      images, labels = images[part], labels[part]
    elif source == "tfds":
      images, labels = read_tfds_cifar10(config.data.data_dir, split,
                                         config.data.get("max_examples", 0))
    else:
      raise ValueError(f"unknown config.data.source {source!r} for task 'image'; "
                       f"expected one of {SOURCES}")
    if len(labels) == 0:
      raise ValueError(f"task 'image' ({source}): split {split!r} is empty")
    # Subset before padding (and widening): tiny presets keep a few hundred images.
    kept = take_first({"images": images, "labels": labels}, config.data.get("max_examples", 0))
    images, labels = pad_to_square(kept["images"]), kept["labels"]
    inputs = pixel_tokens(images.reshape(len(images), SEQUENCE_LENGTH), config)
    return {"inputs": inputs, "targets": labels}
