"""The process's one SIGTERM handler and the one preemption type
(SIGTERM in docs/DESIGN.md § Training outputs).

The training loop asks `sigterm_requested`; the command-line programs catch
`Preempted` and exit 75 (`cli.EXIT_PREEMPTED`). Standard library only, so that
the core, the runner and the commands can all import it.
"""

from collections.abc import Iterator
import contextlib
import dataclasses
import signal
from typing import Any


class Preempted(BaseException):
  """SIGTERM stopped the work; re-running the same command resumes it.

  Raised by `on_sigterm` before training begins (a BaseException, so that no
  ``except Exception`` on the way swallows it), and by a caller whose training
  run stopped on SIGTERM after saving its checkpoint (the experiments sweep).
  """


@dataclasses.dataclass
class _SigtermState:
  # A SIGTERM arrived since the handler was (re)armed.
  requested: bool = False
  # Inside `defer_sigterm`: a SIGTERM only sets `requested`.
  deferred: bool = False


_STATE = _SigtermState()


def on_sigterm(signum: int, frame: Any) -> None:
  """The process's one SIGTERM handler."""
  del signum, frame
  _STATE.requested = True
  if not _STATE.deferred:
    raise Preempted()


def sigterm_requested() -> bool:
  """Whether a SIGTERM arrived while it was deferred (`defer_sigterm`)."""
  return _STATE.requested


def install_handler() -> Any:
  """Installs `on_sigterm` so that a SIGTERM raises `Preempted` at once (until
  `defer_sigterm`); returns the handler it replaced."""
  _STATE.requested = False
  _STATE.deferred = False
  return signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def defer_sigterm(install: bool = True) -> Iterator[None]:
  """In the block a SIGTERM only sets `sigterm_requested` (the loop saves and
  stops).

  Installs the handler unless the process has it already or ``install`` is
  False (several hosts: JAX's preemption notifier owns SIGTERM there). A
  SIGTERM that the installed handler took before the block stays requested:
  its `Preempted` may have been swallowed (raised inside a gc callback or a
  ``__del__``, which Python only reports), and the loop must still stop.
  """
  deferred_before = _STATE.deferred
  installed = signal.getsignal(signal.SIGTERM) is on_sigterm
  if not (install and installed):
    # A request left by an earlier run, or several hosts (they stop together,
    # at Orbax's `reached_preemption`): not this run's to act on.
    _STATE.requested = False
  _STATE.deferred = True
  replaced = None
  if install and not installed:
    # Outside the main thread no handler can be installed.
    with contextlib.suppress(ValueError):
      replaced = signal.signal(signal.SIGTERM, on_sigterm) or signal.SIG_DFL
  try:
    yield
  finally:
    _STATE.deferred = deferred_before
    if replaced is not None:
      signal.signal(signal.SIGTERM, replaced)
