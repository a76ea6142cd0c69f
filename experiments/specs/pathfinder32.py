"""Pathfinder-32 to LRA's last step: dense, DFSS 2:4, Nystromformer and DSA-90, on a GPU.

Every run is LRA's Pathfinder-32 config (``configs/pathfinder.py``: 4 layers, 4 heads of 4,
32 wide, batch 512, 62,400 steps = 200 epochs, 1e-3 with a one-epoch warmup and cosine decay,
dropout 0.1 and LRA's attention dropout, black pixels masked as LRA does) in bfloat16, from
scratch, on the generated hard set (contour length 14, 200k images: 160k / 20k / 20k):

  python -m lra_sparse.data.prepare --task=pathfinder --data_dir=data --offline

A run takes 23-113 minutes of one GPU (H100 step times at this config with its attention
dropout, ``experiments/reports/train_step/memory_h100.md``: dense 37.0 ms, DFSS 2:4 48.1,
Nystromformer 21.8, DSA-90 108.3), longer than a device call, so the runs train in
slices whose checkpoints (a few MB: the model is small) come back and are carried to the next
call: one run per GPU of a 4-GPU machine,

  PREPARE="python -m lra_sparse.data.prepare --task=pathfinder --data_dir=data --offline" \\
  GPUS=0,1,3,2 CARRY_IN=experiments/carry/pathfinder32 bash scripts/device_sweep.sh \\
      experiments/specs/pathfinder32.py:all /tmp/pf 520 \\
      '^pathfinder32(-ft|-predictor|-ft-fitted)?__.*__(dense|dsa90-ft|dsa-predictor)__seed=0$' \\
      '__dfss2-4__seed=[01]$|^pathfinder32-lra-model__.*__seed=0$' '__dsa90__seed=0$' \\
      '__nystrom__seed=0$'

(the I-th regex's runs in root /tmp/pf.pI, on the I-th GPU of GPUS, one after the other; a
slot starts the ready run with the most work on its chain first, so name a cheaper run beside
an unfinished one only once that one is done, and a run beside the one it depends on, as the
DSA fine-tune beside its dense run: a root holds its own runs only; then copy $OUT's pI/
folders into experiments/carry/pathfinder32/ and commit them for the next call or session;
experiments/carry/README.md lists the runs each part holds now), and the table

  python -m lra_sparse.tables --root=ROOT --spec=experiments/specs/pathfinder32.py \\
      --curves=experiments/results/pathfinder32_curves.png

(a regex names runs of every group: '__dense__seed=0$' alone would also name the LRA-model run
below, which would then train in two roots; the fine-tunes and the predictor fit depend on the
dense run, so they share its root.)

Presets: "" (seed 0 of every kind, the dense Transformer also with LRA's own Pathfinder model,
and DSA-90 fine-tuned from the dense run, directly and after the predictor fit), "seeds"
(seeds 1 and 2 of dense, of the LRA-model dense and of DFSS 2:4, the issue's three seeds where
the budget allows), "all" (every kind at seeds 0-2 and the fine-tunes in one root, the runs
of "" and "seeds" among them, so that a GPU whose run ends mid-call goes on with the next one
its regex names, e.g. '__dfss2-4__seed=[01]$': seed 0, then seed 1), "best_val" (the table at
the best validation step; sweep: the same runs as ""), "tiny" (the tiny Pathfinder
config for 20 steps: the CPU pipeline check). The table pools a kind's runs over the seeds.

The published value beside the two dense rows is LRA's Transformer (Tay et al. 2021, Table 1:
71.40). The first dense row's model is the LRA paper's Pathfinder-32 setting as
``configs/pathfinder.py`` has it (4 layers, 32 wide); the second is the model LRA's repository
configures for its Transformer (see LRA_MODEL below), the fairer comparison with 71.40. DFSS
and DSA left Pathfinder out of their papers, so their rows have none. The DSA-90 row trains
from scratch with the mean form of L_MSE (the DSA paper's Eq. 6 swamps the cross-entropy from
scratch; the same row as ``lra_listops.py``); the DSA-90 fine-tune row follows DSA's own
protocol instead (see FINETUNE_* below: 6,240 steps from the seed-0 dense run, its predictor
trained by L_MSE alone). The dense model under a fresh predictor's keys is at chance before
any update, and under the keys of the real scores' top 10% (``attention.dsa.selection_scores=
"oracle"``) 2.6 points under dense (``experiments/results/pathfinder32_notes.md``), so a
second fine-tune row fits the predictor first (WARMUP_* below: the trained dense model
frozen, attention kept dense) and then fine-tunes the same way from there, and two probes
follow (ORACLE, SIGMA1 below). The fine-tunes' first runs fell to chance with a bug of the
predictor-only mode (L_MSE's gradient reached the block input X and so the whole model;
``attention.dsa.mse_input_gradient`` now keeps it out): their records are in
``experiments/results/pathfinder32_mse_input_leak/``, and these rows run again.
"""
import operator
import os

