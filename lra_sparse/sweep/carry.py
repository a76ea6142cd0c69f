"""Carry a sweep root from one machine to the next: its run records and resumable checkpoints,
packed into a few size-limited parts, and unpacked where the sweep goes on.

A lent GPU machine forgets everything between leases, returns at most a few files of limited
size, and takes a limited tree along. A run longer than one lease survives only if its
newest checkpoint travels. ``pack`` writes, for every run under the root, its records
(config.json, metrics.jsonl, result.json, the sweep's error file and log) and its newest
checkpoint (``checkpoints/<step>``: the one the run resumes from, and the one a fine-tune's
``init_from`` loads), plus the root's ``sweep.json``; never locks, "running" markers,
TensorBoard event files, profiles or older checkpoints. The stream (tar, gzip) is cut into
``carry.tgz.part-<i>-of-<n>`` files of at most ``--part_mb`` MiB; more than ``--max_parts``
parts is one error that names the largest runs, before anything is written.

``unpack`` checks that every part of one pack is there, joins them and extracts under the root
(paths inside the root only). A run whose local copy already holds a checkpoint at or past the
carried one keeps its local copy (the carried one would move it back); every other carried run
replaces its local copy. Resuming from the unpacked root then continues each run exactly where
the packed one stopped (``tests/test_reliability.py::test_a_carried_run_resumes_bit_identically``).
With ``--runs=REGEX`` only the runs whose name it matches (``re.search``, as the sweep's own
``--runs``) are unpacked, and the pack's ``sweep.json`` is not (it describes the packed root):
``scripts/device_sweep.sh`` unpacks every carried part into the root of each REGEX that way,
so a run resumes under the sweep that selects it whatever part it came in.

  python -m lra_sparse.sweep.carry --pack --root=runs/pf --parts_dir=$OUT
  python -m lra_sparse.sweep.carry --unpack --root=runs/pf --parts_dir=experiments/carry/pf/p0
  python -m lra_sparse.sweep.carry --unpack --root=runs/pf.p1 --parts_dir=... --runs='__seed=2$'
"""
from __future__ import annotations

import io
import os
import re
import shutil
import tarfile
from typing import Optional, Sequence

from absl import app
from absl import flags

from lra_sparse import cli
from lra_sparse import workdir as workdir_lib

PART_PREFIX = "carry.tgz.part-"
_PART_RE = re.compile(re.escape(PART_PREFIX) + r"(\d+)-of-(\d+)$")
# A run's records that travel (beside its newest checkpoint).
RECORD_FILES = (workdir_lib.CONFIG_FILE, workdir_lib.METRICS_FILE, workdir_lib.RESULT_FILE,
                workdir_lib.ERROR_FILE, workdir_lib.LOG_FILE)


def newest_checkpoint_step(run_dir: str) -> Optional[int]:
  """The largest step of ``<run>/checkpoints/<step>`` (orbax names a checkpoint by its step
  only once it is complete; temporary directories carry a suffix), or None."""
  ckpt_dir = os.path.join(run_dir, workdir_lib.CHECKPOINT_DIR)
  if not os.path.isdir(ckpt_dir):
    return None
  steps = [int(n) for n in os.listdir(ckpt_dir)
           if n.isdigit() and os.path.isdir(os.path.join(ckpt_dir, n))]
  return max(steps) if steps else None


