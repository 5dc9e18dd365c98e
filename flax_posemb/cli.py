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

``run(main, prog)`` is ``absl.app.run`` with these rules applied to flag parsing too (an
unknown ``--config.key``, a value of the wrong type, a missing or broken config file), and
``main`` returning an exit code. SIGTERM has one handler (`exit_early_on_sigterm`,
`defer_sigterm`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import platform
import re
import signal
import sys
import traceback
from typing import Callable, Iterator, Sequence

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
  # dataset or table file; the other OSErrors a path the user gave that cannot be used.
  # (A full disk or an I/O error is not the user's input: it keeps its traceback.)
  return (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
          PermissionError, FileExistsError)


# The machine, not the input: a full disk or quota, an I/O error, a read-only filesystem.
ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


def _environment_failure(e: BaseException) -> bool:
  """An OSError of the machine, or one that TensorStore (under Orbax) reports as a ValueError
  (``... [os_error_code='28']``), anywhere in ``e``'s chain of causes: exit 1, traceback."""
  while e is not None:
    if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
      return True
    if any(f"os_error_code='{n}'" in str(e) for n in ENVIRONMENT_ERRNOS):
      return True
    e = e.__cause__ or e.__context__
  return False


def _own_runtime_error(e: BaseException) -> bool:
  """A RuntimeError class of flax_posemb's own (e.g. checkpointing.CheckpointDamagedError):
  its message is written for users (what is damaged, what to do). Plain RuntimeErrors (of
  JAX/XLA, other libraries, or a bug here) keep their traceback."""
  return type(e).__module__.startswith('flax_posemb.')


def define_debug_flag() -> None:
  """Defines ``--debug`` (show the traceback of user errors) in the calling CLI."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_bool('debug', False, 'Show the traceback of user errors too (or set '
                    'FLAX_POSEMB_DEBUG=1).')


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
        if debug_enabled() or _environment_failure(e):
          raise  # A full disk is no user error: EXIT_UNEXPECTED with the traceback.
        fail(prog, _one_line(e), EXIT_USER_ERROR)
      except RuntimeError as e:
        if debug_enabled() or not _own_runtime_error(e):
          raise
        fail(prog, _one_line(e), EXIT_USER_ERROR)
      except Exception as e:  # absl's app.UsageError: bad positional arguments, flag combos.
        if type(e).__name__ != 'UsageError' or debug_enabled():
          raise
        fail(prog, f'{e} (see --helpshort).', EXIT_USER_ERROR)
      return None
    return inner
  return wrap


def _one_line(e: BaseException) -> str:
  """The message of ``e`` (multi-line messages are kept: they are one message)."""
  text = str(e).strip()
  if isinstance(e, KeyError) and text.startswith(("'", '"')):
    text = text[1:-1]
  return text or type(e).__name__


def _flag_error_message(e: BaseException, argv: Sequence[str]) -> str:
  """One message for an exception raised while parsing flags (config overrides included)."""
  msg = _one_line(e)
  if isinstance(e, UserError):
    return msg
  if isinstance(e, (AttributeError, KeyError)):  # ml_collections: unknown config field.
    found = re.search(r"'([A-Za-z_][\w]*)\\*'", msg)
    key = found.group(1) if found else msg
    args = [a for a in argv if a.startswith('--') and re.search(
        rf'\.{re.escape(key)}(\.|=|$)', a.split('=')[0])]
    where = f' in {args[0]}' if args else ''
    hint = re.search(r'Did you mean "([\w.]+)"', msg)
    hint = f'did you mean {hint.group(1)!r}? ' if hint else ''
    return (f'unknown config field {key!r}{where}; {hint}the fields and their defaults are '
            'listed in flax_posemb/defaults.py.')
  from absl import flags  # pylint: disable=g-import-not-at-top
  if isinstance(e, flags.Error):
    return f'{msg} (see --helpshort).'
  return f'bad flags or config file: {type(e).__name__}: {msg}'


def parse_flags(prog: str) -> Callable[[list[str]], list[str]]:
  """An ``app.run`` flags_parser: flag and config-file errors are one message, exit 2."""
  def parser(argv: list[str]) -> list[str]:
    from absl import flags  # pylint: disable=g-import-not-at-top
    try:
      try:
        rest = flags.FLAGS(argv)
      except SystemExit as e:  # absl exits 1 after printing --help; asking for help is no error.
        if e.code == 1 and any(a.split('=')[0] in HELP_FLAGS for a in argv[1:]):
          raise SystemExit(EXIT_OK) from None
        raise
      for name in flags.FLAGS:
        # config_flags keeps a config file's load error for later (any access raises it).
        value = flags.FLAGS[name].value
        error = vars(value).get('_error') if type(value).__name__ == '_ErrorConfig' else None
        if error is not None:
          detail = [l.strip() for l in str(error).splitlines() if l.strip()][-1]
          raise UserError(f'--{name}: cannot load the config file ({detail}); pass an '
                          'existing config file such as configs/tiny.py.')
      return rest
    except SystemExit:
      raise
    except Exception as e:  # pylint: disable=broad-except
      if os.environ.get('FLAX_POSEMB_DEBUG', '') not in ('', '0') or '--debug' in argv:
        raise
      fail(prog, _flag_error_message(e, argv))
    return []
  return parser


HELP_FLAGS = ('-h', '-?', '--help', '--helpshort', '--helpfull', '--helpxml')


def name_main_module(prog: str, module_name: str) -> None:
  """Makes absl title a ``python -m`` program's flags ``prog`` rather than the absolute path of
  its ``__main__.py`` (absl names the main module by ``sys.argv[0]``). Call before the flags
  are defined, with the caller's ``__name__`` (nothing changes unless it is ``'__main__'``)."""
  if module_name == '__main__' and sys.argv and os.path.isabs(sys.argv[0]):
    sys.argv[0] = prog


HUGE_PAGES_TUNABLE = 'glibc.malloc.hugetlb=1'
HUGE_PAGES_OFF = 'FLAX_POSEMB_HUGE_PAGES'  # =0: never restart on huge pages.


def huge_pages_apply() -> bool:
  """Whether `start_on_huge_pages` restarts this process: glibc >= 2.35 (the tunable's first
  release), transparent huge pages in ``madvise`` mode (with ``always`` the kernel already
  uses them, with ``never`` the tunable does nothing), the tunable not set yet and
  ``FLAX_POSEMB_HUGE_PAGES`` not ``0``."""
  if os.environ.get(HUGE_PAGES_OFF) == '0' or 'glibc.malloc.hugetlb' in os.environ.get(
      'GLIBC_TUNABLES', ''):
    return False
  lib, version = platform.libc_ver()
  try:
    if lib != 'glibc' or tuple(int(x) for x in version.split('.')[:2]) < (2, 35):
      return False
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      return '[madvise]' in f.read()
  except (OSError, ValueError):
    return False


def start_on_huge_pages() -> None:
  """Restarts this program (same interpreter and arguments) with glibc's malloc on
  transparent huge pages, when `huge_pages_apply`; returns otherwise.

  XLA:CPU's buffers come from malloc; on 4 KB pages the train step spends its time in TLB
  misses (7-12% faster steps on huge pages at the benchmark's small shape, bit-identical
  results; README, Benchmarks). glibc reads the tunable only at process start, so a restart
  is the only way to set it; call this first in ``main``, before anything is written.
  """
  if not huge_pages_apply() or not sys.executable:
    return
  tunables = ':'.join(filter(None, (os.environ.get('GLIBC_TUNABLES'), HUGE_PAGES_TUNABLE)))
  sys.stdout.flush()
  sys.stderr.flush()
  # HUGE_PAGES_OFF=0 in the new process: it never restarts again, whatever its environment.
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
            dict(os.environ, GLIBC_TUNABLES=tunables, **{HUGE_PAGES_OFF: '0'}))


