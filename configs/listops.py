"""LRA ListOps (google-research/long-range-arena listops, transformer_base).

Presets: ``--config=configs/listops.py`` (LRA defaults: LRA's protocol, float32 with attention
dropout 0.1), ``--config=configs/listops.py:stable`` (LRA's recipe with the peak learning rate
halved, 0.025 rsqrt: the documented stable option, see below) or
``--config=configs/listops.py:tiny`` (a CPU-sized model that trains in minutes on the generated
demo set).

Why ``stable``: at LRA's learning rate the run often ends well below its best validation step
(measured: ``experiments/results/listops_recipe_notes.md``). In float32 (this config as it is)
over 5 seeds at 5000 steps, LRA's recipe ended at 32.39 +- 2.34 test with 2 seeds on a 0.30
plateau, the halved peak at 34.42 +- 0.27 with every seed within 1.5 points of its best
validation step (``experiments/results/listops_protocol/``); in bf16, 1 of 5 against 5 of 5
(``experiments/results/listops_recipe_5000/``). It is one field away from LRA's protocol
(``optim.learning_rate``).
"""
from lra_sparse.config import get_base_config, set_tiny_model


def get_config(preset: str = "") -> "ml_collections.ConfigDict":
  config = get_base_config()
  config.task = "listops"
  config.data.data_dir = "data/listops"   # basic_{train,val,test}.tsv
  config.data.max_length = 2000
  # The official files write every node in parentheses; LRA's tokenizer dropped them, so its
  # models saw operators, "]" and digits only, and 500 < length < 2000 fits max_length 2000.
  # True keeps "(" and ")" as tokens (about 3x longer sequences).
  config.data.keep_parentheses = False
  # LRA: 4 layers, 8 heads, 512/512/1024, batch 32, 0.05 rsqrt, 5000 steps, warmup 1000, wd 0.1.
  if preset == "tiny":
    config.data.data_dir = "data/listops_tiny"
    config.data.max_length = 100
    set_tiny_model(config, num_layers=2, num_heads=4, width=64, mlp_dim=128)
    config.optim.learning_rate = 0.05
    config.optim.warmup_steps = 100
    config.optim.weight_decay = 0.0
    config.batch_size = 32
    config.num_train_steps = 800
    config.eval_every_steps = 200
    config.checkpoint_every_steps = 200
    config.log_every_steps = 20
  elif preset == "stable":
    config.optim.learning_rate = 0.025
  elif preset:
    raise ValueError(f"unknown preset {preset!r} for configs/listops.py; known: '', 'stable', "
                     "'tiny'")
  return config
