"""Why LRA's ListOps recipe collapses: one factor at a time, several seeds, on a GPU.

Every run is ``configs/listops.py`` with no override (LRA's protocol: fp32, dropout 0.1,
attention dropout 0.1, lr 0.05 rsqrt, warmup 1000, Adam (0.9, 0.98, 1e-9), weight decay 0.1,
5000 steps) except the factor its arm names, in fp32 or bf16 (group). Dense attention trains
with attention dropout on the Mosaic GPU kernels in bf16 on a Hopper (on XLA's explicit
attention before commit c926dfd, and in fp32). Each evaluation also runs the validation
split as in training (``eval_train_mode``: dropout on), to tell a gap between the two modes
from bad parameters; evaluations record the predicted-class histogram and train windows their
worst step (``grad_norm_max``, ``loss_max``).

Data: generated ListOps at LRA's sizes (``lra_listops.py`` gives the command; seed 0).
Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/listops_recipe.py[:short] \\
          --root=runs/listops_recipe --parallel=gpus [--runs=REGEX]
Table:  python -m lra_sparse.tables --root=runs/listops_recipe \\
          --spec=experiments/specs/listops_recipe.py[:short] --format=markdown
Presets: "" 5000 steps, evaluation every 250; "short": 2000 steps (the warmup's peak and the
first 1000 steps of decay, where most collapses start), evaluation every 200; "tiny": the tiny
CPU preset (``make demo``'s data) with LRA's dropout and attention dropout, 800 steps,
evaluation every 50 (on a CPU both modes run XLA's attention: a mode gap there is not cuDNN's);
"protocol": ``configs/listops.py`` as it is (float32, LRA's evaluation every 500 steps) for
LRA's recipe and the halved peak (``configs/listops.py:stable``), 5 seeds, nothing else
changed; "best_val", "short_best_val", "protocol_best_val", "tiny_best_val": the same runs, the
table of test accuracy at the best validation step; "smoke": the tiny CPU preset for 20 steps.
"""
from experiments.specs._tiny import TINY_SEEDS, tiny_steps
from lra_sparse.config import EARLIER_MODEL, get_base_config

_BASE = get_base_config()
LRA_MODEL = {key: _BASE.model[key.split(".")[1]] for key in EARLIER_MODEL}
from lra_sparse.sweep import Group, Sweep, Variant
from lra_sparse.tables import Selector, Table

SEEDS = (0, 1, 2, 3, 4)
PRESETS = ("", "short", "best_val", "short_best_val", "protocol", "protocol_best_val", "tiny",
           "tiny_best_val", "smoke")
# "protocol": the default config with no override at all (LRA's evaluation cadence, every 500
# steps, no train-mode pass) in float32, LRA's recipe and the stable option (lr 0.025), 5 seeds.
PROTOCOL_ARMS = ("lra", "lr0.025")
ARMS = (  # (row label, run-name label, overrides): one factor each against "lra"
    ("LRA's recipe (the default config)", "lra", {}),
    ("model's earlier parameters (biases, lecun_normal, CLS N(0, 0.02))", "earlier-model",
     EARLIER_MODEL),
    ("attention dropout 0", "attn-dropout0", {"model.attention_dropout_rate": 0.0}),
    ("gradient clipping at norm 1", "clip1", {"optim.grad_clip_norm": 1.0}),
    ("peak learning rate halved (0.025 rsqrt)", "lr0.025", {"optim.learning_rate": 0.025}),
    ("Adam b2 0.999, eps 1e-6", "adam-b2-0.999", {"optim.b2": 0.999, "optim.eps": 1e-6}),
    # Dense evaluates on cuDNN in bf16 while attention dropout trains on another
    # implementation (Mosaic GPU; XLA before c926dfd): this arm trains and evaluates on XLA,
    # to tell a mode gap of the dropout from one of two implementations.
    ("evaluation on XLA too (not cuDNN)", "xla-eval", {"attention.dense.implementation": "xla"}),
)
DTYPES = (("fp32", "float32"), ("bf16", "bfloat16"))
# DFSS 1:2 seed 0 of ``lra_listops`` collapsed late (35.9% validation at step 3000, 20.4% test
# at the end). Its own config (bf16, attention dropout 0, the earlier parameters) rerun on the
# Mosaic GPU kernels (what ``auto`` picks on a Hopper) and on the Triton kernels tells a kernel
# from the recipe; the third arm is DFSS 1:2 under the halved learning rate. bf16, seed 0,
# 5000 steps (the default preset only).
LRA_LISTOPS_RUN = {"model.attention_dropout_rate": 0.0, **EARLIER_MODEL}
DFSS_1_2 = {"attention.kind": "dfss", "attention.dfss.nm": "1:2"}
DFSS_ARMS = (
    ("DFSS 1:2, lra_listops's config, Mosaic GPU kernels", "dfss1-2-mosaic",
     {**DFSS_1_2, "attention.dfss.backend": "mosaic", **LRA_LISTOPS_RUN}),
    ("DFSS 1:2, lra_listops's config, Triton kernels", "dfss1-2-triton",
     {**DFSS_1_2, "attention.dfss.backend": "triton", **LRA_LISTOPS_RUN}),
    ("DFSS 1:2, peak learning rate halved (0.025 rsqrt)", "dfss1-2-lr0.025",
     {**DFSS_1_2, "optim.learning_rate": 0.025}),
)
DFSS_SEEDS = (0,)
TINY_LEARNING_RATE = 0.05      # configs/listops.py:tiny
LRA_LISTOPS = 36.37            # LRA's Transformer, the paper value beside every full-size row
# What every factor is when its arm leaves it alone (configs/listops.py): a row matches runs
# whose factors all have these values but its own.
DEFAULTS = {"attention.kind": "dense", "model.attention_dropout_rate": 0.1,
            "optim.grad_clip_norm": 0.0,
            "optim.learning_rate": 0.05, "optim.b2": 0.98, "optim.eps": 1e-9,
            "attention.dense.implementation": "auto",
            **LRA_MODEL}

