"""Pathfinder / Path-X: generator properties, the LRA on-disk layout, the loader, bad input."""
from __future__ import annotations

import logging
import math
import os
import re

import ml_collections
import numpy as np
import pytest
from PIL import Image

from lra_sparse.config import load_python_file
from lra_sparse.data import pathfinder as pf_data
from lra_sparse.data.registry import check_split_arrays, get_task
from lra_sparse.generators import pathfinder as pf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flood(mask: np.ndarray, start: np.ndarray) -> np.ndarray:
  """Cells of ``mask > 0`` 4-connected to ``start`` (brute force: grow until nothing changes)."""
  inside = mask > 0
  reach = np.zeros(mask.shape, bool)
  reach[tuple(start)] = inside[tuple(start)]
  while True:
    grown = reach.copy()
    grown[1:] |= reach[:-1]
    grown[:-1] |= reach[1:]
    grown[:, 1:] |= reach[:, :-1]
    grown[:, :-1] |= reach[:, 1:]
    grown &= inside
    if np.array_equal(grown, reach):
      return reach
    reach = grown


def _dilate(a: np.ndarray, radius: int) -> np.ndarray:
  out = a.copy()
  for dy in range(-radius, radius + 1):
    for dx in range(-radius, radius + 1):
      shifted = np.zeros_like(a)
      ys, yd = (slice(dy, None), slice(None, -dy or None)) if dy >= 0 else \
          (slice(None, dy), slice(-dy, None))
      xs, xd = (slice(dx, None), slice(None, -dx or None)) if dx >= 0 else \
          (slice(None, dx), slice(-dx, None))
      shifted[ys, xs] = a[yd, xd]
      out |= shifted
  return out


@pytest.fixture(scope="module")
def easy_samples():
  return pf.generate_batch(pf.settings_for(32, "easy"), seed=3, batch=0, num=1000)


@pytest.fixture(scope="module")
def sample_sets(easy_samples):
  return {
      (32, "easy"): easy_samples[:300],
      (32, "hard"): pf.generate_batch(pf.settings_for(32, "hard"), seed=4, batch=0, num=150),
      (128, "hard"): pf.generate_batch(pf.settings_for(128, "hard"), seed=5, batch=0, num=6),
  }


SETS = [(32, "easy"), (32, "hard"), (128, "hard")]


# ---------------------------------------------------------------------------------------------
# Generator.

def test_labels_balanced_on_1000_images(easy_samples):
  share = np.mean([s.label for s in easy_samples])
  assert 0.45 <= share <= 0.55, share
  odd = pf.batch_labels(seed=0, batch=0, num=7)
  assert odd.sum() in (3, 4) and set(odd.tolist()) <= {0, 1}


@pytest.mark.parametrize("key", SETS)
def test_markers_connected_exactly_when_label_is_1(sample_sets, key):
  for sample in sample_sets[key]:
    start, end = sample.marker_cells
    assert sample.contour_mask[tuple(start)] == 1, "the first marker sits on snake 1"
    reach = _flood(sample.contour_mask, start)
    assert bool(reach[tuple(end)]) == (sample.label == 1)
    # The flood never leaks into another snake: snakes never touch in the mask.
    assert set(np.unique(sample.contour_mask[reach]).tolist()) == {1}
    assert sample.contour_mask[tuple(end)] == (1 if sample.label else 2)


@pytest.mark.parametrize("key", SETS)
def test_snakes_follow_the_settings(sample_sets, key):
  settings = pf.settings_for(*key)
  max_turn = math.pi / 2 / settings.continuity
  num_distractors = []
  for sample in sample_sets[key]:
    assert sample.paddle_margin in settings.paddle_margins
    step = settings.paddle_length + 2 * sample.paddle_margin
    for index, pivots in enumerate(sample.snakes):
      expected = settings.contour_length if index < 2 else settings.distractor_length
      assert len(pivots) == expected + 1
      d = np.diff(pivots, axis=0)
      assert np.all(np.abs(np.hypot(d[:, 0], d[:, 1]) - step) < 0.5)
      angles = np.arctan2(d[:, 0], d[:, 1])
      turns = np.abs(np.angle(np.exp(1j * np.diff(angles))))
      assert np.all(turns < max_turn + 1e-9), (turns, max_turn)
      assert np.all((pivots >= settings.padding) & (pivots <= key[0] - settings.padding))
    num_distractors.append(len(sample.snakes) - 2)
  assert max(num_distractors) <= settings.num_distractor_snakes
  assert np.mean(num_distractors) >= 0.5 * settings.num_distractor_snakes


