"""Shared test setup: a synthetic task, GPU skipping, and a small ListOps dataset."""
from __future__ import annotations

import atexit
import gzip
import math
import os
import shutil
import struct
import tempfile

import numpy as np
import pytest

# On a GPU, every pytest-xdist worker would otherwise preallocate 75% of the GPU's memory, and
# with more than one worker the later ones run out of memory (set before jax starts a backend).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One JAX compilation cache for the session's processes: the pytest-xdist workers inherit it
# from the process that loads this first, and so do the runs tests start as subprocesses
# (``lra_sparse.main``, sweeps). Many tests train the same tiny configs again (a reference run,
# then one killed and resumed; both workers; the same op-by-op programs in every process), and
# compiling was most of their time: a program compiled once is read back instead (tests that
# train, 10-40% less time). The cache is keyed by the program, its compile options and the
# jax version, so a hit runs what compiling would give. Fresh for every session: a directory
# of its own, removed at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _JAX_CACHE = tempfile.mkdtemp(prefix="lra_sparse_tests_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)

import jax  # pylint: disable=wrong-import-position

from lra_sparse.data.registry import TaskSpec, register_task, _TASKS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _slow_tests() -> tuple[set, set]:
  """(test functions, single cases) listed in tests/slow_tests.txt."""
  with open(os.path.join(REPO, "tests", "slow_tests.txt")) as f:
    entries = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  return {e for e in entries if "[" not in e}, {e for e in entries if "[" in e}


def pytest_collection_modifyitems(config, items):
  """Marks the tests of tests/slow_tests.txt 'slow' (the fast tier runs -m 'not slow'); off a
  GPU, skips the tests marked 'gpu'."""
  del config
  functions, cases = _slow_tests()
  for item in items:
    nodeid = item.nodeid if item.nodeid.startswith("tests/") else "tests/" + item.nodeid
    if nodeid in cases or nodeid.split("[")[0] in functions:
      item.add_marker(pytest.mark.slow)
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_numerics_for_cpu_tests(request):
  """The unmarked (CPU) tests hold float32 results to float32 references; on a GPU, where
  float32 products default to TF32 (10-bit mantissa), they run with full float32 products so
  that ``make test`` on a GPU machine checks the same things. Tests marked ``gpu`` keep the
  GPU's defaults (their tolerances say what they allow)."""
  if jax.default_backend() != "gpu" or "gpu" in request.keywords:
    yield
    return
  with jax.default_matmul_precision("float32"):
    yield


