"""What the CLIs share: exit codes, one-message errors, quiet logs, huge pages,
the SIGTERM exit of a program that is starting (docs/failures.md; the handler
itself: `flax_posemb.preemption`).
"""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import difflib
import errno
import logging
import os
import platform
import re
import signal
import sys
from typing import Any, NoReturn

from absl import app
from absl import flags
from absl import logging as absl_logging

from flax_posemb import preemption
from flax_posemb import workdir as workdir_lib

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: re-run the same command to resume.
HELP_FLAGS = ('-h', '-?', '--help', '--helpshort', '--helpfull', '--helpxml')
# The machine, not the input: a full disk or quota, an I/O error, a read-only
# filesystem.
ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)
# Bad input when nothing else explains the error (`_is_user_error`).
USER_ERROR_TYPES = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    FileExistsError,
)


class UserError(ValueError):
  """Bad input that the user can fix; the message names the problem and the
  fix."""


def debug_enabled(argv: Sequence[str] = ()) -> bool:
  """Whether user errors show their traceback (``--debug`` or
  ``FLAX_POSEMB_DEBUG=1``)."""
  if os.environ.get('FLAX_POSEMB_DEBUG', '') not in ('', '0'):
    return True
  if '--debug' in argv:
    return True
  return (
      flags.FLAGS.is_parsed() and 'debug' in flags.FLAGS and flags.FLAGS.debug
  )


def _is_environment_failure(error: BaseException) -> bool:
  """An OSError of the machine, raised as such or reported in TensorStore's
  text."""
  if isinstance(error, OSError) and error.errno in ENVIRONMENT_ERRNOS:
    return True
  text = str(error)
  return any(f"os_error_code='{n}'" in text for n in ENVIRONMENT_ERRNOS)


def _is_user_error(error: BaseException) -> bool:
  """Bad input, unless an environment failure is among its causes."""
  cause: BaseException | None = error
  while cause is not None:
    if _is_environment_failure(cause):
      return False
    cause = cause.__cause__ or cause.__context__
  if isinstance(error, USER_ERROR_TYPES):
    return True
  return type(error).__name__ == 'UsageError'


def define_debug_flag() -> None:
  """Defines `--debug`, shared by every program: show the traceback of a user
  error."""
  flags.DEFINE_bool(
      'debug',
      False,
      'Show the traceback of user errors (or FLAX_POSEMB_DEBUG=1).',
  )


