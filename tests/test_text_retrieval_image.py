"""Loaders for LRA Text (IMDB bytes), Retrieval (AAN pairs) and Image (CIFAR-10 / Fashion-MNIST).

Fixtures are written in the official formats (aclImdb tree, AAN TSV, IDX files); expected tokens
are rebuilt independently from the raw bytes / pixels with plain Python.
"""
from __future__ import annotations

import gzip
import os
import struct

import ml_collections
import numpy as np
import pytest

from lra_sparse import config as config_lib
from lra_sparse.config import load_python_file
from lra_sparse.data import common
from lra_sparse.data import image as image_data
from lra_sparse.data import registry
from lra_sparse.generators import retrieval as retrieval_generator
from lra_sparse.generators import text as text_generator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
image_config = load_python_file(os.path.join(REPO, "configs", "image.py"))
retrieval_config = load_python_file(os.path.join(REPO, "configs", "retrieval.py"))
text_config = load_python_file(os.path.join(REPO, "configs", "text.py"))

FASHION_MNIST_FILES = [os.path.join(image_data.FASHION_MNIST_DIR, name) for name in (
    "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")]


def byte_tokens(text: bytes, length: int) -> list[int]:
  """Reference: one token per byte (byte + 1), cut to ``length``, padded with 0."""
  tokens = [b + 1 for b in text][:length]
  return tokens + [0] * (length - len(tokens))


def check_contract(task_name: str, config, arrays: dict[str, np.ndarray]) -> None:
  spec = registry.get_task(task_name).spec(config)
  registry.check_split_arrays(arrays, spec, task_name)
  for name in spec.input_names:       # the smallest unsigned dtype holding the vocabulary
    assert arrays[name].dtype == (np.uint8 if spec.vocab_size <= 256 else np.uint16)
  assert arrays["targets"].dtype == np.int32


# ------------------------------------------------------------------------------------------------
# Text (IMDB)

REVIEWS = {  # (split dir, label dir, file name) -> raw file bytes
    ("train", "neg", "0_3.txt"): b"  Bad film.\n",
    ("train", "neg", "1_1.txt"): "Awful caf\u00e9 scene; \"worst\" <br /> ever".encode("utf-8"),
    ("train", "pos", "0_9.txt"): b"\tGreat!",
    ("train", "pos", "1_10.txt"): b"x" * 40,
    ("train", "pos", "2_8.txt"): b"ok \xff\x00 bytes",
    ("train", "pos", "10_9.txt"): b"id ten sorts after id two",
    ("test", "neg", "0_2.txt"): b"meh",
    ("test", "pos", "0_7.txt"): b"fine movie ",
}


def write_aclimdb(root) -> str:
  data_dir = os.path.join(root, "aclImdb")
  for (split_dir, label_dir, name), content in REVIEWS.items():
    os.makedirs(os.path.join(data_dir, split_dir, label_dir), exist_ok=True)
    with open(os.path.join(data_dir, split_dir, label_dir, name), "wb") as f:
      f.write(content)
  # Parts of the real release that the loader must ignore.
  os.makedirs(os.path.join(data_dir, "train", "unsup"))
  with open(os.path.join(data_dir, "train", "unsup", "0_0.txt"), "wb") as f:
    f.write(b"unlabeled")
  with open(os.path.join(data_dir, "train", "urls_pos.txt"), "wb") as f:
    f.write(b"http://example.com\n")
  with open(os.path.join(data_dir, "train", "pos", "labeledBow.feat"), "wb") as f:
    f.write(b"9 0:1\n")
  return data_dir


def text_config_for(data_dir: str, max_length: int = 16, source: str = "aclimdb"):
  config = text_config.get_config()
  config.data.data_dir = data_dir
  config.data.max_length = max_length
  config.data.source = source
  return config