def run(main: Callable[[list[str]], int | None], prog: str) -> None:
  """``app.run(main)`` with one-message errors for flags and ``main`` (see ``guarded``) and
  the project's logging (``quiet_third_party``); ``main``'s return value is the exit code."""
  from absl import app  # pylint: disable=g-import-not-at-top

  def main_with_logging(argv):
    quiet_third_party()
    return main(argv)
  app.run(guarded(prog)(functools.wraps(main)(main_with_logging)),
          flags_parser=parse_flags(prog))


# Libraries whose INFO records are noise at the default verbosity (Orbax logs every file it
# writes; TFDS every builder lookup), and warnings that are expected here.
NOISY_LIBRARIES = ('/orbax/', '/tensorstore/', '/tensorflow_datasets/', '/grain/', '/etils/')
# INFO lines of other libraries that are expected on every start (JAX probing for a TPU on a
# machine without one); shown with --verbosity=1.
EXPECTED_INFO = ("Unable to initialize backend 'tpu'",)
EXPECTED_WARNINGS = (
    'Given directory is read only',  # Orbax, for every read-only restore (eval): intended.
    'has no dataset_info.json',  # TFDS, for a local corpus before its first build.
    'Using custom data configuration',
)
# Orbax's logs of a failed asynchronous save, from its threads: the same error is raised in
# the main thread (the next save, or closing the checkpointer) and reported there, once.
REPORTED_AGAIN = ('_SignalingThread.run() raised an exception', 'in background save thread',
                  'Save Finalize thread')


