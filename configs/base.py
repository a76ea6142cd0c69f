"""Shared defaults for every LRA task (google-research/long-range-arena, transformer_base).

Task configs call ``get_base_config()`` and override what differs. Every field can be set from
the command line: ``--config.model.num_layers=2``.
"""
import ml_collections


def get_base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.task = ""                  # a name from lra_sparse.data.task_names()
  config.seed = 0

  config.data = ml_collections.ConfigDict()
  config.data.data_dir = ""         # task files (official layout); task-specific fields below
  config.data.max_length = 2000

  config.model = ml_collections.ConfigDict()
  config.model.num_layers = 4
  config.model.num_heads = 8
  config.model.emb_dim = 512
  config.model.qkv_dim = 512
  config.model.mlp_dim = 1024
  config.model.dropout_rate = 0.1
  # LRA used 0.1; fused kernels (cuDNN, DFSS Triton) have no dropout on probabilities, so 0 keeps
  # them usable. Every kind honours a value > 0 through its reference path.
  config.model.attention_dropout_rate = 0.0
  config.model.pooling = "cls"      # "cls" | "mean"
  config.model.classifier_dim = 1024
  config.model.pad_multiple = 16    # sequence (incl. CLS) padded to a multiple: N:M, kernel tiles
  config.model.dtype = "float32"    # compute dtype: "float32" | "bfloat16"; params stay float32

  config.attention = ml_collections.ConfigDict()
  config.attention.kind = "dense"   # a name from lra_sparse.attention.attention_kinds()
  config.attention.implementation = "auto"   # dense: auto | xla | cudnn | reference
  # DFSS
  config.attention.n = 2
  config.attention.m = 4
  config.attention.backend = "auto"          # dfss: auto | triton | reference
  # dfss Triton backward: False = one pass with fp32 atomics for dQ (fastest, last bits of dQ
  # vary run to run); True = separate dK/dV and dQ kernels (bit-reproducible, ~15% slower)
  config.attention.deterministic_kernels = False
  # DSA
  config.attention.sigma = 0.25
  config.attention.sparsity = 0.9
  config.attention.quant_bits = 0            # 0 = float predictor; 2 | 4 | 8 = fake-quantized
  config.attention.mse_weight = 1.0
  config.attention.vector = 1                # column-vector granularity: 1 | 4 | 8
  config.attention.selection = "topk"        # "topk" | "threshold"
  config.attention.threshold = 0.0
  config.attention.topk_algorithm = "top_k"  # "top_k" (lax.top_k) | "radix" (sort-free select)
  # Nystromformer
  config.attention.num_landmarks = 64
  config.attention.pinv_iters = 6
  config.attention.conv_kernel = 35
  config.attention.nm = ""                   # "" (plain Nystrom) or "n:m", e.g. "2:4"

  config.optim = ml_collections.ConfigDict()
  config.optim.learning_rate = 0.05
  config.optim.schedule = "rsqrt"   # "rsqrt" (linear warmup x rsqrt decay) | "cosine"
  config.optim.warmup_steps = 1000
  config.optim.weight_decay = 0.1
  config.optim.b1 = 0.9
  config.optim.b2 = 0.98
  config.optim.eps = 1e-9
  config.optim.grad_clip_norm = 0.0  # 0 = off

  config.batch_size = 32
  config.num_train_steps = 5000
  config.eval_every_steps = 500
  config.num_eval_batches = 0       # 0 = the whole split
  config.checkpoint_every_steps = 500
  config.log_every_steps = 50
  config.init_from = ""             # workdir of a finished run: load its params, then train
  config.eval_dtype = ""            # "" = as trained; "bfloat16" casts params for evaluation
  return config


def set_tiny_model(config: ml_collections.ConfigDict, *, num_layers: int, num_heads: int,
                   width: int, mlp_dim: int) -> None:
  """The CPU presets' model: emb = qkv = ``width``, classifier as wide as the MLP, no dropout."""
  config.model.num_layers = num_layers
  config.model.num_heads = num_heads
  config.model.emb_dim = width
  config.model.qkv_dim = width
  config.model.mlp_dim = mlp_dim
  config.model.classifier_dim = mlp_dim
  config.model.dropout_rate = 0.0