if "synthetic" not in _TASKS:
  @register_task("synthetic")
  class SyntheticTask:
    """Label = first token mod 3: learnable in a few steps; rows have end padding."""

    def spec(self, config):
      return TaskSpec("synthetic", num_classes=3, vocab_size=12)

    def load_split(self, config, split):
      rng = np.random.default_rng({"train": 0, "val": 1, "test": 2}[split])
      n, length = 128, config.data.max_length
      tokens = rng.integers(1, 12, size=(n, length)).astype(np.int32)
      lengths = rng.integers(length // 2, length + 1, size=n)
      tokens[np.arange(length)[None] >= lengths[:, None]] = 0
      return {"inputs": tokens, "targets": (tokens[:, 0] % 3).astype(np.int32)}


@pytest.fixture(scope="session")
def listops_dir(tmp_path_factory):
  """A small generated ListOps set in the official layout (short sequences for speed)."""
  from lra_sparse.generators.listops import write_listops_dataset
  out = tmp_path_factory.mktemp("listops")
  write_listops_dataset(str(out), num_train=400, num_val=64, num_test=64, seed=0,
                        min_length=20, max_length=120)
  return str(out)


@pytest.fixture
def tiny_config():
  """Factory: the tiny ListOps preset shrunk further for tests, with dotted overrides."""
  return make_tiny_config


def make_tiny_config(task: str = "synthetic", **overrides):
  from lra_sparse.config import load_config_file
  config = load_config_file(os.path.join(REPO, "configs", "listops.py"), "tiny")
  config.task = task
  config.data.max_length = 32
  config.model.num_layers = 1
  config.model.emb_dim = 32
  config.model.qkv_dim = 32
  config.model.mlp_dim = 64
  config.model.classifier_dim = 32
  config.batch_size = 16
  config.num_train_steps = 30
  config.eval_every_steps = 15
  config.checkpoint_every_steps = 10
  config.log_every_steps = 5
  config.optim.learning_rate = 0.05
  config.optim.warmup_steps = 10
  config.update_from_flattened_dict(overrides)
  return config


def np_select(q_pred, k_pred, mask, *, vector: int, sparsity: float, selection: str = "topk",
              threshold: float = 0.0, scale: float = 1.0) -> np.ndarray:
  """DSA's selection rule (lra_sparse.kernels.dsa.reference) written again in float64 numpy
  with explicit loops over rows: bool [batch, heads, groups, length].  A group that starts at
  or past the example's last real token keeps nothing."""
  q_pred = np.asarray(q_pred, np.float64)
  k_pred = np.asarray(k_pred, np.float64)
  b, l, h, _ = q_pred.shape
  mask = np.ones((b, l), bool) if mask is None else np.asarray(mask, bool)
  g = l // vector
  out = np.zeros((b, h, g, l), bool)
  for bi in range(b):
    real = np.flatnonzero(mask[bi])
    end = real[-1] + 1 if len(real) else 0
    need = max(1, math.ceil((1 - sparsity) * len(real) - 1e-6))
    for hi in range(h):
      kk = k_pred[bi, :, hi]
      kmax = np.max(np.abs(kk[real])) if len(real) else 0.0
      k8 = np.clip(np.round(kk / (kmax if kmax > 0 else 1.0) * 127), -127, 127)
      for gi in range(g):
        rows = np.arange(gi * vector, (gi + 1) * vector)
        real_rows = rows[mask[bi, rows]]
        qg = q_pred[bi, real_rows if len(real_rows) else rows, hi].mean(axis=0)
        qmax = np.max(np.abs(qg))
        q8 = np.clip(np.round(qg / (qmax if qmax > 0 else 1.0) * 127), -127, 127)
        s = (k8[real] @ q8).astype(np.int64)
        if not len(real) or gi * vector >= end:
          continue
        if selection == "threshold":
          factor = np.float32(np.float32(qmax) * np.float32(kmax) * np.float32(scale / 127**2))
          chosen = real[s.astype(np.float32) * factor >= np.float32(threshold)]
        else:
          span = s.max() - s.min()
          shift = 0
          while (span >> shift) >= 256:
            shift += 1
          code = (s - s.min()) >> shift
          order = sorted(range(len(real)), key=lambda j: (-code[j], real[j]))
          chosen = real[order[:need]]
        out[bi, hi, gi, chosen] = True
  return out


def rel_err(a, b):
  """||a - b|| / ||b|| in float64 (a kernel result against its reference)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# Per-row bound of the kernel comparisons (``check_close``): a row is one (batch, position,
# head) vector of a [batch, length, heads, head_dim] result, its error ||a - r|| / max(||r||,
# ROW_FLOOR * rms row norm of r). The whole-tensor error moves by about 1/sqrt(rows) when one
# row is wrong (1.9% for 3 x 700 x 2 rows), inside a 2e-2 bound; a wrong row moves its own
# error to about 1. ROW_TOL_FACTOR x the whole-tensor tolerance bounds every row.
ROW_FLOOR = 0.1
ROW_TOL_FACTOR = 5.0
# At most this share of rows may be excused as near-ties (``nm_near_tie_rows``), and no more
# than that: a bug that touches many rows is not excused.
MAX_TIE_SHARE = 0.05


def row_errors(a, r) -> np.ndarray:
  """Per-row relative errors of a [batch, length, heads, head_dim] result a against r:
  float64 [batch, length, heads]."""
  a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
  norms = np.linalg.norm(r, axis=-1)
  floor = ROW_FLOOR * max(float(np.sqrt(np.mean(norms ** 2))), 1e-30)
  return np.linalg.norm(a - r, axis=-1) / np.maximum(norms, floor)


def nm_near_tie_rows(q, k, mask, n, m, rel=1e-5):
  """Query rows whose N:M keep set a rounding difference could flip: bool [b, l, h], True
  where some group of the row's scores has its n-th and (n+1)-th largest real scores within
  ``rel`` * (1 + |score|) (float64 scores of the inputs as given; kernels and references sum
  the same exact bf16 products in another order, about 1e-7 apart). Such a row's output and
  dQ may differ from the reference's by one swapped key. A key's dK and dV sum over every
  query row, so one swap moves them by one term of many: key rows are not excused."""
  b, l, h, d = np.shape(q)
  if n == m:
    return np.zeros((b, l, h), bool)
  q, k = (np.asarray(np.asarray(x, np.float32), np.float64) for x in (q, k))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
  kp = -(-l // m) * m
  real = np.ones((b, l), bool) if mask is None else np.asarray(mask, bool)
  s = np.where(real[:, None, None, :], s, -np.inf)
  s = np.pad(s, [(0, 0)] * 3 + [(0, kp - l)], constant_values=-np.inf)
  g = -np.sort(-s.reshape(b, h, l, kp // m, m), axis=-1)
  nth, nxt = g[..., n - 1], g[..., n]
  with np.errstate(invalid="ignore"):
    tie = np.isfinite(nxt) & (nth - nxt <= rel * (1.0 + np.abs(nth)))   # [b, h, l, groups]
  return tie.any(-1).transpose(0, 2, 1)


def check_close(label, pairs, tol, *, excused=None):
  """Each (name, kernel result, reference) pair: no NaN (an unwritten or invalid element of a
  poisoned output), relative error below ``tol`` over the whole tensor and, for [batch,
  length, heads, head_dim] results, below ``ROW_TOL_FACTOR * tol`` in every row (printed with
  ``label``). ``excused``: name -> bool [batch, length, heads] rows left out of the per-row
  bound (near-ties, ``nm_near_tie_rows``), at most ``MAX_TIE_SHARE`` of them; their count is
  printed."""
  for name, a, r in pairs:
    a = np.asarray(a.astype(np.float32))
    assert not np.isnan(a).any(), f"{name}: NaN (unwritten or invalid) elements"
    e = rel_err(a, r)
    message = f"{label} {name} rel_err={e:.2e}"
    assert e < tol, (name, e)
    if a.ndim == 4:
      rows = row_errors(a, r)
      skip = np.zeros(rows.shape, bool) if excused is None else np.asarray(excused[name])
      assert skip.mean() <= MAX_TIE_SHARE, (name, f"{skip.sum()} near-tie rows of {skip.size}")
      worst = float(rows[~skip].max(initial=0.0))
      message += f" worst row {worst:.2e} ({skip.sum()} near-tie rows excused)"
      bad = np.argwhere((rows >= ROW_TOL_FACTOR * tol) & ~skip)
      assert not len(bad), (name, f"{len(bad)} rows over {ROW_TOL_FACTOR * tol:.1e}, first "
                                  f"(batch, position, head) {tuple(int(i) for i in bad[0])}: "
                                  f"{rows[tuple(bad[0])]:.2e}")
    print(message)


def np_philox4x32(c, key, rounds):
  """Philox-4x32 in numpy uint64 (exact 32x32 -> 64-bit products): counters c (4 arrays),
  key (2 ints); the independent check of dfss_dropout.philox4x32."""
  mask = np.uint64(0xFFFFFFFF)
  c = [np.asarray(x, np.uint64) & mask for x in np.broadcast_arrays(*c)]
  k0, k1 = np.uint64(key[0]), np.uint64(key[1])
  for _ in range(rounds):
    p0 = np.uint64(0xD2511F53) * c[0]
    p1 = np.uint64(0xCD9E8D57) * c[2]
    c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1,
         p0 & mask]
    k0 = (k0 + np.uint64(0x9E3779B9)) & mask
    k1 = (k1 + np.uint64(0xBB67AE85)) & mask
  return c


def np_key_multiplier(seed, b, h, rows, keys, rate):
  """The attention dropout rule written out with numpy (every backend of every kind draws
  it): the draw of key j in row r (batch*heads index bh) is 16-bit half j % 2 of output
  (j % 8) // 2 of Philox-4x32-7((j // 8, r, bh, 0), seed); dropped when below
  round(rate 2^16), else scaled by 2^16 / (2^16 - T). float64 [b, h, rows, keys]."""
  t_drop = int(round(rate * 65536))
  key = [int(x) & 0xFFFFFFFF for x in np.asarray(seed)]
  bh, r, j = np.meshgrid(np.arange(b * h), np.arange(rows), np.arange(keys), indexing="ij")
  words = np_philox4x32((j // 8, r, bh, 0 * j), key, 7)
  word = np.choose((j % 8) // 2, words)
  half = np.where(j % 2 == 0, word & np.uint64(0xFFFF), word >> np.uint64(16))
  return np.where(half >= t_drop, 65536 / (65536 - t_drop), 0.0).reshape(b, h, rows, keys)


def np_dropout_multiplier(seed, keep, rate):
  """``np_key_multiplier`` on the entries a kind keeps (bool [b, h, rows, keys]), 0 elsewhere."""
  return np.where(keep, np_key_multiplier(seed, *keep.shape, rate), 0.0)


def np_dense(q, k, v, mask, ct, seed=None, rate=0.0):
  """float64 numpy dense attention with dropout by the kernels' rule (np_key_multiplier):
  (out, dq, dk, dv); a row with no real key gives zeros."""
  q, k, v, ct = (np.asarray(np.asarray(x, np.float32), np.float64) for x in (q, k, v, ct))
  b, l, h, d = q.shape
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
  real = np.ones((b, l), bool) if mask is None else np.asarray(mask, bool)
  real = np.broadcast_to(real[:, None, None, :], s.shape)
  s = np.where(real, s, -np.inf)
  top = s.max(-1, keepdims=True)
  e = np.where(real, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
  a = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  zs = np_key_multiplier(seed, b, h, l, l, rate) if rate else 1.0
  out = np.einsum("bhqk,bkhd->bqhd", a * zs, v)
  dp = np.einsum("bqhd,bkhd->bhqk", ct, v) * zs
  ds = a * (dp - np.sum(a * dp, -1, keepdims=True))
  return (out, np.einsum("bhqk,bkhd->bqhd", ds, k) / math.sqrt(d),
          np.einsum("bhqk,bqhd->bkhd", ds, q) / math.sqrt(d),
          np.einsum("bhqk,bqhd->bkhd", a * zs, ct))


def checkpoint_params(workdir) -> dict:
  """The params of the newest checkpoint in ``workdir`` (nested, as saved)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  params = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore())["params"]
  manager.close()
  return params


