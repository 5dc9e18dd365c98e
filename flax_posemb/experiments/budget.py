"""Budget equalization: the same steps and scored tokens per step for every arm.

The rule (``batch_size = round(target / scored per row)``, length_schedule phases, the cache):
docs/DESIGN.md "Experiments outputs".
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import ml_collections
import numpy as np

from flax_posemb.experiments import spec

# (training config, num_batches) -> mean scored targets per row.
Estimator = Callable[[ml_collections.ConfigDict, int], float]


def estimate_scored_per_row(config: ml_collections.ConfigDict, num_batches: int) -> float:
  """Mean ``loss_mask`` sum per row of ``config``'s training pipeline; ``length_schedule``
  weights its short and full phases by their share of the steps."""
  if config.data.position_policy != 'length_schedule':
    return _pipeline_mean(config, num_batches)
  f = float(config.data.schedule_fraction)
  phase = lambda x: _pipeline_mean(
      spec.apply_overrides(config, (('data.schedule_fraction', x),), 'budget'), num_batches)
  return f * phase(1.0) + (1.0 - f) * phase(0.0)


def _pipeline_mean(config: ml_collections.ConfigDict, num_batches: int) -> float:
  from flax_posemb.data import pipeline  # pylint: disable=g-import-not-at-top
  it = pipeline.make_train_iterator(config.data, batch_size=int(config.batch_size),
                                    seed=int(config.seed),
                                    num_train_steps=int(config.num_train_steps),
                                    max_len=int(config.model.max_len))
  masks = [np.asarray(next(it)['loss_mask']) for _ in range(num_batches)]
  return sum(float(m.sum()) for m in masks) / max(sum(m.shape[0] for m in masks), 1)


@dataclasses.dataclass(frozen=True)
class Budget:
  """Mode, reference arm, target scored tokens per step, and per arm: measured scored
  tokens per row and rows per step."""
  mode: str
  reference: str
  target_tokens_per_step: float
  per_row: dict[str, float]
  batch_size: dict[str, int]

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _measure(arms: dict[str, ml_collections.ConfigDict], estimator: Estimator,
             num_batches: int, cache_path: str | None) -> dict[str, float]:
  """Scored targets per row of each arm at seed 0, through the cache keyed by run key."""
  cache = {}
  if cache_path and os.path.exists(cache_path):
    with open(cache_path) as f:
      cache = json.load(f)
  per_row = {}
  for a, c in arms.items():
    probe = spec.apply_overrides(c, (('seed', 0),), f'arm {a!r}')
    key = spec.run_key(probe)
    if key not in cache:
      cache[key] = float(estimator(probe, num_batches))
    per_row[a] = cache[key]
    if not per_row[a] > 0:
      raise ValueError(f'arm {a!r}: its pipeline gave no scored targets per row; check its '
                       'data settings.')
  if cache_path:
    os.makedirs(os.path.dirname(cache_path) or '.', exist_ok=True)
    with open(cache_path, 'w') as f:
      json.dump(cache, f, indent=1, sort_keys=True)
  return per_row


def equalize(runs: list[spec.Run], budget_config: ml_collections.ConfigDict,
             estimator: Estimator = estimate_scored_per_row,
             cache_path: str | None = None) -> tuple[list[spec.Run], Budget]:
  """``(runs, Budget)``: each arm's batch size set so that all arms of the grid see the
  same scored tokens per step (``estimator``: scored targets per row of a config; the
  estimates are kept in ``cache_path``, so a resumed sweep keeps its batch sizes)."""
  arms: dict[str, ml_collections.ConfigDict] = {}
  for r in runs:
    arms.setdefault(r.arm, r.config)
  reference = budget_config.reference_arm
  if reference not in arms:  # Unset, or not among --quick's two arms.
    reference = next(iter(arms))
  base_rows = {a: int(c.batch_size) for a, c in arms.items()}
  if budget_config.equalize == 'none':
    return runs, Budget('none', reference, float('nan'), {}, base_rows)
  per_row = _measure(arms, estimator, int(budget_config.estimate_batches), cache_path)
  target = float(budget_config.get('target_tokens_per_step', 0) or 0)
  if target <= 0:
    target = base_rows[reference] * per_row[reference]
  batch = {a: max(1, int(round(target / per_row[a]))) for a in arms}
  out = [dataclasses.replace(r, config=spec.apply_overrides(
      r.config, (('batch_size', batch[r.arm]),), f'arm {r.arm!r}')) for r in runs]
  return out, Budget('real_tokens', reference, target, per_row, batch)
