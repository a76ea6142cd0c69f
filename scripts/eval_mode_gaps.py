"""Per run: where validation in evaluation mode fell below the same parameters run as in
training (dropout on), and where both fell (the parameters themselves).

Reads runs recorded with ``config.eval_train_mode`` (split ``val_train_mode`` beside ``val``)
and prints a markdown table: last-step and best-validation test accuracy, then every
evaluation where the two modes differ by more than ``--gap`` (a "mode gap": evaluation mode
predicts one class far more often) and every evaluation, after validation first reached
``--learned``, where both are at or below ``--low`` (a collapse of the parameters), each as step: val / train-mode val (share of the
most predicted class in evaluation mode).

  python -m scripts.eval_mode_gaps --root=experiments/results/listops_recipe
"""
from __future__ import annotations

import os

from absl import app, flags

from lra_sparse import workdir as workdir_lib

ROOT = flags.DEFINE_string("root", None, "Directory of run directories.", required=True)
GAP = flags.DEFINE_float("gap", 0.05, "Mode gap: train-mode val accuracy minus val accuracy.")
LOW = flags.DEFINE_float("low", 0.25, "Collapse: both accuracies at or below this, after the "
                         "run first reached --learned.")
LEARNED = flags.DEFINE_float("learned", 0.30, "Validation accuracy that counts as learned.")


def top_share(record: dict) -> float:
  shares = [v for k, v in record.items() if k.startswith("predicted_")]
  return max(shares) if shares else float("nan")


def describe(run_dir: str, gap: float, low: float, learned: float) -> list[str] | None:
  records = [r for _, r in workdir_lib.read_metrics(run_dir)]
  val = {r["step"]: r for r in records if r.get("split") == "val"}
  checks = {r["step"]: r for r in records if r.get("split") == "val_train_mode"}
  if not checks:
    return None
  gaps, collapses, reached = [], [], False
  for step in sorted(set(val) & set(checks)):
    v, c = val[step]["accuracy"], checks[step]["accuracy"]
    text = f"{step}: {v:.3f} / {c:.3f} ({top_share(val[step]):.2f})"
    if c - v > gap:
      gaps.append(text)
    elif reached and max(v, c) <= low:
      collapses.append(text)
    reached = reached or v >= learned
  try:
    result = workdir_lib.read_result(run_dir)
    best = result["test_at_best_val"]
    outcome = (f"{100 * result['test']['accuracy']:.2f}",
               f"{100 * best['accuracy']:.2f} ({best['step']})")
  except (OSError, ValueError, KeyError, TypeError):
    outcome = (f"unfinished (step {max(val) if val else 0})", "")
  return [os.path.basename(run_dir), *outcome, "; ".join(gaps) or "none",
          "; ".join(collapses) or "none"]


def main(argv):
  del argv
  rows = []
  for name in sorted(os.listdir(ROOT.value)):
    path = os.path.join(ROOT.value, name)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, workdir_lib.METRICS_FILE)):
      row = describe(path, GAP.value, LOW.value, LEARNED.value)
      if row is not None:
        rows.append(row)
  if not rows:
    raise app.UsageError(f"no run under {ROOT.value} recorded split 'val_train_mode' "
                         "(config.eval_train_mode)")
  print("| run | test, last step | test at best val (step) | mode gaps: step: val / "
        "train-mode val (top class share) | collapses (both modes) |")
  print("|---|---|---|---|---|")
  for row in rows:
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  app.run(main)
