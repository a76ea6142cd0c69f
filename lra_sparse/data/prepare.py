"""Fetches or generates the LRA data sets and writes them where the task loaders read them.

CLI (absl flags)::

  python -m lra_sparse.data.prepare --task=text|retrieval|image|listops|pathfinder|pathx|all \\
      --data_dir=DIR [--overwrite] [--offline] [--aan_archive=PATH_OR_URL] [--aan_sha256=HEX]
      [--num_images=200000] [--difficulty=hard] [--num_workers=N] [--seed=0]
      [--listops_sizes=96000,2000,2000] [--retrieval_max_length=4000]
      [--[no]mask_black_pixels] [--[no]compact]

Each task goes to ``DIR/<task>/``; train on it with ``--config.data.data_dir=DIR/<task>``:

- text: tfds ``imdb_reviews`` in the array_record format (``DIR/text/imdb_reviews/...``), which
  the text task's ``tfds`` source reads: also pass ``--config.data.source=tfds``. tfds builds
  data sets with TensorFlow (reading them needs none). By hand: put ``aclImdb_v1.tar.gz`` in
  ``DIR/text/downloads/manual/`` (tfds uses it instead of downloading).
- image: tfds ``cifar10`` the same way (``DIR/image/cifar10/...``); by hand:
  ``cifar-10-binary.tar.gz`` in ``DIR/image/downloads/manual/``.
- retrieval: ``DIR/retrieval/new_aan_pairs.{train,eval,test}.tsv``, extracted from LRA's release
  archive (``lra_release.gz``, a multi-GB tar.gz that also holds ListOps and Pathfinder; kept
  as ``DIR/retrieval/downloads/lra_release.gz``, delete it when done). Only those three
  regular files are read out of it; a member name that is absolute or holds ``..`` makes the
  whole archive refused. Its sha256 is checked against ``--aan_sha256`` (default
  ``AAN_ARCHIVE_SHA256``); when none is known the computed one is printed, to be recorded. By
  hand: put the archive there (or pass ``--aan_archive=PATH``), or the three TSV files.
- listops: ``DIR/listops/basic_{train,val,test}.tsv`` from ``lra_sparse.generators.listops``
  (96k/2k/2k as LRA; about 20 s).
- pathfinder / pathx: ``DIR/<task>/<difficulty dir>/{imgs,metadata}`` from
  ``lra_sparse.generators.pathfinder`` at 32 / 128 pixels (``--num_images``, LRA: 200k, split
  160k/20k/20k). On one core of a 2-core machine 200k images took about 4 min (32 px) and
  9 min (128 px) to generate, and as long again to decode into the compact cache;
  ``--num_workers`` (default: every core) generates in parallel. Disk: Path-X's PNGs take
  about 0.6 GB, its cache 3.3 GB.

Compact cache: for retrieval, pathfinder and pathx (``--compact``, default on) the loader's
split arrays are also written to ``DIR/<task>/compact/`` (``lra_sparse.data.common``): one
memory-mapped ``.npy`` per split and array in the smallest unsigned dtype holding the
vocabulary, with a ``meta.json`` recording the config fields that shaped them. The loaders read
it when present, so Path-X's 200k x 16384 tokens (13 GB as int32) need no RAM of their own. Its
settings must match the run's config: ``--retrieval_max_length`` (config.data.max_length) and
``--mask_black_pixels`` and ``--difficulty`` (config.data.*). The other tasks have none: their
arrays are small, and text and ListOps runs vary max_length.

A task already prepared (its files, and its cache for these settings, present) is skipped
unless ``--overwrite``; a retrieval overwrite extracts again from the kept archive.

Offline (``--offline``, or the download host does not answer within 5 s): a task that needs a
download fails at once with one line naming what could not be fetched and where to put it by
hand; the exit status is 1 if any task failed. ``--task=all`` goes on past failures and ends
with one line per task: prepared, skipped (present) or failed (why).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import shutil
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from typing import Callable, Optional, Sequence

from absl import app
from absl import flags
import ml_collections

from lra_sparse import cli
from lra_sparse.data.common import CompactCacheMismatch, check_compact_cache, write_compact_cache
from lra_sparse.data.pathfinder import DIFFICULTY_DIRS
from lra_sparse.data.registry import SPLITS, get_task
from lra_sparse.generators.listops import write_listops_dataset
from lra_sparse.generators.pathfinder import write_dataset as write_pathfinder_dataset

TASKS = ("text", "image", "retrieval", "listops", "pathfinder", "pathx")   # downloads first
AAN_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"
# sha256 of lra_release.gz. None: not known here (never computed from a real download), so the
# archive is not checked and the computed sha256 is printed; record it here or pass it with
# --aan_sha256 to check later downloads.
AAN_ARCHIVE_SHA256: Optional[str] = None
AAN_FILES = tuple(f"new_aan_pairs.{name}.tsv" for name in ("train", "eval", "test"))
AAN_ARCHIVE_DIR = "tsv_data"          # the AAN files' directory in the archive
PROBE_TIMEOUT_S = 5.0
PATHFINDER_RESOLUTIONS = {"pathfinder": 32, "pathx": 128}


@dataclasses.dataclass(frozen=True)
class TfdsData:
  """A tfds data set: its download and what the loaders accept instead."""
  name: str
  url: str
  file_name: str                      # the download's name in tfds' manual directory
  config_flags: str                   # what a run passes to read it
  alternative: str                    # the way around it, offline or without TensorFlow


TFDS_DATA = {
    "text": TfdsData("imdb_reviews",
                     "http://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
                     "aclImdb_v1.tar.gz", "--config.data.source=tfds --config.data.data_dir=",
                     "or train without tfds on the archive's aclImdb/ tree, extracted "
                     "(--config.data.source=aclimdb --config.data.data_dir=PATH/aclImdb)"),
    "image": TfdsData("cifar10", "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
                      "cifar-10-binary.tar.gz", "--config.data.data_dir=",
                      "or use the Fashion-MNIST stand-in (--config.data.source=fashion_mnist; "
                      "apt-get install dataset-fashion-mnist)"),
}
TFDS_BUILD_PACKAGES = ("tensorflow", "importlib_resources")   # tfds builds data sets with them


@dataclasses.dataclass(frozen=True)
class Options:
  """What the flags ask for (see the module docstring)."""
  data_dir: str
  overwrite: bool = False
  offline: bool = False
  aan_archive: str = ""               # "" = DIR/retrieval/downloads/lra_release.gz or AAN_URL
  aan_sha256: Optional[str] = AAN_ARCHIVE_SHA256
  num_images: int = 200_000
  difficulty: str = "hard"
  num_workers: int = 1
  seed: int = 0
  listops_sizes: tuple[int, int, int] = (96_000, 2_000, 2_000)
  retrieval_max_length: int = 4000
  mask_black_pixels: bool = True
  compact: bool = True


@dataclasses.dataclass(frozen=True)
class Result:
  task: str
  status: str                         # "prepared" | "skipped" | "failed"
  detail: str


class Unavailable(OSError):
  """A download this task needs cannot be made (offline); the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Network.

def reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
  """Whether the host of ``url`` answers an HTTP HEAD within ``timeout`` seconds.

  Any HTTP status counts (the network works; the download reports its own error). The probe
  runs in a daemon thread, so a hanging DNS lookup costs no more than the timeout either.
  """
  answered = []

  def probe():
    try:
      with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
        pass
      answered.append(True)
    except urllib.error.HTTPError:
      answered.append(True)
    except (OSError, ValueError):
      answered.append(False)

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(timeout)
  return bool(answered) and answered[0]


class Network:
  """Answers "can ``url`` be fetched?" once per host; always no with ``--offline``."""

  def __init__(self, offline: bool, probe: Callable[[str], bool] = reachable):
    self._offline = offline
    self._probe = probe
    self._hosts: dict[str, bool] = {}

  def can_fetch(self, url: str) -> bool:
    if self._offline:
      return False
    host = urllib.parse.urlparse(url).netloc
    if host not in self._hosts:
      self._hosts[host] = self._probe(url)
    return self._hosts[host]

  def why_not(self, url: str) -> str:
    """The start of the message for a ``url`` that ``can_fetch`` said no to."""
    reason = "--offline" if self._offline else f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    return f"cannot fetch {url} ({reason})"


def download(url: str, path: str) -> None:
  """Streams ``url`` to ``path`` (through ``path.part``, renamed when complete)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  partial = path + ".part"
  print(f"downloading {url} to {path}", flush=True)
  start = last = time.monotonic()
  done = 0
  with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as f:
    total = int(response.headers.get("Content-Length") or 0)
    while chunk := response.read(1 << 20):
      f.write(chunk)
      done += len(chunk)
      if time.monotonic() - last > 10:
        last = time.monotonic()
        share = f" of {total / 1e9:.2f} GB" if total else ""
        print(f"  {done / 1e9:.2f}{share} GB, {done / 1e6 / (last - start):.1f} MB/s", flush=True)
  if total and done != total:
    raise OSError(f"download of {url} stopped after {done} of {total} bytes; run again")
  os.replace(partial, path)


# ---------------------------------------------------------------------------------------------
# The AAN files out of LRA's release archive.

class _HashingReader:
  """A file's ``read`` that also feeds every byte read to a hash."""

  def __init__(self, f, digest):
    self._f = f
    self._digest = digest

  def read(self, size: int = -1) -> bytes:
    data = self._f.read(size)
    self._digest.update(data)
    return data


