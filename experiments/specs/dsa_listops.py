"""DSA under its paper's protocol on ListOps: fine-tuned from each seed's dense run, with the
Eq. 6 weight chosen by validation and a fine-tune learning rate no higher than the dense run's.

The DSA paper fine-tunes DSA from a trained dense Transformer with the joint loss (Sec. 4.2:
task loss + lambda * L_MSE, Eq. 6 summing the squared score error over every real pair, about
10^6 per head at length 2000) and never states lambda. Its own tasks are Text, Retrieval and
Image (``dsa_table2.py``, ``dsa_sparsity.py``); ListOps is the task these machines can
generate at LRA's size, so the paper's tables are rebuilt here on it.

Dense base: ``configs/listops.py:stable`` (LRA's config with the peak learning rate halved, the
stable option of ``experiments/results/listops_recipe_notes.md``), 5000 steps, 3 seeds. Fine-tune:
FINETUNE_STEPS with a WARMUP-step rsqrt warmup whose peak equals the dense run's learning rate
at its last step (``finetune_learning_rate``), so the fine-tune never steps harder than the
dense run ended; the predictor (sigma 0.25) starts fresh, the rest loads from the dense run.

Presets:
  "weight": DSA-90 at each Eq. 6 weight in WEIGHTS (seeds 0 and 1); the table shows validation
    accuracy at the last step. ``scripts/pick_dsa_weight.py`` applies ``pick_mse_weight`` to
    these runs (validation accuracy, then the predictor's validation hit rate where the
    accuracies lie within the validation split's noise) and writes MSE_WEIGHT here.
  "" (sparsity): DSA at 90 / 95 / 99% with the UPDATE the "mse" preset chose, and each
    sparsity with an untrained predictor (weight 0: its random projection and random W~ pick
    keys unrelated to the scores, this codebase's stand-in for the paper's random mask of the
    same density), 3 seeds.
  "table2": the paper's Table 2 grid at DSA-90: sigma x predictor precision (INT2 / 4 / 8,
    FP32), with UPDATE, 3 seeds.
  "granularity": fine-grained DSA-90 / 95 (the paper's rule) against the block rule at the
    same sparsities (``attention.dsa.granularity="block"``, 64 x 64 blocks ranked by the mean
    predicted score of the block pair), with MSE_WEIGHT, 3 seeds: what block granularity, the
    structure tile-skipping kernels need, costs in accuracy (the runs also log the predictor's
    hit rate and, for blocks, the share of real pairs kept).
  "mse": how L_MSE should reach the model, DSA-90, 3 seeds (it chose UPDATE, below). The weight
    preset showed that neither the predictor's hit rate nor the cross-entropy moves with the
    Eq. 6 weight (Adam): in the joint update Eq. 6 (10^6 x the cross-entropy at the start even at
    weight 1e-6) pulls the model towards a fresh, random predictor at every weight. Rows: the
    joint update at MSE_WEIGHT, as autodiff of the joint loss has it (L_MSE's gradient reaches
    q/k through S and every layer below through the predictor's input X), the same at the
    JOINT_SMALL_WEIGHTS, and with X kept out (``attention.dsa.mse_input_gradient=False``); the
    predictor-only update (PREDICTOR_ONLY: S a fixed target, X without gradient, so only W~
    learns from L_MSE); the predictor-only update after WARM_STEPS of a predictor warm-up on
    dense attention (a "warm" stage from the dense run: DSA at sparsity 0, predictor-only, so
    the first sparse step selects with a trained predictor), fine and 64 x 64 block selection.
    The warm rows train WARM_STEPS more steps in all. The first run of this preset
    (``dsa_listops_mse_input_leak/``) ran before ``mse_input_gradient`` existed: its
    "predictor-only" runs let L_MSE reach X.
  "best_val", "weight_best_val", "table2_best_val", "granularity_best_val", "mse_best_val": the
    same runs, test at the best validation step.
  "granularity_hit_rate": the granularity runs' predictor hit rate on the validation split at
    the last step (the share of the keys each rule keeps that the same rule on the real scores
    keeps too).
  "sparsity_table2": the sparsity and table2 presets in one sweep (a sweep preset only): one set
    of dense bases, then the sparsity preset's 18 fine-tunes, then table2's grid less its sigma
    0.25 / FP32 cell, which is the sparsity preset's DSA-90 config value for value. The dense
    bases' checkpoints do not outlive a device machine and their reruns differ (GPU sums in no
    fixed order), so fine-tunes belong in a table only beside the dense runs they started
    from: this preset spends the dense bases once on both tables. Both tables build from its
    root: ``--spec=experiments/specs/dsa_listops.py`` and ``...:table2`` (each run fills one
    cell of one table, DSA-90 one of each).
  "tiny": the sparsity preset at DSA-90 only, one seed, on ``make demo``'s ListOps (a CPU).
Until the "weight" preset has run, MSE_WEIGHT is a placeholder and the tables' titles say so
(MSE_WEIGHT_MEASURED).

Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/dsa_listops.py[:PRESET] \\
          --root=runs/dsa_listops --parallel=gpus
Table:  python -m lra_sparse.tables --root=runs/dsa_listops \\
          --spec=experiments/specs/dsa_listops.py[:PRESET] --format=markdown
"""
import math
import os
from typing import Mapping, Sequence