from experiments.specs._tiny import check_preset, tiny_steps
from lra_sparse.sweep import Group, Ref, Sweep, Variant
from lra_sparse.tables import Selector, Table

PRESETS = ("", "seeds", "all", "best_val", "tiny")
KINDS = (  # (run-name label, row label, overrides, step cost: H100 ms per step / 48.1)
    ("dense", "Transformer (dense)", {"attention.kind": "dense"}, 37.0 / 48.1),
    ("dfss2-4", "DFSS 2:4", {"attention.kind": "dfss", "attention.dfss.nm": "2:4"}, 1.0),
    ("nystrom", "Nystromformer", {"attention.kind": "nystrom", "attention.nystrom.nm": ""},
     21.8 / 48.1),
    ("dsa90", "DSA-90 (sigma 0.25, mean-form L_MSE)",
     {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9, "attention.dsa.sigma": 0.25,
      "attention.dsa.mse_normalization": "scaled_mean"}, 108.3 / 48.1),
)
# LRA's repository trains its Transformer on Pathfinder-32 with the model of its
# pathfinder32/transformer_base.py, which overrides the base config's (above: the LRA paper's
# 4 layers, 32 wide) with 1 layer, 4 heads of 16, widths 128/64/128 and dropout 0.2 (attention
# dropout stays 0.1). Its own group, so that the fine-tune's Ref finds one dense run. Step
# cost: its run's log, 19.5 ms per step on one H200 (the dense row: 35.4 on H100 and H200).
LRA_MODEL_GROUP = "pathfinder32-lra-model"
LRA_MODEL_ROW = "Transformer (LRA's transformer_base.py model: 1 layer, 128/64/128)"
LRA_MODEL = {"attention.kind": "dense", "model.num_layers": 1, "model.emb_dim": 128,
             "model.qkv_dim": 64, "model.mlp_dim": 128, "model.classifier_dim": 128,
             "model.dropout_rate": 0.2}
LRA_MODEL_COST = 19.5 / 48.1
# What keeps the LRA-model runs out of the dense row in the table: their width (the dense
# row's runs leave the config's, 32 here and smaller in the tiny preset).
ROW_MATCH = {"dense": {"model.emb_dim": lambda width: width != LRA_MODEL["model.emb_dim"]}}
# DSA's own protocol (its paper fine-tunes DSA from a trained dense Transformer): DSA-90 from
# each seed-0 dense run, for a tenth of the task's steps at a tenth of its peak learning rate
# (one epoch of warmup, cosine decay; no paper states a fine-tune schedule for Pathfinder, and
# the dense run's own rate ends at 0 under its cosine decay). L_MSE trains the predictor only
# (S a fixed target, the block input X without L_MSE's gradient): the from-scratch row's joint
# update shrank q and k while L_MSE dominated (pathfinder32_notes.md), and on ListOps the joint
# update dragged a trained model's q/k towards the fresh predictor at every Eq. 6 weight
# (dsa_listops_notes.md).
FINETUNE_LABEL = "dsa90-ft"
FINETUNE_ROW = "DSA-90 fine-tuned from dense (predictor-only L_MSE)"
FINETUNE_DSA = {"attention.kind": "dsa", "attention.dsa.sparsity": 0.9,
                "attention.dsa.sigma": 0.25, "attention.dsa.mse_normalization": "scaled_mean",
                "attention.dsa.mse_gradient": "predictor",
                "attention.dsa.mse_input_gradient": False}