@pytest.mark.parametrize("key", SETS)
def test_image_ink_is_snakes_and_markers(sample_sets, key):
  settings = pf.settings_for(*key)
  size = key[0]
  yy, xx = np.mgrid[0:size, 0:size] + 0.5
  for sample in sample_sets[key]:
    assert sample.image.shape == (size, size) and sample.image.dtype == np.uint8
    markers = np.zeros((size, size), bool)
    for y, x in sample.marker_cells:
      markers |= np.hypot(yy - (y + 0.5), xx - (x + 0.5)) <= settings.marker_radius + 1.5
      assert sample.image[y, x] >= 200, "a marker centre is bright"
    allowed = _dilate(sample.contour_mask > 0, 1) | markers
    assert not np.any(sample.image[~allowed]), "ink away from every snake and marker"
    # Every snake is drawn: some of its cells carry ink.
    for mask_id in range(1, len(sample.snakes) + 1):
      assert sample.image[sample.contour_mask == mask_id].max() > 60


def test_generator_is_deterministic_by_seed():
  settings = pf.settings_for(32, "intermediate")
  first = pf.generate_batch(settings, seed=11, batch=2, num=6)
  again = pf.generate_batch(settings, seed=11, batch=2, num=6)
  other = pf.generate_batch(settings, seed=12, batch=2, num=6)
  for a, b in zip(first, again):
    assert a.label == b.label
    np.testing.assert_array_equal(a.image, b.image)
    np.testing.assert_array_equal(a.contour_mask, b.contour_mask)
  assert any(not np.array_equal(a.image, c.image) for a, c in zip(first, other))


def test_settings_reject_unknown_values():
  with pytest.raises(ValueError, match="difficulty"):
    pf.settings_for(32, "medium")
  with pytest.raises(ValueError, match="resolution"):
    pf.settings_for(64, "easy")
  with pytest.raises(ValueError, match="label"):
    pf.generate_sample(pf.settings_for(32, "easy"), 2, pf.image_rng(0, 0, 0))


# ---------------------------------------------------------------------------------------------
# Writer: LRA layout.

def _config(data_dir, difficulty="easy", max_length=1024,
            mask_black_pixels=None) -> ml_collections.ConfigDict:
  """A minimal config; mask_black_pixels None leaves the field out (the loader's default)."""
  config = ml_collections.ConfigDict()
  config.data = ml_collections.ConfigDict()
  config.data.data_dir = str(data_dir)
  config.data.difficulty = difficulty
  config.data.max_length = max_length
  if mask_black_pixels is not None:
    config.data.mask_black_pixels = mask_black_pixels
  return config


def test_write_dataset_in_lra_layout(tmp_path):
  root = pf.write_dataset(str(tmp_path), 32, "easy", 30, seed=1, images_per_batch=12,
                          progress=False)
  assert root == os.path.join(str(tmp_path), "curv_baseline")
  assert sorted(os.listdir(os.path.join(root, "metadata"))) == ["0.npy", "1.npy", "2.npy"]
  settings = pf.settings_for(32, "easy")
  for batch, num in enumerate((12, 12, 6)):
    with open(os.path.join(root, "metadata", f"{batch}.npy"), encoding="utf-8") as f:
      text = f.read()
    assert text.endswith("\n")
    rows = [line.split(" ") for line in text.split("\n")[:-1]]   # how LRA's builder reads it
    assert len(rows) == num
    expected = pf.generate_batch(settings, seed=1, batch=batch, num=num)
    for i, row in enumerate(rows):
      assert len(row) == pf_data.METADATA_FIELDS
      assert row[0] == f"imgs/{batch}" and row[1] == f"sample_{i}.png" and int(row[2]) == i
      assert int(row[3]) == expected[i].label
      assert (float(row[4]), int(row[5]), int(row[6])) == (1.0, 6, 2)
      with Image.open(os.path.join(root, row[0], row[1])) as image:
        assert image.mode == "L" and image.size == (32, 32)
        np.testing.assert_array_equal(np.asarray(image), expected[i].image)
  with pytest.raises(ValueError, match=re.escape(os.path.join(root, "metadata"))):
    pf.write_dataset(str(tmp_path), 32, "easy", 5, seed=1, progress=False)

  task = get_task("pathfinder")
  spec = task.spec(_config(tmp_path))
  assert (spec.num_classes, spec.vocab_size) == (2, 256)
  sizes = {}
  for split in ("train", "val", "test"):
    arrays = task.load_split(_config(tmp_path), split)
    check_split_arrays(arrays, spec, split)
    sizes[split] = len(arrays["targets"])
  assert sizes == {"train": 24, "val": 3, "test": 3}