def expected_text_split(split_dir: str, max_length: int) -> tuple[list[list[int]], list[int]]:
  """Reference order: neg and pos alternate, each class by numeric review id."""
  per_label = []
  for label_dir in ("neg", "pos"):
    names = [name for (s, l, name) in REVIEWS if s == split_dir and l == label_dir]
    per_label.append(sorted(names, key=lambda name: int(name.split("_")[0])))
  rows, labels = [], []
  for rank in range(max(len(names) for names in per_label)):
    for label, label_dir in enumerate(("neg", "pos")):
      if rank < len(per_label[label]):
        content = REVIEWS[(split_dir, label_dir, per_label[label][rank])]
        rows.append(byte_tokens(content.strip(), max_length))
        labels.append(label)
  return rows, labels


def test_text_aclimdb_tokens_labels_and_lra_splits(tmp_path):
  config = text_config_for(write_aclimdb(tmp_path), max_length=16)
  task = registry.get_task("text")
  train = task.load_split(config, "train")
  check_contract("text", config, train)
  rows, labels = expected_text_split("train", 16)
  assert train["inputs"].tolist() == rows
  assert train["targets"].tolist() == labels == [0, 1, 0, 1, 1, 1]   # neg/pos alternate
  assert train["inputs"][5, :6].tolist() == [c + 1 for c in b"id ten"]  # id 10 after id 2
  # Whitespace is stripped like tfds; UTF-8 stays as bytes; the 40-byte review is cut at 16.
  assert train["inputs"][0, :9].tolist() == [c + 1 for c in b"Bad film."]
  assert train["inputs"][0, 9:].tolist() == [0] * 7
  assert train["inputs"][3].tolist() == [ord("x") + 1] * 16
  assert train["inputs"][4, 3:5].tolist() == [256, 1]   # byte 0xff -> 256, NUL -> 1 (not pad)
  # LRA: IMDB has no validation split; val and test both read aclImdb/test.
  val, test = task.load_split(config, "val"), task.load_split(config, "test")
  rows, labels = expected_text_split("test", 16)
  for split in (val, test):
    assert split["inputs"].tolist() == rows and split["targets"].tolist() == labels


def test_text_max_examples_and_spec(tmp_path):
  config = text_config_for(write_aclimdb(tmp_path), max_length=8)
  config.data.max_examples = 3
  train = registry.get_task("text").load_split(config, "train")
  assert train["inputs"].shape == (3, 8) and train["targets"].tolist() == [0, 1, 0]
  spec = registry.get_task("text").spec(config)
  assert (spec.num_classes, spec.vocab_size, spec.input_names) == (2, 257, ("inputs",))
  config.data.max_examples = -1
  with pytest.raises(ValueError, match="max_examples"):
    registry.get_task("text").load_split(config, "train")


def test_text_bad_inputs(tmp_path):
  task = registry.get_task("text")
  missing = str(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="nowhere"):
    task.load_split(text_config_for(missing), "train")
  data_dir = write_aclimdb(tmp_path)
  for name in os.listdir(os.path.join(data_dir, "test", "pos")):
    os.remove(os.path.join(data_dir, "test", "pos", name))
  with pytest.raises(ValueError, match=r"test/pos holds no \*\.txt"):
    task.load_split(text_config_for(data_dir), "test")
  os.rmdir(os.path.join(data_dir, "test", "pos"))
  with pytest.raises(FileNotFoundError, match=r"test/pos does not exist"):
    task.load_split(text_config_for(data_dir), "val")
  with pytest.raises(ValueError, match="source"):
    task.load_split(text_config_for(data_dir, source="csv"), "train")
  with pytest.raises(ValueError, match="split"):
    task.load_split(text_config_for(data_dir), "dev")
  with pytest.raises(ValueError, match="max_length"):
    task.load_split(text_config_for(data_dir, max_length=0), "train")
  with pytest.raises(ValueError, match=r"labels\.tsv: example 2 has label 2"):
    common.check_labels(np.array([0, 1, 2]), 2, "labels.tsv")


