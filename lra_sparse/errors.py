"""The error types a run reports to its user (``lra_sparse.cli`` prints them as one line)."""


class WorkdirBusy(RuntimeError):
  """Another live process holds the workdir's lock."""


class TrainingDiverged(RuntimeError):
  """The loss or the gradient norm became non-finite; nothing non-finite was checkpointed."""


# The exit code of a program stopped by Ctrl-C / SIGINT (the trainer saves its checkpoint first,
# so a run stopped this way resumes when launched again).
EXIT_INTERRUPTED = 130


class TrainingInterrupted(RuntimeError):
  """SIGINT (Ctrl-C) stopped the run after its in-flight save finished and the step it reached
  was checkpointed (``train._save_on_interrupt`` says when it cannot be)."""