def test_parallel_writers_write_the_same_bytes(tmp_path):
  roots = [pf.write_dataset(str(tmp_path / f"w{n}"), 32, "hard", 6, seed=9, images_per_batch=3,
                            progress=False, num_workers=n) for n in (1, 2)]
  files = sorted(os.path.relpath(os.path.join(d, f), roots[0])
                 for d, _, names in os.walk(roots[0]) for f in names)
  assert len(files) == 6 + 2
  for name in files:
    with open(os.path.join(roots[0], name), "rb") as a, open(os.path.join(roots[1], name),
                                                             "rb") as b:
      assert a.read() == b.read(), name


# ---------------------------------------------------------------------------------------------
# Loader on hand-written fixtures in the official layout.

def _write_fixture(data_dir, difficulty="hard", counts=(4, 3, 3), names=("0", "2", "10"),
                   size=32, seed=0):
  """Random PNGs + text metadata as LRA's release; returns (pixels, labels) in load order."""
  rng = np.random.default_rng(seed)
  root = os.path.join(str(data_dir), pf_data.DIFFICULTY_DIRS[difficulty])
  os.makedirs(os.path.join(root, "metadata"), exist_ok=True)
  pixels, labels = [], []
  for name, num in zip(names, counts):     # names are listed in numeric order
    os.makedirs(os.path.join(root, "imgs", name), exist_ok=True)
    lines = []
    for i in range(num):
      image = rng.integers(0, 256, (size, size), dtype=np.uint8)
      label = int(rng.integers(2))
      Image.fromarray(image, mode="L").save(os.path.join(root, "imgs", name, f"sample_{i}.png"))
      lines.append(f"imgs/{name} sample_{i}.png {i} {label} 1.0 14 4 2 0.5 1 1\n")
      pixels.append(image)
      labels.append(label)
    with open(os.path.join(root, "metadata", f"{name}.npy"), "w") as f:
      f.writelines(lines)
  return root, np.stack(pixels), np.array(labels)


@pytest.mark.parametrize("mask_black_pixels", [None, True, False])
def test_loader_returns_pixel_tokens_labels_and_lra_split(tmp_path, mask_black_pixels):
  root, pixels, labels = _write_fixture(tmp_path)
  assert (pixels == 0).any()
  task = get_task("pathfinder")
  config = _config(tmp_path, "hard", mask_black_pixels=mask_black_pixels)
  masked = mask_black_pixels is not False       # LRA's inputs > 0 mask is the default
  spec = task.spec(config)
  assert (spec.vocab_size, spec.padding_at_end) == ((256, False) if masked else (257, True))
  bounds = {"train": (0, 8), "val": (8, 9), "test": (9, 10)}   # 80/10/10 of 10 rows
  for split, (lo, hi) in bounds.items():
    arrays = task.load_split(config, split)
    check_split_arrays(arrays, spec, split)
    assert arrays["inputs"].dtype == (np.uint8 if masked else np.uint16)
    assert arrays["targets"].dtype == np.int32
    # Masked: the raw pixel, black = 0 = padding; else pixel + 1, every pixel a real token.
    expected = pixels[lo:hi].reshape(hi - lo, -1).astype(np.int32) + (0 if masked else 1)
    np.testing.assert_array_equal(arrays["inputs"], expected)
    np.testing.assert_array_equal(arrays["targets"], labels[lo:hi])
    np.testing.assert_array_equal(arrays["inputs"] == 0,
                                  (pixels[lo:hi] == 0).reshape(hi - lo, -1) & masked)