_SPEC_WRAPPER = """
import importlib.util
import os
_spec = importlib.util.spec_from_file_location("wrapped_spec", {path!r})
wrapped = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wrapped)
BY_TASK = {by_task!r}


def get_sweep(preset=""):
  sweep = wrapped.get_sweep({preset!r})
  for group in sweep.groups:
    task = os.path.basename(group.config.split(":")[0]).removesuffix(".py")
    group.overrides = dict(group.overrides, **BY_TASK[task if task in BY_TASK else "*"])
  return sweep


def get_table(preset=""):
  return wrapped.get_table({preset!r})
"""


def spec_on_task_data(tmp_path, spec: str, preset: str, by_task: dict) -> str:
  """A spec file in ``tmp_path`` that is ``spec:preset`` (a path under the repo) with each
  group given the overrides of its config file's task (``by_task["text"]`` for
  configs/text.py, e.g. ``task_data_overrides``; ``by_task["*"]`` for any other): a committed
  spec's tiny preset run end to end on a test's generated data. Returns its path."""
  path = tmp_path / f"on_data_{os.path.basename(spec)}"
  path.write_text(_SPEC_WRAPPER.format(path=os.path.join(REPO, spec), preset=preset,
                                       by_task=by_task))
  return str(path)


def spec_on_data(tmp_path, spec: str, preset: str, data_dir: str) -> str:
  """``spec_on_task_data`` with every group reading ``data_dir``."""
  return spec_on_task_data(tmp_path, spec, preset, {"*": {"data.data_dir": data_dir}})