def test_text_tfds_source_reads_imdb_reviews(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  config = text_config_for(str(tmp_path), max_length=12, source="tfds")
  task = registry.get_task("text")
  with tfds.testing.mock_data(num_examples=6):
    train = task.load_split(config, "train")
    source = tfds.data_source("imdb_reviews", split="train", download=False)
    expected = [source[i] for i in range(len(source))]
  check_contract("text", config, train)
  def raw(example):
    text = example["text"]
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)
  assert train["inputs"].tolist() == [byte_tokens(raw(e), 12) for e in expected]
  assert train["targets"].tolist() == [int(e["label"]) for e in expected]


def test_text_tfds_not_prepared_is_one_clear_error(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  config = text_config_for(str(tmp_path / "tfds"), source="tfds")
  with pytest.raises(FileNotFoundError, match=r"imdb_reviews.*not prepared.*tfds build.*aclimdb"):
    registry.get_task("text").load_split(config, "train")


# ------------------------------------------------------------------------------------------------
# Retrieval (AAN)

def write_aan(data_dir, name: str, lines: list[bytes]) -> str:
  os.makedirs(data_dir, exist_ok=True)
  path = os.path.join(data_dir, f"new_aan_pairs.{name}.tsv")
  with open(path, "wb") as f:
    f.write(b"".join(lines))
  return path


def retrieval_config_for(data_dir, max_length: int = 10):
  config = retrieval_config.get_config()
  config.data.data_dir = str(data_dir)
  config.data.max_length = max_length
  return config


def test_retrieval_tsv_tokens_labels_and_splits(tmp_path):
  train_rows = [  # (label field, text1, text2)
      (b"1.0", b"Graph \"quoted\" text, tab-free", b"abc"),
      (b"0.0", b"", b"0123456789" * 3),
      (b"1", "na\u00efve".encode("utf-8"), b"x'y"),
  ]
  lines = [b"\t".join([label, b"P%d" % i, b"Q%d" % i, t1, t2]) + b"\n"
           for i, (label, t1, t2) in enumerate(train_rows)]
  lines[1] = lines[1][:-1] + b"\r\n"        # CRLF line ending
  lines.insert(2, b"\n")                    # blank line: skipped
  write_aan(tmp_path, "train", lines)
  write_aan(tmp_path, "eval", [b"0.0\ta\tb\teval one\teval two\n"])
  write_aan(tmp_path, "test", [b"1.0\ta\tb\ttest\tdoc\n", b"0.0\tc\td\tt2\td2\n"])
  config = retrieval_config_for(tmp_path, max_length=24)
  task = registry.get_task("retrieval")
  spec = task.spec(config)
  assert spec.input_names == ("inputs1", "inputs2") and spec.model_kind == "dual_encoder"
  assert (spec.num_classes, spec.vocab_size) == (2, 257)
  train = task.load_split(config, "train")
  check_contract("retrieval", config, train)
  assert train["inputs1"].tolist() == [byte_tokens(t1, 24) for _, t1, _ in train_rows]
  assert train["inputs2"].tolist() == [byte_tokens(t2, 24) for _, _, t2 in train_rows]
  assert train["targets"].tolist() == [1, 0, 1]
  assert train["inputs1"][1].tolist() == [0] * 24          # empty document: all padding
  assert train["inputs1"][0, 6] == ord('"') + 1           # quotes are plain characters
  assert train["inputs2"][1].tolist() == [c + 1 for c in b"0123456789" * 3][:24]  # truncated
  val, test = task.load_split(config, "val"), task.load_split(config, "test")
  assert val["inputs1"].tolist() == [byte_tokens(b"eval one", 24)]
  assert val["targets"].tolist() == [0]
  assert test["inputs2"].tolist() == [byte_tokens(b"doc", 24), byte_tokens(b"d2", 24)]
  assert test["targets"].tolist() == [1, 0]
  config.data.max_examples = 1
  assert task.load_split(config, "test")["targets"].tolist() == [1]


@pytest.mark.parametrize("bad_line, message", [
    (b"1.0\tP\tQ\tonly four\n", r"new_aan_pairs\.train\.tsv:2: expected 5 .*got 4"),
    (b"1.0\tP\tQ\tt1\tt2\textra\n", r"new_aan_pairs\.train\.tsv:2: expected 5 .*got 6"),
    (b"yes\tP\tQ\tt1\tt2\n", r"new_aan_pairs\.train\.tsv:2: label b'yes' is not a number"),
    (b"2.0\tP\tQ\tt1\tt2\n", r"new_aan_pairs\.train\.tsv:2: label '2\.0' is outside the classes"),
    (b"0.5\tP\tQ\tt1\tt2\n", r"new_aan_pairs\.train\.tsv:2: label '0\.5' is outside the classes"),
    (b"-1\tP\tQ\tt1\tt2\n", r"new_aan_pairs\.train\.tsv:2: label '-1' is outside the classes"),
    (b"nan\tP\tQ\tt1\tt2\n", r"new_aan_pairs\.train\.tsv:2: label 'nan' is outside the classes"),
])
def test_retrieval_bad_lines_name_file_and_line(tmp_path, bad_line, message):
  write_aan(tmp_path, "train", [b"0.0\ta\tb\tc\td\n", bad_line])
  with pytest.raises(ValueError, match=message):
    registry.get_task("retrieval").load_split(retrieval_config_for(tmp_path), "train")


def test_retrieval_missing_directory_file_and_empty_file(tmp_path):
  task = registry.get_task("retrieval")
  with pytest.raises(FileNotFoundError, match="nowhere"):
    task.load_split(retrieval_config_for(tmp_path / "nowhere"), "train")
  write_aan(tmp_path, "train", [b"0.0\ta\tb\tc\td\n"])
  with pytest.raises(FileNotFoundError, match=r"new_aan_pairs\.eval\.tsv does not exist"):
    task.load_split(retrieval_config_for(tmp_path), "val")
  write_aan(tmp_path, "test", [b"\n", b"\n"])
  with pytest.raises(ValueError, match=r"new_aan_pairs\.test\.tsv holds no examples"):
    task.load_split(retrieval_config_for(tmp_path), "test")


# ------------------------------------------------------------------------------------------------
# Image (IDX / Fashion-MNIST, CIFAR-10 through tfds)

def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
  """Independent IDX writer: magic 00 00 <type> <ndim>, big-endian uint32 dims, big-endian data."""
  big_endian = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
  header = struct.pack(">BBBB", 0, 0, type_code, array.ndim)
  header += struct.pack(f">{array.ndim}I", *array.shape)
  return header + array.astype(big_endian[type_code]).tobytes()


def write_file(path, content: bytes, compress: bool) -> str:
  path = str(path) + (".gz" if compress else "")
  with open(path, "wb") as f:
    f.write(gzip.compress(content) if compress else content)
  return path


def write_fashion_mnist(data_dir, num_train: int = 20, num_test: int = 5, seed: int = 0,
                        compress: bool = True):
  rng = np.random.default_rng(seed)
  os.makedirs(data_dir, exist_ok=True)
  arrays = {}
  for prefix, count in (("train", num_train), ("t10k", num_test)):
    images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=count, dtype=np.uint8)
    write_file(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte"), idx_bytes(images), compress)
    write_file(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte"), idx_bytes(labels), compress)
    arrays[prefix] = (images, labels)
  return arrays


def padded_tokens(image: np.ndarray, mask_black_pixels: bool = True) -> list[int]:
  """Reference: 28x28 centred in a 32x32 zero canvas, row-major; the raw pixel value (black =
  0 = padding, LRA's inputs > 0 mask) or, without masking, pixel + 1."""
  canvas = [[0] * 32 for _ in range(32)]
  for r in range(28):
    for c in range(28):
      canvas[r + 2][c + 2] = int(image[r, c])
  shift = 0 if mask_black_pixels else 1
  return [value + shift for row in canvas for value in row]


def image_config_for(data_dir, source: str = "fashion_mnist", mask_black_pixels: bool = True):
  config = image_config.get_config()
  config.data.data_dir = str(data_dir)
  config.data.source = source
  config.data.mask_black_pixels = mask_black_pixels
  return config


@pytest.mark.parametrize("type_code, values", [
    (0x08, np.array([[0, 1, 255], [7, 8, 9]])),
    (0x09, np.array([-128, -1, 0, 127])),
    (0x0B, np.array([[-30000], [258], [1]])),
    (0x0C, np.array([2**31 - 1, -5, 65536])),
    (0x0D, np.array([[1.5, -2.25], [3e-8, 1e30]])),
    (0x0E, np.array([np.pi, -1e-300])),
])
@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_types_and_gzip(tmp_path, type_code, values, compress):
  path = write_file(tmp_path / "data-idx", idx_bytes(values, type_code), compress)
  array = image_data.read_idx(path)
  assert array.shape == values.shape
  assert array.dtype.isnative
  np.testing.assert_array_equal(array, values.astype(array.dtype))
  if type_code in (0x0D, 0x0E):
    assert array.dtype.kind == "f" and array.dtype.itemsize == (4 if type_code == 0x0D else 8)


def test_read_idx_corrupt_files_name_the_file(tmp_path):
  good = idx_bytes(np.arange(24, dtype=np.uint8).reshape(2, 3, 4))
  cases = {
      "bad_magic": (b"\x01\x00" + good[2:], "bad magic number"),
      "bad_type": (good[:2] + b"\x07" + good[3:], "bad magic number"),
      "zero_dims": (good[:3] + b"\x00" + good[4:], "bad magic number"),
      "empty": (b"", r"bad magic number \(empty file\)"),
      "short_header": (good[:9], "truncated header"),
      "truncated": (good[:-1], "23 data bytes, but dims \\(2, 3, 4\\) of uint8 need 24"),
      "trailing": (good + b"\x00", "25 data bytes"),
  }
  for name, (content, message) in cases.items():
    path = write_file(tmp_path / name, content, compress=False)
    with pytest.raises(ValueError, match=f"{name}: {message}"):
      image_data.read_idx(path)
  gz = gzip.compress(good)
  for name, content in (("cut.gz", gz[:len(gz) // 2]), ("badcrc.gz", gz[:-8] + b"\0" * 8)):
    path = write_file(tmp_path / name, content, compress=False)
    with pytest.raises(ValueError, match=f"{name}: corrupt or truncated gzip"):
      image_data.read_idx(path)
  with pytest.raises(FileNotFoundError, match="absent-idx"):
    image_data.read_idx(str(tmp_path / "absent-idx"))


@pytest.mark.parametrize("compress, mask_black_pixels", [(True, True), (False, True),
                                                       (True, False)])
def test_fashion_mnist_padding_tokens_and_splits(tmp_path, compress, mask_black_pixels):
  fixture = write_fashion_mnist(tmp_path, num_train=20, num_test=5, compress=compress)
  fixture["train"][0][3, 5:9, 5:9] = 0           # black pixels inside an image, not only border
  write_file(os.path.join(tmp_path, "train-images-idx3-ubyte"), idx_bytes(fixture["train"][0]),
             compress)
  config = image_config_for(tmp_path, mask_black_pixels=mask_black_pixels)
  task = registry.get_task("image")
  spec = task.spec(config)
  assert (spec.num_classes, spec.vocab_size, spec.input_names, spec.padding_at_end) == (
      10, 256 if mask_black_pixels else 257, ("inputs",), not mask_black_pixels)
  train_images, train_labels = fixture["train"]
  test_images, test_labels = fixture["t10k"]
  expected = {"train": (train_images[:18], train_labels[:18]),   # LRA: train[:90%]
              "val": (train_images[18:], train_labels[18:]),     # LRA: train[90%:]
              "test": (test_images, test_labels)}
  for split, (images, labels) in expected.items():
    arrays = task.load_split(config, split)
    check_contract("image", config, arrays)
    assert arrays["inputs"].shape == (len(images), 1024)
    assert arrays["inputs"].tolist() == [padded_tokens(image, mask_black_pixels)
                                         for image in images]
    assert arrays["targets"].tolist() == labels.tolist()
  border = task.load_split(config, "test")["inputs"].reshape(5, 32, 32)
  black = 0 if mask_black_pixels else 1        # masked (PAD_ID) or the token of pixel 0
  assert (border[:, :2] == black).all() and (border[:, :, 30:] == black).all()
  inner = task.load_split(config, "train")["inputs"].reshape(-1, 32, 32)[3, 7:11, 7:11]
  assert (inner == black).all()
  config.data.max_examples = 4
  assert task.load_split(config, "train")["targets"].tolist() == train_labels[:4].tolist()


def test_fashion_mnist_bad_inputs(tmp_path):
  task = registry.get_task("image")
  with pytest.raises(FileNotFoundError, match="nowhere.*dataset-fashion-mnist"):
    task.load_split(image_config_for(tmp_path / "nowhere"), "train")
  write_fashion_mnist(tmp_path, num_train=10, num_test=3)
  config = image_config_for(tmp_path)
  config.data.max_length = 784
  with pytest.raises(ValueError, match="max_length=1024"):
    task.load_split(config, "train")
  with pytest.raises(ValueError, match="source"):
    task.load_split(image_config_for(tmp_path, source="mnist"), "train")
  with pytest.raises(ValueError, match=r"^config.data.mask_black_pixels='yes' must be True "
                                       r"\(black pixels are padding.*\) or False [^\n]*$"):
    bad = image_config_for(tmp_path)       # a value a hand-written config or JSON could hold
    bad.data = ml_collections.ConfigDict({**bad.data.to_dict(), "mask_black_pixels": "yes"})
    task.spec(bad)
  config_ok = image_config_for(tmp_path)
  # A label outside the 10 classes.
  labels_path = os.path.join(tmp_path, "t10k-labels-idx1-ubyte.gz")
  write_file(labels_path[:-3], idx_bytes(np.array([1, 10, 3])), compress=True)
  with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: example 1 has label 10"):
    task.load_split(image_config_for(tmp_path), "test")
  # Image and label counts disagree.
  write_file(labels_path[:-3], idx_bytes(np.array([1, 2])), compress=True)
  with pytest.raises(ValueError, match="holds 3 images but .*t10k-labels.* holds 2 labels"):
    task.load_split(config_ok, "test")
  # Labels stored as a 2-D array / images as int32.
  write_file(labels_path[:-3], idx_bytes(np.zeros((3, 1))), compress=True)
  with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: expected uint8 labels"):
    task.load_split(config_ok, "test")
  images_path = os.path.join(tmp_path, "t10k-images-idx3-ubyte")
  os.remove(images_path + ".gz")
  write_file(images_path, idx_bytes(np.zeros((3, 28, 28)), 0x0C), compress=False)
  with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte: expected uint8 images"):
    task.load_split(config_ok, "test")
  # Truncated gzip of the images.
  os.remove(images_path)
  content = gzip.compress(idx_bytes(np.zeros((3, 28, 28), np.uint8)))
  write_file(images_path + ".gz", content[:40], compress=False)
  with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: corrupt or truncated gzip"):
    task.load_split(config_ok, "test")
  os.remove(images_path + ".gz")
  with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
    task.load_split(config_ok, "test")


def test_rgb_to_grayscale_matches_tf_formula():
  # tf.image.rgb_to_grayscale on uint8: uint8((0.2989 r + 0.5870 g + 0.1140 b) / 255 * 255.5).
  rng = np.random.default_rng(1)
  rgb = rng.integers(0, 256, size=(64, 32, 3), dtype=np.uint8)
  rgb[0, :4] = [[0, 0, 0], [255, 255, 255], [1, 2, 3], [255, 0, 0]]
  gray = image_data.rgb_to_grayscale(rgb)
  exact = (rgb.astype(np.float64) @ np.array([0.2989, 0.5870, 0.1140])) / 255 * 255.5
  assert gray.dtype == np.uint8 and gray.shape == (64, 32)
  assert gray[0, :4].tolist() == [0, 255, 1, 76]
  away_from_ties = np.abs(exact - np.round(exact)) > 1e-4
  assert away_from_ties.mean() > 0.99
  np.testing.assert_array_equal(gray[away_from_ties], np.floor(exact[away_from_ties]))
  with pytest.raises(ValueError, match="RGB"):
    image_data.rgb_to_grayscale(rgb[..., :2])


@pytest.mark.parametrize("mask_black_pixels", [True, False])
def test_cifar10_tfds_source_gray_tokens(tmp_path, mask_black_pixels):
  tfds = pytest.importorskip("tensorflow_datasets")
  config = image_config_for(tmp_path, source="tfds", mask_black_pixels=mask_black_pixels)
  assert image_config.get_config().data.source == "tfds"       # CIFAR-10 is the default
  task = registry.get_task("image")
  with tfds.testing.mock_data(num_examples=4):
    test = task.load_split(config, "test")
    source = tfds.data_source("cifar10", split="test", download=False)
    expected = [source[i] for i in range(len(source))]
  check_contract("image", config, test)
  shift = 0 if mask_black_pixels else 1
  reference = [image_data.rgb_to_grayscale(np.asarray(e["image"])).reshape(-1) + shift
               for e in expected]
  np.testing.assert_array_equal(test["inputs"], np.stack(reference))
  assert test["targets"].tolist() == [int(e["label"]) for e in expected]


def test_cifar10_tfds_not_prepared_is_one_clear_error(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  with pytest.raises(FileNotFoundError, match=r"cifar10.*not prepared.*fashion_mnist"):
    registry.get_task("image").load_split(image_config_for(tmp_path, source="tfds"), "val")


@pytest.mark.skipif(not all(os.path.isfile(p) for p in FASHION_MNIST_FILES),
                    reason="Debian package dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_from_debian_package():
  config = image_config.get_config()
  assert config.data.source == "tfds" and config.data.data_dir == ""
  config.data.source = "fashion_mnist"           # the stand-in, only when asked for
  task = registry.get_task("image")
  test = task.load_split(config, "test")
  check_contract("image", config, test)
  assert test["inputs"].shape == (10000, 1024)
  assert np.bincount(test["targets"]).tolist() == [1000] * 10   # balanced official test set
  grid = test["inputs"].reshape(-1, 32, 32)
  assert (grid[:, :2] == 0).all() and (grid[:, 30:] == 0).all()    # black border: padding
  assert grid[:, 2:30, 2:30].max() == 255 and grid[:, 2:30, 2:30].mean() > 50
  config.data.max_examples = 100
  assert task.load_split(config, "val")["inputs"].shape == (100, 1024)


# ------------------------------------------------------------------------------------------------
# Configs and tiny demo sets

def test_configs_have_lra_defaults():
  text, retrieval, image = (text_config.get_config(), retrieval_config.get_config(),
                            image_config.get_config())
  rows = [(c.model.num_layers, c.model.num_heads, c.model.emb_dim, c.model.qkv_dim,
           c.model.mlp_dim, c.batch_size, c.optim.learning_rate, c.optim.schedule,
           c.num_train_steps, c.optim.warmup_steps, c.optim.weight_decay, c.data.max_length)
          for c in (text, retrieval, image)]
  assert rows == [(4, 4, 256, 256, 1024, 32, 0.05, "rsqrt", 20000, 8000, 0.1, 1000),
                  (4, 4, 128, 128, 512, 32, 0.05, "rsqrt", 5000, 8000, 0.1, 4000),
                  (1, 8, 128, 64, 128, 256, 5e-4, "cosine", 35000, 175, 0.0, 1024)]
  assert (text.task, retrieval.task, image.task) == ("text", "retrieval", "image")
  for module in (text_config, retrieval_config, image_config):
    with pytest.raises(ValueError, match="unknown preset"):
      module.get_config("huge")
  # LRA defaults of this issue: CIFAR-10, LRA's pixel mask, LRA's dual head.
  assert (image.data.source, image.data.mask_black_pixels) == ("tfds", True)
  assert retrieval.model.dual_head == "lra"


def test_image_nystromformer_preset_is_the_nystromformer_lra_image_config():
  """mlpen/Nystromformer LRA/code: lra_config.py config["image"] with "nystrom-64",
  run_tasks.py (AdamW(0.9, 0.999, eps 1e-6), OneCycleLR linear), attention_nystrom.py
  (6 pinv iterations, conv kernel 35, no attention dropout), model_wrapper.py (MEAN pooling,
  head Linear(64, 128) -> ReLU -> Linear(128, 10))."""
  config = image_config.get_config("nystromformer")
  flat = config_lib.flatten_config(config.to_dict())
  want = {
      "model.num_layers": 2, "model.num_heads": 2, "model.qkv_dim": 64, "model.emb_dim": 64,
      "model.mlp_dim": 128, "model.classifier_dim": 128, "model.dropout_rate": 0.1,
      "model.attention_dropout_rate": 0.0, "model.pooling": "mean", "model.pos_emb": "learned",
      "attention.kind": "nystrom", "attention.nystrom.num_landmarks": 64,
      "attention.nystrom.conv_kernel": 35, "attention.nystrom.pinv_iters": 6,
      "attention.nystrom.nm": "", "data.max_length": 1024, "data.source": "tfds",
      "data.mask_black_pixels": True, "batch_size": 256, "optim.learning_rate": 1e-4,
      "optim.schedule": "one_cycle", "optim.warmup_steps": 175, "optim.weight_decay": 0.0,
      "optim.b2": 0.999, "optim.eps": 1e-6, "optim.grad_clip_norm": 0.0,
      "num_train_steps": 35000, "eval_every_steps": 175, "num_eval_batches": 20}
  assert {key: flat[key] for key in want} == want
  assert config.model.qkv_dim // config.model.num_heads == 32      # head_dim 32


def test_tiny_presets_load_generated_and_real_data(tmp_path):
  config = text_config.get_config("tiny")
  assert config.data.data_dir == "data/text_tiny"
  config.data.data_dir = str(tmp_path / "text")
  text_generator.write_tiny_aclimdb(config.data.data_dir, num_train=40, num_test=10)
  train = registry.get_task("text").load_split(config, "train")
  check_contract("text", config, train)
  assert train["inputs"].shape == (40, config.data.max_length)
  assert np.bincount(train["targets"]).tolist() == [20, 20]
  assert len(registry.get_task("text").load_split(config, "val")["targets"]) == 10

  config = retrieval_config.get_config("tiny")
  assert config.data.data_dir == "data/retrieval_tiny"
  config.data.data_dir = str(tmp_path / "aan")
  retrieval_generator.write_tiny_aan(config.data.data_dir, num_train=30, num_eval=6, num_test=8)
  sizes = {split: len(registry.get_task("retrieval").load_split(config, split)["targets"])
           for split in registry.SPLITS}
  assert sizes == {"train": 30, "val": 6, "test": 8}
  train = registry.get_task("retrieval").load_split(config, "train")
  check_contract("retrieval", config, train)
  assert np.bincount(train["targets"]).tolist() == [15, 15]

  config = image_config.get_config("tiny")
  assert config.data.source == "tfds" and config.data.max_examples > 0
  config.data.source = "fashion_mnist"
  config.data.data_dir = str(tmp_path / "fm")
  write_fashion_mnist(config.data.data_dir, num_train=30, num_test=4)
  config.data.max_examples = 7
  assert registry.get_task("image").load_split(config, "train")["inputs"].shape == (7, 1024)
