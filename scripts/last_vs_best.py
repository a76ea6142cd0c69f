"""Per table row: last-step test against test at the best validation step, seed by seed.

For each row of a table spec, the finished runs it matches (every column pooled): n, the
mean ± sample std of last-step test and of test at the best validation step, and how many
seeds end within ``--within`` points of their own best-validation test (the stability rule
of the recipe study: a run whose last step is far below its best collapsed or drifted).
Unfinished and failed runs are counted beside, never averaged.

  python -m scripts.last_vs_best --root=experiments/results/listops_recipe_5000 \\
      --spec=experiments/specs/listops_recipe.py [--within=1.5] [--seeds]
"""
from __future__ import annotations

import statistics

from absl import app, flags

from lra_sparse import tables

ROOT = flags.DEFINE_string("root", None, "Directory of run directories.", required=True)
SPEC = flags.DEFINE_string("spec", None, "Table spec (PATH[:PRESET]).", required=True)
WITHIN = flags.DEFINE_float("within", 1.5, "Points of test accuracy: a seed is stable when "
                            "its last-step test is at most this far below its best-val test.")
SEEDS = flags.DEFINE_boolean("seeds", False, "Also print one line per run.")


def _mean_std(values: list[float]) -> str:
  if not values:
    return "—"
  if len(values) == 1:
    return f"{values[0]:.2f}"
  return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def rows(root: str, spec: str, within: float) -> list[dict]:
  """One dict per table row: label, runs [(seed, last, best, best step, workdir)], others."""
  table = tables.load_table(spec)
  report = tables.Reporter(echo=False)
  last = {r.workdir: r for r in tables.find_runs(root, "test", report=report)}
  best = {r.workdir: r for r in tables.find_runs(root, "test_at_best_val", report=report)}
  out = []
  for row in table.rows:
    matched = [r for r in last.values()
               if tables.matches(r.config, row.match)
               and any(tables.matches(r.config, column.match) for column in table.columns)]
    runs, others = [], []
    for run in matched:
      if run.status != "finished" or best[run.workdir].value is None:
        others.append(f"{run.workdir.rsplit('/', 1)[-1]} ({run.status}, step {run.last_step})")
        continue
      runs.append((run.config.get("seed"), 100 * run.value, 100 * best[run.workdir].value,
                   run.workdir))
    runs.sort(key=lambda r: (r[0] is None, r[0]))
    out.append({"label": row.label, "runs": runs, "others": others,
                "stable": sum(b - l <= within for _, l, b, _ in runs)})
  return out


def main(argv):
  del argv
  within = WITHIN.value
  print(f"| row | n | last-step test | test at best val | seeds with last >= best-val - "
        f"{within:g} | per seed: last / best-val |")
  print("|---|---|---|---|---|---|")
  for row in rows(ROOT.value, SPEC.value, within):
    if not row["runs"] and not row["others"]:
      continue
    runs = row["runs"]
    per_seed = "; ".join(f"{seed}: {l:.2f} / {b:.2f}" for seed, l, b, _ in runs)
    if row["others"]:
      per_seed += ("; " if per_seed else "") + "not finished: " + ", ".join(row["others"])
    print(f"| {row['label']} | {len(runs)} | {_mean_std([l for _, l, _, _ in runs])} | "
          f"{_mean_std([b for _, _, b, _ in runs])} | {row['stable']} of {len(runs)} | "
          f"{per_seed} |")
    if SEEDS.value:
      for seed, l, b, workdir in runs:
        print(f"|  seed {seed} | | {l:.2f} | {b:.2f} | {'yes' if b - l <= within else 'no'} "
              f"| {workdir} |")


if __name__ == "__main__":
  app.run(main)
