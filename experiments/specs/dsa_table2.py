"""DSA paper, Table 2: DSA-90% on LRA Text, sweeping sigma (= k/d) and predictor precision.

Sweep:  python -m lra_sparse.sweep --sweep=experiments/specs/dsa_table2.py --root=runs/dsa_table2
Table:  python -m lra_sparse.tables --root=runs/dsa_table2 --spec=experiments/specs/dsa_table2.py \
          --format=markdown --out=experiments/results/dsa_table2.md \
          --plot=experiments/results/dsa_table2.png
Tiny (CPU): ``experiments/specs/dsa_table2.py:tiny`` with ``--root=runs/dsa_table2_tiny``.

A dense Transformer is trained on Text per seed (the "Base" of the paper); DSA-90% is then
fine-tuned from it (joint update, Sec. 4.2) for every sigma in {0.1, 0.16, 0.2, 0.25, 0.33} and
predictor precision in {INT2, INT4, INT8, FP32} (attention.dsa.quant_bits 2/4/8/0). The paper sweeps
the two knobs one at a time (sigma at FP32, precision at sigma 0.25); the full grid here holds
both lines: the FP32 column and the sigma = 0.25 row. The paper gives no fine-tuning length:
5,000 steps (1/4 of the dense run) with a 500-step warmup is our choice. The dense base run has
no predictor (no attention.dsa block in its config): the FP32 column also accepts a missing
quant_bits (None), so the base shows in the FP32 column of the "Dense (base)" row.

Sequence length: the DSA paper states Text's length twice: "Following the configuration in
Text Classification Benchmark, we set batch size=16, h=4, l=2000" and "a DSA-90% model working
on a sequence length of 2000" (the Text study of this table); its "4K tasks" (Sec. 4.4) names
LRA's category for Text and Retrieval. So 2000 here, not the 1000 of LRA's text config.
Only the length changes: the rest is configs/text.py (LRA's Text config). The predictor loss
is the paper's Eq. 6 (attention.dsa.mse_normalization="eq6", the default).
Attention dropout is the task configs' (LRA's 0.1; Image 0.2): the DSA kernels draw it
inside, the dense base runs on the Mosaic GPU kernels (Hopper, half precision) or XLA.
"""
from experiments.specs._tiny import check_preset, tiny_steps
from lra_sparse.sweep import Group, Ref, Sweep
from lra_sparse.tables import Plot, Selector, Table

SEEDS = (0, 1, 2)
SIGMAS = (0.1, 0.16, 0.2, 0.25, 0.33)
PRECISIONS = (("INT2", 2), ("INT4", 4), ("INT8", 8), ("FP32", 0))
SPARSITY = 0.9
TEXT_LENGTH = 2000          # the paper's Text l=2000 (LRA's text config has 1000)
FINETUNE = {"num_train_steps": 5_000, "optim.warmup_steps": 500}


def get_sweep(preset: str = "") -> Sweep:
  tiny = check_preset(preset, "experiments/specs/dsa_table2.py")
  config = "configs/text.py" + (":tiny" if tiny else "")
  seeds = (0,) if tiny else SEEDS
  length = {} if tiny else {"data.max_length": TEXT_LENGTH}
  dense = Group(name="dense", config=config, seeds=seeds,
                overrides={"attention.kind": "dense", **length,
                           **(tiny_steps(30) if tiny else {})})
  dsa = Group(
      name="dsa90", config=config, seeds=seeds,
      overrides={"attention.kind": "dsa", "attention.dsa.sparsity": SPARSITY,
                 "init_from": Ref("dense"), **length,
                 **(tiny_steps(10) if tiny else FINETUNE)},
      product={"attention.dsa.sigma": list(SIGMAS),
               "attention.dsa.quant_bits": [bits for _, bits in PRECISIONS]})
  return Sweep(name="dsa_table2" + ("_tiny" if tiny else ""), groups=[dense, dsa])


def get_table(preset: str = "") -> Table:
  tiny = check_preset(preset, "experiments/specs/dsa_table2.py")
  dsa = {"attention.kind": "dsa", "attention.dsa.sparsity": SPARSITY}
  return Table(
      title="DSA Table 2: DSA-90% on LRA Text, test accuracy (%) by sigma and predictor "
            "precision" + (" [tiny CPU variant]" if tiny else ""),
      row_header="sigma",
      rows=[Selector("Dense (base)", {"attention.kind": "dense"})]
           + [Selector(f"{sigma:g}", {**dsa, "attention.dsa.sigma": sigma}) for sigma in SIGMAS],
      columns=[Selector(label, {"attention.dsa.quant_bits": bits if bits else [0, None]})
               for label, bits in PRECISIONS],
      where={"task": "text", **({} if tiny else {"data.max_length": TEXT_LENGTH})},
      plot=Plot(x="attention.dsa.sigma", xlabel="sigma = k / d (predictor size)",
                series=[Selector(label, {**dsa, "attention.dsa.quant_bits": bits})
                        for label, bits in PRECISIONS],
                baselines=[Selector("Dense", {"attention.kind": "dense"})],
                title="DSA-90% on Text: accuracy vs. sigma, per predictor precision"),
  )