def _check_member_name(name: str, archive: str) -> None:
  path = pathlib.PurePosixPath(name)
  if path.is_absolute() or ".." in path.parts:
    raise ValueError(f"{archive}: archive member {name!r} points outside the archive (absolute "
                     f"path or '..'); refusing to read anything from it")


def extract_aan_pairs(archive: str, out_dir: str, expected_sha256: Optional[str]) -> str:
  """Writes the AAN files of LRA's release archive ``archive`` into ``out_dir``.

  One streaming pass reads the archive, hashing every byte: the members ``.../tsv_data/
  new_aan_pairs.{train,eval,test}.tsv`` (regular files) are copied to temporary files, which
  are renamed into place only once the whole archive is read and its sha256 matches
  ``expected_sha256`` (None: not checked). Every member name is checked (nothing is extracted
  by name, and a name that escapes the archive refuses it). Returns the sha256.
  """
  if not os.path.isfile(archive):
    raise FileNotFoundError(f"AAN archive {archive} does not exist")
  os.makedirs(out_dir, exist_ok=True)
  digest = hashlib.sha256()
  found: dict[str, str] = {}
  try:
    with open(archive, "rb") as raw:
      reader = _HashingReader(raw, digest)
      with tarfile.open(fileobj=reader, mode="r|*") as tar:
        for member in tar:
          _check_member_name(member.name, archive)
          parts = pathlib.PurePosixPath(member.name).parts
          if len(parts) < 2 or parts[-2] != AAN_ARCHIVE_DIR or parts[-1] not in AAN_FILES:
            continue
          if not member.isfile():
            raise ValueError(f"{archive}: member {member.name!r} is not a regular file "
                             f"(a link or a device); refusing it")
          if parts[-1] in found:
            raise ValueError(f"{archive}: holds {parts[-1]} twice; refusing it")
          found[parts[-1]] = os.path.join(out_dir, f".{parts[-1]}.part")
          with tar.extractfile(member) as source, open(found[parts[-1]], "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
      while reader.read(1 << 20):       # the rest of the file, for the checksum
        pass
    sha256 = digest.hexdigest()
    if expected_sha256 and sha256 != expected_sha256.lower():
      raise ValueError(f"{archive}: sha256 {sha256} does not match the expected "
                       f"{expected_sha256} (a truncated or different file); delete it and "
                       f"download it again")
    missing = [name for name in AAN_FILES if name not in found]
    if missing:
      raise ValueError(f"{archive}: no {AAN_ARCHIVE_DIR}/{', '.join(missing)} in it; is it "
                       f"LRA's lra_release.gz?")
    for name in AAN_FILES:
      os.replace(found[name], os.path.join(out_dir, name))
    return sha256
  except (tarfile.TarError, EOFError, zlib.error) as error:
    raise ValueError(f"{archive}: not a readable tar.gz archive ({error})") from None
  finally:
    for path in found.values():
      if os.path.exists(path):
        os.remove(path)


# ---------------------------------------------------------------------------------------------
# Compact caches.

def loader_config(task: str, options: Options) -> ml_collections.ConfigDict:
  """The config fields the loader of ``task`` reads, as a run with these options sets them."""
  data = {"data_dir": os.path.join(options.data_dir, task), "max_examples": 0}
  if task == "retrieval":
    data.update(source="tsv", max_length=options.retrieval_max_length)
  else:
    resolution = PATHFINDER_RESOLUTIONS[task]
    data.update(difficulty=options.difficulty, max_length=resolution * resolution,
                mask_black_pixels=options.mask_black_pixels)
  return ml_collections.ConfigDict({"data": data})


def _cache_is_current(task: str, config: ml_collections.ConfigDict) -> bool:
  """Whether the task's compact cache exists and was built with this config's settings."""
  loader = get_task(task)
  try:
    return check_compact_cache(loader.compact_cache_dir(config), loader.spec(config),
                               loader.compact_settings(config), config.data.data_dir) is not None
  except CompactCacheMismatch as error:
    print(f"{task}: rebuilding the compact cache: {error}", flush=True)
    return False


def write_compact(task: str, config: ml_collections.ConfigDict) -> str:
  """Reads every split of ``task`` from its original files and writes its compact cache."""
  loader = get_task(task)
  cache_dir = loader.compact_cache_dir(config)
  start = time.perf_counter()
  print(f"{task}: writing the compact cache {cache_dir}", flush=True)
  write_compact_cache(cache_dir, loader.spec(config), loader.compact_settings(config),
                      config.data.data_dir, loader.compact_sources(config),
                      lambda split: loader.load_original_split(config, split))
  print(f"{task}: compact cache written in {time.perf_counter() - start:.0f} s", flush=True)
  return cache_dir


# ---------------------------------------------------------------------------------------------
# Tasks. Each returns (status, detail) or raises; the caller turns errors into one line.

def _prepare_tfds(task: str, options: Options, network: Network) -> tuple[str, str]:
  data = TFDS_DATA[task]
  task_dir = os.path.join(options.data_dir, task)
  use = f"train with {data.config_flags}{task_dir}"
  if not options.overwrite and _tfds_readable(data.name, task_dir):
    return "skipped", f"tfds {data.name} already prepared in {task_dir}; {use}"
  manual_dir = os.path.join(task_dir, "downloads", "manual")
  problems = []
  if not os.path.isfile(os.path.join(manual_dir, data.file_name)) \
      and not network.can_fetch(data.url):
    problems.append(f"{network.why_not(data.url)}; download it elsewhere and put it in "
                    f"{manual_dir}/{data.file_name}, then run this again")
  missing = [name for name in TFDS_BUILD_PACKAGES if importlib.util.find_spec(name) is None]
  if missing:
    problems.append(f"tfds builds {data.name} with {' and '.join(missing)} (pip install "
                    f"{' '.join(missing)}; reading it needs neither)")
  if problems:
    raise Unavailable(f"{'; '.join(problems)}; {data.alternative}")
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  mode = (tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS if options.overwrite
          else tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS)
  builder = tfds.builder(data.name, data_dir=task_dir, file_format="array_record")
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
      manual_dir=manual_dir, download_mode=mode))
  if not _tfds_readable(data.name, task_dir):
    raise ValueError(f"tfds {data.name} in {task_dir} is prepared but not as array_record "
                     f"(the format the loader reads); run again with --overwrite")
  return "prepared", f"tfds {data.name} in {task_dir}; {use}"


