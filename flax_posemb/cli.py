"""What the command-line programs share: exit codes, one-message errors, quiet logs, huge
pages and the one SIGTERM handler (README, "What happens when things go wrong")."""

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
from typing import Callable, Iterator, Sequence

EXIT_OK, EXIT_UNEXPECTED, EXIT_USER_ERROR, EXIT_NONFINITE = 0, 1, 2, 3
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: re-run the same command to resume.
HELP_FLAGS = ('-h', '-?', '--help', '--helpshort', '--helpfull', '--helpxml')
# The machine, not the input: a full disk or quota, an I/O error, a read-only filesystem.
ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


class UserError(ValueError):
  """Bad input that the user can fix; the message names the problem and the fix."""


def debug_enabled() -> bool:
  """Whether user errors show their traceback (``--debug`` or ``FLAX_POSEMB_DEBUG=1``)."""
  if os.environ.get('FLAX_POSEMB_DEBUG', '') not in ('', '0'):
    return True
  from absl import flags  # pylint: disable=g-import-not-at-top
  return bool(flags.FLAGS.is_parsed() and 'debug' in flags.FLAGS and flags.FLAGS.debug)


def _is_user_error(e: BaseException) -> bool:
  """Bad input (a ValueError, an OSError of a path the user gave, a RuntimeError of
  flax_posemb's own such as a damaged checkpoint, absl's UsageError), unless an OSError of
  the machine is among its causes (TensorStore reports one as ``[os_error_code='28']``)."""
  cause = e
  while cause is not None:
    if isinstance(cause, OSError) and cause.errno in ENVIRONMENT_ERRNOS or any(
        f"os_error_code='{n}'" in str(cause) for n in ENVIRONMENT_ERRNOS):
      return False
    cause = cause.__cause__ or cause.__context__
  return (isinstance(e, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                         PermissionError, FileExistsError)) or type(e).__name__ == 'UsageError'
          or isinstance(e, RuntimeError) and type(e).__module__.startswith('flax_posemb.'))


def define_debug_flag() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_bool('debug', False, 'Show the traceback of user errors (or FLAX_POSEMB_DEBUG=1).')


def fail(prog: str, message: str, code: int = EXIT_USER_ERROR) -> None:
  """Prints ``prog: message`` on stderr and exits with ``code``."""
  sys.stderr.write(f'{prog}: {message}\n')
  sys.stderr.flush()
  sys.exit(code)


def guarded(prog: str) -> Callable[[Callable[..., int | None]], Callable[..., int | None]]:
  """Decorates a CLI's main: a non-finite loss exits 3, a user error 2, each with one
  message; anything else keeps its traceback (exit 1)."""
  def wrap(main):
    @functools.wraps(main)
    def inner(*args, **kwargs):
      try:
        return main(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except
        nonfinite = isinstance(e, FloatingPointError)  # training.NonFiniteLossError
        if debug_enabled() or not (nonfinite or _is_user_error(e)):
          raise
        usage = ' (see --helpshort).' if type(e).__name__ == 'UsageError' else ''
        fail(prog, _one_line(e) + usage, EXIT_NONFINITE if nonfinite else EXIT_USER_ERROR)
    return inner
  return wrap


def _one_line(e: BaseException) -> str:
  """The message of ``e`` (a KeyError's without its quotes)."""
  text = str(e).strip()
  return (text[1:-1] if isinstance(e, KeyError) and text[:1] in '\'"' else text) or type(e).__name__


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
    hint = re.search(r'Did you mean "([\w.]+)"', msg)
    return (f'unknown config field {key!r}{f" in {args[0]}" if args else ""}; '
            f'{f"did you mean {hint.group(1)!r}? " if hint else ""}the fields and their '
            'defaults are listed in flax_posemb/defaults.py.')
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
          sys.exit(EXIT_OK)
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
    except Exception as e:  # pylint: disable=broad-except
      if os.environ.get('FLAX_POSEMB_DEBUG', '') not in ('', '0') or '--debug' in argv:
        raise
      fail(prog, _flag_error_message(e, argv))
    return []
  return parser


def name_main_module(prog: str, module_name: str) -> None:
  """Makes absl title a ``python -m`` program's flags ``prog`` (not its ``__main__.py``'s
  path); call before the flags are defined, with the caller's ``__name__``."""
  if module_name == '__main__' and sys.argv and os.path.isabs(sys.argv[0]):
    sys.argv[0] = prog


HUGE_PAGES_TUNABLE = 'glibc.malloc.hugetlb=1'
HUGE_PAGES_OFF = 'FLAX_POSEMB_HUGE_PAGES'  # =0: never restart on huge pages.


def huge_pages_apply() -> bool:
  """Whether `start_on_huge_pages` restarts: glibc >= 2.35 (the tunable's first release),
  transparent huge pages in ``madvise`` mode, the tunable not set, ``HUGE_PAGES_OFF`` not 0."""
  lib, version = platform.libc_ver()
  try:
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      madvise = '[madvise]' in f.read()
  except OSError:
    return False
  return (madvise and lib == 'glibc' and tuple(map(int, version.split('.')[:2])) >= (2, 35)
          and os.environ.get(HUGE_PAGES_OFF) != '0'
          and 'glibc.malloc.hugetlb' not in os.environ.get('GLIBC_TUNABLES', ''))


def start_on_huge_pages() -> None:
  """Restarts this program with glibc's malloc on transparent huge pages when
  `huge_pages_apply` (XLA:CPU's buffers come from malloc: 7-12% faster steps, bit-identical;
  README, Benchmarks). glibc reads the tunable at start only: call this first in ``main``."""
  if not huge_pages_apply() or not sys.executable:
    return
  tunables = ':'.join(filter(None, (os.environ.get('GLIBC_TUNABLES'), HUGE_PAGES_TUNABLE)))
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
            dict(os.environ, GLIBC_TUNABLES=tunables, **{HUGE_PAGES_OFF: '0'}))