from experiments.specs._tiny import tiny_steps
from lra_sparse.sweep import Group, Ref, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2)
WEIGHT_SEEDS = (0, 1)
PRESETS = ("", "best_val", "weight", "weight_best_val", "table2", "table2_best_val",
           "granularity", "granularity_best_val", "granularity_hit_rate", "mse", "mse_best_val",
           "mse_hit_rate", "sparsity_table2", "tiny")
SWEEP_ONLY = ("sparsity_table2",)
GRANULARITY_SPARSITIES = (0.9, 0.95)
BLOCK = {"attention.dsa.granularity": "block", "attention.dsa.block_size": 64}
DENSE_CONFIG = "configs/listops.py:stable"
DENSE_LEARNING_RATE, DENSE_STEPS = 0.025, 5000          # configs/listops.py:stable
FINETUNE_STEPS, WARMUP = 1000, 100
WARM_STEPS = 500           # "mse": the predictor warm-up on dense attention
# "mse": the joint update (X's gradient kept, plain autodiff) also at weights below the
# "weight" grid, where the task loss and L_MSE pull q/k with comparable force (by the logged
# sizes of the two terms, about 1e-12 at a fine-tune's start and 1e-8 at its end): the
# paper's literal protocol, at the weights it could have used.
JOINT_SMALL_WEIGHTS = (1e-12, 1e-10, 1e-8)
# Two decades apart (measured: across this grid the weight hardly changes a run, see
# experiments/results/dsa_listops_notes.md).
WEIGHTS = (1e-6, 1e-4, 1e-2, 1.0)
# One standard error of a validation accuracy near 0.35 on LRA's 2000 ListOps validation
# examples (sqrt(0.35 * 0.65 / 2000) = 0.0107): weights whose accuracies differ by less are not
# told apart by accuracy.
VAL_NOISE = 0.01
MSE_WEIGHT = 1e-06          # written by scripts/pick_dsa_weight.py --write_spec
MSE_WEIGHT_MEASURED = True
SPARSITIES = (0.9, 0.95, 0.99)
SIGMAS = (0.1, 0.16, 0.2, 0.25, 0.33)
PRECISIONS = (("INT2", 2), ("INT4", 4), ("INT8", 8), ("FP32", 0))
# "predictor": L_MSE trains W~ alone (S a fixed target, the block input X without its gradient).
PREDICTOR_ONLY = {"attention.dsa.mse_gradient": "predictor",
                  "attention.dsa.mse_input_gradient": False}
# How the sparsity and table2 presets fine-tune, chosen by the "mse" preset's runs
# (experiments/results/dsa_listops_notes.md, 3 seeds, DSA-90 from dense): the predictor-only
# update kept its dense bases' accuracy (34.83 +- 0.08 test against 34.97 +- 0.31, hit rate
# 89-92%), while the joint update at MSE_WEIGHT collapsed one seed of three with X's gradient
# (26.15 +- 7.68) and two without it (29.80 +- 4.27). The loss is still the paper's joint
# loss; only where L_MSE's gradient goes differs (the paper does not say). Its weight then
# scales only W~'s gradient, which Adam normalises: 1.0, as those runs had it. The "weight"
# and "granularity" presets ran the joint update at MSE_WEIGHT and keep it. Untested: the
# joint update at weights below the "weight" grid (1e-12..1e-8, where the task loss would
# drive q and k again), the paper's literal reading.
UPDATE = {**PREDICTOR_ONLY, "attention.dsa.mse_weight": 1.0}
UNTRAINED = {**PREDICTOR_ONLY, "attention.dsa.mse_weight": 0.0}
DSA = {"attention.kind": "dsa", "attention.dsa.sigma": 0.25, "attention.dsa.quant_bits": 0,
       "attention.dsa.mse_normalization": "eq6"}


