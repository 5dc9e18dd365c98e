"""What the command-line programs share: exit codes and one-message error handling.

Exit codes (documented in the README, "What happens when things go wrong"):

* ``EXIT_OK`` (0): done.
* ``EXIT_UNEXPECTED`` (1): a bug or an environment failure; the traceback is printed.
* ``EXIT_USER_ERROR`` (2): bad input (config, flags, data, a workdir that does not fit); one
  message naming the problem and the fix, no traceback, nothing lost.
* ``EXIT_NONFINITE`` (3): the training loss became NaN/inf; the last good checkpoint is kept.
* ``EXIT_PREEMPTED`` (75, sysexits' ``EX_TEMPFAIL``): stopped by SIGTERM after saving a
  checkpoint; re-run the same command to resume.

Set ``FLAX_POSEMB_DEBUG=1`` (or pass ``--debug`` to a CLI that defines it) to get the
traceback of a user error too.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75


class UserError(ValueError):
  """Bad input that the user can fix; the message names the problem and the fix."""


def debug_enabled() -> bool:
  """Whether user errors should show their traceback."""
  if os.environ.get('FLAX_POSEMB_DEBUG', '') not in ('', '0'):
    return True
  from absl import flags  # pylint: disable=g-import-not-at-top
  return bool(flags.FLAGS.is_parsed() and 'debug' in flags.FLAGS and flags.FLAGS.debug)


def _user_error_types() -> tuple[type[BaseException], ...]:
  # ValueError covers config validation, data and the library's own caller errors
  # (checkpointing.CallerError, the position guard); FileNotFoundError a missing workdir,
  # dataset or table file.
  return (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def fail(prog: str, message: str, code: int = EXIT_USER_ERROR) -> None:
  """Prints ``prog: message`` on stderr and exits with ``code``."""
  sys.stderr.write(f'{prog}: {message}\n')
  sys.stderr.flush()
  sys.exit(code)


def guarded(prog: str) -> Callable[[Callable[..., int | None]], Callable[..., int | None]]:
  """Decorates a CLI's main: user errors become one message and exit code 2.

  ``NonFiniteLossError`` exits ``EXIT_NONFINITE`` with its message; anything else keeps its
  traceback (``EXIT_UNEXPECTED``).
  """
  def wrap(main):
    @functools.wraps(main)
    def inner(*args, **kwargs):
      try:
        return main(*args, **kwargs)
      except SystemExit:
        raise
      except FloatingPointError as e:  # training.NonFiniteLossError
        if debug_enabled():
          raise
        fail(prog, str(e), EXIT_NONFINITE)
      except _user_error_types() as e:
        if debug_enabled():
          raise
        fail(prog, str(e), EXIT_USER_ERROR)
      return None
    return inner
  return wrap
