"""Self-pretraining (SPT) then fine-tuning, per attention kind: does sparsity keep SPT's gain?

Amos, Berant and Gupta ("Never Train from Scratch", ICLR 2024) pretrain on the task's own
training inputs with a denoising objective and then fine-tune; a vanilla Transformer then
matches S4 on LRA. Here every kind (dense, DFSS 2:4, DSA-90, Nystromformer) runs both stages:

1. ``pretrain-<task>``: the task's config with ``objective="denoise"`` (masked tokens, BERT's
   15% / 80-10-10, labels unused; ``lra_sparse/objectives.py``) and ``model.mask_token=True``.
   DSA's predictor trains here too (its L_MSE term is on, mean form as in ``lra_listops``).
2. ``finetune-<task>-<kind>``: the task's classification config from the same kind's pretrain
   run of the same seed (``init_from``: every encoder parameter, the mask token's embedding row
   included; the LM head is dropped and the classifier head starts fresh), the mask token
   kept so the embedding loads.

ListOps fine-tunes on the stable recipe (``configs/listops.py:stable``, the peak learning rate
halved: ``experiments/results/listops_recipe_notes.md``); Pathfinder-32 on its LRA config.
Attention dropout is the configs' (LRA's 0.1). PRETRAIN_STEPS are a first choice, not yet
chosen by the measured curve (fine-tuned accuracy against pretraining steps) the issue asks
for. The from-scratch rows to compare with are ``lra_listops`` (ListOps) and ``lra_pixels``.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/self_pretraining.py \\
          --root=runs/self_pretraining --parallel=gpus
Table:  python -m lra_sparse.tables --root=runs/self_pretraining \\
          --spec=experiments/specs/self_pretraining.py --format=markdown
Presets: "" (ListOps at LRA size and Pathfinder-32, 3 seeds); "best_val" (the same runs, test at
the best validation step); "curve" and "curve_best_val" (how many pretraining steps: ListOps,
dense and DFSS 2:4, seed 0, pretrained CURVE_STEPS steps each (warmup: 1000 steps or a fifth
of a shorter run) then fine-tuned; rows are the pretraining lengths); "tiny" (``make demo``'s
ListOps on a CPU, a few steps per stage, one seed, dense and DSA-90: the pipeline end to end,
run by ``make test``).
"""
from experiments.specs._tiny import tiny_steps
from lra_sparse.sweep import Group, Ref, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2)
TINY_SEED = (0,)
PRESETS = ("", "best_val", "curve", "curve_best_val", "tiny")
CURVE_STEPS = (500, 1000, 2500, 5000, 10000)
CURVE_KINDS = ("dense", "dfss2-4")
KINDS = (  # (run-name label, row label, attention overrides)
    ("dense", "Transformer (dense)", {"attention.kind": "dense"}),
    ("dfss2-4", "DFSS 2:4", {"attention.kind": "dfss", "attention.dfss.nm": "2:4"}),
    ("dsa90", "DSA-90 (sigma 0.25, mean-form L_MSE)",
     {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9, "attention.dsa.sigma": 0.25,
      "attention.dsa.mse_normalization": "scaled_mean"}),
    ("nystrom", "Nystromformer", {"attention.kind": "nystrom", "attention.nystrom.nm": ""}),
)
TASKS = (  # (name, column label, pretrain config, fine-tune config, pretraining steps)
    ("listops", "ListOps", "configs/listops.py", "configs/listops.py:stable", 5000),
    ("pathfinder32", "Pathfinder-32", "configs/pathfinder.py", "configs/pathfinder.py", 20000),
)
PRETRAIN = {"objective": "denoise", "model.mask_token": True}
FINETUNE = {"objective": "classify", "model.mask_token": True}


def _check(preset: str) -> bool:
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for experiments/specs/self_pretraining.py; "
                     f"known: {', '.join(repr(p) for p in PRESETS)}")
  return preset == "tiny"