def _run_dirs(root: str) -> list[str]:
  """Run workdirs under ``root`` (folders holding a config.json), relative to it, sorted."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    if workdir_lib.CONFIG_FILE in filenames:
      found.append(os.path.relpath(dirpath, root))
      dirnames[:] = []                  # a workdir's own folders hold no runs
    else:
      dirnames.sort()
  return sorted(found)


def _members(root: str) -> list[tuple[str, str]]:
  """(path on disk, name in the archive) of everything a pack carries, runs in order."""
  members = []
  manifest = os.path.join(root, workdir_lib.MANIFEST_FILE)
  if os.path.isfile(manifest):
    members.append((manifest, workdir_lib.MANIFEST_FILE))
  for run in _run_dirs(root):
    run_dir = os.path.join(root, run)
    for name in RECORD_FILES:
      path = os.path.join(run_dir, name)
      if os.path.isfile(path):
        members.append((path, os.path.join(run, name)))
    step = newest_checkpoint_step(run_dir)
    if step is not None:
      ckpt = os.path.join(run_dir, workdir_lib.CHECKPOINT_DIR, str(step))
      for dirpath, dirnames, filenames in os.walk(ckpt):
        dirnames.sort()
        for name in sorted(filenames):
          path = os.path.join(dirpath, name)
          members.append((path, os.path.relpath(path, root)))
  return members


def pack(root: str, parts_dir: str, part_mb: float = 15.0, max_parts: int = 8) -> list[str]:
  """Packs ``root`` into parts under ``parts_dir``; returns their paths."""
  if not os.path.isdir(root):
    raise FileNotFoundError(f"--root={root!r}: no such directory")
  if part_mb <= 0 or max_parts < 1:
    raise ValueError(f"--part_mb must be > 0 and --max_parts >= 1, got {part_mb}, {max_parts}")
  members = _members(root)
  if not members:
    raise ValueError(f"--root={root!r}: no run (a folder with {workdir_lib.CONFIG_FILE}) and "
                     f"no {workdir_lib.MANIFEST_FILE} to carry")
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
    for path, name in members:
      tar.add(path, arcname=name, recursive=False)
  data = buffer.getvalue()
  part_bytes = int(part_mb * 2**20)
  count = max(1, -(-len(data) // part_bytes))
  if count > max_parts:
    sizes: dict[str, int] = {}
    for path, name in members:
      run = name.split(os.sep)[0] if os.sep in name else name
      sizes[run] = sizes.get(run, 0) + os.path.getsize(path)
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    raise ValueError(
        f"--root={root!r}: the pack is {len(data) / 2**20:.1f} MiB compressed, more than "
        f"{max_parts} parts of {part_mb:g} MiB; largest runs (uncompressed): "
        + ", ".join(f"{run} {size / 2**20:.1f} MiB" for run, size in largest))
  os.makedirs(parts_dir, exist_ok=True)
  stale = [n for n in os.listdir(parts_dir) if n.startswith(PART_PREFIX)]
  if stale:
    raise FileExistsError(f"--parts_dir={parts_dir!r} already holds parts of a pack "
                          f"({', '.join(sorted(stale)[:3])}); remove them or pick another folder")
  paths = []
  for i in range(count):
    path = os.path.join(parts_dir, f"{PART_PREFIX}{i + 1}-of-{count}")
    with open(path, "wb") as f:
      f.write(data[i * part_bytes:(i + 1) * part_bytes])
    paths.append(path)
  return paths


def _read_parts(parts_dir: str) -> bytes:
  if not os.path.isdir(parts_dir):
    raise FileNotFoundError(f"--parts_dir={parts_dir!r}: no such directory")
  found = {}
  totals = set()
  for name in os.listdir(parts_dir):
    match = _PART_RE.fullmatch(name)
    if match:
      found[int(match.group(1))] = os.path.join(parts_dir, name)
      totals.add(int(match.group(2)))
  if not found:
    raise FileNotFoundError(f"--parts_dir={parts_dir!r}: no {PART_PREFIX}<i>-of-<n> file")
  if len(totals) != 1:
    raise ValueError(f"--parts_dir={parts_dir!r}: parts of several packs (of {sorted(totals)} "
                     "parts); keep one pack per folder")
  total = totals.pop()
  missing = [i for i in range(1, total + 1) if i not in found]
  if missing:
    raise FileNotFoundError(f"--parts_dir={parts_dir!r}: part(s) {missing} of {total} missing")
  return b"".join(open(found[i], "rb").read() for i in range(1, total + 1))


def unpack(root: str, parts_dir: str, runs: str = "") -> dict[str, str]:
  """Unpacks the parts in ``parts_dir`` under ``root`` (with ``runs``, a regular expression,
  only the runs whose name it matches, and no root file); returns run -> what happened to it.
  """
  try:
    selects = re.compile(runs).search if runs else None
  except re.error as e:
    raise ValueError(f"--runs={runs!r} is not a regular expression ({e})") from None
  data = _read_parts(parts_dir)
  try:
    tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    names = tar.getmembers()
  except (tarfile.TarError, EOFError, OSError) as e:
    raise ValueError(f"--parts_dir={parts_dir!r}: the joined parts are not a whole pack ({e})")
  by_run: dict[str, list[tarfile.TarInfo]] = {}
  carried: dict[str, int] = {}          # run -> the step of its carried checkpoint
  root_files = []
  for member in names:
    parts = member.name.split("/")
    if (member.name.startswith("/") or ".." in parts or not member.isfile()):
      raise ValueError(f"--parts_dir={parts_dir!r}: the pack holds {member.name!r}, which is "
                       "not a file inside the root")
    if len(parts) == 1:
      root_files.append(member)
      continue
    if workdir_lib.CHECKPOINT_DIR in parts[:-1]:     # <run>/checkpoints/<step>/...
      at = parts.index(workdir_lib.CHECKPOINT_DIR)
      run = "/".join(parts[:at])
      if parts[at + 1].isdigit():
        carried[run] = max(carried.get(run, 0), int(parts[at + 1]))
    else:
      run = "/".join(parts[:-1])
    by_run.setdefault(run, []).append(member)
  os.makedirs(root, exist_ok=True)
  outcome = {}
  for run, members in sorted(by_run.items()):
    if selects is not None and not selects(run):
      outcome[run] = f"left out (--runs={runs!r} does not match it)"
      continue
    local = os.path.join(root, run)
    step = carried.get(run)
    have = newest_checkpoint_step(local)
    if have is not None and (step is None or have >= step):
      outcome[run] = f"kept the local copy (checkpoint {have} >= carried {step})"
      continue
    if os.path.isdir(local):
      shutil.rmtree(local)
    for member in members:
      tar.extract(member, path=root, filter="data")
    outcome[run] = f"unpacked (checkpoint {step})" if step is not None else "unpacked"
  for member in root_files if selects is None else ():
    tar.extract(member, path=root, filter="data")
  return outcome


def define_flags() -> None:
  flags.DEFINE_bool("pack", False, "Pack --root into parts under --parts_dir.")
  flags.DEFINE_bool("unpack", False, "Unpack the parts in --parts_dir under --root.")
  flags.DEFINE_string("root", None, "The sweep root (or one run's workdir's parent).")
  flags.DEFINE_string("parts_dir", None, "Where the parts are written / read.")
  flags.DEFINE_float("part_mb", 15.0, "Largest part, MiB.")
  flags.DEFINE_integer("max_parts", 8, "Most parts a pack may take.")
  flags.DEFINE_string("runs", "", "With --unpack: only the runs whose name this regular "
                      "expression matches (re.search), and not the pack's sweep.json.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if f.pack == f.unpack:
    raise ValueError("give exactly one of --pack and --unpack")
  if not f.root or not f.parts_dir:
    raise ValueError("--root and --parts_dir are required")
  if f.pack and f.runs:
    raise ValueError("--runs selects what --unpack unpacks; --pack carries the whole root")
  if f.pack:
    paths = pack(f.root, f.parts_dir, f.part_mb, f.max_parts)
    size = sum(os.path.getsize(p) for p in paths) / 2**20
    print(f"packed {f.root} into {len(paths)} part(s), {size:.1f} MiB: {f.parts_dir}")
  else:
    for run, what in unpack(f.root, f.parts_dir, f.runs).items():
      print(f"{run}: {what}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
