"""Trains and evaluates one LRA run.

  python -m lra_sparse.main --config=configs/listops.py:tiny --workdir=runs/listops_tiny \
      [--config.attention.kind=dfss --config.attention.dfss.nm=1:2 ...]
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from lra_sparse import config as config_lib
from lra_sparse import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:preset]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, logs, checkpoints, result.")
flags.mark_flags_as_required(["config", "workdir"])


def _override_keys(argv) -> list[str]:
  """The keys of ``--config.<key>=value`` / ``--config.<key> value`` arguments."""
  keys = []
  for arg in argv[1:]:
    if arg == "--":
      break
    for prefix in ("--config.", "-config."):
      if arg.startswith(prefix):
        keys.append(arg[len(prefix):].split("=", 1)[0])
  return keys


def parse_flags(argv):
  """absl's flag parsing, after one clear error for keys of the old flat attention layout
  (ml_collections would report them as unknown fields inside a long traceback)."""
  for key in _override_keys(argv):
    message = config_lib.legacy_key_message(key)
    if message:
      sys.exit(f"error: {message}")
  return FLAGS(argv)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:
    # Library INFO chatter (orbax, absl) drowns the progress bar; --verbosity=0 brings it back.
    logging.set_verbosity(logging.WARNING)
  try:
    config_lib.check_override_keys(FLAGS.config,
                                   config_flags.get_override_values(FLAGS["config"]))
  except ValueError as error:
    sys.exit(f"error: {error}")
  result = train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  logging.info("result: %s", result)
  print(f"test accuracy {result['test']['accuracy']:.4f} | majority-class accuracy "
        f"{result['majority_class_accuracy']:.4f} | test loss {result['test']['loss']:.4f} | "
        f"{result['step']} steps | workdir {FLAGS.workdir}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