def _warmup(steps: int) -> int:
  """The config's 1000 warmup steps, or a fifth of a shorter pretraining (so that it reaches
  its peak learning rate)."""
  return min(1000, steps // 5)


def _curve_sweep() -> Sweep:
  """ListOps: each of CURVE_KINDS pretrained for each of CURVE_STEPS, then fine-tuned."""
  _, _, pretrain_config, finetune_config, _ = TASKS[0]
  kinds = [(label, overrides) for label, _, overrides in KINDS if label in CURVE_KINDS]
  groups = [Group(name="pretrain", config=pretrain_config, overrides=PRETRAIN,
                  variants=[Variant(f"{label}-{steps}", {**overrides, "num_train_steps": steps,
                                                         "optim.warmup_steps": _warmup(steps)})
                            for label, overrides in kinds for steps in CURVE_STEPS],
                  seeds=(0,))]
  for label, overrides in kinds:
    for steps in CURVE_STEPS:
      groups.append(Group(
          name=f"finetune-{label}-after-{steps}", config=finetune_config,
          overrides={**FINETUNE, **overrides,
                     "init_from": Ref("pretrain", same=("seed",),
                                      match={**overrides, "num_train_steps": steps})},
          seeds=(0,)))
  return Sweep(name="self_pretraining_curve", groups=groups)


def _curve_table(best_val: bool) -> Table:
  def pretrained_for(steps):
    return lambda path: bool(path) and path.rstrip("/").split("/")[-1].startswith(
        f"pretrain__listops__") and f"-{steps}__seed=" in path
  return Table(
      title=("ListOps fine-tuned after self-pretraining for a number of steps (rows), seed 0: "
             "test accuracy (%) " + ("at the best validation step" if best_val
                                     else "at the last step")),
      split="test_at_best_val" if best_val else "test",
      rows=[Selector(f"pretrained {steps} steps", {**FINETUNE, "init_from": pretrained_for(steps)})
            for steps in CURVE_STEPS],
      columns=[Selector(row, overrides) for label, row, overrides in KINDS
               if label in CURVE_KINDS])


# The tiny CPU preset runs two kinds end to end (dense and DSA, whose predictor and sown
# statistics are the most to carry through both stages); every kind's denoising step trains
# in-process in tests/test_self_pretraining.py.
TINY_KINDS = ("dense", "dsa90")


def _kinds(tiny: bool):
  return [kind for kind in KINDS if not tiny or kind[0] in TINY_KINDS]


def _tasks(tiny: bool):
  if tiny:
    return (("listops", "ListOps", "configs/listops.py:tiny", "configs/listops.py:tiny", 0),)
  return TASKS


def get_sweep(preset: str = "") -> Sweep:
  tiny = _check(preset)
  if preset.startswith("curve"):
    return _curve_sweep()
  groups = []
  for task, _, pretrain_config, finetune_config, steps in _tasks(tiny):
    pretrain_steps = tiny_steps(12) if tiny else {"num_train_steps": steps}
    groups.append(Group(
        name=f"pretrain-{task}", config=pretrain_config,
        overrides={**PRETRAIN, **pretrain_steps},
        variants=[Variant(label, overrides) for label, _, overrides in _kinds(tiny)],
        seeds=TINY_SEED if tiny else SEEDS))
    for label, _, overrides in _kinds(tiny):
      groups.append(Group(
          name=f"finetune-{task}-{label}", config=finetune_config,
          overrides={**FINETUNE, **overrides, **(tiny_steps(8) if tiny else {}),
                     "init_from": Ref(f"pretrain-{task}", same=("seed",), match=overrides)},
          seeds=TINY_SEED if tiny else SEEDS))
  return Sweep(name="self_pretraining" + ("_tiny" if tiny else ""), groups=groups)


def get_table(preset: str = "") -> Table:
  tiny = _check(preset)
  best_val = preset.endswith("best_val")
  if preset.startswith("curve"):
    return _curve_table(best_val)
  return Table(
      title=("Self-pretrained (denoising) then fine-tuned, per attention kind: test accuracy (%) "
             + ("at the best validation step" if best_val else "at the last step")
             + (" [tiny CPU variant]" if tiny else "")),
      split="test_at_best_val" if best_val else "test",
      rows=[Selector(f"{row} + SPT", {**overrides, **FINETUNE,
                                      "init_from": lambda path: bool(path)})
            for _, row, overrides in _kinds(tiny)],
      columns=[Selector(label, {"task": task.removesuffix("32")})
               for task, label, *_ in _tasks(tiny)])
