"""Scaling suite: step time and compiled memory against context length, width
and batch.

Compiled memory comes from `jax.jit(...).lower(...).compile().memory_analysis()`
(the CPU backend has no `memory_stats()`), so it is the buffer assignment XLA
made, not a sampled high-water mark. The statistics' extra memory is `stats on -
stats off` of `temp + argument` bytes; the batch sweep holds positions and width
fixed while the batch grows, so an extra that stays flat is O(positions x
width), one that grows with the batch would be O(batch x positions x width)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks import steps
from benchmarks.suites import Options
from benchmarks.suites import get_peak
from benchmarks.suites import measure


def _memory(shape: common.Shape, collect: bool) -> dict[str, int] | None:
  return common.compiled_memory(
      steps.library_train(shape, collect).lower().compile()
  )


def _point(
    shape: common.Shape, opts: Options, peak: float, timed: bool
) -> dict[str, Any]:
  on = _memory(shape, True)
  off = _memory(shape, False)
  row: dict[str, Any] = {
      'seq_len': shape.seq_len,
      'emb_dim': shape.emb_dim,
      'batch_size': shape.batch_size,
      'num_heads': shape.num_heads,
      'memory_stats_on': on,
      'memory_stats_off': off,
  }
  if on and off:
    extra = (on['temp'] + on['argument']) - (off['temp'] + off['argument'])
    row['stats_extra_bytes'] = extra
    row['positions_x_width_bytes'] = 4 * shape.seq_len * shape.emb_dim
    row['batch_x_positions_x_width_bytes'] = 4 * shape.tokens * shape.emb_dim
  if timed:
    sub = dataclasses.replace(opts, steps=max(3, min(opts.steps, 5)), warmup=1)
    row['step'] = measure(steps.library_train(shape, True), shape, sub, peak)
  return row


def run_scaling(opts: Options) -> dict[str, Any]:
  """Context, width and batch sweeps (see module docstring)."""
  peak = get_peak(opts)['flops_per_s']
  base = common.MINI if opts.mini else common.SMALL
  if opts.mini:
    contexts = (16, 32)
    widths = (32, 64)
    batches = (2, 4)
  else:
    contexts = (256, 512, 1024, 2048)
    widths = (128, 256, 512, 768)
    batches = (4, 8, 16, 32)
  tokens = base.tokens
  ctx = [
      _point(
          base.replace(seq_len=t, batch_size=max(1, tokens // t)),
          opts,
          peak,
          True,
      )
      for t in contexts
  ]
  wid = [
      _point(
          base.replace(
              emb_dim=d, num_heads=max(1, d // 64) if not opts.mini else 2
          ),
          opts,
          peak,
          True,
      )
      for d in widths
  ]
  bat = [_point(base.replace(batch_size=b), opts, peak, False) for b in batches]
  extras = [r.get('stats_extra_bytes') for r in bat]
  verdict = None
  if all(e is not None for e in extras):
    growth = (extras[-1] - extras[0]) / max(
        1,
        (
            bat[-1]['batch_x_positions_x_width_bytes']
            - bat[0]['batch_x_positions_x_width_bytes']
        ),
    )
    verdict = {
        'extra_bytes_by_batch': extras,
        'extra_growth_per_batch_token_feature': growth,
        'reading': (
            'flat in batch: O(positions x width)'
            if abs(growth) < 0.25
            else 'grows with batch: O(batch x positions x width)'
        ),
    }
  return {
      'note': f'context sweep keeps batch x context = {tokens} tokens per step',
      'context': ctx,
      'width': wid,
      'batch': bat,
      'stats_memory': verdict,
      'peak': opts.peak,
      'extra_min_bytes': (
          int(np.min(extras)) if all(e is not None for e in extras) else None
      ),
  }