def run(main: Callable[[list[str]], int | None], prog: str) -> None:
  """``app.run(main)`` with one-message errors and quiet third-party logs; ``main``'s return
  value is the exit code."""
  from absl import app  # pylint: disable=g-import-not-at-top

  def main_quietly(argv):
    quiet_third_party()
    return main(argv)
  app.run(guarded(prog)(main_quietly), flags_parser=parse_flags(prog))


# Libraries whose INFO records are noise at the default verbosity (Orbax logs every file it
# writes; TFDS every builder lookup), and warnings that are expected here.
NOISY_LIBRARIES = ('/orbax/', '/tensorstore/', '/tensorflow_datasets/', '/grain/', '/etils/')
# INFO of other libraries on every start (JAX probing for a TPU); shown with --verbosity=1.
EXPECTED_INFO = ("Unable to initialize backend 'tpu'",)
EXPECTED_WARNINGS = (
    'Given directory is read only',  # Orbax, for every read-only restore (eval): intended.
    'setting save_interval_steps=0',  # Orbax, the same.
    'has no dataset_info.json',  # TFDS, for a local corpus before its first build.
    'Using custom data configuration',
    # A failed asynchronous save, logged from Orbax's threads: the same error is raised in the
    # main thread (the next save, or closing the checkpointer) and reported there, once.
    '_SignalingThread.run() raised an exception', 'in background save thread',
    'Save Finalize thread')


class _ThirdPartyFilter(logging.Filter):
  """Drops third-party INFO and the expected warnings unless --verbosity >= 1."""

  def filter(self, record: logging.LogRecord) -> bool:
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    if absl_logging.get_verbosity() >= 1:
      return True
    third_party = any(p in record.pathname for p in NOISY_LIBRARIES)
    if record.levelno < logging.WARNING and (
        third_party or record.getMessage().startswith(EXPECTED_INFO)):
      return False
    return not (third_party and any(w in record.getMessage() for w in EXPECTED_WARNINGS))


def quiet_third_party() -> None:
  """A `_ThirdPartyFilter` on absl's and the root logger's handlers: the project's own INFO
  (progress, periodic eval results) shows at the default verbosity."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  for h in [absl_logging.get_absl_handler(), *logging.getLogger().handlers]:
    if not any(isinstance(f, _ThirdPartyFilter) for f in h.filters):
      h.addFilter(_ThirdPartyFilter())


def check_output_dir(path: str, what: str = '--workdir') -> None:
  """Raises UserError unless ``path`` is (or can be created as) a writable directory."""
  parent = os.path.abspath(path or '.')
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not path:
    problem = 'is empty; give a directory path'
  elif os.path.islink(path) and not os.path.exists(path):
    problem = (f'is a symbolic link to {os.readlink(path)}, which does not exist; create that '
               'directory or give another path')
  elif os.path.exists(path) and not os.path.isdir(path):
    problem = 'exists and is not a directory; give a directory path'
  elif not os.path.isdir(parent):
    problem = f'cannot be created: {parent} is a file, not a directory'
  elif not os.access(parent, os.W_OK | os.X_OK):
    problem = f'cannot be written: {parent} is not writable; choose another directory'
  else:
    return
  raise UserError(' '.join(filter(None, (what, path, problem))) + '.')


class Preempted(BaseException):
  """SIGTERM before training began: stop at once (no ``except Exception`` swallows it)."""


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
    with contextlib.suppress(ValueError):  # Not the main thread: no handler.
      old = signal.signal(signal.SIGTERM, _on_sigterm)
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