def _tfds_readable(name: str, data_dir: str) -> bool:
  """Whether the loader's ``tfds.data_source`` opens the prepared data set."""
  if not os.path.isdir(os.path.join(data_dir, name)):
    return False                      # not prepared: no need to import tfds to know
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  try:
    tfds.data_source(name, split="train", data_dir=data_dir, download=False)
  except Exception:  # pylint: disable=broad-except  # tfds raises several types
    return False
  return True


def _prepare_retrieval(options: Options, network: Network) -> tuple[str, str]:
  task_dir = os.path.join(options.data_dir, "retrieval")
  config = loader_config("retrieval", options)
  present = all(os.path.isfile(os.path.join(task_dir, name)) for name in AAN_FILES)
  done = []
  if options.overwrite or not present:
    if options.overwrite:
      shutil.rmtree(os.path.join(task_dir, "compact"), ignore_errors=True)
    archive = options.aan_archive
    kept = os.path.join(task_dir, "downloads", "lra_release.gz")
    if not archive:
      archive = kept if os.path.isfile(kept) else AAN_URL
    if urllib.parse.urlparse(archive).scheme in ("http", "https"):
      if not network.can_fetch(archive):
        raise Unavailable(
            f"{network.why_not(archive)}; download it elsewhere and put it at {kept} (or "
            f"pass --aan_archive=PATH), or put {', '.join(AAN_FILES)} (lra_release/tsv_data "
            f"in it) in {task_dir}/, then run this again")
      download(archive, kept)
      archive = kept
    print(f"retrieval: reading {archive}", flush=True)
    sha256 = extract_aan_pairs(archive, task_dir, options.aan_sha256)
    if not options.aan_sha256:
      print(f"retrieval: sha256 of {archive} is {sha256} (no expected checksum known; record "
            f"it in lra_sparse.data.prepare.AAN_ARCHIVE_SHA256 or pass --aan_sha256)")
    done.append(f"extracted {', '.join(AAN_FILES)} to {task_dir}")
  if options.compact and (options.overwrite or not _cache_is_current("retrieval", config)):
    done.append(f"wrote the compact cache {write_compact('retrieval', config)}")
  use = f"train with --config.data.data_dir={task_dir}"
  if not done:
    return "skipped", f"already present in {task_dir}; {use}"
  return "prepared", "; ".join(done + [use])