def finetune_learning_rate(dense_lr: float, dense_steps: int, warmup: int) -> float:
  """The rsqrt schedule's constant whose peak (at ``warmup``) equals the dense run's learning
  rate at its last step: c / sqrt(warmup) = dense_lr / sqrt(dense_steps)."""
  return dense_lr * math.sqrt(warmup / dense_steps)


FINETUNE = {"num_train_steps": FINETUNE_STEPS, "optim.warmup_steps": WARMUP,
            "optim.learning_rate": finetune_learning_rate(DENSE_LEARNING_RATE, DENSE_STEPS,
                                                          WARMUP)}


def pick_mse_weight(measured: Mapping[float, Sequence[tuple[float, float]]]) -> float:
  """The Eq. 6 weight the "weight" preset's runs pick.

  ``measured`` maps each weight in WEIGHTS to one (validation accuracy, validation hit rate)
  pair per seed in WEIGHT_SEEDS, both at the last step. The weight with the highest mean
  accuracy wins, unless other weights' means lie within VAL_NOISE of it: then, of those, the
  one whose predictor's mean hit rate is highest (the predictor is what the weight trains),
  the smaller weight on a tie.
  """
  missing = [w for w in WEIGHTS if len(measured.get(w, ())) != len(WEIGHT_SEEDS)]
  extra = sorted(set(measured) - set(WEIGHTS))
  if missing or extra:
    raise ValueError(
        f"pick_mse_weight needs {len(WEIGHT_SEEDS)} finished runs (seeds {WEIGHT_SEEDS}) at "
        f"each weight of {WEIGHTS}; " + (f"incomplete: {missing}" if missing else "")
        + ("; " if missing and extra else "") + (f"not in WEIGHTS: {extra}" if extra else ""))
  mean = lambda values: sum(values) / len(values)  # noqa: E731
  accuracy = {w: mean([a for a, _ in measured[w]]) for w in WEIGHTS}
  hit_rate = {w: mean([h for _, h in measured[w]]) for w in WEIGHTS}
  best = max(accuracy.values())
  close = [w for w in WEIGHTS if accuracy[w] >= best - VAL_NOISE]
  return max(close, key=lambda w: (hit_rate[w], -w))


def _check(preset: str) -> str:
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for experiments/specs/dsa_listops.py; "
                     f"known: {', '.join(repr(p) for p in PRESETS)}")
  return preset.removesuffix("best_val").removesuffix("hit_rate").rstrip("_")


def _variants(kind: str) -> list[Variant]:
  if kind == "sparsity_table2":
    # The group leaves sigma and precision to the variants (table2's), so the sparsity rows
    # name DSA's own.
    own = {key: DSA[key] for key in ("attention.dsa.sigma", "attention.dsa.quant_bits")}
    sparsity = [Variant(v.label, {**own, **v.overrides}) for v in _variants("")]
    same_as_dsa90 = f"sigma{DSA['attention.dsa.sigma']:g}-FP32"
    return sparsity + [v for v in _variants("table2") if v.label != same_as_dsa90]
  if kind == "weight":
    return [Variant(f"w{w:g}", {"attention.dsa.sparsity": 0.9,
                                "attention.dsa.mse_weight": w}) for w in WEIGHTS]
  if kind == "table2":
    return [Variant(f"sigma{s:g}-{name}", {"attention.dsa.sparsity": 0.9,
                                           "attention.dsa.sigma": s,
                                           "attention.dsa.quant_bits": bits, **UPDATE})
            for s in SIGMAS for name, bits in PRECISIONS]
  if kind == "mse":
    predictor = {"attention.dsa.sparsity": 0.9, **UPDATE}
    dense = {"init_from": Ref("dense")}
    joint = {"attention.dsa.sparsity": 0.9, "attention.dsa.mse_weight": MSE_WEIGHT, **dense}
    return [Variant("dsa90-joint", joint),
            *[Variant(f"dsa90-joint-w{w:g}", {**joint, "attention.dsa.mse_weight": w})
              for w in JOINT_SMALL_WEIGHTS],
            Variant("dsa90-joint-no-x-grad", {**joint, "attention.dsa.mse_input_gradient": False}),
            Variant("dsa90-predictor", {**predictor, **dense}),
            Variant("dsa90-warm", {**predictor, "init_from": Ref("warm")}),
            Variant("dsa90-block-warm", {**predictor, **BLOCK, "init_from": Ref("warm")})]
  if kind == "granularity":
    return [Variant(f"dsa{round(100 * s)}" + ("-block" if block else ""),
                    {"attention.dsa.sparsity": s, "attention.dsa.mse_weight": MSE_WEIGHT,
                     **(BLOCK if block else {})})
            for s in GRANULARITY_SPARSITIES for block in (False, True)]
  sparsities = (0.9,) if kind == "tiny" else SPARSITIES
  return ([Variant(f"dsa{round(100 * s)}", {"attention.dsa.sparsity": s, **UPDATE})
           for s in sparsities]
          + [Variant(f"dsa{round(100 * s)}-random", {"attention.dsa.sparsity": s, **UNTRAINED})
             for s in sparsities])