# A DFSS run's config holds no attention.dense fields.
DFSS_DEFAULTS = {key: value for key, value in DEFAULTS.items()
                 if not key.startswith("attention.dense.")}


def _check(preset: str) -> str:
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for experiments/specs/listops_recipe.py; "
                     f"known: {', '.join(repr(p) for p in PRESETS)}")
  return preset.removesuffix("best_val").rstrip("_")


def _schedule(length: str) -> dict:
  if length == "smoke":
    return dict(tiny_steps(20), eval_train_mode=True)
  if length == "tiny":   # the tiny preset (its dropouts: _tiny_arm), on a CPU
    return {"num_train_steps": 800, "eval_every_steps": 50, "checkpoint_every_steps": 400,
            "log_every_steps": 10, "eval_train_mode": True}
  steps, every = (2000, 200) if length == "short" else (5000, 250)
  return {"num_train_steps": steps, "eval_every_steps": every, "checkpoint_every_steps": 500,
          "log_every_steps": 10, "eval_train_mode": True}


def get_sweep(preset: str = "") -> Sweep:
  length = _check(preset)
  if length == "protocol":
    return Sweep(name="listops_protocol", groups=[Group(
        config="configs/listops.py", name="fp32", overrides={},
        variants=[Variant(label, match) for _, label, match in ARMS if label in PROTOCOL_ARMS],
        seeds=SEEDS)])
  tiny = length in ("smoke", "tiny")
  suffix = f"_{length}" if length else ""
  return Sweep(
      name="listops_recipe" + suffix,
      groups=[Group(config="configs/listops.py" + (":tiny" if tiny else ""), name=name,
                    overrides=dict(_schedule(length), **{"model.dtype": dtype}),
                    variants=[Variant(label, _tiny_arm(match) if tiny else match)
                              for _, label, match in ARMS],
                    seeds=TINY_SEEDS if length == "smoke" else SEEDS)
              for name, dtype in DTYPES]
      + ([] if length else [Group(config="configs/listops.py", name="dfss",
                                overrides=dict(_schedule(length), **{"model.dtype": "bfloat16"}),
                                variants=[Variant(label, match) for _, label, match in DFSS_ARMS],
                                seeds=DFSS_SEEDS)]))


def _tiny_arm(match: dict) -> dict:
  """An arm on the tiny preset: LRA's dropout and attention dropout (the preset has none)
  unless the arm sets them; a halved learning rate halves the preset's 0.05."""
  arm = {key: (TINY_LEARNING_RATE / 2 if key == "optim.learning_rate" else value)
         for key, value in match.items()}
  return {"model.dropout_rate": 0.1, "model.attention_dropout_rate": 0.1, **arm}


def get_table(preset: str = "") -> Table:
  length = _check(preset)
  best_val = preset.endswith("best_val")
  tiny = length in ("smoke", "tiny")
  defaults = dict(DEFAULTS, **({"optim.learning_rate": TINY_LEARNING_RATE} if tiny else {}))
  steps = {"": "5000 steps", "short": "2000 steps", "tiny": "tiny preset on a CPU, 800 steps",
           "smoke": "tiny, 20 steps",
           "protocol": "5000 steps, the default config, no override"}[length]
  arms = [(name, dtype, label, match) for name, dtype in DTYPES for label, short, match in ARMS
          if length != "protocol" or (dtype == "float32" and short in PROTOCOL_ARMS)]
  return Table(
      title=f"ListOps, LRA's recipe one factor at a time ({steps}; LRA's Transformer: "
            "36.37 at 5000 steps): test accuracy (%) "
            + ("at the best validation step" if best_val else "at the last step"),
      split="test_at_best_val" if best_val else "test",
      rows=[Selector(f"{name}: {label}", {"model.dtype": dtype, **defaults,
                                          **(_tiny_arm(match) if tiny else match)},
                     paper={} if tiny else {"ListOps": LRA_LISTOPS})
            for name, dtype, label, match in arms]
           + ([] if length else [Selector(f"bf16: {label}", {"model.dtype": "bfloat16",
                                                            **DFSS_DEFAULTS, **match},
                                          paper={"ListOps": LRA_LISTOPS})
                               for label, _, match in DFSS_ARMS]),
      paper_source="" if tiny else "LRA's Transformer on ListOps (Tay et al. 2021), every row",
      columns=[Selector("ListOps", {"task": "listops"})])
