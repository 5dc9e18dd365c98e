"""Exposure report: library dict and the `python -m flax_posemb.data` CLI."""

import json
import os
import subprocess
import sys

import numpy as np

from configs import tiny
from flax_posemb.data import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exposure_counts_real_tokens_per_position():
  cfg = tiny.get_config()
  cfg.data.prefetch = 0
  rep = report.exposure(cfg, num_batches=5, num_source_docs=100)
  assert len(rep['counts']) == cfg.data.seq_len and len(rep['deciles']) == 10
  assert rep['real_tokens'] == sum(rep['counts']) > 0
  assert rep['token_slots'] == 5 * cfg.batch_size * cfg.data.seq_len
  assert sum(h['docs'] for h in rep['doc_lengths']) == 100
  np.testing.assert_allclose(sum(h['token_share'] for h in rep['segment_lengths']), 1.0)
  assert 'padding' in report.format_report(rep)


def test_exposure_of_packed_has_no_padding():
  cfg = tiny.get_config()
  cfg.data.position_policy = 'packed'
  rep = report.exposure(cfg, num_batches=2, num_source_docs=10)
  assert rep['padding_fraction'] == 0.0 and rep['last_over_first'] == 1.0


def test_cli_prints_and_writes_json_and_png(tmp_path):
  js, png = tmp_path / 'e.json', tmp_path / 'e.png'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  out = subprocess.run(
      [sys.executable, '-m', 'flax_posemb.data', '--config', 'configs/tiny.py',
       '--num_batches', '3', '--json', str(js), '--png', str(png),
       '--config.data.position_policy=packed_reset'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'policy=packed_reset' in out.stdout and 'decile' in out.stdout
  assert json.loads(js.read_text())['policy'] == 'packed_reset'
  assert png.stat().st_size > 1000