def _fixed(kind: str) -> dict:
  """DSA's settings every fine-tune of the preset shares (table2's variants set the rest)."""
  varied = (("attention.dsa.sigma", "attention.dsa.quant_bits")
            if kind in ("table2", "sparsity_table2") else ())
  return {key: value for key, value in DSA.items() if key not in varied}


def get_sweep(preset: str = "") -> Sweep:
  kind = _check(preset)
  tiny = kind == "tiny"
  seeds = (0,) if tiny else WEIGHT_SEEDS if kind == "weight" else SEEDS
  config = "configs/listops.py:tiny" if tiny else DENSE_CONFIG
  warm = [] if kind != "mse" else [
      Group(name="warm", config=config, seeds=seeds,
            overrides={**_fixed(kind), "init_from": Ref("dense"), **FINETUNE,
                       "num_train_steps": WARM_STEPS, "attention.dsa.sparsity": 0.0,
                       **UPDATE})]
  return Sweep(
      name="dsa_listops" + (f"_{kind}" if kind else ""),
      groups=[Group(name="dense", config=config, seeds=seeds,
                    overrides={"attention.kind": "dense", **(tiny_steps(30) if tiny else {})}),
              *warm,
              Group(name="dsa", config=config, seeds=seeds,
                    overrides={**_fixed(kind),
                               **({} if kind == "mse" else {"init_from": Ref("dense")}),
                               **(tiny_steps(10) if tiny else FINETUNE)},
                    variants=_variants(kind))])


def _hit_rate_table(title: str, rows: list[Selector], columns: list[Selector],
                    suffix: str = "") -> Table:
  return Table(title=f"{title}: the predictor's validation hit rate (%) at the last step{suffix}",
               split="val", metric="dsa_hit_rate", rows=rows, columns=columns)


