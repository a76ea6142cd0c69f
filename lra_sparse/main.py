"""Trains and evaluates one LRA run.

  python -m lra_sparse.main --config=configs/listops.py:tiny --workdir=runs/listops_tiny \
      [--config.attention.kind=dfss --config.model.num_layers=2 ...]
"""
from absl import app, flags, logging
from ml_collections import config_flags

from lra_sparse import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:preset]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, logs, checkpoints, result.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:
    # Library INFO chatter (orbax, absl) drowns the progress bar; --verbosity=0 brings it back.
    logging.set_verbosity(logging.WARNING)
  result = train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  logging.info("result: %s", result)
  print(f"test accuracy {result['test']['accuracy']:.4f} | majority-class accuracy "
        f"{result['majority_class_accuracy']:.4f} | test loss {result['test']['loss']:.4f} | "
        f"{result['step']} steps | workdir {FLAGS.workdir}")


if __name__ == "__main__":
  app.run(main)