class _ThirdPartyFilter(logging.Filter):
  """Drops third-party INFO (and the expected warnings and the errors reported again above)
  unless --verbosity >= 1."""

  def filter(self, record: logging.LogRecord) -> bool:
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    if absl_logging.get_verbosity() >= 1:  # --verbosity=1 (debug): everything.
      return True
    third_party = any(p in record.pathname for p in NOISY_LIBRARIES)
    if record.levelno < logging.WARNING and (
        third_party or record.getMessage().startswith(EXPECTED_INFO)):
      return False
    return not (third_party and any(w in record.getMessage()
                                    for w in EXPECTED_WARNINGS + REPORTED_AGAIN))


def quiet_third_party() -> None:
  """Silences third-party noise at the source: a filter on absl's and the root logger's
  handlers, so the project's own ``logging.info`` (progress, periodic eval results) shows at
  the default verbosity and ``--verbosity`` keeps its meaning."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  handlers = [absl_logging.get_absl_handler(), *logging.getLogger().handlers]
  for h in handlers:
    if not any(isinstance(f, _ThirdPartyFilter) for f in h.filters):
      h.addFilter(_ThirdPartyFilter())


def check_output_dir(path: str, what: str = '--workdir') -> None:
  """Raises UserError unless ``path`` is (or can be created as) a writable directory."""
  if not path:
    raise UserError(f'{what} is empty; give a directory path.')
  if os.path.islink(path) and not os.path.exists(path):
    raise UserError(f'{what} {path} is a symbolic link to {os.readlink(path)}, which does not '
                    'exist; create that directory or give another path.')
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f'{what} {path} exists and is not a directory; give a directory path.')
  parent = os.path.abspath(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise UserError(f'{what} {path} cannot be created: {parent} is a file, not a directory.')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f'{what} {path}: {parent} is not writable; choose another directory.')


class Preempted(BaseException):
  """SIGTERM before training started: stop at once (no ``except Exception`` swallows it)."""


_SIGTERM = {'requested': False, 'deferred': False}


def _on_sigterm(signum, frame) -> None:
  """The process's one SIGTERM handler (README, "SIGTERM at any time is safe")."""
  del signum, frame
  _SIGTERM['requested'] = True
  if not _SIGTERM['deferred']:
    raise Preempted()


def sigterm_requested() -> bool:
  """Whether SIGTERM arrived since `defer_sigterm` began (the training loop then saves)."""
  return _SIGTERM['requested']


@contextlib.contextmanager
def defer_sigterm(install: bool = True) -> Iterator[None]:
  """From here on SIGTERM only sets `sigterm_requested` (training: the loop saves a
  checkpoint and stops). Installs the handler for the block if the process has not (a
  library caller); ``install=False`` on several hosts, where JAX's notifier owns SIGTERM."""
  _SIGTERM.update(requested=False, deferred=True)
  old = None
  if install and signal.getsignal(signal.SIGTERM) is not _on_sigterm:
    try:
      old = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # Not the main thread: no handler.
      pass
  try:
    yield
  finally:
    if old is not None:
      signal.signal(signal.SIGTERM, old)
      _SIGTERM['deferred'] = False


@contextlib.contextmanager
def exit_early_on_sigterm(prog: str, workdir: str, remove: bool = True) -> Iterator[None]:
  """Installs the one SIGTERM handler for a training CLI and takes a SIGTERM held since start
  (train.py blocks it while importing). Until training begins (`defer_sigterm`), SIGTERM
  stops at once: it removes ``workdir`` if this process created it and it is still empty and
  unlocked (`workdir.remove_unused`; not if ``remove`` is False: hosts share it), and exits
  ``EXIT_PREEMPTED``."""
  created = not os.path.exists(workdir)
  old = signal.signal(signal.SIGTERM, _on_sigterm)
  try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    yield
  except Preempted:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # A second SIGTERM: let cleanup finish.
    from flax_posemb import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    removed = remove and created and workdir_lib.remove_unused(workdir)
    fail(prog, 'SIGTERM while starting, before the first training step: stopped'
         + (f'; removed {workdir}, which this run had created' if removed else '')
         + '. Re-run the same command to start (or resume) the run.', EXIT_PREEMPTED)
  finally:
    signal.signal(signal.SIGTERM, old)