def pathfinder_dir_with_cue(root, resolution=32) -> str:
  """Generated Pathfinder in the LRA layout, with a bright top row added to label-1 images.

  Real Pathfinder stays at chance for thousands of steps; the cue lets 30 steps show that the
  layout, loader, model and trainer work together.
  """
  from PIL import Image
  from lra_sparse.data import pathfinder
  from lra_sparse.generators import pathfinder as pathfinder_generator
  pathfinder_generator.write_dataset(str(root), resolution=resolution, difficulty="easy",
                                     num_images=320, seed=0)
  paths, labels, _ = pathfinder.read_metadata(os.path.join(str(root), "curv_baseline"))
  for path, label in zip(paths, labels):
    pixels = np.array(Image.open(path))
    pixels[:2] = 255 if label else 0
    Image.fromarray(pixels).save(path)
  return str(root)


def _write_idx(path: str, array: np.ndarray) -> None:
  """IDX as Fashion-MNIST ships it: magic (0, 0, type 0x08 = uint8, ndim), big-endian dims."""
  header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                       *array.shape)
  with gzip.open(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def _image_dir(root) -> str:
  """Fashion-MNIST-format files whose class is readable from the image (bright stripe row)."""
  rng = np.random.default_rng(0)
  for prefix, n in (("train", 320), ("t10k", 64)):
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 60, (n, 28, 28))
    images[np.arange(n), labels * 2 + 4, :] = 255
    _write_idx(os.path.join(root, f"{prefix}-images-idx3-ubyte.gz"), images)
    _write_idx(os.path.join(root, f"{prefix}-labels-idx1-ubyte.gz"), labels)
  return str(root)


