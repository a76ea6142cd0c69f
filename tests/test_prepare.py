"""``python -m lra_sparse.data.prepare``, compact caches and int32 batches from compact arrays.

No network: the AAN archive is a tar.gz built here in the layout of LRA's release, offline
runs use --offline or a local port that refuses connections, ListOps and Pathfinder are tiny.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import socket
import subprocess
import sys
import tarfile
import threading

import ml_collections
import numpy as np
import pytest

from lra_sparse.config import load_python_file
from lra_sparse.data import prepare
from lra_sparse.data.pipeline import ArraySource, eval_batches, train_dataset
from lra_sparse.data.registry import SPLITS, check_split_arrays, get_task
from lra_sparse.data.retrieval import read_aan_tsv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
retrieval_config = load_python_file(os.path.join(REPO, "configs", "retrieval.py"))
OFFLINE = prepare.Network(offline=True)

# AAN TSV lines as in tests/test_text_retrieval_image.py: label, id1, id2, text1, text2.
AAN_LINES = {
    "train": [b"1.0\tP0\tQ0\tGraph \"quoted\" text\tabc\n", b"0.0\tP1\tQ1\t\t" + b"0123456789" * 3
              + b"\r\n", b"1\tP2\tQ2\t" + "na\u00efve".encode() + b"\tx'y\n"],
    "eval": [b"0.0\ta\tb\teval one\teval two\n"],
    "test": [b"1.0\ta\tb\ttest\tdoc\n", b"0.0\tc\td\tt2\td2\n"],
}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def write_archive(path, extra: tuple[tuple[str, bytes], ...] = ()) -> str:
  """A tar.gz laid out as LRA's lra_release.gz (lra_release/lra_release/tsv_data/...), with a
  ListOps member before the AAN files and ``extra`` members after them."""
  with tarfile.open(path, "w:gz") as tar:
    _add(tar, "lra_release/lra_release/listops-1000/basic_train.tsv", b"Source\tTarget\r\n")
    for name, lines in AAN_LINES.items():
      _add(tar, f"lra_release/lra_release/tsv_data/new_aan_pairs.{name}.tsv", b"".join(lines))
    for name, data in extra:
      _add(tar, name, data)
  return str(path)


def options(tmp_path, **fields) -> prepare.Options:
  fields.setdefault("retrieval_max_length", 24)
  return prepare.Options(data_dir=str(tmp_path / "data"), **fields)


def retrieval_run_config(data_dir, max_length=24) -> ml_collections.ConfigDict:
  config = retrieval_config.get_config()
  config.data.data_dir = str(data_dir)
  config.data.max_length = max_length
  return config


def pathfinder_run_config(data_dir, mask_black_pixels=True) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"data": {
      "data_dir": str(data_dir), "difficulty": "easy", "max_length": 1024,
      "mask_black_pixels": mask_black_pixels}})


# ---------------------------------------------------------------------------------------------
# Retrieval: the AAN files out of the release archive.

def test_retrieval_from_archive_reads_like_the_tsv_files(tmp_path, capsys):
  archive = write_archive(tmp_path / "lra_release.gz")
  [result] = prepare.prepare(["retrieval"], options(tmp_path, aan_archive=archive), OFFLINE)
  assert result.status == "prepared", result.detail
  out_dir = tmp_path / "data" / "retrieval"
  for name, lines in AAN_LINES.items():
    assert (out_dir / f"new_aan_pairs.{name}.tsv").read_bytes() == b"".join(lines)
  assert sorted(os.listdir(out_dir)) == ["compact"] + [f"new_aan_pairs.{n}.tsv"
                                                       for n in ("eval", "test", "train")]
  with open(archive, "rb") as f:
    assert f"is {hashlib.sha256(f.read()).hexdigest()}" in capsys.readouterr().out

  # The task reads the compact cache (memory-mapped uint16), equal to parsing the TSV files.
  task, config = get_task("retrieval"), retrieval_run_config(out_dir)
  for split, name in zip(SPLITS, ("train", "eval", "test")):
    arrays = task.load_split(config, split)
    check_split_arrays(arrays, task.spec(config), split)
    assert isinstance(arrays["inputs1"], np.memmap) and arrays["inputs1"].dtype == np.uint16
    expected = read_aan_tsv(str(out_dir / f"new_aan_pairs.{name}.tsv"), 24)
    for key, value in expected.items():
      np.testing.assert_array_equal(arrays[key], value)
      assert arrays[key].dtype == value.dtype
  config.data.max_examples = 1
  assert task.load_split(config, "test")["targets"].tolist() == [1]

  # A run with another max_length is refused, naming the setting and the way out.
  with pytest.raises(ValueError, match=r"was built with other settings: max_length=24 \(this "
                     r"config: 16\).*delete .*compact"):
    task.load_split(retrieval_run_config(out_dir, max_length=16), "train")
  [again] = prepare.prepare(["retrieval"], options(tmp_path, aan_archive=archive), OFFLINE)
  assert again.status == "skipped"


def test_wrong_checksum_is_one_clear_error_and_writes_nothing(tmp_path):
  archive = write_archive(tmp_path / "lra_release.gz")
  [result] = prepare.prepare(["retrieval"], options(tmp_path, aan_archive=archive,
                                                    aan_sha256="0" * 64), OFFLINE)
  assert result.status == "failed"
  assert "\n" not in result.detail
  assert f"{archive}: sha256 " in result.detail and "does not match the expected" \
      in result.detail
  assert os.listdir(tmp_path / "data" / "retrieval") == []


@pytest.mark.parametrize("name", ["../evil.tsv", "lra_release/../../evil.tsv", "/tmp/evil.tsv"])
def test_member_escaping_the_archive_refuses_it(tmp_path, name):
  archive = write_archive(tmp_path / "lra_release.gz", extra=((name, b"pwned"),))
  [result] = prepare.prepare(["retrieval"], options(tmp_path, aan_archive=archive), OFFLINE)
  assert result.status == "failed"
  assert f"archive member {name!r} points outside the archive" in result.detail
  assert os.listdir(tmp_path / "data" / "retrieval") == []
  assert not (tmp_path / "evil.tsv").exists()


def test_linked_aan_member_refuses_the_archive(tmp_path):
  path = tmp_path / "lra_release.gz"
  with tarfile.open(path, "w:gz") as tar:
    link = tarfile.TarInfo("lra_release/tsv_data/new_aan_pairs.train.tsv")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    tar.addfile(link)
  [result] = prepare.prepare(["retrieval"], options(tmp_path, aan_archive=str(path)), OFFLINE)
  assert result.status == "failed" and "is not a regular file" in result.detail


# ---------------------------------------------------------------------------------------------
# ListOps and Pathfinder: the generators, and the compact cache of the pixel tasks.

def test_listops_and_pathfinder_tiny_sets_the_loaders_read(tmp_path):
  opts = options(tmp_path, listops_sizes=(20, 5, 5), num_images=20, difficulty="easy")
  results = prepare.prepare(["listops", "pathfinder"], opts, OFFLINE)
  assert [r.status for r in results] == ["prepared", "prepared"], results
  data = tmp_path / "data"
  listops_config = ml_collections.ConfigDict({"data": {"data_dir": str(data / "listops"),
                                                       "max_length": 2000}})
  listops = get_task("listops")
  sizes = {split: len(listops.load_split(listops_config, split)["targets"]) for split in SPLITS}
  assert sizes == {"train": 20, "val": 5, "test": 5}
  assert sorted(os.listdir(data / "listops")) == [f"basic_{s}.tsv" for s in ("test", "train",
                                                                               "val")]

  # The cache round-trips the loader's arrays exactly, as uint8 (vocabulary 256).
  task, config = get_task("pathfinder"), pathfinder_run_config(data / "pathfinder")
  for split in SPLITS:
    cached, original = task.load_split(config, split), task.load_original_split(config, split)
    check_split_arrays(cached, task.spec(config), split)
    assert isinstance(cached["inputs"], np.memmap) and cached["inputs"].dtype == np.uint8
    assert cached["targets"].dtype == np.int32
    for key in ("inputs", "targets"):
      np.testing.assert_array_equal(cached[key], original[key])
  assert [len(task.load_split(config, s)["targets"]) for s in SPLITS] == [16, 2, 2]
  again = prepare.prepare(["listops", "pathfinder"], opts, OFFLINE)
  assert [r.status for r in again] == ["skipped", "skipped"]

  # A run with other pixel tokens is refused; prepare rebuilds the cache for them, as uint16.
  unmasked = pathfinder_run_config(data / "pathfinder", mask_black_pixels=False)
  with pytest.raises(ValueError, match=r"built with other settings: mask_black_pixels=True "
                     r"\(this config: False\)"):
    task.load_split(unmasked, "train")
  [rebuilt] = prepare.prepare(["pathfinder"], dataclasses.replace(opts, mask_black_pixels=False),
                              OFFLINE)
  assert rebuilt.status == "prepared" and "compact cache" in rebuilt.detail
  cached = task.load_split(unmasked, "train")
  assert cached["inputs"].dtype == np.uint16
  masked_tokens = task.load_original_split(config, "train")["inputs"]
  np.testing.assert_array_equal(cached["inputs"], masked_tokens.astype(np.int32) + 1)

  # Regenerated images under the cache make it stale: refused, not silently used.
  metadata = data / "pathfinder" / "curv_baseline" / "metadata" / "0.npy"
  metadata.write_text(metadata.read_text() + "\n")
  with pytest.raises(ValueError, match=r"is stale: .*0\.npy changed"):
    task.load_split(unmasked, "val")


def test_pipeline_batches_are_int32_from_uint16_arrays():
  rng = np.random.default_rng(0)
  arrays = {"inputs": rng.integers(0, 257, (10, 6)).astype(np.uint16),
            "targets": rng.integers(0, 2, 10).astype(np.uint8)}
  assert ArraySource(arrays)[3]["inputs"].dtype == np.int32
  batch = train_dataset(arrays, batch_size=4, seed=0)[0]
  assert {key: value.dtype for key, value in batch.items()} == {"inputs": np.int32,
                                                                 "targets": np.int32}
  rows = [np.flatnonzero((arrays["inputs"] == row).all(1))[0] for row in batch["inputs"]]
  np.testing.assert_array_equal(batch["targets"], arrays["targets"][rows])
  batches = list(eval_batches(arrays, batch_size=4))
  assert all(b["inputs"].dtype == np.int32 and b["targets"].dtype == np.int32
             for b, _ in batches)
  np.testing.assert_array_equal(np.concatenate([b["inputs"] for b, _ in batches])[:10],
                                arrays["inputs"].astype(np.int32))


# ---------------------------------------------------------------------------------------------
# Offline: one line per task, fast, no traceback.

def _run_cli(*args) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "lra_sparse.data.prepare", *args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_offline_download_tasks_fail_fast_with_one_line(tmp_path):
  data_dir = str(tmp_path / "data")
  runs = {task: _run_cli(f"--task={task}", f"--data_dir={data_dir}", "--offline")
          for task in ("text", "image", "retrieval")}
  # No --offline: the probe of a local port that refuses connections says "offline" at once.
  runs["probe"] = _run_cli("--task=retrieval", f"--data_dir={data_dir}",
                           "--aan_archive=http://127.0.0.1:9/lra_release.gz")
  manual = {"text": os.path.join(data_dir, "text", "downloads", "manual", "aclImdb_v1.tar.gz"),
            "image": os.path.join(data_dir, "image", "downloads", "manual",
                                  "cifar-10-binary.tar.gz"),
            "retrieval": os.path.join(data_dir, "retrieval", "downloads", "lra_release.gz"),
            "probe": "no answer in 5 s"}
  for name, run in runs.items():
    _, stderr = run.communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if line.strip()]
    task = "retrieval" if name == "probe" else name
    assert run.returncode == 1, (name, stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: {task}: cannot fetch "), stderr
    assert manual[name] in lines[0] and "Traceback" not in stderr
  assert not os.path.exists(os.path.join(data_dir, "retrieval", "downloads"))


def test_probe_of_a_silent_server_gives_up_at_its_timeout():
  with socket.socket() as server:         # accepts connections (backlog), never answers
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    # The server never answers: without its timeout the probe would wait forever. It must
    # return (False) well inside the join's generous bound; no wall-clock assertion.
    answer = []
    probe = threading.Thread(target=lambda: answer.append(prepare.reachable(
        f"http://127.0.0.1:{server.getsockname()[1]}/x", timeout=1.0)), daemon=True)
    probe.start()
    probe.join(timeout=60)
    assert not probe.is_alive(), "the probe did not give up at its timeout"
    assert answer == [False]
