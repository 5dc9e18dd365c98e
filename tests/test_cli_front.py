"""The front door: what a new user sees when starting the command-line programs."""

import logging
import subprocess
import sys

import pytest
from conftest import ROOT, SUBPROCESS_ENV

from flax_posemb import cli


@pytest.mark.parametrize('argv, title', [
    (['train.py', '--help'], 'train.py:'),
    (['eval.py', '--helpfull'], 'eval.py:'),
    (['-m', 'flax_posemb.experiments', '--help'], 'python -m flax_posemb.experiments:'),
    (['-m', 'flax_posemb.data', '--helpshort'], 'python -m flax_posemb.data:'),
    (['-m', 'flax_posemb.data.prepare', '--help'], 'python -m flax_posemb.data.prepare:'),
])
def test_help_exits_0_and_titles_the_flags_with_the_program_name(argv, title):
  p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=SUBPROCESS_ENV,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  assert title in p.stdout.splitlines() or '--helpshort' in argv
  assert '__main__.py' not in p.stdout and str(ROOT) not in p.stdout


def test_an_unknown_flag_still_exits_2():
  p = subprocess.run([sys.executable, 'train.py', '--help_me'], cwd=ROOT, env=SUBPROCESS_ENV,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and 'help_me' in p.stderr


def _record(msg, path, level=logging.INFO):
  return logging.LogRecord('jax._src.xla_bridge', level, path, 1, msg, (), None)


def test_the_tpu_probe_of_a_machine_without_tpu_is_not_logged_at_the_default_verbosity():
  f = cli._ThirdPartyFilter()  # pylint: disable=protected-access
  path = '/site-packages/jax/_src/xla_bridge.py'
  tpu = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: "
         'cannot open shared object file')
  assert not f.filter(_record(tpu, path))
  assert f.filter(_record("Unable to initialize backend 'cuda': ...", path, logging.WARNING))
  assert f.filter(_record('eval step 100: loss 2.7664', '/flax_posemb/training.py'))
