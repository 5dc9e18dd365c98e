"""Input-pipeline suite: batches/s and tokens/s of `make_train_iterator` per
policy.

`tokens_per_s` counts row slots (batch x row length, padding included): what a
train step consumes, so it compares directly with the train step's tokens/s
(`summary` in run.py divides the two). `real_tokens_per_s` counts non-padding
tokens only."""

from __future__ import annotations

import tempfile
import time
import traceback
from typing import Any

from benchmarks import common
from configs import tiny
from flax_posemb import config as config_lib
from flax_posemb import data


def _config(shape: common.Shape, policy: str, source: str, data_dir: str):
  cfg = tiny.get_config()
  cfg.batch_size = shape.batch_size
  cfg.data.seq_len = shape.seq_len
  cfg.model.max_len = shape.seq_len
  cfg.data.position_policy = policy
  cfg.data.schedule_seq_len = max(shape.seq_len // 4, 1)
  cfg.data.source = source
  cfg.data.data_dir = data_dir
  if source == 'synthetic':
    cfg.data.synthetic.vocab_size = min(shape.vocab_size, 64)
    period = cfg.data.synthetic.num_regimes * cfg.data.synthetic.segment_len
    if shape.seq_len % period:
      cfg.data.synthetic.num_regimes = 1
      cfg.data.synthetic.segment_len = 1
  return config_lib.RunConfig.from_config_dict(cfg)


def measure(
    shape: common.Shape,
    policy: str,
    source: str,
    batches: int,
    warmup: int,
    data_dir: str,
) -> dict[str, Any]:
  """Times `batches` batches after `warmup` untimed ones (iterator construction
  separate)."""
  cfg = _config(shape, policy, source, data_dir)
  t0 = time.perf_counter()
  it = data.make_train_iterator(
      cfg.data,
      batch_size=cfg.batch_size,
      seed=0,
      num_train_steps=batches + warmup,
  )
  for _ in range(warmup):
    next(it)
  t1 = time.perf_counter()
  slots = 0
  real = 0
  for _ in range(batches):
    b = next(it)
    slots += b['segment_ids'].size
    real += int((b['segment_ids'] > 0).sum())
  dt = time.perf_counter() - t1
  return {
      'policy': policy,
      'source': source,
      'batches': batches,
      'seconds': dt,
      'setup_s': t1 - t0,
      'batches_per_s': batches / dt,
      'tokens_per_s': slots / dt,
      'real_tokens_per_s': real / dt,
      'real_fraction': real / max(slots, 1),
  }


def run_suite(opts) -> dict[str, Any]:
  """Input pipeline tokens/s per policy on the tiny and GPT-2-small shapes (MINI
  if mini)."""
  shapes = [common.MINI] if opts.mini else [common.TINY, common.GPT2_SMALL]
  batches = max(opts.steps, 3 if opts.mini else 20)
  warmup = max(opts.warmup, 1)
  out: dict[str, Any] = {'shapes': {}}
  with tempfile.TemporaryDirectory() as tmp:
    for shape in shapes:
      runs = [('synthetic', p) for p in data.policies.names()]
      if not opts.mini:
        runs += [('stdlib', 'natural'), ('stdlib', 'packed')]
      rows = []
      for source, policy in runs:
        try:
          rows.append(measure(shape, policy, source, batches, warmup, tmp))
        except Exception as e:
          rows.append(
              {
                  'policy': policy,
                  'source': source,
                  'error': repr(e),
                  'traceback': traceback.format_exc()[-1500:],
              }
          )
        if source == 'stdlib':
          rows[-1]['policy'] = f'stdlib_{policy}'
      out['shapes'][shape.name] = {
          'seq_len': shape.seq_len,
          'batch_size': shape.batch_size,
          'rows': rows,
      }
  return out