def get_table(preset: str = "") -> Table:
  kind = _check(preset)
  if kind in SWEEP_ONLY:
    raise ValueError(f"experiments/specs/dsa_listops.py:{preset} is a sweep preset with no "
                     "table of its own: build its tables with the presets '' (sparsity) and "
                     "'table2' on its root")
  best_val = preset.endswith("best_val")
  split = "test_at_best_val" if best_val else "test"
  placeholder = "" if MSE_WEIGHT_MEASURED else f" [Eq. 6 weight {MSE_WEIGHT:g}: not yet measured]"
  column = [Selector("ListOps", {"task": "listops"})]
  finetuned = {"init_from": lambda path: bool(path)}
  if kind == "weight":
    return Table(
        title=("DSA-90 fine-tuned from dense on ListOps at each Eq. 6 weight: validation "
               "accuracy (%) at the last step (picks the weight)"),
        split="val", columns=column,
        rows=[Selector(f"weight {w:g}", {**DSA, **finetuned, "attention.dsa.sparsity": 0.9,
                                         "attention.dsa.granularity": "fine",
                                         "attention.dsa.mse_gradient": "joint",
                                         "attention.dsa.mse_weight": w}) for w in WEIGHTS])
  if kind == "table2":
    return Table(
        title=("DSA Table 2 on ListOps: DSA-90 fine-tuned from dense, test accuracy (%) "
               + ("at the best validation step" if best_val else "at the last step")
               + placeholder),
        split=split,
        rows=[Selector(f"sigma {s:g}", {"attention.kind": "dsa", "attention.dsa.sigma": s,
                                        "attention.dsa.sparsity": 0.9, **UPDATE,
                                        **finetuned}) for s in SIGMAS],
        columns=[Selector(name, {"task": "listops", "attention.dsa.quant_bits": bits})
                 for name, bits in PRECISIONS])
  if kind == "mse":
    warmed = lambda path: os.path.basename(str(path)).startswith("warm__")  # noqa: E731
    unwarmed = lambda path: bool(path) and not warmed(path)                  # noqa: E731
    dsa90 = {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9}
    predictor = {**dsa90, **PREDICTOR_ONLY}
    joint = {**dsa90, "attention.dsa.mse_gradient": "joint", "attention.dsa.granularity": "fine",
             "init_from": unwarmed}
    rows = [
        *[Selector(f"DSA-90, joint update (Eq. 6 weight {w:g})",
                   {**joint, "attention.dsa.mse_input_gradient": True,
                    "attention.dsa.mse_weight": w})
          for w in (MSE_WEIGHT, *JOINT_SMALL_WEIGHTS)],
        Selector("DSA-90, joint update, L_MSE kept from the block input X",
                 {**joint, "attention.dsa.mse_input_gradient": False}),
        Selector("DSA-90, predictor-only L_MSE",
                 {**predictor, "attention.dsa.granularity": "fine", "init_from": unwarmed}),
        Selector(f"DSA-90, predictor-only, after a {WARM_STEPS}-step predictor warm-up",
                 {**predictor, "attention.dsa.granularity": "fine", "init_from": warmed}),
        Selector("DSA-90 64 x 64 blocks, predictor-only, after the warm-up",
                 {**predictor, "attention.dsa.granularity": "block", "init_from": warmed})]
    if preset.endswith("hit_rate"):
      return _hit_rate_table("How L_MSE reaches the model, DSA-90 fine-tuned from dense on "
                             "ListOps", rows, column)
    rows = [Selector("Dense (the base runs)", {"attention.kind": "dense"}),
            Selector(f"Predictor warm-up ({WARM_STEPS} steps on dense attention)",
                     {"attention.kind": "dsa", "attention.dsa.sparsity": 0.0, **PREDICTOR_ONLY}),
            *rows]
    return Table(
        title=("How L_MSE reaches the model, DSA-90 fine-tuned from dense on ListOps: test "
               "accuracy (%) " + ("at the best validation step" if best_val else
                                  "at the last step")),
        split=split, rows=rows, columns=column)
  if kind == "granularity":
    rows = [Selector("Dense (the base runs)", {"attention.kind": "dense"})]
    for s in GRANULARITY_SPARSITIES:
      for block in (False, True):
        rows.append(Selector(
            f"DSA-{round(100 * s)}, " + ("64 x 64 blocks" if block else "fine-grained"),
            {"attention.kind": "dsa", "attention.dsa.sparsity": s,
             "attention.dsa.mse_weight": MSE_WEIGHT,
             "attention.dsa.granularity": "block" if block else "fine", **finetuned}))
    if preset.endswith("hit_rate"):
      return _hit_rate_table("DSA fine-tuned from dense on ListOps, fine-grained against block "
                             "selection", rows[1:], column, placeholder)
    return Table(
        title=("DSA fine-tuned from dense on ListOps, fine-grained against block selection: "
               "test accuracy (%) " + ("at the best validation step" if best_val else
                                       "at the last step") + placeholder),
        split=split, rows=rows, columns=column)
  sparsities = (0.9,) if kind == "tiny" else SPARSITIES
  rows = [Selector("Dense (the base runs)", {"attention.kind": "dense"})]
  # DSA's sigma and precision pinned: a root of "sparsity_table2" holds table2's grid too.
  own = {**DSA, **finetuned}
  for s in sparsities:
    rows.append(Selector(f"DSA-{round(100 * s)}", {
        **own, "attention.dsa.sparsity": s, **UPDATE}))
    rows.append(Selector(f"DSA-{round(100 * s)}, untrained predictor", {
        **own, "attention.dsa.sparsity": s, **UNTRAINED}))
  return Table(
      title=("DSA fine-tuned from dense on ListOps by sparsity: test accuracy (%) "
             + ("at the best validation step" if best_val else "at the last step")
             + placeholder + (" [tiny CPU variant]" if kind == "tiny" else "")),
      split=split, rows=rows, columns=column)
