"""The front door: what a new user sees when starting the command-line
programs."""

import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from conftest import SUBPROCESS_ENV
from flax_posemb import cli


def _defined_flags(source: pathlib.Path) -> list[str]:
  """The names of the flags a program's own file defines (absl's DEFINE_*;
  the shared --debug is cli's)."""
  return re.findall(r"DEFINE_\w+\(\s*'(\w+)'", source.read_text())


@pytest.mark.parametrize(
    'argv, source, title',
    [
        (['train.py', '--help'], 'train.py', 'train.py:'),
        (['eval.py', '--helpfull'], 'eval.py', 'eval.py:'),
        (
            ['-m', 'flax_posemb.experiments', '--help'],
            'flax_posemb/experiments/__main__.py',
            'python -m flax_posemb.experiments:',
        ),
        (
            ['-m', 'flax_posemb.commands.data_report', '--helpshort'],
            'flax_posemb/commands/data_report.py',
            'python -m flax_posemb.commands.data_report:',
        ),
        (
            ['-m', 'flax_posemb.commands.prepare', '--help'],
            'flax_posemb/commands/prepare.py',
            'python -m flax_posemb.commands.prepare:',
        ),
    ],
)
def test_help_exits_0_and_titles_the_flags_with_the_program_name(
    argv, source, title
):
  """The help exits 0, lists every flag the program defines under the
  program's name (--helpshort: the flags alone), and shows no file path."""
  p = subprocess.run(
      [sys.executable, *argv],
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert p.returncode == 0, p.stderr[-2000:]
  lines = p.stdout.splitlines()
  if title is not None:
    assert title in lines
  listed = {line.split(':')[0].strip() for line in lines}
  names = _defined_flags(ROOT / source)
  assert names, source
  for name in names:
    assert f'--{name}' in listed or f'--[no]{name}' in listed, name
  assert '__main__.py' not in p.stdout and str(ROOT) not in p.stdout


def test_an_unknown_flag_still_exits_2():
  p = subprocess.run(
      [sys.executable, 'train.py', '--help_me'],
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert p.returncode == 2 and 'help_me' in p.stderr


def _record(msg, path, level=logging.INFO):
  return logging.LogRecord('jax._src.xla_bridge', level, path, 1, msg, (), None)


def test_the_tpu_probe_is_not_logged_at_the_default_verbosity():
  f = cli._third_party_filter
  path = '/site-packages/jax/_src/xla_bridge.py'
  tpu = (
      "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so:"
      ' libtpu.so: cannot open shared object file'
  )
  assert not f(_record(tpu, path))
  assert f(
      _record("Unable to initialize backend 'cuda': ...", path, logging.WARNING)
  )
  assert f(_record('eval step 100: loss 2.7664', '/flax_posemb/training.py'))


@pytest.mark.parametrize('off', ['', '0'])
def test_programs_restart_on_huge_pages_where_glibc_and_kernel_allow(
    off,
):
  code = (
      'from flax_posemb import cli; cli.start_on_huge_pages(); import os;'
      " print(os.environ.get('GLIBC_TUNABLES'),"
      " os.environ.get('FLAX_POSEMB_HUGE_PAGES'))"
  )
  env = {
      k: v
      for k, v in SUBPROCESS_ENV.items()
      if k not in ('GLIBC_TUNABLES', 'FLAX_POSEMB_HUGE_PAGES')
  }
  if off:
    env['FLAX_POSEMB_HUGE_PAGES'] = off
  p = subprocess.run(
      [sys.executable, '-c', code],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert p.returncode == 0, p.stderr[-2000:]
  saved = {
      k: os.environ.pop(k, None)
      for k in ('GLIBC_TUNABLES', 'FLAX_POSEMB_HUGE_PAGES')
  }
  try:
    os.environ.update({'FLAX_POSEMB_HUGE_PAGES': off} if off else {})
    applies = cli.huge_pages_apply()
  finally:
    os.environ.pop('FLAX_POSEMB_HUGE_PAGES', None)
    os.environ.update({k: v for k, v in saved.items() if v is not None})
  want = (cli.HUGE_PAGES_TUNABLE + ' 0') if applies else f"None {off or 'None'}"
  assert p.stdout.strip() == want
  # This project's machines:
  with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
    # glibc 2.36, transparent huge pages on madvise.
    madvise = '[madvise]' in f.read()
  assert applies == (madvise and not off)


def test_only_the_ends_of_abandoned_checkpoint_reads_are_kept_off_stderr(
    capsys, monkeypatch
):
  """A failed restore's abandoned reads end after Orbax closed its loop; any
  other exception Python cannot raise is still printed."""
  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', seen.append)

  class Raises:

    def __init__(self, exc):
      self.exc = exc

    def __del__(self):
      raise self.exc

  Raises(RuntimeError('Event loop is closed'))
  Raises(KeyError('a bug of ours'))
  late, bug = seen
  cli._report_unraisable(late)
  assert capsys.readouterr().err == ''
  cli._report_unraisable(bug)
  assert 'a bug of ours' in capsys.readouterr().err
