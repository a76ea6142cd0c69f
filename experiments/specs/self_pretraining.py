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
Attention dropout is the configs' (LRA's 0.1). Both stages compute in bfloat16 (parameters
float32, the fused kernels: a 5000-step ListOps stage costs about 4 GPU-minutes), and every
kind also trains from scratch on the fine-tune's exact config (``scratch-<task>-<kind>``: same
dtype, dropout, recipe and mask-token row, no ``init_from``), so each "+ SPT" row has its own
from-scratch row beside it. PRETRAIN_STEPS are a first choice; the ``curve`` preset measures
fine-tuned accuracy against pretraining steps.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/self_pretraining.py \\
          --root=runs/self_pretraining --parallel=gpus
Table:  python -m lra_sparse.tables --root=runs/self_pretraining \\
          --spec=experiments/specs/self_pretraining.py --format=markdown
Presets:
- "" (ListOps at LRA size and Pathfinder-32, 3 seeds: pretrain, fine-tune and from scratch per
  kind); "best_val" (the same runs, test at the best validation step); "pretrain_val" (the same
  runs: the pretraining stage's masked-token accuracy on the validation split, per kind);
- "curve" and "curve_best_val" (how many pretraining steps: ListOps, dense, seed 0, pretrained
  CURVE_STEPS steps each (warmup: 1000 steps or a fifth of a shorter run) then fine-tuned; rows
  are the pretraining lengths);
- "pretrain_recipe" (what lets a softmax-attention Transformer learn the denoising task on
  ListOps at all: RECIPE_STEPS steps of pretraining, seed 0, one variant per RECIPE_VARIANTS
  row (dense ones, and Nystromformer with and without its conv skip), each then fine-tuned,
  and each architecture from scratch; the table is the denoising accuracy on the validation
  split); "pretrain_recipe_finetune" and "pretrain_recipe_finetune_best_val" (the same runs:
  test accuracy of the fine-tunes and from-scratch runs); "long_finetune" and
  "long_finetune_best_val" (LONG_FINETUNE_VARIANTS pretrained as there, fine-tuned and from
  scratch for LONG_FINETUNE_STEPS: does the gain grow with the fine-tune's length?);
- "conv_probe", "conv_probe_best_val", "conv_probe_pretrain_val" (CONV_PROBE_VARIANTS, dense
  with Nystromformer's conv skip on V with and without rotary positions, pretrained as
  pretrain_recipe, fine-tuned and from scratch for LONG_FINETUNE_STEPS);
- "rotary_long", "rotary_long_best_val", "rotary_long_pretrain_val" (the main sweep on ListOps
  with what the recipe study measured: rotary positions for the softmax kinds,
  LONG_PRETRAIN_STEPS of pretraining, LONG_FINETUNE_STEPS of fine-tuning and from scratch;
  3 seeds); "conv_long", "conv_long_best_val", "conv_long_pretrain_val" (the same with what
  conv_probe measured: the softmax kinds also with Nystromformer's conv skip on V);
  "conv_pathfinder", "conv_pathfinder_best_val", "conv_pathfinder_pretrain_val" (conv_long's
  architectures on Pathfinder-32, PATHFINDER_PRETRAIN_EPOCHS of pretraining and
  PATHFINDER_FINETUNE_EPOCHS of fine-tuning and from scratch, 3 seeds); "nystrom_pathx",
  "nystrom_pathx_best_val", "nystrom_pathx_pretrain_val" (Path-X with Nystromformer only, seed
  0, PATHX_PRETRAIN_EPOCHS and PATHX_FINETUNE_EPOCHS);
- "conv_curve", "conv_curve_best_val" (the curve on conv_long's recipe: dense with rotary
  positions and the conv skip on V, pretrained CURVE_STEPS steps, each fine-tuned for
  conv_long's LONG_FINETUNE_STEPS; is conv_long's 2500 enough?);
- "dsa_from_dense", "dsa_from_dense_best_val" (DSA-90 with conv_long's fields fine-tuned from
  conv_long's dense pretraining of the same seed, 3 seeds: is DSA-90's small SPT gain in
  conv_long its own pretraining, or fine-tuning with 10% of the keys?);
- "tiny" (``make demo``'s ListOps on a CPU, a few steps per stage, one seed, dense and DSA-90:
  the pipeline end to end, run by ``make test``).

Why the recipe preset: in the first runs (``experiments/results/self_pretraining_notes.md``)
dense, DFSS 2:4 and DSA-90 ended pretraining at the context-free level (22.2% validation
accuracy: the unmasked tokens copied, the most frequent token, "]", at 14.2% of tokens,
everywhere else) for 5000 and 10000 steps, and their fine-tunes gained 1-2 points; only
Nystromformer, whose value path has a depthwise convolution along the sequence, learned from
context (26.1%) and gained 7.3 points.
"""
import dataclasses

from experiments.specs._tiny import tiny_steps
from lra_sparse.sweep import Group, Ref, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2)
TINY_SEED = (0,)
PRESETS = ("", "best_val", "pretrain_val", "curve", "curve_best_val", "pretrain_recipe",
           "pretrain_recipe_finetune", "pretrain_recipe_finetune_best_val", "long_finetune",
           "long_finetune_best_val", "conv_probe", "conv_probe_best_val",
           "conv_probe_pretrain_val", "rotary_long", "rotary_long_best_val",
           "rotary_long_pretrain_val", "conv_long", "conv_long_best_val",
           "conv_long_pretrain_val", "conv_pathfinder", "conv_pathfinder_best_val",
           "conv_pathfinder_pretrain_val", "nystrom_pathx", "nystrom_pathx_best_val",
           "nystrom_pathx_pretrain_val", "dsa_from_dense", "dsa_from_dense_best_val", "conv_curve",
           "conv_curve_best_val", "tiny")
CURVE_STEPS = (1000, 2500, 5000, 10000)
CURVE_KINDS = ("dense",)
KINDS = (  # (run-name label, row label, attention overrides)
    ("dense", "Transformer (dense)", {"attention.kind": "dense"}),
    ("dfss2-4", "DFSS 2:4", {"attention.kind": "dfss", "attention.dfss.nm": "2:4"}),
    ("dsa90", "DSA-90 (sigma 0.25, mean-form L_MSE)",
     {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9, "attention.dsa.sigma": 0.25,
      "attention.dsa.mse_normalization": "scaled_mean"}),
    ("nystrom", "Nystromformer", {"attention.kind": "nystrom", "attention.nystrom.nm": ""}),
)
# Relative time per training step (the sweep's step_cost: with several GPU slots the longest
# chain of runs launches first). DSA-90 ran ListOps at 10.9-11.6 steps/s where DFSS 2:4 ran at
# 42-43 (two runs per H200, self_pretraining_notes.md, conv_long); dense and Nystromformer were
# within 2x of DFSS. Launched in the spec's order, conv_long's DSA-90 rows started last and were
# the ones cut when the device budget ended.
STEP_COST = {"dense": 1, "dfss2-4": 1, "dsa90": 4, "nystrom": 1}
TASKS = (  # (name, column label, pretrain config, fine-tune config, pretraining steps)
    ("listops", "ListOps", "configs/listops.py", "configs/listops.py:stable", 5000),
    ("pathfinder32", "Pathfinder-32", "configs/pathfinder.py", "configs/pathfinder.py", 20000),
)
# Path-X (16384 tokens) only in its own preset (nystrom_pathx): no other kind trains it cheaply.
PATHX_TASK = ("pathx", "Path-X", "configs/pathx.py", "configs/pathx.py", None)
# The pretrain_recipe preset: each variant pretrains one architecture (RECIPE_ARCHS: the
# fields a fine-tune inherits) with some pretraining-only fields (learning rate, dropout); each
# pretraining run sets every field of RECIPE_FIELDS (the rest are the first runs' values), so
# that each table row matches its run and no other. Two Nystromformer rows test whether its
# conv skip (a fixed local window on V) is what lets it learn. Every variant is then fine-tuned
# (RECIPE_FINETUNE_STEPS, the fine-tune's config otherwise), and every architecture trains from
# scratch on that same fine-tune config: the gain, not only the denoising accuracy, picks.
RECIPE_STEPS = 2500
RECIPE_FINETUNE_STEPS = 2500
RECIPE_FIELDS = {"attention.kind": "dense", "model.pos_emb": "sinusoidal",
                 "optim.learning_rate": 0.05, "model.dropout_rate": 0.1,
                 "model.attention_dropout_rate": 0.1}
_NYSTROM = {"attention.kind": "nystrom", "attention.nystrom.nm": ""}
# Nystromformer's conv skip on V (its LRA width, 35) for any kind: model.value_conv_kernel.
CONV_SKIP = {"model.value_conv_kernel": 35}
RECIPE_ARCHS = {  # label: (row label, fields over RECIPE_FIELDS' kind and positions)
    "sinusoidal": ("dense, sinusoidal positions", {}),
    "rotary": ("dense, rotary positions", {"model.pos_emb": "rotary"}),
    "learned": ("dense, learned positions", {"model.pos_emb": "learned"}),
    "nystrom": ("Nystromformer (conv skip of 35)",
                {**_NYSTROM, "attention.nystrom.conv_kernel": 35}),
    "nystrom-noconv": ("Nystromformer without its conv skip",
                       {**_NYSTROM, "attention.nystrom.conv_kernel": 0}),
    "conv": ("dense, sinusoidal positions, conv skip of 35 on V", CONV_SKIP),
    "rotary-conv": ("dense, rotary positions, conv skip of 35 on V",
                    {"model.pos_emb": "rotary", **CONV_SKIP}),
}
RECIPE_VARIANTS = (  # (run-name label, row label, architecture, pretraining-only fields)
    ("first", "dense as the first runs (sinusoidal positions, LRA's 0.05 rsqrt)",
     "sinusoidal", {}),
    ("rotary", "dense, rotary positions", "rotary", {}),
    ("learned", "dense, learned positions", "learned", {}),
    ("lr0.01", "dense, peak learning rate / 5 (0.01 rsqrt)", "sinusoidal",
     {"optim.learning_rate": 0.01}),
    ("rotary-lr0.01", "dense, rotary, 0.01 rsqrt", "rotary", {"optim.learning_rate": 0.01}),
    ("rotary-lr0.2", "dense, rotary, 0.2 rsqrt (x4)", "rotary", {"optim.learning_rate": 0.2}),
    ("rotary-nodropout", "dense, rotary, no dropout", "rotary",
     {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}),
    ("nystrom", "Nystromformer (conv skip of 35, as the first runs)", "nystrom", {}),
    ("nystrom-noconv", "Nystromformer without its conv skip", "nystrom-noconv", {}),
)
# The conv_probe preset: does Nystromformer's conv skip on V (model.value_conv_kernel, the
# local path that let Nystromformer learn the denoising task) carry SPT's gain to dense
# softmax attention, alone or with rotary positions? Pretrained as pretrain_recipe, fine-tuned
# and from scratch for LONG_FINETUNE_STEPS, seed 0. Rotary alone at that length is rotary_long's
# dense seed 0 (the same configs); in one sweep with rotary-conv its fine-tune's init_from
# would match both pretrainings.
CONV_PROBE_VARIANTS = (
    ("conv", "dense, sinusoidal positions, conv skip of 35 on V", "conv", {}),
    ("rotary-conv", "dense, rotary positions, conv skip of 35 on V", "rotary-conv", {}),
)
# The long_finetune preset: the variants that left the context-free level, pretrained as in
# pretrain_recipe and fine-tuned (and trained from scratch) for LONG_FINETUNE_STEPS.
LONG_FINETUNE_VARIANTS = ("rotary", "nystrom")
LONG_FINETUNE_STEPS = 10000


def _recipe_pretrain_fields(arch: str, fields) -> dict:
  return {**RECIPE_FIELDS, **RECIPE_ARCHS[arch][1], **fields}


def _recipe_arch_fields(arch: str) -> dict:
  return {"attention.kind": RECIPE_FIELDS["attention.kind"],
          "model.pos_emb": RECIPE_FIELDS["model.pos_emb"], **RECIPE_ARCHS[arch][1]}


def _with_conv(fields: dict) -> dict:
  """A table match: ``fields`` and the conv skip on V they set (0 unless they set it), so that
  a row without the conv never holds a run with it."""
  return {"model.value_conv_kernel": 0, **fields}


PRETRAIN = {"objective": "denoise", "model.mask_token": True}
FINETUNE = {"objective": "classify", "model.mask_token": True}
COMPUTE = {"model.dtype": "bfloat16"}   # both stages and the from-scratch rows (not :tiny)
# Masked-token accuracy (%) of copying a shown token and otherwise guessing the most frequent
# one, on LRA-size ListOps: where the first runs' softmax kinds stayed (the notes).
CONTEXT_FREE_LEVEL = 22.2


def _check(preset: str) -> bool:
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for experiments/specs/self_pretraining.py; "
                     f"known: {', '.join(repr(p) for p in PRESETS)}")
  return preset == "tiny"


def _warmup(steps: int) -> int:
  """The config's 1000 warmup steps, or a fifth of a shorter pretraining (so that it reaches
  its peak learning rate)."""
  return min(1000, steps // 5)


def _curve_setup(conv: bool):
  """(kinds [(label, row, overrides)], fine-tune overrides, sweep name) of a curve preset: the
  first protocol's ("curve"), or conv_long's fields and fine-tune length ("conv_curve")."""
  if not conv:
    return [kind for kind in KINDS if kind[0] in CURVE_KINDS], {}, "self_pretraining_curve"
  kinds, _, _, finetune_steps, _ = _setup("conv_long")
  return ([kind for kind in kinds if kind[0] in CURVE_KINDS], finetune_steps,
          "self_pretraining_conv_curve")


def _curve_sweep(conv: bool = False) -> Sweep:
  """ListOps: each of CURVE_KINDS pretrained for each of CURVE_STEPS, then fine-tuned."""
  _, _, pretrain_config, finetune_config, _ = TASKS[0]
  kinds, finetune_steps, name = _curve_setup(conv)
  groups = [Group(name="pretrain", config=pretrain_config, overrides={**PRETRAIN, **COMPUTE},
                  variants=[Variant(f"{label}-{steps}", {**overrides, "num_train_steps": steps,
                                                         "optim.warmup_steps": _warmup(steps)},
                                    step_cost=STEP_COST[label])
                            for label, _, overrides in kinds for steps in CURVE_STEPS],
                  seeds=(0,))]
  for label, _, overrides in kinds:
    for steps in CURVE_STEPS:
      groups.append(Group(
          name=f"finetune-{label}-after-{steps}", config=finetune_config,
          overrides={**FINETUNE, **COMPUTE, **overrides, **finetune_steps,
                     "init_from": Ref("pretrain", same=("seed",),
                                      match={**overrides, "num_train_steps": steps})},
          seeds=(0,), step_cost=STEP_COST[label]))
  return Sweep(name=name, groups=groups)


def _curve_table(best_val: bool, conv: bool = False) -> Table:
  def pretrained_for(steps):
    return lambda path: bool(path) and path.rstrip("/").split("/")[-1].startswith(
        "pretrain__listops__") and f"-{steps}__seed=" in path
  kinds, finetune_steps, _ = _curve_setup(conv)
  # conv_curve's column also matches the conv field (0 unless set), so that it never holds a
  # run without it (the first curve's runs predate the field: its column stays as it was)
  match = _with_conv if conv else dict
  return Table(
      title=("ListOps fine-tuned after self-pretraining for a number of steps (rows), seed 0"
             + (f", {LONG_PRESETS['conv_long'].title}, "
                f"{finetune_steps.get('num_train_steps')}-step fine-tunes" if conv else "")
             + ": test accuracy (%) "
             + ("at the best validation step" if best_val else "at the last step")),
      split="test_at_best_val" if best_val else "test",
      rows=[Selector(f"pretrained {steps} steps",
                     {**FINETUNE, **finetune_steps, "init_from": pretrained_for(steps)})
            for steps in CURVE_STEPS],
      columns=[Selector(row, match(overrides)) for _, row, overrides in kinds])


def _recipe_sweep(variants=RECIPE_VARIANTS, finetune_steps=RECIPE_FINETUNE_STEPS,
                  name="self_pretraining_recipe") -> Sweep:
  """Each variant pretrained RECIPE_STEPS steps and fine-tuned ``finetune_steps``; each of its
  architectures from scratch for ``finetune_steps`` on the fine-tune's config."""
  _, _, pretrain_config, finetune_config, _ = TASKS[0]
  groups = [Group(
      name="pretrain", config=pretrain_config,
      overrides={**PRETRAIN, **COMPUTE, "num_train_steps": RECIPE_STEPS,
                 "optim.warmup_steps": _warmup(RECIPE_STEPS)},
      variants=[Variant(label, _recipe_pretrain_fields(arch, fields))
                for label, _, arch, fields in variants],
      seeds=(0,))]
  finetune = {**FINETUNE, **COMPUTE, "num_train_steps": finetune_steps,
              "optim.warmup_steps": _warmup(finetune_steps)}
  for label, _, arch, fields in variants:
    groups.append(Group(
        name=f"finetune-{label}", config=finetune_config,
        overrides={**finetune, **_recipe_arch_fields(arch),
                   "init_from": Ref("pretrain", same=("seed",),
                                    match=_recipe_pretrain_fields(arch, fields))},
        seeds=(0,)))
  for arch in dict.fromkeys(arch for _, _, arch, _ in variants):
    groups.append(Group(name=f"scratch-{arch}", config=finetune_config,
                        overrides={**finetune, **_recipe_arch_fields(arch)}, seeds=(0,)))
  return Sweep(name=name, groups=groups)


def _long_finetune_variants():
  return [v for v in RECIPE_VARIANTS if v[0] in LONG_FINETUNE_VARIANTS]


def _recipe_table(variants=RECIPE_VARIANTS) -> Table:
  return Table(
      title=(f"ListOps denoising (self-pretraining), {RECIPE_STEPS} steps, seed 0: masked-token "
             f"accuracy (%) on the validation split (context-free level: {CONTEXT_FREE_LEVEL})"),
      split="val",
      rows=[Selector(row, _with_conv(_recipe_pretrain_fields(arch, fields)))
            for _, row, arch, fields in variants],
      columns=[Selector("ListOps", PRETRAIN)])


def _recipe_finetune_table(best_val: bool, variants=RECIPE_VARIANTS,
                           finetune_steps=RECIPE_FINETUNE_STEPS) -> Table:
  """Each architecture from scratch, then each pretraining variant fine-tuned (its row matches
  the fine-tune whose ``init_from`` is that variant's pretraining run)."""
  def pretrained_by(label):
    return lambda path: bool(path) and path.rstrip("/").split("/")[-1].startswith(
        f"pretrain__listops__{label}__seed=")
  finetune = {**FINETUNE, "num_train_steps": finetune_steps}
  rows = [Selector(f"{RECIPE_ARCHS[arch][0]}, from scratch",
                   _with_conv({**finetune, **_recipe_arch_fields(arch),
                               "init_from": lambda path: not path}))
          for arch in dict.fromkeys(arch for _, _, arch, _ in variants)]
  rows += [Selector(f"{row} + SPT",
                    _with_conv({**finetune, **_recipe_arch_fields(arch),
                                "init_from": pretrained_by(label)}),
                    versus={"vs scratch": f"{RECIPE_ARCHS[arch][0]}, from scratch"})
           for label, row, arch, _ in variants]
  return Table(
      title=(f"ListOps fine-tuned for {finetune_steps} steps after each pretraining "
             f"variant ({RECIPE_STEPS} steps), against each architecture from scratch, seed 0: "
             "test accuracy (%) " + ("at the best validation step" if best_val
                                     else "at the last step")),
      split="test_at_best_val" if best_val else "test",
      rows=rows, columns=[Selector("ListOps", {"task": "listops"})])


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


# The long presets: the main sweep again on ListOps with what the recipe study and conv_probe
# measured (self_pretraining_notes.md), LONG_PRETRAIN_STEPS of pretraining (each kind reaches
# its level by then: 25.8-26.0% at 2500 against 26.1% at 5000) and LONG_FINETUNE_STEPS for the
# fine-tunes and from-scratch rows (the gain appeared only after 5000). rotary_long gives the
# softmax kinds rotary positions in both stages (they left the context-free level only with
# them); conv_long also gives them Nystromformer's conv skip on V (with it, and only with it,
# dense gained 15-18 points in conv_probe; rotary alone gained 4). Nystromformer keeps its
# sinusoidal positions and its own conv skip in both: that is the config measured at +13, and
# rotating q and k before its landmark means would mix rotations of up to L/m positions.
# DSA's predictor sees the layer's inputs, without positions, while its target S is built
# from the rotated q and k.
ROTARY = {"model.pos_emb": "rotary"}
LONG_PRETRAIN_STEPS = 2500
SOFTMAX_KINDS = ("dense", "dfss2-4", "dsa90")
# conv_pathfinder: conv_long's architectures on Pathfinder-32 (the second task), at a
# length one 4-GPU lease holds for seed 0 of most kinds (one run per GPU; at the H100 step
# times of LRA's config with its attention dropout, 37.0 / 48.1 / 21.8 / 108.3 ms in
# experiments/reports/train_step/memory_h100.md, the three runs of a seed take about 13
# GPU-minutes for dense, 17 for DFSS 2:4, 8 for Nystromformer and 39 for DSA-90):
# PATHFINDER_PRETRAIN_EPOCHS of pretraining and
# PATHFINDER_FINETUNE_EPOCHS of fine-tuning and from scratch, against LRA's 200 epochs from
# scratch. A first choice by budget, not by a measured curve; both stages keep the config's
# one-epoch warmup and cosine decay over their own length.
PATHFINDER_STEPS_PER_EPOCH = 312        # configs/pathfinder.py: 160,000 images / batch 512
PATHFINDER_PRETRAIN_EPOCHS = 10
PATHFINDER_FINETUNE_EPOCHS = 30
# nystrom_pathx: one kind on Path-X, the cheapest that trains it on one GPU (Nystromformer:
# 6.7 ms per step of LRA's Path-X config with its attention dropout on one H100, where dense
# takes 104.1 ms, DFSS 2:4 150.5 and DSA-90 375.3: experiments/reports/train_step/
# memory_h100.md), its fields as in the main sweep (the config's learned
# positions, its own conv skip of 35 on V, 64 landmarks): PATHX_PRETRAIN_EPOCHS
# of pretraining, PATHX_FINETUNE_EPOCHS of fine-tuning and from scratch (LRA: 200 epochs from
# scratch), the config's one-epoch warmup and cosine decay in each stage. About 15 GPU-minutes
# for the three runs (125,000 steps) at that step time: one seed first, a length set by budget.
PATHX_STEPS_PER_EPOCH = 2500            # configs/pathx.py: 160,000 images / batch 64
PATHX_PRETRAIN_EPOCHS = 10
PATHX_FINETUNE_EPOCHS = 20


@dataclasses.dataclass(frozen=True)
class LongPreset:
  """One long preset: the main sweep on one task with measured fields for the softmax kinds."""
  fields: dict          # the softmax kinds' fields, in both stages and from scratch
  suffix: str           # their row labels' suffix
  title: str            # what the tables' titles say about the fields
  task: str = "listops"
  pretrain_steps: int = LONG_PRETRAIN_STEPS
  finetune_steps: int = LONG_FINETUNE_STEPS
  listops_warmup: bool = True   # the ListOps rsqrt warmup rule (_warmup) in both stages
  kinds: tuple = ()             # the KINDS labels it runs (all when empty)
  seeds: tuple = SEEDS

  def steps(self, stage_steps: int) -> dict:
    warmup = {"optim.warmup_steps": _warmup(stage_steps)} if self.listops_warmup else {}
    return {"num_train_steps": stage_steps, **warmup}


_CONV_FIELDS = ({**ROTARY, **CONV_SKIP}, ", rotary positions, conv skip of 35 on V",
                "rotary positions and a conv skip of 35 on V for the softmax kinds")
LONG_PRESETS = {
    "rotary_long": LongPreset(ROTARY, ", rotary positions",
                              "rotary positions for the softmax kinds"),
    "conv_long": LongPreset(*_CONV_FIELDS),
    "conv_pathfinder": LongPreset(
        *_CONV_FIELDS, task="pathfinder32", listops_warmup=False,
        pretrain_steps=PATHFINDER_PRETRAIN_EPOCHS * PATHFINDER_STEPS_PER_EPOCH,
        finetune_steps=PATHFINDER_FINETUNE_EPOCHS * PATHFINDER_STEPS_PER_EPOCH),
    "nystrom_pathx": LongPreset(
        {}, "", "Nystromformer only, the one kind that trains Path-X cheaply", task="pathx",
        listops_warmup=False, kinds=("nystrom",), seeds=(0,),
        pretrain_steps=PATHX_PRETRAIN_EPOCHS * PATHX_STEPS_PER_EPOCH,
        finetune_steps=PATHX_FINETUNE_EPOCHS * PATHX_STEPS_PER_EPOCH),
}


# dsa_from_dense: conv_long's DSA-90 fine-tune, but from conv_long's dense pretraining (the
# same config and seed as conv_long's dense pretrain runs): the fine-tune's config is conv_long's
# DSA-90 fine-tune's but for init_from, so its rows compare with conv_long's DSA-90 rows
# directly. DSA-90's predictor starts fresh (dense has none), as in the DSA paper's fine-tunes.
FROM_DENSE_KIND = "dsa90"


def _dsa_from_dense_sweep() -> Sweep:
  kinds, tasks, pretrain_steps, finetune_steps, _ = _setup("conv_long")
  (task, _, pretrain_config, finetune_config, _), = tasks
  by_label = {label: overrides for label, _, overrides in kinds}
  return Sweep(name="self_pretraining_dsa_from_dense", groups=[
      Group(name=f"pretrain-{task}", config=pretrain_config,
            overrides={**PRETRAIN, **COMPUTE, **pretrain_steps(None)},
            variants=[Variant("dense", by_label["dense"], step_cost=STEP_COST["dense"])],
            seeds=SEEDS),
      Group(name=f"finetune-{task}-{FROM_DENSE_KIND}-from-dense", config=finetune_config,
            overrides={**FINETUNE, **COMPUTE, **by_label[FROM_DENSE_KIND], **finetune_steps,
                       "init_from": Ref(f"pretrain-{task}", same=("seed",))},
            seeds=SEEDS, step_cost=STEP_COST[FROM_DENSE_KIND])])


def _dsa_from_dense_table(best_val: bool) -> Table:
  kinds, _, _, finetune_steps, _ = _setup("conv_long")
  label, row, overrides = next(kind for kind in kinds if kind[0] == FROM_DENSE_KIND)
  dense_row = next(row for label, row, _ in kinds if label == "dense")
  return Table(
      title=(f"{row}, fine-tuned ({finetune_steps['num_train_steps']} steps) from the dense "
             f"model's self-pretraining ({LONG_PRESETS['conv_long'].pretrain_steps} steps, "
             f"{dense_row}): test accuracy (%) "
             + ("at the best validation step" if best_val else "at the last step")),
      split="test_at_best_val" if best_val else "test",
      rows=[Selector(f"{row} + dense SPT",
                     _with_conv({**overrides, **FINETUNE, **finetune_steps,
                                 "init_from": lambda path: bool(path)}))],
      columns=[Selector("ListOps", {"task": "listops"})])


def _long_preset(preset: str):
  """The LONG_PRESETS key ``preset`` belongs to, or None."""
  return next((key for key in LONG_PRESETS if preset.startswith(key)), None)


def _setup(preset: str):
  """(kinds, tasks, pretrain steps overrides per task steps, fine-tune overrides, sweep name)."""
  if preset == "tiny":
    return (_kinds(True), _tasks(True), lambda steps: tiny_steps(12), tiny_steps(8),
            "self_pretraining_tiny")
  long = _long_preset(preset)
  if long:
    spec = LONG_PRESETS[long]
    kinds = [(label, row + spec.suffix, {**overrides, **spec.fields})
             if label in SOFTMAX_KINDS else (label, row, overrides)
             for label, row, overrides in KINDS if not spec.kinds or label in spec.kinds]
    return (kinds, tuple(task for task in TASKS + (PATHX_TASK,) if task[0] == spec.task),
            lambda steps: spec.steps(spec.pretrain_steps), spec.steps(spec.finetune_steps),
            f"self_pretraining_{long}")
  return KINDS, TASKS, lambda steps: {"num_train_steps": steps}, {}, "self_pretraining"


def get_sweep(preset: str = "") -> Sweep:
  tiny = _check(preset)
  if preset.startswith("curve"):
    return _curve_sweep()
  if preset.startswith("conv_curve"):
    return _curve_sweep(conv=True)
  if preset.startswith("pretrain_recipe"):
    return _recipe_sweep()
  if preset.startswith("long_finetune"):
    return _recipe_sweep(_long_finetune_variants(), LONG_FINETUNE_STEPS,
                         "self_pretraining_long_finetune")
  if preset.startswith("conv_probe"):
    return _recipe_sweep(CONV_PROBE_VARIANTS, LONG_FINETUNE_STEPS, "self_pretraining_conv_probe")
  if preset.startswith("dsa_from_dense"):
    return _dsa_from_dense_sweep()
  kinds, tasks, pretrain_steps, finetune_steps, name = _setup(preset)
  compute = {} if tiny else COMPUTE
  long = _long_preset(preset)
  seeds = TINY_SEED if tiny else LONG_PRESETS[long].seeds if long else SEEDS
  groups = []
  for task, _, pretrain_config, finetune_config, steps in tasks:
    groups.append(Group(
        name=f"pretrain-{task}", config=pretrain_config,
        overrides={**PRETRAIN, **compute, **pretrain_steps(steps)},
        variants=[Variant(label, overrides, step_cost=STEP_COST[label])
                  for label, _, overrides in kinds],
        seeds=seeds))
    for label, _, overrides in kinds:
      finetune = {**FINETUNE, **compute, **overrides, **finetune_steps}
      groups.append(Group(
          name=f"finetune-{task}-{label}", config=finetune_config,
          overrides={**finetune,
                     "init_from": Ref(f"pretrain-{task}", same=("seed",), match=overrides)},
          seeds=seeds, step_cost=STEP_COST[label]))
      groups.append(Group(name=f"scratch-{task}-{label}", config=finetune_config,
                          overrides=finetune, seeds=seeds, step_cost=STEP_COST[label]))
  return Sweep(name=name, groups=groups)


def get_table(preset: str = "") -> Table:
  tiny = _check(preset)
  best_val = preset.endswith("best_val")
  if preset.startswith("curve"):
    return _curve_table(best_val)
  if preset.startswith("conv_curve"):
    return _curve_table(best_val, conv=True)
  if preset == "pretrain_recipe":
    return _recipe_table()
  if preset.startswith("pretrain_recipe_finetune"):
    return _recipe_finetune_table(best_val)
  if preset.startswith("long_finetune"):
    return _recipe_finetune_table(best_val, _long_finetune_variants(), LONG_FINETUNE_STEPS)
  if preset == "conv_probe_pretrain_val":
    return _recipe_table(CONV_PROBE_VARIANTS)
  if preset.startswith("conv_probe"):
    return _recipe_finetune_table(best_val, CONV_PROBE_VARIANTS, LONG_FINETUNE_STEPS)
  if preset.startswith("dsa_from_dense"):
    return _dsa_from_dense_table(best_val)
  kinds, tasks, _, finetune_steps, _ = _setup(preset)
  columns = [Selector(label, {"task": task.removesuffix("32")}) for task, label, *_ in tasks]
  long = _long_preset(preset)
  protocol = (f" ({LONG_PRESETS[long].pretrain_steps} pretraining steps, "
              f"{LONG_PRESETS[long].finetune_steps} fine-tuning and from-scratch steps, "
              f"{LONG_PRESETS[long].title})" if long else "")
  # the long presets' rows also match the conv skip on V, so that rotary_long's rows never
  # hold a conv_long run
  match = _with_conv if long else dict
  if preset.endswith("pretrain_val"):
    return Table(
        title=("Self-pretraining stage (denoising) per attention kind" + protocol
               + ": masked-token accuracy (%) on the validation split at the last step"
               # the level is ListOps' (no Pathfinder level is measured)
               + (f" (context-free level: {CONTEXT_FREE_LEVEL})"
                  if any(task[0] == "listops" for task in tasks) else "")),
        split="val",
        rows=[Selector(row, match({**overrides, **PRETRAIN})) for _, row, overrides in kinds],
        columns=columns)
  finetune = {**FINETUNE, "num_train_steps": finetune_steps["num_train_steps"]} \
      if long else FINETUNE
  # Each "+ SPT" row's gain over its own from-scratch row, and each sparse kind's delta against
  # dense with SPT (does sparsity keep the gain?).
  dense_row = next((row for label, row, _ in kinds if label == "dense"), None)
  rows = []
  for label, row, overrides in kinds:
    rows.append(Selector(f"{row}, from scratch",
                         match({**overrides, **finetune, "init_from": lambda path: not path})))
    versus = {"vs scratch": f"{row}, from scratch"}
    if dense_row and label != "dense":
      versus["vs dense + SPT"] = f"{dense_row} + SPT"
    rows.append(Selector(f"{row} + SPT",
                         match({**overrides, **finetune, "init_from": lambda path: bool(path)}),
                         versus=versus))
  return Table(
      title=("Self-pretrained (denoising) then fine-tuned, against the same config from scratch, "
             "per attention kind" + protocol + ": test accuracy (%) "
             + ("at the best validation step" if best_val else "at the last step")
             + (" [tiny CPU variant]" if tiny else "")),
      split="test_at_best_val" if best_val else "test",
      rows=rows,
      columns=columns)
