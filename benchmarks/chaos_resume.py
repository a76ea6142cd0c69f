"""Reliability loop: kill a training run at random moments and check every restart.

  python -m benchmarks.chaos_resume [--trials=5] [--steps=200] [--seed=0] [--out=FILE]

Trains the tiny ListOps preset once without interruption (the reference), then, per trial,
starts the same command in a fresh workdir and, at random moments (the first seconds of start
up, mid-training, inside checkpoint saves), sends SIGKILL or SIGINT; the command is started again
until it exits 0. Every trial must end with the reference's result.json (step, test loss and
accuracy, bit for bit on a CPU). SIGINT must exit 130 with one line and no traceback. Prints a
markdown table (one row per trial: interruptions by kind, restarts, wall time, verdict) and
exits 1 if any trial differs.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from benchmarks import harness

REPO = harness.REPO

flags.DEFINE_integer("trials", 5, "Interrupted runs to compare with the reference.")
flags.DEFINE_integer("steps", 200, "Training steps of every run.")
flags.DEFINE_integer("checkpoint_every", 20, "Checkpoint interval (steps).")
flags.DEFINE_float("max_wait", 12.0, "Longest time (s) a launch runs before it is interrupted.")
flags.DEFINE_integer("max_interruptions", 6, "Interruptions per trial before it runs through.")
flags.DEFINE_integer("seed", 0, "Seed of the interruption schedule.")
flags.DEFINE_string("data_dir", "", "ListOps data; default: a small set generated in a temp dir.")
flags.DEFINE_string("out", "", "Also write the table here.")
FLAGS = flags.FLAGS


def _command(workdir: str, data_dir: str) -> list[str]:
  every = FLAGS.checkpoint_every
  return [sys.executable, "-m", "lra_sparse.main", "--config=configs/listops.py:tiny",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}",
          f"--config.num_train_steps={FLAGS.steps}", f"--config.checkpoint_every_steps={every}",
          f"--config.eval_every_steps={FLAGS.steps // 2}", "--config.log_every_steps=10",
          "--config.num_eval_batches=2"]


def _result(workdir: str) -> dict:
  with open(os.path.join(workdir, "result.json")) as f:
    result = json.load(f)
  return {"step": result["step"], "test_loss": result["test"]["loss"],
          "test_accuracy": result["test"]["accuracy"]}


def _trial(command: list[str], rng: random.Random) -> tuple[dict, int]:
  """Interrupts ``command`` at random until it completes; returns (counts, restarts)."""
  counts = {"SIGKILL": 0, "SIGINT": 0, "clean": 0}
  restarts = 0
  while True:
    interrupt = counts["SIGKILL"] + counts["SIGINT"] < FLAGS.max_interruptions
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if interrupt:
      try:
        proc.wait(timeout=rng.uniform(0.5, FLAGS.max_wait))
      except subprocess.TimeoutExpired:
        kind = rng.choice(["SIGKILL", "SIGINT"])
        proc.send_signal(signal.SIGKILL if kind == "SIGKILL" else signal.SIGINT)
        counts[kind] += 1
    _, stderr = proc.communicate(timeout=600)
    if proc.returncode == 0:
      counts["clean"] += 1
      return counts, restarts
    if proc.returncode == 130:
      lines = stderr.strip().splitlines()
      if "Traceback" in stderr or not lines or not lines[-1].startswith("interrupted"):
        raise RuntimeError(f"SIGINT did not end with one line:\n{stderr[-2000:]}")
    elif proc.returncode != -signal.SIGKILL:
      raise RuntimeError(f"run failed with return code {proc.returncode}:\n{stderr[-3000:]}")
    restarts += 1


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  scratch = tempfile.mkdtemp(prefix="chaos_resume_")
  try:
    data_dir = FLAGS.data_dir
    if not data_dir:
      data_dir = os.path.join(scratch, "listops")
      subprocess.run([sys.executable, "-m", "lra_sparse.generators.listops",
                      f"--output_dir={data_dir}", "--num_train=2000", "--num_val=200",
                      "--num_test=200", "--seed=0", "--min_length=20", "--max_length=100"],
                     cwd=REPO, check=True, capture_output=True)
    start = time.time()
    reference_dir = os.path.join(scratch, "reference")
    subprocess.run(_command(reference_dir, data_dir), cwd=REPO, check=True,
                   capture_output=True)
    reference = _result(reference_dir)
    print(f"reference ({time.time() - start:.0f} s): {reference}", flush=True)
    rng = random.Random(FLAGS.seed)
    rows, failures = [], 0
    for trial in range(FLAGS.trials):
      workdir = os.path.join(scratch, f"trial{trial}")
      start = time.time()
      counts, restarts = _trial(_command(workdir, data_dir), rng)
      got = _result(workdir)
      same = got == reference
      failures += not same
      rows.append((trial, counts["SIGKILL"], counts["SIGINT"], restarts,
                   f"{time.time() - start:.0f}", "same result.json" if same else f"DIFFERS: {got}"))
      print(rows[-1], flush=True)
    header = (f"Chaos resume: tiny ListOps, {FLAGS.steps} steps, checkpoint every "
              f"{FLAGS.checkpoint_every}, interruptions after 0.5-{FLAGS.max_wait:g} s; "
              f"commit {harness.commit()}; reference {reference}\n\n")
    table = harness.markdown_table(
        ["trial", "SIGKILL", "SIGINT", "restarts", "seconds", "verdict"], rows)
    harness.emit(header + table + "\n", FLAGS.out)
    if failures:
      sys.exit(1)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