FINETUNE_SCHEDULE = {"num_train_steps": 62_400 // 10, "optim.learning_rate": 1e-4,
                     "checkpoint_every_steps": 3_120}
FINETUNE_SEEDS = (0,)
# The predictor fitted before the switch to 10% of the keys: DSA at sparsity 0 (every key kept,
# so the model computes what the dense run computed) from the dense run, only W~ trained
# (``optim.trainable``) by L_MSE, five epochs at the config's peak rate; then FINETUNE_* from
# that run. Five epochs was a guess (the failed fine-tune's hit rate stopped rising after about
# five epochs); the fit's validation MSE was flat from step 1,248 on (4.70 at 312, 2.38 at the
# end), so it is long enough for this loss. dsa_listops.py's "mse" preset has a warm-up too,
# on dense attention but with the whole model training at the fine-tune's rate; here the
# trained model stays exactly as the dense run left it.
WARMUP_GROUP = "pathfinder32-predictor"
WARMUP_LABEL = "dsa-predictor"
WARMUP_FT_GROUP = "pathfinder32-ft-fitted"
WARMUP_FT_ROW = "DSA-90 fine-tuned from dense, predictor fitted first"
WARMUP = {**FINETUNE_DSA, "attention.dsa.sparsity": 0.0, "optim.trainable": "predictor_"}
WARMUP_SCHEDULE = {"num_train_steps": 5 * 312, "checkpoint_every_steps": 780}
# Two probes of the fine-tunes (pathfinder32_notes.md). "Oracle": the same fine-tune as
# FINETUNE_* with M chosen from the real scores (``selection_scores="oracle"``, an ablation:
# before any update it is 2.6 points under dense), the bound of any predictor's selection.
# (Its first run, with the input-gradient bug, fell to chance too.) "Sigma 1": the fit and
# fine-tune of WARMUP_* at sigma 1.0 (W~ as wide as the 32-wide input, not rank 8): on the
# CPU a fit at sigma 1.0 selected keys under which the frozen dense model kept 56.75
# validation against 50.30 at sigma 0.25 (pathfinder32_swap/).
ORACLE_GROUP = "pathfinder32-ft-oracle"
ORACLE_LABEL = "dsa90-oracle-ft"
ORACLE_ROW = "DSA-90 fine-tuned from dense, keys from the real scores (oracle ablation)"
ORACLE = {**FINETUNE_DSA, "attention.dsa.selection_scores": "oracle"}
SIGMA1 = {"attention.dsa.sigma": 1.0}
SIGMA1_FIT_GROUP = "pathfinder32-predictor-sigma1"
SIGMA1_FT_GROUP = "pathfinder32-ft-fitted-sigma1"
SIGMA1_FT_ROW = "DSA-90 (sigma 1.0) fine-tuned from dense, predictor fitted first"
PREDICTOR_SELECTION = {"attention.dsa.selection_scores": "predictor"}
MORE_SEEDS_KINDS = ("dense", "dfss2-4")
MORE_SEEDS = (1, 2)
COMPUTE = {"model.dtype": "bfloat16"}
DATA_DIR = "data/pathfinder"   # lra_sparse.data.prepare's (the config's default has no cache)
PAPER = {"dense": {"Pathfinder-32": 71.40}, "dense-lra-model": {"Pathfinder-32": 71.40}}
PAPER_SOURCE = ("both Transformer rows: LRA's Transformer (Tay et al. 2021, Table 1); LRA's "
                "repository configures that model in pathfinder32/transformer_base.py")


def _check(preset: str) -> bool:
  return check_preset(preset, "experiments/specs/pathfinder32.py", PRESETS)


def _started_from(group: str):
  """A row's init_from test: the run started from a run of ``group`` (run folders are named
  GROUP__...)."""
  return lambda init_from: bool(init_from) and os.path.basename(
      os.path.normpath(init_from)).startswith(group + "__")