def task_data_overrides(task: str, tmp_path, listops_dir) -> dict:
  """Per-task overrides pointing a task's tiny preset at small data written for a test in
  ``tmp_path`` in the official formats (Text, Retrieval, the Image stand-in, Pathfinder)."""
  if task == "listops":
    return {"data.data_dir": listops_dir, "data.max_length": 128}
  if task == "text":
    from lra_sparse.generators.text import write_tiny_aclimdb
    write_tiny_aclimdb(str(tmp_path / "imdb"), num_train=320, num_test=64)
    return {"data.data_dir": str(tmp_path / "imdb"), "data.max_length": 192}
  if task == "retrieval":
    from lra_sparse.generators.retrieval import write_tiny_aan
    write_tiny_aan(str(tmp_path / "aan"), num_train=320, num_eval=32, num_test=32)
    return {"data.data_dir": str(tmp_path / "aan"), "data.max_length": 192}
  # The 1024-pixel tasks keep one layer: the test is about the pipeline, not capacity,
  # and batch 8 (1024 tokens each).
  if task == "image":
    os.makedirs(tmp_path / "fmnist")
    return {"data.source": "fashion_mnist", "data.data_dir": _image_dir(tmp_path / "fmnist"),
            "data.max_examples": 320, "model.num_layers": 1, "batch_size": 8}
  if task == "pathfinder":
    return {"data.data_dir": pathfinder_dir_with_cue(tmp_path / "pf"), "model.num_layers": 1,
            "batch_size": 8}
  raise AssertionError(task)
