"""Budget equalization: the same steps and the same real (scored) tokens per step per arm.

Arms differ in how many of a row's slots carry real tokens (``natural`` rows are mostly
padding; ``packed`` rows are full), so equal rows per step would give the padded arms less
data. With ``budget.equalize == 'real_tokens'`` every arm gets
``batch_size = round(target / r_arm)`` rows per step, where ``r_arm`` is the arm's mean
number of scored targets (``loss_mask`` sum) per row, measured on ``budget.estimate_batches``
batches of its own pipeline at seed 0, and ``target = budget.target_tokens_per_step`` when
set (> 0; the same number in every experiment of a scale, so coinciding arms of different
experiments stay identical runs), else ``reference batch_size x r_reference`` (the reference
arm keeps the base batch size). For ``length_schedule`` the estimate is the
step-weighted mean of its short and full phases, so the budget matches over the run (fewer
tokens per step in the short phase, more after). Rounding leaves a residual of at most half
a row's tokens; the report lists each arm's measured tokens per step from the training
statistics, so what was actually seen is on record. ``'none'`` keeps the base batch size
for every arm (the report still lists tokens seen). Steps are always equal.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import ml_collections
import numpy as np

from flax_posemb.experiments import spec

MODES = ('real_tokens', 'none')
# Estimator: (training config, num_batches) -> mean scored targets per row.
Estimator = Callable[[ml_collections.ConfigDict, int], float]


def estimate_scored_per_row(config: ml_collections.ConfigDict, num_batches: int) -> float:
  """Mean ``loss_mask`` sum per row of the training pipeline of ``config``.

  ``length_schedule`` is estimated per phase (short and full) and weighted by the fraction
  of steps in each.

  Args:
    config: resolved training config.
    num_batches: batches to draw.

  Returns:
    Mean scored targets per row.
  """
  if config.data.position_policy == 'length_schedule':
    f = float(config.data.schedule_fraction)
    short = spec.apply_overrides(config, (('data.schedule_fraction', 1.0),), 'budget')
    full = spec.apply_overrides(config, (('data.schedule_fraction', 0.0),), 'budget')
    return (f * _pipeline_mean(short, num_batches)
            + (1.0 - f) * _pipeline_mean(full, num_batches))
  return _pipeline_mean(config, num_batches)


def _pipeline_mean(config: ml_collections.ConfigDict, num_batches: int) -> float:
  from flax_posemb.data import pipeline  # pylint: disable=g-import-not-at-top
  it = pipeline.make_train_iterator(config.data, batch_size=int(config.batch_size),
                                    seed=int(config.seed),
                                    num_train_steps=int(config.num_train_steps),
                                    max_len=int(config.model.max_len))
  total, rows = 0.0, 0
  for _ in range(num_batches):
    batch = next(it)
    total += float(np.asarray(batch['loss_mask']).sum())
    rows += int(batch['loss_mask'].shape[0])
  return total / max(rows, 1)


@dataclasses.dataclass(frozen=True)
class Budget:
  """Outcome of equalization.

  Attributes:
    mode: 'real_tokens' or 'none'.
    reference: arm whose batch size is kept.
    target_tokens_per_step: scored targets per step every arm aims at.
    per_row: arm -> measured scored targets per row.
    batch_size: arm -> rows per step.
  """
  mode: str
  reference: str
  target_tokens_per_step: float
  per_row: dict[str, float]
  batch_size: dict[str, int]

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def equalize(runs: list[spec.Run], budget_config: ml_collections.ConfigDict,
             estimator: Estimator = estimate_scored_per_row,
             cache_path: str | None = None) -> tuple[list[spec.Run], Budget]:
  """Sets each arm's batch size so that all arms see the same scored tokens per step.

  Args:
    runs: the grid (``spec.expand``).
    budget_config: ``{equalize, target_tokens_per_step, reference_arm, estimate_batches}``.
    estimator: measures scored targets per row of a config (the data pipeline by default).
    cache_path: JSON file holding earlier estimates (keyed by arm run key at seed 0), so a
      resumed sweep reproduces the same batch sizes without re-measuring.

  Returns:
    ``(runs with batch sizes set, Budget)``.
  """
  mode = budget_config.equalize
  if mode not in MODES:
    raise ValueError(f'budget.equalize {mode!r} is not one of {MODES}.')
  arms: dict[str, ml_collections.ConfigDict] = {}
  for r in runs:
    arms.setdefault(r.arm, r.config)
  reference = budget_config.reference_arm or next(iter(arms))
  if reference not in arms:
    reference = next(iter(arms))  # e.g. --quick keeps two arms only.
  base_rows = {a: int(c.batch_size) for a, c in arms.items()}
  if mode == 'none':
    return runs, Budget(mode, reference, float('nan'), {}, base_rows)
  cache = {}
  if cache_path and os.path.exists(cache_path):
    with open(cache_path) as f:
      cache = json.load(f)
  per_row = {}
  for a, c in arms.items():
    probe = spec.apply_overrides(c, (('seed', 0),), f'arm {a!r}')
    key = spec.run_key(probe)
    if key not in cache:
      cache[key] = float(estimator(probe, int(budget_config.estimate_batches)))
    per_row[a] = cache[key]
    if not per_row[a] > 0:
      raise ValueError(f'arm {a!r}: its pipeline gave no scored targets per row; check its '
                       'data settings.')
  if cache_path:
    os.makedirs(os.path.dirname(cache_path) or '.', exist_ok=True)
    with open(cache_path, 'w') as f:
      json.dump(cache, f, indent=1, sort_keys=True)
  target = float(budget_config.get('target_tokens_per_step', 0) or 0)
  if target <= 0:
    target = base_rows[reference] * per_row[reference]
  batch = {a: max(1, int(round(target / per_row[a]))) for a in arms}
  out = [dataclasses.replace(r, config=spec.apply_overrides(
      r.config, (('batch_size', batch[r.arm]),), f'arm {r.arm!r}')) for r in runs]
  return out, Budget(mode, reference, target, per_row, batch)
