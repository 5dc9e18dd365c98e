"""Shared test setup: CPU only, JAX persistent compilation cache, one shared
tiny run.

The compilation cache lives in ``tmp/.jax_cache`` at the repository root
(git-ignored) so repeated CI runs and subprocesses reuse compiled steps.
``tiny_run`` trains one small run through the library once per session; tests
that only read a trained run share it."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE_DIR = ROOT / 'tmp' / '.jax_cache'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', str(CACHE_DIR))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update(
    'jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR']
)
jax.config.update(
    'jax_persistent_cache_min_compile_time_secs',
    float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']),
)

# Environment for subprocesses started by tests (train.py, multi-device,
# multi-host).
SUBPROCESS_ENV = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    PYTHONPATH=str(ROOT),
    JAX_COMPILATION_CACHE_DIR=str(CACHE_DIR),
)


def stream_chunks(num_docs, chunk=2):
  """Documents ``0 .. num_docs - 1`` in chunks, as the pipeline feeds the
  packers (a Grain IterDataset of ``{'doc', 'stream_position'}``)."""
  chunks = []
  for i in range(0, num_docs, chunk):
    index = np.arange(i, min(i + chunk, num_docs))
    chunks.append({'doc': index, 'stream_position': index})
  return grain.MapDataset.source(chunks).to_iter_dataset()


def tiny_config():
  """A config small enough to compile and train in seconds on one CPU core."""
  from flax_posemb import defaults

  c = defaults.base()
  c.num_train_steps = 20
  c.batch_size = 8
  c.log_every_steps = 5
  c.eval_every_steps = 10
  c.checkpoint_every_steps = 10
  c.max_to_keep = 2
  c.progress_bar = False
  c.data.seq_len = 32
  c.model.max_len = 32
  c.model.num_layers = 1
  c.model.emb_dim = 32
  c.model.mlp_dim = 64
  c.model.num_heads = 2
  c.optimizer.warmup_steps = 4
  c.eval.num_windows = 8
  c.eval.batch_size = 8
  c.eval.bucket_size = 8
  return c


@pytest.fixture(scope='session')
def tiny_config_factory():
  """Returns a fresh copy of the shared tiny config on each call."""
  return tiny_config


@pytest.fixture(scope='session')
def tiny_run(tmp_path_factory):
  """One tiny run trained through the library: (workdir, config, result)."""
  from flax_posemb import training

  workdir = str(tmp_path_factory.mktemp('tiny_run'))
  config = tiny_config()
  result = training.train_and_evaluate(config, workdir)
  return workdir, config, result


@pytest.fixture
def small_disk(tmp_path):
  """A real 1.8 MB filesystem (tmpfs; room for the first checkpoint of
  configs/tiny.py, not the second). Mounting needs root: elsewhere the tests
  using it skip, and the injected full-disk tests (which run everywhere)
  remain."""
  import subprocess

  disk = tmp_path / 'disk'
  disk.mkdir()
  if subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', 'size=1800k', 'tmpfs', str(disk)],
      capture_output=True,
      check=False,
  ).returncode:
    pytest.skip('mounting a tmpfs needs root')
  yield disk
  subprocess.run(['umount', '--lazy', str(disk)], check=False)