def test_loader_reads_binary_npy_metadata(tmp_path):
  # The published generator np.save()s a string array of the same rows.
  root, pixels, labels = _write_fixture(tmp_path, counts=(10,), names=("0",))
  path = os.path.join(root, "metadata", "0.npy")
  with open(path) as f:
    rows = [line.split() for line in f.read().splitlines()]
  os.remove(path)
  np.save(path, np.array(rows))
  arrays = get_task("pathfinder").load_split(_config(tmp_path, "hard"), "train")
  np.testing.assert_array_equal(arrays["targets"], labels[:8])
  np.testing.assert_array_equal(arrays["inputs"], pixels[:8].reshape(8, -1).astype(np.int32))


def test_pathx_loads_128_pixel_images(tmp_path):
  pf.write_dataset(str(tmp_path), 128, "easy", 10, seed=2, progress=False)
  arrays = get_task("pathx").load_split(_config(tmp_path, "easy", 128 * 128), "train")
  assert arrays["inputs"].shape == (8, 16384)
  # Labels are balanced per batch, so the batch size (10 here) is part of what an image is.
  expected = pf.generate_batch(pf.settings_for(128, "easy"), seed=2, batch=0, num=10)
  np.testing.assert_array_equal(arrays["inputs"][3],
                                expected[3].image.reshape(-1).astype(np.int32))
  # The same files are the wrong size for the 32x32 task: the error names the file.
  first = os.path.join(str(tmp_path), "curv_baseline", "imgs", "0", "sample_0.png")
  with pytest.raises(ValueError, match=re.escape(first) + ".*128x128, expected 32x32"):
    get_task("pathfinder").load_split(_config(tmp_path, "easy"), "train")


def test_zero_byte_image_is_skipped_like_lra(tmp_path):
  root, _, labels = _write_fixture(tmp_path)
  open(os.path.join(root, "imgs", "0", "sample_1.png"), "wb").close()
  arrays = get_task("pathfinder").load_split(_config(tmp_path, "hard"), "train")
  np.testing.assert_array_equal(arrays["targets"], np.delete(labels[:8], 1))


# ---------------------------------------------------------------------------------------------
# Bad input: one error naming the file.

def _load(data_dir, difficulty="hard", split="train", max_length=1024):
  return get_task("pathfinder").load_split(_config(data_dir, difficulty, max_length), split)


def test_missing_directories_name_the_path(tmp_path):
  missing = os.path.join(str(tmp_path), "nowhere")
  with pytest.raises(FileNotFoundError, match=re.escape(missing)):
    _load(missing)
  _write_fixture(tmp_path)
  with pytest.raises(FileNotFoundError, match="curv_baseline"):
    _load(tmp_path, difficulty="easy")
  os.makedirs(os.path.join(str(tmp_path), "curv_contour_length_9"))
  with pytest.raises(FileNotFoundError, match=re.escape(
      os.path.join(str(tmp_path), "curv_contour_length_9", "metadata"))):
    _load(tmp_path, difficulty="intermediate")


def test_corrupt_png_names_the_file(tmp_path):
  root, _, _ = _write_fixture(tmp_path)
  path = os.path.join(root, "imgs", "2", "sample_0.png")
  with open(path, "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\nthis is not a png body")
  with pytest.raises(ValueError, match=re.escape(path) + ".*not a readable PNG"):
    _load(tmp_path)


def test_missing_png_names_the_file_and_metadata_line(tmp_path):
  root, _, _ = _write_fixture(tmp_path)
  path = os.path.join(root, "imgs", "0", "sample_2.png")
  os.remove(path)
  metadata = os.path.join(root, "metadata", "0.npy")
  with pytest.raises(FileNotFoundError, match=re.escape(path) + ".*" + re.escape(metadata) + ":3"):
    _load(tmp_path)


