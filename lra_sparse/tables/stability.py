"""How runs end against their best: the recipe study's two views of a sweep root's run logs.

``last_vs_best`` (per row of a table spec, every column pooled): n, the mean ± sample std of
last-step test and of test at the best validation step, and how many seeds end within
``--within`` points of their own best-validation test (a run whose last step is far below its
best collapsed or drifted); unfinished and failed runs are counted beside, never averaged.

``mode_gaps`` (per run recorded with ``config.eval_train_mode``, split ``val_train_mode`` beside
``val``): every evaluation where validation in evaluation mode falls more than ``--gap`` below
the same parameters run as in training (dropout on), and every evaluation, after validation
first reached ``--learned``, where both are at or below ``--low`` (a collapse of the
parameters), each as step: val / train-mode val (share of the most predicted class).

  python -m lra_sparse.tables.stability --root=experiments/results/listops_recipe_5000 \
      --spec=experiments/specs/listops_recipe.py [--within=1.5]
  python -m lra_sparse.tables.stability --root=experiments/results/listops_recipe_5000 \
      --view=mode_gaps [--gap=0.05 --low=0.25 --learned=0.30]
"""
from __future__ import annotations

import os
import statistics

from absl import app, flags

from lra_sparse import workdir as workdir_lib
from lra_sparse.tables.cells import far_below_best, matches
from lra_sparse.tables.runs import Reporter, find_runs
from lra_sparse.tables.spec import load_table


def _mean_std(values: list[float]) -> str:
  if not values:
    return "—"
  if len(values) == 1:
    return f"{values[0]:.2f}"
  return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def last_vs_best(root: str, spec: str, within: float) -> list[dict]:
  """One dict per table row of ``spec``: label; runs, [(seed, last-step test %, test % at the
  best validation step, workdir)] of its finished runs by seed; others, its unfinished or
  failed runs (name, status, last step); stable, how many runs end within ``within`` points
  of their best-validation test."""
  table = load_table(spec)
  report = Reporter(echo=False)
  last = {r.workdir: r for r in find_runs(root, "test", report=report)}
  best = {r.workdir: r for r in find_runs(root, "test_at_best_val", report=report)}
  out = []
  for row in table.rows:
    matched = [r for r in last.values()
               if matches(r.config, row.match)
               and any(matches(r.config, column.match) for column in table.columns)]
    runs, others = [], []
    for run in matched:
      if run.status != "finished" or best[run.workdir].value is None:
        others.append(f"{run.workdir.rsplit('/', 1)[-1]} ({run.status}, step {run.last_step})")
        continue
      runs.append((run.config.get("seed"), 100 * run.value, 100 * best[run.workdir].value,
                   run.workdir))
    runs.sort(key=lambda r: (r[0] is None, r[0]))
    out.append({"label": row.label, "runs": runs, "others": others,
                "stable": sum(not far_below_best(l, b, within) for _, l, b, _ in runs)})
  return out


def top_share(record: dict) -> float:
  """The share of the most predicted class in an evaluation record (``predicted_<class>``)."""
  shares = [v for k, v in record.items() if k.startswith("predicted_")]
  return max(shares) if shares else float("nan")


def mode_gaps(run_dir: str, gap: float, low: float, learned: float) -> list[str] | None:
  """One row for a run: name, last-step test, test at best val (step), its mode gaps, its
  collapses ("none" when there are none); None for a run without ``val_train_mode``."""
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



def _print_last_vs_best(root: str, spec: str, within: float) -> None:
  print(f"| row | n | last-step test | test at best val | seeds with last >= best-val - "
        f"{within:g} | per seed: last / best-val |")
  print("|---|---|---|---|---|---|")
  for row in last_vs_best(root, spec, within):
    if not row["runs"] and not row["others"]:
      continue
    runs = row["runs"]
    per_seed = "; ".join(f"{seed}: {l:.2f} / {b:.2f}" for seed, l, b, _ in runs)
    if row["others"]:
      per_seed += ("; " if per_seed else "") + "not finished: " + ", ".join(row["others"])
    print(f"| {row['label']} | {len(runs)} | {_mean_std([l for _, l, _, _ in runs])} | "
          f"{_mean_std([b for _, _, b, _ in runs])} | {row['stable']} of {len(runs)} | "
          f"{per_seed} |")


def _print_mode_gaps(root: str, gap: float, low: float, learned: float) -> None:
  rows = []
  for name in sorted(os.listdir(root)):
    path = os.path.join(root, name)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, workdir_lib.METRICS_FILE)):
      row = mode_gaps(path, gap, low, learned)
      if row is not None:
        rows.append(row)
  if not rows:
    raise app.UsageError(f"no run under {root} recorded split 'val_train_mode' "
                         "(config.eval_train_mode)")
  print("| run | test, last step | test at best val (step) | mode gaps: step: val / "
        "train-mode val (top class share) | collapses (both modes) |")
  print("|---|---|---|---|---|")
  for row in rows:
    print("| " + " | ".join(row) + " |")


def main(argv):
  del argv
  if FLAGS.view == "mode_gaps":
    _print_mode_gaps(FLAGS.root, FLAGS.gap, FLAGS.low, FLAGS.learned)
  elif not FLAGS.spec:
    raise app.UsageError("--view=last_vs_best needs --spec=PATH[:PRESET] (its table's rows)")
  else:
    _print_last_vs_best(FLAGS.root, FLAGS.spec, FLAGS.within)


if __name__ == "__main__":
  flags.DEFINE_string("root", None, "Directory of run directories.", required=True)
  flags.DEFINE_enum("view", "last_vs_best", ["last_vs_best", "mode_gaps"], "Which view.")
  flags.DEFINE_string("spec", "", "Table spec (PATH[:PRESET]) for --view=last_vs_best.")
  flags.DEFINE_float("within", 1.5, "Points of test accuracy: a seed is stable when its "
                     "last-step test is at most this far below its best-val test.")
  flags.DEFINE_float("gap", 0.05, "Mode gap: train-mode val accuracy minus val accuracy.")
  flags.DEFINE_float("low", 0.25, "Collapse: both accuracies at or below this, after the run "
                     "first reached --learned.")
  flags.DEFINE_float("learned", 0.30, "Validation accuracy that counts as learned.")
  FLAGS = flags.FLAGS
  app.run(main)