def get_sweep(preset: str = "") -> Sweep:
  tiny = _check(preset)
  kinds = [kind for kind in KINDS if preset != "seeds" or kind[0] in MORE_SEEDS_KINDS]
  seeds = {"seeds": MORE_SEEDS, "all": (0, *MORE_SEEDS)}.get(preset, (0,))
  config = "configs/pathfinder.py" + (":tiny" if tiny else "")
  data = tiny_steps(20) if tiny else {"data.data_dir": DATA_DIR}
  def after(name, label, init_from, overrides, schedule, tiny_count):
    """A group of one run per FINETUNE_SEEDS seed that starts from ``init_from``'s run."""
    return Group(config=config, name=name, seeds=FINETUNE_SEEDS,
                 overrides={**COMPUTE, **data, **overrides,
                            **(tiny_steps(tiny_count) if tiny else schedule),
                            "init_from": init_from},
                 variants=[Variant(label, {}, step_cost=108.3 / 48.1)])
  from_dense = Ref("pathfinder32", match={"attention.kind": "dense"})
  finetune = [] if preset == "seeds" else [
      after("pathfinder32-ft", FINETUNE_LABEL, from_dense, FINETUNE_DSA, FINETUNE_SCHEDULE, 10),
      after(WARMUP_GROUP, WARMUP_LABEL, from_dense, WARMUP, WARMUP_SCHEDULE, 5),
      after(WARMUP_FT_GROUP, FINETUNE_LABEL, Ref(WARMUP_GROUP), FINETUNE_DSA,
            FINETUNE_SCHEDULE, 10),
      after(ORACLE_GROUP, ORACLE_LABEL, from_dense, ORACLE, FINETUNE_SCHEDULE, 10),
      after(SIGMA1_FIT_GROUP, WARMUP_LABEL, from_dense, {**WARMUP, **SIGMA1},
            WARMUP_SCHEDULE, 5),
      after(SIGMA1_FT_GROUP, FINETUNE_LABEL, Ref(SIGMA1_FIT_GROUP), {**FINETUNE_DSA, **SIGMA1},
            FINETUNE_SCHEDULE, 10)]
  return Sweep(
      name="pathfinder32" + ("_tiny" if tiny else ""),
      groups=[Group(config=config, name="pathfinder32", overrides={**COMPUTE, **data},
                    variants=[Variant(label, overrides, step_cost=cost)
                              for label, _, overrides, cost in kinds],
                    seeds=seeds),
              Group(config=config, name=LRA_MODEL_GROUP, overrides={**COMPUTE, **data},
                    variants=[Variant("dense", LRA_MODEL, step_cost=LRA_MODEL_COST)],
                    seeds=seeds),
              *finetune])


def get_table(preset: str = "") -> Table:
  tiny = _check(preset)
  best_val = preset == "best_val"
  return Table(
      title=("Pathfinder-32 (generated, hard), LRA's config in bfloat16 from scratch"
             + (" [tiny CPU variant, 20 steps]" if tiny else ", 62,400 steps")
             + ": test accuracy (%) "
             + ("at the best validation step" if best_val else "at the last step")),
      split="test_at_best_val" if best_val else "test",
      rows=[*(Selector(row, {**overrides, **ROW_MATCH.get(label, {}), **COMPUTE,
                             "init_from": operator.not_},
                       paper={} if tiny else PAPER.get(label, {}))
              for label, row, overrides, _ in KINDS),
            Selector(LRA_MODEL_ROW, {**LRA_MODEL, **COMPUTE, "init_from": operator.not_},
                     paper={} if tiny else PAPER["dense-lra-model"]),
            Selector(FINETUNE_ROW, {**FINETUNE_DSA, **PREDICTOR_SELECTION, **COMPUTE,
                                    "init_from": _started_from("pathfinder32")}),
            Selector(WARMUP_FT_ROW, {**FINETUNE_DSA, **COMPUTE,
                                     "init_from": _started_from(WARMUP_GROUP)}),
            Selector(ORACLE_ROW, {**ORACLE, **COMPUTE, "init_from": _started_from("pathfinder32")}),
            Selector(SIGMA1_FT_ROW, {**FINETUNE_DSA, **SIGMA1, **COMPUTE,
                                     "init_from": _started_from(SIGMA1_FIT_GROUP)})],
      paper_source="" if tiny else PAPER_SOURCE,
      columns=[Selector("Pathfinder-32", {"task": "pathfinder"})])