def test_wrong_image_size_names_the_file(tmp_path):
  root, _, _ = _write_fixture(tmp_path)
  path = os.path.join(root, "imgs", "2", "sample_1.png")
  Image.fromarray(np.zeros((31, 32), np.uint8), mode="L").save(path)
  with pytest.raises(ValueError, match=re.escape(path) + ".*32x31, expected 32x32"):
    _load(tmp_path)


@pytest.mark.parametrize("row, message", [
    ("imgs/2 sample_1.png 1 2 1.0 14 4 2 0.5 1 1", "label 2 outside"),
    ("imgs/2 sample_1.png 1 -1", "label -1 outside"),
    ("imgs/2 sample_1.png 1 yes 1.0", "label .* must be 0 or 1"),
    ("imgs/2 sample_1.png", "malformed row"),
])
def test_bad_metadata_rows_name_file_and_line(tmp_path, row, message):
  root, _, _ = _write_fixture(tmp_path)
  path = os.path.join(root, "metadata", "2.npy")
  with open(path) as f:
    lines = f.read().splitlines()
  lines[1] = row
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=re.escape(path) + ":2: " + message):
    _load(tmp_path, split="test")   # labels are checked for every row, whatever the split


def test_bad_config_values(tmp_path):
  _write_fixture(tmp_path)
  with pytest.raises(ValueError, match="max_length=2000.*1024 tokens"):
    _load(tmp_path, max_length=2000)
  with pytest.raises(ValueError, match="difficulty 'medium'"):
    _load(tmp_path, difficulty="medium")
  _write_fixture(tmp_path / "small", counts=(3,), names=("0",))
  with pytest.raises(ValueError, match="3 images leave the test split empty"):
    _load(tmp_path / "small", split="test")


# ---------------------------------------------------------------------------------------------
# Configs.

def test_configs_carry_lra_defaults_and_tiny_presets():
  pathfinder_config = load_python_file(os.path.join(REPO, "configs", "pathfinder.py"))
  pathx_config = load_python_file(os.path.join(REPO, "configs", "pathx.py"))
  import lra_sparse.attention as attention

  config = pathfinder_config.get_config()
  assert (config.task, config.data.max_length, config.data.difficulty) == \
      ("pathfinder", 1024, "hard")
  m = config.model
  assert (m.num_layers, m.num_heads, m.emb_dim, m.qkv_dim, m.mlp_dim) == (4, 4, 32, 16, 32)
  assert (config.batch_size, config.optim.schedule, config.optim.learning_rate) == \
      (512, "cosine", 1e-3)
  assert config.num_train_steps == 160000 // 512 * 200
  assert config.optim.warmup_steps == 160000 // 512 and config.optim.weight_decay == 0.0
  tiny = pathfinder_config.get_config("tiny")
  assert tiny.data.data_dir == "data/pathfinder_tiny" and tiny.data.max_length == 1024

  config = pathx_config.get_config()
  assert (config.task, config.data.max_length) == ("pathx", 16384)
  m = config.model
  assert (m.num_layers, m.num_heads, m.emb_dim, m.qkv_dim, m.mlp_dim) == (1, 2, 32, 16, 32)
  assert (config.batch_size, config.num_train_steps, config.optim.warmup_steps) == \
      (64, 500000, 2500)
  tiny = pathx_config.get_config("tiny")
  assert tiny.attention.kind in attention.attention_kinds()
  assert 16384 % tiny.attention.nystrom.num_landmarks == 0
  for module in (pathfinder_config, pathx_config):
    with pytest.raises(ValueError, match="unknown preset"):
      module.get_config("huge")


def test_missing_metadata_batch_is_a_loud_warning(tmp_path, caplog):
  root = pf.write_dataset(str(tmp_path), 32, "easy", 30, seed=1, images_per_batch=10,
                          progress=False)
  os.remove(os.path.join(root, "metadata", "1.npy"))
  with caplog.at_level(logging.INFO):
    arrays = get_task("pathfinder").load_split(_config(tmp_path), "train")
  assert len(arrays["targets"]) == 16                       # 80% of the 20 images left
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any("metadata batch(es) 1.npy missing (1 of 3)" in m and "split boundaries move" in m
             for m in warnings), warnings
