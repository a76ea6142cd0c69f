"""DSA paper, Fig. 3: DSA at 90/95/99% sparsity fine-tuned from dense, on Text/Retrieval/Image.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/dsa_sparsity.py \
          --root=runs/dsa_sparsity
Table:  python -m lra_sparse.tables --root=runs/dsa_sparsity \
          --spec=experiments/specs/dsa_sparsity.py \
          --format=markdown --out=experiments/results/dsa_sparsity.md \
          --plot=experiments/results/dsa_sparsity.png
Tiny (CPU): ``experiments/specs/dsa_sparsity.py:tiny`` with ``--root=runs/dsa_sparsity_tiny``.

The paper's three tasks (ListOps and Pathfinder excluded, Sec. 4.1). Per task and seed a dense
Transformer is trained with the task's LRA config, then DSA (sigma 0.25, float predictor) is
fine-tuned from it at each sparsity. The paper gives no fine-tuning length; FINETUNE below is
our choice (about a quarter of the dense schedule, short warmup). Text runs at the paper's
l=2000 (as in experiments/specs/dsa_table2.py, which quotes it; LRA's text config has 1000);
Retrieval (4000
per document) and Image (1024, CIFAR-10) keep their LRA lengths. The predictor loss is the paper's
Eq. 6 (the default attention.dsa.mse_normalization="eq6"). The tiny variant reads
Fashion-MNIST for Image (named as the stand-in in run names and table).
Attention dropout is the task configs' (LRA's 0.1; Image 0.2): the DSA kernels draw it
inside, the dense base runs on the Mosaic GPU kernels (Hopper, half precision) or XLA.
"""
from experiments.specs._tiny import (IMAGE_STANDIN_LABEL, IMAGE_STANDIN_NAME, TINY_SEEDS,
                                     check_preset, image_data, tiny_steps)
from lra_sparse.sweep import Group, Ref, Sweep
from lra_sparse.tables import Plot, Selector, Table

SEEDS = (0, 1, 2)
SPARSITIES = (0.9, 0.95, 0.99)
TASKS = (("text", "Text"), ("retrieval", "Retrieval"), ("image", "Image"))
LENGTHS = {"text": {"data.max_length": 2000}}     # the DSA paper's Text l=2000


def _task_data(task: str, tiny: bool) -> dict:
  """Overrides that pick the task's data: the paper's Text length, CIFAR-10 or the stand-in."""
  if task == "image":
    return image_data(tiny)
  return {} if tiny else dict(LENGTHS.get(task, {}))


def _label(task: str, label: str, tiny: bool) -> str:
  return IMAGE_STANDIN_LABEL if tiny and task == "image" else label
FINETUNE = {
    "text": {"num_train_steps": 5_000, "optim.warmup_steps": 500},
    "retrieval": {"num_train_steps": 2_000, "optim.warmup_steps": 200},
    "image": {"num_train_steps": 3_500, "optim.warmup_steps": 175},
}


def get_sweep(preset: str = "") -> Sweep:
  tiny = check_preset(preset, "experiments/specs/dsa_sparsity.py")
  seeds = TINY_SEEDS if tiny else SEEDS
  groups = []
  for task, _ in TASKS:
    config = f"configs/{task}.py" + (":tiny" if tiny else "")
    data = _task_data(task, tiny)
    name = f"{task}-{IMAGE_STANDIN_NAME}" if tiny and task == "image" else task
    groups.append(Group(name=f"dense-{name}", config=config, seeds=seeds,
                        overrides={"attention.kind": "dense", **data,
                                   **(tiny_steps(30) if tiny else {})}))
    groups.append(Group(
        name=f"dsa-{name}", config=config, seeds=seeds,
        overrides={"attention.kind": "dsa", "attention.dsa.sigma": 0.25,
                   "attention.dsa.quant_bits": 0,
                   "init_from": Ref(f"dense-{name}"), **data,
                   **(tiny_steps(20) if tiny else FINETUNE[task])},
        product={"attention.dsa.sparsity": list(SPARSITIES)}))
  return Sweep(name="dsa_sparsity" + ("_tiny" if tiny else ""), groups=groups)


def get_table(preset: str = "") -> Table:
  tiny = check_preset(preset, "experiments/specs/dsa_sparsity.py")
  task_match = lambda task: {"task": task, **_task_data(task, tiny)}
  return Table(
      title="DSA sparsity sweep (fine-tuned from dense): test accuracy (%)"
            + (" [tiny CPU variant]" if tiny else ""),
      rows=[Selector("Transformer (dense)", {"attention.kind": "dense"})]
           + [Selector(f"DSA-{round(s * 100)}%", {"attention.kind": "dsa",
                                                  "attention.dsa.sparsity": s})
              for s in SPARSITIES],
      columns=[Selector(_label(task, label, tiny), task_match(task)) for task, label in TASKS],
      average=True,
      plot=Plot(x="attention.dsa.sparsity", xlabel="attention sparsity (fraction dropped)",
                series=[Selector(f"DSA {_label(task, label, tiny)}",
                                 {"attention.kind": "dsa", **task_match(task)})
                        for task, label in TASKS],
                baselines=[Selector(f"Dense {_label(task, label, tiny)}",
                                    {"attention.kind": "dense", **task_match(task)})
                           for task, label in TASKS],
                title="DSA: test accuracy vs. sparsity (dashed: dense baselines)"),
  )
