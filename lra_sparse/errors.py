"""The error types a run reports to its user (``lra_sparse.cli`` prints them as one line),
and the short form of an error that a message quotes."""


class WorkdirBusy(RuntimeError):
  """Another live process holds the workdir's lock."""


class TrainingDiverged(RuntimeError):
  """The loss or the gradient norm became non-finite; nothing non-finite was checkpointed."""


# The exit code of a program stopped by Ctrl-C / SIGINT (the trainer saves its checkpoint first,
# so a run stopped this way resumes when launched again).
EXIT_INTERRUPTED = 130


class TrainingInterrupted(RuntimeError):
  """SIGINT (Ctrl-C) stopped the run after its in-flight save finished and the step it reached
  was checkpointed (``checkpointing.save_on_interrupt`` says when it cannot be)."""


def first_line(error: BaseException) -> str:
  """``Type: the message's first line``, at most 300 characters."""
  lines = [line for line in str(error).splitlines() if line.strip()]
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