def _prepare_listops(options: Options) -> tuple[str, str]:
  task_dir = os.path.join(options.data_dir, "listops")
  names = [f"basic_{split}.tsv" for split in SPLITS]
  use = f"train with --config.data.data_dir={task_dir}"
  if not options.overwrite and all(os.path.isfile(os.path.join(task_dir, n)) for n in names):
    return "skipped", f"already present in {task_dir}; {use}"
  num_train, num_val, num_test = options.listops_sizes
  staging = os.path.join(task_dir, ".prepare")
  shutil.rmtree(staging, ignore_errors=True)
  try:
    write_listops_dataset(staging, num_train, num_val, num_test, options.seed)
    for name in names:
      os.replace(os.path.join(staging, name), os.path.join(task_dir, name))
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return "prepared", f"generated {num_train}/{num_val}/{num_test} examples in {task_dir}; {use}"


def _prepare_pathfinder(task: str, options: Options) -> tuple[str, str]:
  task_dir = os.path.join(options.data_dir, task)
  config = loader_config(task, options)
  root = os.path.join(task_dir, DIFFICULTY_DIRS[options.difficulty])
  metadata_dir = os.path.join(root, "metadata")
  present = os.path.isdir(metadata_dir) and bool(os.listdir(metadata_dir))
  done = []
  if options.overwrite or not present:
    shutil.rmtree(get_task(task).compact_cache_dir(config), ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    staging = os.path.join(task_dir, ".prepare")
    shutil.rmtree(staging, ignore_errors=True)
    try:
      written = write_pathfinder_dataset(staging, PATHFINDER_RESOLUTIONS[task],
                                         options.difficulty, options.num_images, options.seed,
                                         num_workers=options.num_workers)
      os.replace(written, root)
    finally:
      shutil.rmtree(staging, ignore_errors=True)
    done.append(f"generated {options.num_images} images in {root}")
  if options.compact and (options.overwrite or not present
                          or not _cache_is_current(task, config)):
    done.append(f"wrote the compact cache {write_compact(task, config)}")
  use = (f"train with --config.data.data_dir={task_dir} "
         f"--config.data.difficulty={options.difficulty}")
  if not done:
    return "skipped", f"already present in {root}; {use}"
  return "prepared", "; ".join(done + [use])


def prepare_task(task: str, options: Options, network: Network) -> Result:
  """Prepares one task; any error becomes a "failed" result with a one-line reason (the full
  traceback with the environment variable ``cli.TRACEBACK_ENV`` set)."""
  try:
    if task in TFDS_DATA:
      status, detail = _prepare_tfds(task, options, network)
    elif task == "retrieval":
      status, detail = _prepare_retrieval(options, network)
    elif task == "listops":
      status, detail = _prepare_listops(options)
    elif task in PATHFINDER_RESOLUTIONS:
      status, detail = _prepare_pathfinder(task, options)
    else:
      raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)} or 'all'")
  except Exception as error:  # pylint: disable=broad-except  # one line per task, go on
    if os.environ.get(cli.TRACEBACK_ENV):
      raise
    return Result(task, "failed", cli.one_line(error))
  return Result(task, status, detail)


