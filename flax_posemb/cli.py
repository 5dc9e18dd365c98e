"""What the CLIs share: exit codes, one-message errors, quiet logs, huge pages,
the one SIGTERM handler (README, "What happens when things go wrong")."""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import errno
import logging
import os
import platform
import re
import signal
import sys
from typing import Any

EXIT_OK, EXIT_UNEXPECTED, EXIT_USER_ERROR, EXIT_NONFINITE = 0, 1, 2, 3
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: re-run the same command to resume.
HELP_FLAGS = ('-h', '-?', '--help', '--helpshort', '--helpfull', '--helpxml')
# The machine, not the input: a full disk or quota, an I/O error, a read-only
# filesystem.
ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


class UserError(ValueError):
  """Bad input that the user can fix; the message names the problem and the
  fix."""


def debug_enabled(argv: Sequence[str] = ()) -> bool:
  """Whether user errors show their traceback (``--debug`` or
  ``FLAX_POSEMB_DEBUG=1``)."""
  from absl import flags

  parsed = (
      flags.FLAGS.is_parsed() and 'debug' in flags.FLAGS and flags.FLAGS.debug
  )
  return (
      os.environ.get('FLAX_POSEMB_DEBUG', '') not in ('', '0')
      or '--debug' in argv
      or parsed
  )


def _is_user_error(e: BaseException) -> bool:
  """Bad input, unless an OSError of the machine (errno or TensorStore's text)
  is a cause."""
  cause = e
  while cause is not None:
    if (
        isinstance(cause, OSError)
        and cause.errno in ENVIRONMENT_ERRNOS
        or any(f"os_error_code='{n}'" in str(cause) for n in ENVIRONMENT_ERRNOS)
    ):
      return False
    cause = cause.__cause__ or cause.__context__
  return (
      isinstance(
          e,
          (
              ValueError,
              FileNotFoundError,
              NotADirectoryError,
              IsADirectoryError,
              PermissionError,
              FileExistsError,
          ),
      )
      or type(e).__name__ == 'UsageError'
  )


def define_debug_flag() -> None:
  from absl import flags

  flags.DEFINE_bool(
      'debug',
      False,
      'Show the traceback of user errors (or FLAX_POSEMB_DEBUG=1).',
  )


def fail(prog: str, message: str, code: int = EXIT_USER_ERROR) -> None:
  print(f'{prog}: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def _message(e: BaseException, argv: Sequence[str] = ()) -> str:
  """One message for bad input, also a bad flag (an unknown config field:
  Attribute/KeyError)."""
  from absl import flags

  msg = str(e).strip() or type(e).__name__
  if isinstance(e, (AttributeError, KeyError)):
    found = re.search(r"'([A-Za-z_][\w]*)\\*'", msg)
    key = found.group(1) if found else msg.strip('\'"')
    args = [
        a
        for a in argv
        if a.startswith('--')
        and re.search(rf'\.{re.escape(key)}(\.|=|$)', a.split('=')[0])
    ]
    hint = re.search(r'Did you mean "([\w.]+)"', msg)
    return (
        f'unknown config field {key!r}{f" in {args[0]}" if args else ""};'
        f' {f"did you mean {hint.group(1)!r}? " if hint else ""}the fields and'
        ' their defaults are listed in flax_posemb/defaults.py.'
    )
  if isinstance(e, flags.Error) or type(e).__name__ == 'UsageError':
    return f'{msg} (see --helpshort).'
  # raised by main, or parse's own message
  plain = not argv or isinstance(e, UserError)
  return (
      msg if plain else f'bad flags or config file: {type(e).__name__}: {msg}'
  )


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
  §Config)."""
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
  `huge_pages_apply` (XLA:CPU's buffers: faster steps, bit-identical; README,
  Benchmarks); call it first in ``main``."""
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