def fail(prog: str, message: str, code: int = EXIT_USER_ERROR) -> NoReturn:
  """Prints `PROG: message` on stderr and exits with `code`."""
  print(f'{prog}: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def _unknown_field_message(error: BaseException, argv: Sequence[str]) -> str:
  """The message for an override of a config field that does not exist.

  ml_collections raises ``KeyError("'KEY'")``, or with a close field
  ``KeyError('\'KEY\'\nDid you mean "NAME" instead of "KEY"?')``, itself
  wrapped in an AttributeError for a field of a section.
  """
  if isinstance(error, AttributeError) and error.args:
    if isinstance(error.args[0], KeyError):
      error = error.args[0]
  text = str(error.args[0]) if error.args else str(error)
  first_line, _, second_line = text.strip().partition('\n')
  key = first_line.strip('\'"')
  message = f'unknown config field {key!r}'
  for arg in argv:
    name = arg.split('=')[0]
    if arg.startswith('--') and key in name.split('.')[1:]:
      message += f' in {arg}'
      break
  message += ';'
  if second_line.startswith('Did you mean "'):
    suggestion = second_line.split('"')[1]
    message += f' did you mean {suggestion!r}?'
  return (
      message + ' the fields and their defaults are listed in'
      ' flax_posemb/defaults.py.'
  )


def _missing_flags_message(text: str) -> str | None:
  """'--NAME is required: HELP' for each flag absl's required-flag check names
  in ``text`` ("Flag --NAME must have a value other than None"), or None."""
  names = re.findall(r'Flag --(\w+) must have a value other than None', text)
  if not names:
    return None
  parts = []
  for name in dict.fromkeys(names):
    help_text = (
        flags.FLAGS[name].help.rstrip('.') if name in flags.FLAGS else ''
    )
    parts.append(f'--{name} is required: {help_text}')
  return '; '.join(parts) + '.'


def _message(error: BaseException, argv: Sequence[str] = ()) -> str:
  """The one line that reports bad input: a bad flag, a config field that does
  not exist (Attribute/KeyError), or an error raised by ``main`` (no
  ``argv``)."""
  if isinstance(error, (AttributeError, KeyError)):
    return _unknown_field_message(error, argv)
  text = str(error).strip() or type(error).__name__
  if isinstance(error, flags.Error) or type(error).__name__ == 'UsageError':
    missing = _missing_flags_message(text)
    if missing:
      return missing
    return f'{text} (see --helpshort).'
  if not argv or isinstance(error, UserError):
    return text
  return f'bad flags or config file: {type(error).__name__}: {text}'


def name_main_module(prog: str, module_name: str) -> None:
  """Makes absl title a ``python -m`` program's flags ``prog`` (not its
  ``__main__.py``'s path); call before the flags are defined, with the caller's
  ``__name__``."""
  if module_name == '__main__' and sys.argv and os.path.isabs(sys.argv[0]):
    sys.argv[0] = prog


HUGE_PAGES_TUNABLE = 'glibc.malloc.hugetlb=1'
HUGE_PAGES_OFF = 'FLAX_POSEMB_HUGE_PAGES'  # =0: never restart on huge pages.


def huge_pages_apply() -> bool:
  """Whether `start_on_huge_pages` restarts (once; when: docs/DESIGN.md
  § Config)."""
  lib, version = platform.libc_ver()
  try:
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      madvise = '[madvise]' in f.read()
  except OSError:
    return False
  return (
      madvise
      and lib == 'glibc'
      and tuple(map(int, version.split('.')[:2])) >= (2, 35)
      and os.environ.get(HUGE_PAGES_OFF) != '0'
      and 'glibc.malloc.hugetlb' not in os.environ.get('GLIBC_TUNABLES', '')
  )


def start_on_huge_pages() -> None:
  """Restarts this program with glibc's malloc on huge pages if
  `huge_pages_apply` (XLA:CPU's buffers: faster steps, bit-identical;
  docs/benchmarks.md); call it first in ``main``."""
  if huge_pages_apply() and sys.executable:
    tunables = ':'.join(
        filter(None, (os.environ.get('GLIBC_TUNABLES'), HUGE_PAGES_TUNABLE))
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(
        sys.executable,
        [sys.executable, *sys.orig_argv[1:]],
        dict(os.environ, GLIBC_TUNABLES=tunables, **{HUGE_PAGES_OFF: '0'}),
    )


def _config_load_error(value: Any) -> str | None:
  """The last line of a config file's load error, which config_flags keeps in
  the flag's value for later (any access raises it), or None."""
  if type(value).__name__ != '_ErrorConfig':
    return None
  error = vars(value).get('_error')
  if error is None:
    return None
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return lines[-1]


def run(
    main: Callable[[list[str]], int | None], prog: str, positional: bool = False
) -> None:
  """``app.run(main)`` (which returns the exit code) with quiet third-party
  logs: bad input is one message and exit 2, a non-finite loss exit 3; anything
  else keeps its traceback (exit 1). Positional arguments are refused unless
  ``positional``."""

  def parse(argv: list[str]) -> list[str]:
    try:
      rest = flags.FLAGS(argv)
      for name in flags.FLAGS:
        detail = _config_load_error(flags.FLAGS[name].value)
        if detail is not None:
          raise UserError(
              f'--{name}: cannot load the config file ({detail}); pass an '
              'existing config file such as configs/tiny.py.'
          )
      if len(rest) > 1 and not positional:
        raise UserError(
            f'unexpected arguments {rest[1:]}; every option is a --flag.'
        )
      return rest
    except SystemExit as e:
      # absl exits 1 after printing --help; asking for help is no error.
      asked_for_help = any(a.split('=')[0] in HELP_FLAGS for a in argv[1:])
      if e.code == 1 and asked_for_help:
        sys.exit(EXIT_OK)
      raise
    except Exception as e:
      if debug_enabled(argv):
        raise
      fail(prog, _message(e, argv))

  def guarded(argv: list[str]) -> int | None:
    try:
      return main(argv)
    except Exception as e:
      # training.NonFiniteLossError, or a non-finite state refused at save.
      nonfinite = isinstance(e, FloatingPointError)
      if debug_enabled() or not (nonfinite or _is_user_error(e)):
        raise
      if nonfinite:
        fail(prog, _message(e), EXIT_NONFINITE)
      fail(prog, _message(e), EXIT_USER_ERROR)

  sys.unraisablehook = _report_unraisable
  for handler in [
      absl_logging.get_absl_handler(),
      *logging.getLogger().handlers,
  ]:
    # Once: addFilter skips a filter the handler has.
    handler.addFilter(_third_party_filter)
  app.run(guarded, flags_parser=parse)


# Third-party INFO is noise at the default verbosity (Orbax logs every file it
# writes), and some warnings are expected here; --verbosity=1 shows them all.
NOISY_LIBRARIES = (
    '/orbax/',
    '/tensorstore/',
    '/tensorflow_datasets/',
    '/grain/',
    '/etils/',
)
# JAX, on every start without a TPU.
EXPECTED_INFO = ("Unable to initialize backend 'tpu'",)
EXPECTED_WARNINGS = (
    # Orbax, read-only (eval).
    'Given directory is read only',
    'setting save_interval_steps=0',
    # TFDS, a local corpus.
    'has no dataset_info.json',
    # A failed asynchronous save, logged from Orbax's threads: the same error is
    # raised in the main thread (the next save, or closing the checkpointer) and
    # reported there, once.
    '_SignalingThread.run() raised an exception',
    'in background save thread',
    'Save Finalize thread',
    # A restore of a damaged step fails at its first bad read (reported once, as
    # damage); its other reads, which Orbax abandons, end later with the same
    # kind of error.
    'exception was never retrieved',
)


def _third_party_filter(record: logging.LogRecord) -> bool:
  """Drops third-party INFO and the expected warnings unless --verbosity >=
  1."""
  if absl_logging.get_verbosity() >= 1:
    return True
  text = record.getMessage()
  third_party = record.name == 'asyncio' or any(
      p in record.pathname for p in NOISY_LIBRARIES
  )
  if record.levelno < logging.WARNING:
    return not (third_party or text.startswith(EXPECTED_INFO))
  return not (third_party and any(w in text for w in EXPECTED_WARNINGS))


def _report_unraisable(unraisable: Any) -> None:
  """Python's report, less the late ends of the reads that a failed Orbax
  restore abandoned, and less a `preemption.Preempted` raised where Python
  cannot propagate it (a gc callback): its request stays set, and the run
  stops on it."""
  late = unraisable.exc_type is RuntimeError and (
      str(unraisable.exc_value) == 'Event loop is closed'
  )
  code = getattr(unraisable.object, 'cr_code', None)
  from_orbax = code is not None and '/orbax/' in code.co_filename
  preempted = unraisable.exc_type is preemption.Preempted
  if not (late or from_orbax or preempted):
    sys.__unraisablehook__(unraisable)


def similar_directory(path: str) -> str | None:
  """The existing directory beside ``path`` whose name is closest to its
  name (a typo's fix), or None."""
  parent = os.path.dirname(os.path.normpath(path)) or '.'
  if not os.path.isdir(parent):
    return None
  siblings = [
      name
      for name in os.listdir(parent)
      if os.path.isdir(os.path.join(parent, name))
  ]
  close = difflib.get_close_matches(
      os.path.basename(os.path.normpath(path)), siblings, n=1
  )
  if not close:
    return None
  return os.path.join(os.path.dirname(os.path.normpath(path)), close[0])


def check_output_dir(path: str, what: str = '--workdir') -> None:
  """Raises UserError unless ``path`` is (or can be created as) a writable
  directory."""
  parent = os.path.abspath(path or '.')
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not path:
    problem = 'is empty; give a directory path'
  elif os.path.islink(path) and not os.path.exists(path):
    problem = (
        f'is a symbolic link to {os.readlink(path)}, which does not exist;'
        ' create that directory or give another path'
    )
  elif os.path.exists(path) and not os.path.isdir(path):
    problem = 'exists and is not a directory; give a directory path'
  elif not os.path.isdir(parent):
    problem = f'cannot be created: {parent} is a file, not a directory'
  elif not os.access(parent, os.W_OK | os.X_OK):
    problem = (
        f'cannot be written: {parent} is not writable; choose another directory'
    )
  else:
    return
  raise UserError(' '.join(filter(None, (what, path, problem))) + '.')


@contextlib.contextmanager
def exit_early_on_sigterm(
    prog: str, workdir: str, remove: bool = True
) -> Iterator[None]:
  """A training CLI's setup: until `preemption.defer_sigterm` a SIGTERM exits
  ``EXIT_PREEMPTED`` at once (SIGTERM in docs/DESIGN.md § Training outputs),
  removing an unused ``workdir`` it created if ``remove``."""
  created = not os.path.exists(workdir)
  replaced = preemption.install_handler()
  try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    yield
  except preemption.Preempted:
    # A second SIGTERM: let cleanup finish.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    removed = False
    if remove and created:
      removed = workdir_lib.remove_unused(workdir)
    message = 'SIGTERM while starting, before the first training step: stopped'
    if removed:
      message += f'; removed {workdir}, which this run had created'
    message += '. Re-run the same command to start (or resume) the run.'
    fail(prog, message, EXIT_PREEMPTED)
  finally:
    signal.signal(signal.SIGTERM, replaced)