def prepare(tasks: Sequence[str], options: Options,
            network: Optional[Network] = None) -> list[Result]:
  """Prepares ``tasks`` in order, going on past failures (each reported on stderr at once)."""
  network = network or Network(options.offline)
  results = []
  for task in tasks:
    result = prepare_task(task, options, network)
    if result.status == "failed":
      print(f"error: {task}: {result.detail}", file=sys.stderr, flush=True)
    results.append(result)
  return results


# ---------------------------------------------------------------------------------------------
# CLI.

def _define_flags() -> None:
  flags.DEFINE_enum("task", None, list(TASKS) + ["all"], "Task to prepare, or all of them.")
  flags.DEFINE_string("data_dir", None, "Root directory: each task goes to DATA_DIR/<task>/.")
  flags.DEFINE_boolean("overwrite", False, "Prepare tasks again even if present.")
  flags.DEFINE_boolean("offline", False, "Fetch nothing: tasks needing a download fail at once.")
  flags.DEFINE_string("aan_archive", "", "Path or URL of LRA's lra_release.gz (default: "
                      "DATA_DIR/retrieval/downloads/lra_release.gz if present, else "
                      f"{AAN_URL}).")
  flags.DEFINE_string("aan_sha256", AAN_ARCHIVE_SHA256 or "",
                      "Expected sha256 of the AAN archive ('' = unknown: print it).")
  flags.DEFINE_integer("num_images", 200_000, "Pathfinder / Path-X images (LRA: 200000).")
  flags.DEFINE_enum("difficulty", "hard", ["easy", "intermediate", "hard"],
                    "Pathfinder / Path-X contour length 6 / 9 / 14 (LRA: hard).")
  flags.DEFINE_integer("num_workers", os.cpu_count() or 1,
                       "Processes generating Pathfinder / Path-X images.")
  flags.DEFINE_integer("seed", 0, "Seed of the ListOps and Pathfinder generators.")
  flags.DEFINE_list("listops_sizes", ["96000", "2000", "2000"],
                    "ListOps train,val,test examples (LRA: 96000,2000,2000).")
  flags.DEFINE_integer("retrieval_max_length", 4000, "config.data.max_length the retrieval "
                       "cache is built for (configs/retrieval.py: 4000).")
  flags.DEFINE_boolean("mask_black_pixels", True, "config.data.mask_black_pixels the "
                       "Pathfinder / Path-X caches are built for (configs: True).")
  flags.DEFINE_boolean("compact", True, "Also write the compact caches (retrieval, "
                       "pathfinder, pathx).")
  flags.mark_flags_as_required(["task", "data_dir"])


def _options_from_flags() -> Options:
  f = flags.FLAGS
  try:
    sizes = tuple(int(n) for n in f.listops_sizes)
  except ValueError:
    sizes = ()
  if len(sizes) != 3 or min(sizes) < 1:
    raise app.UsageError(f"--listops_sizes={','.join(f.listops_sizes)}: expected three "
                         f"positive integers train,val,test")
  sha256 = f.aan_sha256.strip().lower()
  if sha256 and (len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256)):
    raise app.UsageError(f"--aan_sha256={f.aan_sha256!r} is not a sha256 (64 hex digits)")
  for name in ("num_images", "num_workers", "retrieval_max_length"):
    if getattr(f, name) < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {getattr(f, name)}")
  return Options(data_dir=f.data_dir, overwrite=f.overwrite, offline=f.offline,
                 aan_archive=f.aan_archive, aan_sha256=sha256 or None, num_images=f.num_images,
                 difficulty=f.difficulty, num_workers=f.num_workers, seed=f.seed,
                 listops_sizes=sizes, retrieval_max_length=f.retrieval_max_length,
                 mask_black_pixels=f.mask_black_pixels, compact=f.compact)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  options = _options_from_flags()
  tasks = TASKS if flags.FLAGS.task == "all" else (flags.FLAGS.task,)
  results = prepare(tasks, options)
  if len(results) > 1:
    print("summary:")
  for result in results:
    if result.status != "failed" or len(results) > 1:
      print(f"{result.task}: {result.status}: {result.detail}", flush=True)
  if any(result.status == "failed" for result in results):
    sys.exit(cli.EXIT_ERROR)


# Flags are defined only when this file is the program (tests import it next to modules whose
# flag names overlap), as in lra_sparse.generators.
if __name__ == "__main__":
  _define_flags()
  cli.run(main)