def run(
    main: Callable[[list[str]], int | None], prog: str, positional: bool = False
) -> None:
  """``app.run(main)`` (which returns the exit code) with quiet third-party
  logs: bad input is one message and exit 2, a non-finite loss exit 3; anything
  else keeps its traceback (exit 1). Positional arguments are refused unless
  ``positional``."""
  from absl import app
  from absl import flags
  from absl import logging as absl_logging

  def parse(argv: list[str]) -> list[str]:
    try:
      rest = flags.FLAGS(argv)
      for name in flags.FLAGS:
        # config_flags keeps a config file's load error for later (any access
        # raises it).
        value = flags.FLAGS[name].value
        error = (
            vars(value).get('_error')
            if type(value).__name__ == '_ErrorConfig'
            else None
        )
        if error is not None:
          detail = [
              line.strip() for line in str(error).splitlines() if line.strip()
          ][-1]
          raise UserError(
              f'--{name}: cannot load the config file ({detail}); pass an '
              'existing config file such as configs/tiny.py.'
          )
      if len(rest) > 1 and not positional:
        raise UserError(
            f'unexpected arguments {rest[1:]}; every option is a --flag.'
        )
      return rest
    # absl exits 1 after printing --help; asking for help is no error.
    except SystemExit as e:
      if e.code == 1 and any(a.split('=')[0] in HELP_FLAGS for a in argv[1:]):
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
      # training.NonFiniteLossError
      nonfinite = isinstance(e, FloatingPointError)
      if debug_enabled() or not (nonfinite or _is_user_error(e)):
        raise
      fail(prog, _message(e), EXIT_NONFINITE if nonfinite else EXIT_USER_ERROR)

  sys.unraisablehook = _report_unraisable
  for h in [absl_logging.get_absl_handler(), *logging.getLogger().handlers]:
    # Once: addFilter skips a filter the handler has.
    h.addFilter(_third_party_filter)
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
    'Using custom data configuration',
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
  from absl import logging as absl_logging

  text = record.getMessage()
  third_party = record.name == 'asyncio' or any(
      p in record.pathname for p in NOISY_LIBRARIES
  )
  quiet = record.levelno < logging.WARNING and (
      third_party or text.startswith(EXPECTED_INFO)
  )
  return absl_logging.get_verbosity() >= 1 or not (
      quiet or third_party and any(w in text for w in EXPECTED_WARNINGS)
  )


def _report_unraisable(unraisable: Any) -> None:
  """Python's report, less the late ends of the reads that a failed Orbax
  restore abandoned."""
  code = getattr(unraisable.object, 'cr_code', None)
  late = unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == (
      'Event loop is closed'
  )
  if not (late or code is not None and '/orbax/' in code.co_filename):
    sys.__unraisablehook__(unraisable)


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


class Preempted(BaseException):
  """SIGTERM before training began: stop at once (no ``except Exception``
  swallows it)."""


_SIGTERM = {'requested': False, 'deferred': False}


def _on_sigterm(signum, frame) -> None:
  """The process's one SIGTERM handler (docs/DESIGN.md, "SIGTERM")."""
  del signum, frame
  _SIGTERM['requested'] = True
  if not _SIGTERM['deferred']:
    raise Preempted()


def sigterm_requested() -> bool:
  return _SIGTERM['requested']


@contextlib.contextmanager
def defer_sigterm(install: bool = True) -> Iterator[None]:
  """In the block SIGTERM only sets `sigterm_requested` (the loop saves and
  stops); installs the handler unless the process has it or ``install`` is False
  (several hosts: JAX's notifier)."""
  before = dict(_SIGTERM)
  _SIGTERM.update(requested=False, deferred=True)
  old = None
  if install and signal.getsignal(signal.SIGTERM) is not _on_sigterm:
    with contextlib.suppress(ValueError):  # Not the main thread: no handler.
      old = signal.signal(signal.SIGTERM, _on_sigterm) or signal.SIG_DFL
  try:
    yield
  finally:
    _SIGTERM['deferred'] = before['deferred']
    if old is not None:
      signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def exit_early_on_sigterm(
    prog: str, workdir: str, remove: bool = True
) -> Iterator[None]:
  """The one SIGTERM handler for a training CLI (docs/DESIGN.md "SIGTERM"):
  until `defer_sigterm` it exits ``EXIT_PREEMPTED`` at once, removing an unused
  ``workdir`` it created if ``remove``."""
  created = not os.path.exists(workdir)
  _SIGTERM.update(requested=False, deferred=False)
  old = signal.signal(signal.SIGTERM, _on_sigterm)
  try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    yield
  except Preempted:
    # A second SIGTERM: let cleanup finish.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from flax_posemb import workdir as workdir_lib

    removed = remove and created and workdir_lib.remove_unused(workdir)
    fail(
        prog,
        'SIGTERM while starting, before the first training step: stopped'
        + (
            f'; removed {workdir}, which this run had created'
            if removed
            else ''
        )
        + '. Re-run the same command to start (or resume) the run.',
        EXIT_PREEMPTED,
    )
  finally:
    signal.signal(signal.SIGTERM, old)
