"""Peak GPU memory and step time of each attention setting at LRA's configs, one process a cell.

  python -m benchmarks.bench_memory \
      [--configs=configs/listops.py,configs/pathfinder.py,configs/pathx.py] \
      [--variants=bf16:auto,bf16:kind=dfss+nm=2:4,bf16:kind=dsa+sparsity=0.9,bf16:kind=nystrom] \
      [--gpus=0,1,2,3] [--attention_dropout=RATE] [--overrides=key=value,...] [--out=FILE]

A cell is one (config, variant): the full trainer step of ``benchmarks.harness`` (random
tokens at the config's batch and length, forward, backward, AdamW update; variants as in
``bench_train_step``: ``dtype:attention[/drop=RATE]``), its median wall time after warm-up, and
the device's peak bytes in use afterwards (``memory_stats()["peak_bytes_in_use"]``: the
largest the allocator held for live buffers, compilation scratch included). The peak is per
process, so every cell runs in its own process (``--cell``), at most one per GPU of ``--gpus``
at a time (``CUDA_VISIBLE_DEVICES``), with XLA's preallocation off. A cell that runs out of
memory says so, with the allocation it asked for where XLA names it; another failure gives its
error's last line. Attention dropout is each config's own (LRA's) unless --attention_dropout
sets one for every cell. Cells above --card_gib (40: an A100 40GB) are listed under the table:
such a config needs ``optim.grad_accum_steps`` (or a smaller batch) to fit that card.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from absl import app, flags

from benchmarks import harness

FLAGS = flags.FLAGS
CONFIGS = ["configs/listops.py", "configs/pathfinder.py", "configs/pathx.py"]
VARIANTS = ["bf16:auto", "bf16:kind=dfss+nm=2:4", "bf16:kind=dsa+sparsity=0.9",
            "bf16:kind=nystrom"]
CELL_MARK = "CELL "
GIB = 2 ** 30


def define_flags() -> None:
  """Defined only when run as a program: importing this module (the tests do) adds no flags."""
  flags.DEFINE_list("configs", CONFIGS, "Config files, the table's columns.")
  flags.DEFINE_list("variants", VARIANTS, "dtype:attention[/drop=RATE] settings, the rows.")
  flags.DEFINE_list("overrides", [], "key=value config overrides for every cell.")
  flags.DEFINE_float("attention_dropout", None, "Attention dropout of every cell (default: each "
                     "config's own).")
  flags.DEFINE_list("gpus", [], "GPU ids: cells run one per GPU at a time (default: one cell "
                    "at a time on the visible device).")
  flags.DEFINE_integer("warmup", 3, "Untimed steps after compilation.")
  flags.DEFINE_integer("reps", 10, "Timed steps.")
  flags.DEFINE_float("card_gib", 40.0, "List the cells whose peak exceeds this many GiB.")
  flags.DEFINE_integer("cell_timeout_s", 540, "A cell still running after this is stopped.")
  flags.DEFINE_string("out", "", "Also write the table here.")
  flags.DEFINE_bool("cell", False, "Internal: measure the one config and variant given, print "
                    "one CELL line.")


def _overrides() -> list[str]:
  rate = ([] if FLAGS.attention_dropout is None
          else [f"model.attention_dropout_rate={FLAGS.attention_dropout}"])
  return [*rate, *FLAGS.overrides]


def measure_cell(config_path: str, variant: str) -> dict:
  """The step's median ms and the device's peak GiB (None where the backend keeps no memory
  statistics, as on a CPU) of one cell, in this process."""
  import jax  # pylint: disable=g-import-not-at-top
  seconds, loss = harness.time_variant(variant, config_path=config_path, warmup=FLAGS.warmup,
                                       reps=FLAGS.reps, overrides=_overrides())
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return {"ms": seconds * 1e3, "peak_gib": None if peak is None else peak / GIB,
          "loss": loss, "device": harness.device_kind()}


def cell_command(config_path: str, variant: str) -> list[str]:
  command = [sys.executable, "-m", "benchmarks.bench_memory", "--cell",
             f"--configs={config_path}", f"--variants={variant}", f"--warmup={FLAGS.warmup}",
             f"--reps={FLAGS.reps}"]
  if FLAGS.attention_dropout is not None:
    command.append(f"--attention_dropout={FLAGS.attention_dropout}")
  if FLAGS.overrides:
    command.append(f"--overrides={','.join(FLAGS.overrides)}")
  return command


def read_cell(returncode: int | None, stdout: str, stderr: str, timeout_s: float) -> dict:
  """A cell process's result: its CELL line, or what stopped it (``returncode`` None: it ran
  past ``timeout_s`` and was stopped)."""
  for line in reversed(stdout.splitlines()):
    if line.startswith(CELL_MARK):
      return json.loads(line[len(CELL_MARK):])
  if returncode is None:
    return {"error": f"stopped after {timeout_s:g} s"}
  text = stdout + "\n" + stderr
  if re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory", text):
    asked = re.search(r"(?:allocate|allocating)\s+([0-9.]+\s*[KMGT]?i?B|\d+ bytes)", text)
    return {"error": "out of memory" + (f" (asked {asked.group(1)})" if asked else "")}
  lines = [line.strip() for line in stderr.splitlines() if line.strip()]
  return {"error": "failed: " + (lines[-1][:120] if lines else f"exit code {returncode}")}


def run_cells(cells: list[tuple[str, str]]) -> dict[tuple[str, str], dict]:
  """Each cell in its own process, at most one per GPU of --gpus at a time."""
  slots = list(FLAGS.gpus) or [None]
  pending, running, results = list(cells), [], {}
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  while pending or running:
    free = [slot for slot in slots if slot not in {r[1] for r in running}]
    while pending and free:
      cell, slot = pending.pop(0), free.pop(0)
      cell_env = dict(env, **({"CUDA_VISIBLE_DEVICES": slot} if slot is not None else {}))
      process = subprocess.Popen(cell_command(*cell), env=cell_env, cwd=harness.REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      running.append((cell, slot, process, time.monotonic()))
      print(f"started {cell[0]} {cell[1]} (GPU {slot})", flush=True)
    for entry in list(running):
      cell, slot, process, started = entry
      if process.poll() is None and time.monotonic() - started < FLAGS.cell_timeout_s:
        continue
      timed_out = process.poll() is None
      if timed_out:
        process.kill()
      stdout, stderr = process.communicate()
      results[cell] = read_cell(None if timed_out else process.returncode, stdout, stderr,
                                FLAGS.cell_timeout_s)
      running.remove(entry)
      print(f"{cell[0]} {cell[1]}: {results[cell]}", flush=True)
    time.sleep(0.2)
  return results


def cell_text(result: dict) -> str:
  if "error" in result:
    return result["error"]
  peak = "n/a" if result["peak_gib"] is None else f"{result['peak_gib']:.2f} GiB"
  return f"{result['ms']:.1f} ms, {peak}"


def table(results: dict[tuple[str, str], dict]) -> tuple[list[str], list[list[str]], str]:
  """(columns, rows, note): a row per variant, a column per config; the note lists the cells
  above --card_gib and the devices that ran them."""
  columns = ["variant"] + [os.path.splitext(os.path.basename(c))[0] for c in FLAGS.configs]
  rows = [[variant] + [cell_text(results[(config, variant)]) for config in FLAGS.configs]
          for variant in FLAGS.variants]
  over = [f"{os.path.basename(config)} {variant} ({result['peak_gib']:.1f} GiB)"
          for (config, variant), result in results.items()
          if result.get("peak_gib") is not None and result["peak_gib"] > FLAGS.card_gib]
  devices = sorted({result["device"] for result in results.values() if "device" in result})
  note = (f"Cells above {FLAGS.card_gib:g} GiB: " + ("; ".join(over) if over else "none")
          + f". Devices: {', '.join(devices) or 'none (every cell failed)'}.")
  return columns, rows, note


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.cell:
    if len(FLAGS.configs) != 1 or len(FLAGS.variants) != 1:
      raise app.UsageError("--cell measures one --configs and one --variants")
    print(CELL_MARK + json.dumps(measure_cell(FLAGS.configs[0], FLAGS.variants[0])),
          flush=True)
    return
  for config in FLAGS.configs:
    if not os.path.isfile(os.path.join(harness.REPO, config)):
      raise app.UsageError(f"--configs: {config} is not a file under {harness.REPO}")
  results = run_cells([(c, v) for c in FLAGS.configs for v in FLAGS.variants])
  columns, rows, note = table(results)
  dropout = ("each config's own" if FLAGS.attention_dropout is None
             else f"{FLAGS.attention_dropout:g}")
  header = (f"Train step time and peak device memory, one process per cell "
            f"({harness.run_header()}); each config's batch and length; attention dropout "
            f"{dropout}; overrides {FLAGS.overrides or 'none'}; median of {FLAGS.reps} steps "
            f"after {FLAGS.warmup} warm-up; peak = memory_stats()['peak_bytes_in_use']")
  harness.emit_table(header, columns, rows, FLAGS.out, note=note)


if __name__ == "__main__":
  define_flags()
  app.run(main)
