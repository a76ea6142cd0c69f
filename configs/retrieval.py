"""LRA Retrieval: AAN citation matching with a dual encoder (google-research/long-range-arena
matching, transformer_base).

Presets: ``--config=configs/retrieval.py`` (LRA defaults) or ``--config=configs/retrieval.py:tiny``
(a CPU-sized model on the generated demo set: ``python -m lra_sparse.generators.retrieval
--output_dir=data/retrieval_tiny``).
"""
from lra_sparse.config import get_base_config, set_tiny_model


def get_config(preset: str = "") -> "ml_collections.ConfigDict":
  config = get_base_config()
  config.task = "retrieval"
  config.data.source = "tsv"
  config.data.data_dir = "data/aan"  # new_aan_pairs.{train,eval,test}.tsv (lra_release/tsv_data)
  config.data.max_length = 4000          # per document (byte tokens)
  config.data.max_examples = 0           # > 0 keeps the first examples of each split
  # LRA: 4 layers, 4 heads, 128/128/512, batch 32, 0.05 rsqrt, 5000 steps, warmup 8000, wd 0.1.
  # (warmup > steps as in LRA's config: the run never leaves the warmup ramp.)
  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.emb_dim = 128
  config.model.qkv_dim = 128
  config.model.mlp_dim = 512
  config.model.classifier_dim = 512      # LRA's classifier head hidden width is mlp_dim
  # "lra": LRA's classifier_head_dual as its matching task calls it: concat[u, v] ->
  # Dense(512) -> ReLU -> Dense(256) -> ReLU -> Dense(2). "nli_one_hidden": the earlier
  # [u, v, u*v, u-v] -> Dense(512) -> ReLU -> Dense(2) (lra_sparse/models/__init__.py).
  # (LRA's dual encoder prepends no CLS token, so its "CLS" pooling reads the first byte's
  # output; u and v here are the outputs of a CLS token, as in every classifier.)
  config.model.dual_head = "lra"
  config.optim.learning_rate = 0.05
  config.optim.schedule = "rsqrt"
  config.optim.warmup_steps = 8000
  config.optim.weight_decay = 0.1
  config.batch_size = 32
  config.num_train_steps = 5000
  if preset == "tiny":
    config.data.data_dir = "data/retrieval_tiny"
    config.data.max_length = 256
    set_tiny_model(config, num_layers=2, num_heads=4, width=64, mlp_dim=128)
    # rsqrt at 0.05 barely moves a tiny byte model in 400 steps; cosine 1e-3 learns the demo set.
    config.optim.schedule = "cosine"
    config.optim.learning_rate = 1e-3
    config.optim.warmup_steps = 50
    config.optim.weight_decay = 0.0
    config.batch_size = 32
    config.num_train_steps = 400
    config.eval_every_steps = 100
    config.checkpoint_every_steps = 200
    config.log_every_steps = 20
  elif preset:
    raise ValueError(f"unknown preset {preset!r} for configs/retrieval.py; known: '', 'tiny'")
  return config
