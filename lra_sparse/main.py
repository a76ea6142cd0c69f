"""Trains and evaluates one LRA run.

  python -m lra_sparse.main --config=configs/listops.py:tiny --workdir=runs/listops_tiny \
      [--config.attention.kind=dfss --config.attention.dfss.nm=1:2 ...]

Several processes train one run together when ``--coordinator_address``, ``--num_processes``
and ``--process_id`` are given (all three, on every process), or under ``srun`` with more than
one task (``lra_sparse.distributed``); process 0 writes the logs.

User errors (config, data, workdir) print one line ``error: ...`` and exit 1; Ctrl-C lets an
in-flight checkpoint save finish and exits 130 (``lra_sparse.cli``).
"""
import os
import signal
import sys


def _interrupted_while_starting(signum, frame):
  del signum, frame
  print("interrupted: before training started; nothing was written", file=sys.stderr,
        flush=True)
  os._exit(130)    # pylint: disable=protected-access  (no cleanup is owed yet)


# Ctrl-C during the imports and flag parsing below is one line too; main() hands SIGINT back to
# Python (KeyboardInterrupt) once the trainer can finish a save cleanly.
signal.signal(signal.SIGINT, _interrupted_while_starting)

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags, logging
from ml_collections import config_flags

from lra_sparse import cli
from lra_sparse import config as config_lib
from lra_sparse import distributed
from lra_sparse import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file (path[:preset]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, logs, checkpoints, result.")
flags.mark_flags_as_required(["config", "workdir"])
flags.DEFINE_string("coordinator_address", None,
                    "Multi-process run: HOST:PORT of process 0's coordinator (with "
                    "--num_processes and --process_id; none of them under srun or for one "
                    "process).")
flags.DEFINE_integer("num_processes", None, "Multi-process run: the number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process run: this process's index, "
                     "0..num_processes-1 (process 0 writes the logs).")


def _config_args(argv) -> tuple[str, dict[str, str]]:
  """The ``--config`` value and the ``--config.<key>`` overrides (key -> text) of ``argv``."""
  config_arg, overrides = "", {}
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg == "--":
      break
    name, has_value, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-"):
      continue
    if not has_value:
      value = args[i + 1] if i + 1 < len(args) else ""
    if name == "config":
      config_arg = value
    elif name.startswith("config."):
      overrides[name[len("config."):]] = value
  return config_arg, overrides


def parse_flags(argv):
  """Checks the config file and every ``--config.<key>`` before absl parses them, so that a
  missing file, an unknown preset, a typo'd key (with a suggestion), a key of the old flat
  attention layout (with its new name) or a field of an attention kind the run does not use
  is one line, not a traceback."""
  config_arg, overrides = _config_args(argv)
  for key in overrides:
    message = config_lib.legacy_key_message(key)
    if message:
      cli.fail(message)
  if config_arg:
    path, preset = config_lib.split_spec_arg(config_arg)
    try:
      config = config_lib.load_config_file(path, preset)
    except Exception as error:  # pylint: disable=broad-except  (any failure of the file)
      cli.fail(f"--config={config_arg}: {cli.one_line(error)}")
    if "attention.kind" in overrides:
      config.attention.kind = overrides["attention.kind"]
    config_lib.check_override_keys(config, list(overrides))
  try:
    return FLAGS(argv)
  except flags.Error as error:
    cli.fail(cli.one_line(error), code=2)


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  if not FLAGS["verbosity"].present:
    # Library INFO chatter (orbax, absl) drowns the progress bar; --verbosity=0 brings it back.
    logging.set_verbosity(logging.WARNING)
  if FLAGS.config.get("deterministic") is True:
    train.enable_deterministic_xla()       # before JAX starts its backend, just below
  # Before any other use of JAX: join the run's other processes, if there are any.
  distributed.initialize(distributed.decide(FLAGS.coordinator_address, FLAGS.num_processes,
                                            FLAGS.process_id))
  signal.signal(signal.SIGINT, signal.default_int_handler)
  result = train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  logging.info("result: %s", result)
  if not distributed.is_primary():
    return
  print(f"test accuracy {result['test']['accuracy']:.4f} | majority-class accuracy "
        f"{result['majority_class_accuracy']:.4f} | test loss {result['test']['loss']:.4f} | "
        f"{result['step']} steps | workdir {FLAGS.workdir}")


if __name__ == "__main__":
  cli.run(main, flags_parser=parse_flags)
