"""What every command line program does with errors: one line, not a traceback.

A user error (a bad config or flag, missing or malformed data, a busy or foreign workdir, a
diverged run, a run too big for the device's memory) prints ``error: <message>`` on one line
and exits 1; Ctrl-C prints one line and exits 130 (the trainer first lets an in-flight
checkpoint save finish). Set the environment variable ``LRA_SPARSE_TRACEBACK=1`` to get the
full traceback instead.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional, Sequence

from absl import app

from lra_sparse.errors import (EXIT_INTERRUPTED, TrainingDiverged, TrainingInterrupted,
                               WorkdirBusy)

TRACEBACK_ENV = "LRA_SPARSE_TRACEBACK"
EXIT_ERROR = 1
# OSError covers missing files and directories; ValueError every config and data check.
USER_ERRORS = (ValueError, OSError, WorkdirBusy, TrainingDiverged)


def one_line(error: BaseException) -> str:
  """The error's message on one line (continuation lines joined with ' | ')."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return " | ".join(lines) or type(error).__name__


def fail(message: str, code: int = EXIT_ERROR):
  """Prints ``error: message`` to stderr and exits with ``code``."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(code)


def out_of_memory_message(error: BaseException) -> Optional[str]:
  """The one-line message for an accelerator (or host) allocation that XLA refused, else None:
  a run too big for the device is a sizing problem the user fixes with flags, not a crash."""
  text = str(error).strip()
  if not (isinstance(error, RuntimeError) and text.startswith("RESOURCE_EXHAUSTED")):
    return None
  first = text.splitlines()[0]
  first = first[:300] + ("..." if len(first) > 300 else "")
  return (f"out of device memory: {first} | the run does not fit: lower --config.batch_size "
          "(or keep it and raise --config.optim.grad_accum_steps: the same update in "
          "micro-batches, a fraction of the activation memory) or shrink the model")


def _exit_interrupted(message: str):
  """Prints ``message`` and leaves at once. Ctrl-C may land while XLA compiles on another
  thread; a normal interpreter shutdown can then crash (seen: a segfault after the message), so
  the process exits without it, once the files it owns are closed (the trainer has already
  waited for its checkpoint save)."""
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(EXIT_INTERRUPTED)  # pylint: disable=protected-access


def report_errors(main: Callable[[Sequence[str]], Any]) -> Callable[[Sequence[str]], Any]:
  """``main`` whose user errors and Ctrl-C end the program with one line."""
  def wrapped(argv):
    try:
      return main(argv)
    except TrainingInterrupted as error:
      _exit_interrupted(f"interrupted: {one_line(error)}")
    except KeyboardInterrupt:
      if os.environ.get(TRACEBACK_ENV):
        raise
      _exit_interrupted("interrupted")
    except USER_ERRORS as error:
      if os.environ.get(TRACEBACK_ENV):
        raise
      fail(one_line(error))
    except RuntimeError as error:   # JAX's runtime errors; only running out of memory is ours
      message = out_of_memory_message(error)
      if message is None or os.environ.get(TRACEBACK_ENV):
        raise
      fail(message)
  return wrapped


def run(main: Callable[[Sequence[str]], Any],
        flags_parser: Optional[Callable[[list[str]], Any]] = None) -> None:
  """``absl.app.run`` with ``report_errors``; a flags parser's user errors are one line too."""
  if flags_parser is None:
    app.run(report_errors(main))
  else:
    app.run(report_errors(main), flags_parser=report_errors(flags_parser))
