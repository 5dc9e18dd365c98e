"""The resumable sweep runner: budget, then train, evaluate and measure every
run, in-process."""

from collections.abc import Callable
import dataclasses
import datetime
import json
import logging
import os
import time
from typing import Any

import ml_collections
import numpy as np

from flax_posemb import eval_report
from flax_posemb import outputs
from flax_posemb.experiments import measures
from flax_posemb.experiments import spec

logger = logging.getLogger(__name__)
DONE = 'DONE.json'
EVAL_DIR = 'experiment_eval'

# (training config, run dir) -> anything JSON-serializable (training's return
# value).
TrainFn = Callable[[ml_collections.ConfigDict, str], Any]
EvalFn = Callable[
    [ml_collections.ConfigDict, str, tuple[int, ...]],
    tuple[dict[str, Any], dict[str, np.ndarray]],
]
# (training config, num_batches) -> mean scored targets per row.
Estimator = Callable[[ml_collections.ConfigDict, int], float]


def estimate_scored_per_row(
    config: ml_collections.ConfigDict, num_batches: int
) -> float:
  """Mean ``loss_mask`` sum per row of ``config``'s training pipeline
  (docs/DESIGN.md, Budget)."""
  f = float(config.data.schedule_fraction)
  if config.data.position_policy == 'length_schedule' and 0 < f < 1:

    def phase(x):
      return estimate_scored_per_row(
          spec.apply_overrides(
              config, (('data.schedule_fraction', x),), 'budget'
          ),
          num_batches,
      )

    return f * phase(1.0) + (1.0 - f) * phase(0.0)
  from flax_posemb.data import pipeline

  it = pipeline.make_train_iterator(
      config.data,
      batch_size=int(config.batch_size),
      seed=int(config.seed),
      num_train_steps=int(config.num_train_steps),
      max_len=int(config.model.max_len),
  )
  return float(
      np.mean(
          [np.asarray(next(it)['loss_mask']).sum(1) for _ in range(num_batches)]
      )
  )


@dataclasses.dataclass(frozen=True)
class Budget:
  """The equalized budget; per arm its scored tokens per row and rows per
  step."""

  mode: str
  reference: str
  target_tokens_per_step: float
  per_row: dict[str, float]
  batch_size: dict[str, int]


def equalize(
    runs: list[spec.Run],
    budget_config: ml_collections.ConfigDict,
    estimator: Estimator = estimate_scored_per_row,
    cache_path: str | None = None,
) -> tuple[list[spec.Run], Budget]:
  """``(runs, Budget)``: each arm's batch size gives the same scored tokens per
  step."""
  # The seeds' configs differ only in 'seed'.
  arms = {r.arm: r.config for r in runs}
  # Unset, or not among --quick's two arms: the first.
  reference = budget_config.reference_arm
  reference = reference if reference in arms else next(iter(arms))
  base_rows = {a: int(c.batch_size) for a, c in arms.items()}
  if budget_config.equalize == 'none':
    return runs, Budget('none', reference, float('nan'), {}, base_rows)
  # Scored targets per row at seed 0, cached by run key: a resumed sweep keeps
  # its batches.
  cache = (
      measures.load_json(cache_path)
      if cache_path and os.path.exists(cache_path)
      else {}
  )
  per_row = {}
  for a, c in arms.items():
    probe = spec.apply_overrides(c, (('seed', 0),), f'arm {a!r}')
    key = spec.run_key(probe)
    if key not in cache:
      logger.info(
          'budget: arm %s: scored tokens per row over %d batches ...',
          a,
          int(budget_config.estimate_batches),
      )
      cache[key] = float(estimator(probe, int(budget_config.estimate_batches)))
    per_row[a] = cache[key]
    if not per_row[a] > 0:
      raise ValueError(
          f'arm {a!r}: its pipeline gave no scored targets per row; check its '
          'data settings.'
      )
  if cache_path:
    write_json(cache_path, dict(sorted(cache.items())))
  target = float(budget_config.target_tokens_per_step)
  target = target if target > 0 else base_rows[reference] * per_row[reference]
  batch = {a: max(1, int(round(target / per_row[a]))) for a in arms}
  out = [
      dataclasses.replace(
          r,
          config=spec.apply_overrides(
              r.config, (('batch_size', batch[r.arm]),), f'arm {r.arm!r}'
          ),
      )
      for r in runs
  ]
  return out, Budget('real_tokens', reference, target, per_row, batch)


class Preempted(Exception):
  """SIGTERM stopped a run's training (checkpoint saved); re-running resumes the
  sweep."""


def default_train(config: ml_collections.ConfigDict, run_dir: str) -> Any:
  """``training.train_and_evaluate`` (resumes from checkpoints); raises
  ``Preempted``."""
  from flax_posemb import training

  result = training.train_and_evaluate(config, run_dir)
  if result.get('preempted'):
    raise Preempted(
        f'{run_dir} was preempted at step {result["step"]} (checkpoint saved); '
        're-run the same command to resume the sweep.'
    )
  return result


def default_evaluate(
    config: ml_collections.ConfigDict, run_dir: str, offsets: tuple[int, ...]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """``evaluation.run_evaluation`` of the latest checkpoint's params."""
  from flax_posemb import checkpointing
  from flax_posemb import evaluation
  from flax_posemb import train_step

  params, _, info = checkpointing.restore_params(run_dir)
  out = evaluation.run_evaluation(
      train_step.make_model(config),
      params,
      config,
      step=info.step,
      offsets=list(offsets) if any(offsets) else None,
  )
  return eval_report.json_safe(out.results), out.per_position


def write_json(path: str, obj: Any) -> None:
  """``obj`` as indented JSON, written atomically."""

  def default(x):  # ConfigDicts inside tuples (the arms), numpy values.
    if isinstance(x, ml_collections.ConfigDict):
      return x.to_dict()
    return x.tolist() if isinstance(x, (np.generic, np.ndarray)) else str(x)

  with outputs.atomic_write(path, 'w') as f:
    json.dump(obj, f, indent=1, default=default)


def is_done(run_dir: str) -> bool:
  return os.path.exists(os.path.join(run_dir, DONE))


def execute_run(
    run: spec.Run,
    run_dir: str,
    offsets: tuple[int, ...],
    train_fn: TrainFn,
    eval_fn: EvalFn,
) -> dict[str, Any]:
  """Trains (or resumes), evaluates and marks one run done; returns its DONE
  record."""
  write_json(
      os.path.join(run_dir, 'run.json'),
      {'key': run.key, 'seed': run.seed, 'config': run.config.to_dict()},
  )
  t0 = time.perf_counter()
  train_out = train_fn(run.config, run_dir)
  t1 = time.perf_counter()
  results, per_position = eval_fn(run.config, run_dir, tuple(offsets))
  t2 = time.perf_counter()
  eval_dir = os.path.join(run_dir, EVAL_DIR)
  write_json(
      os.path.join(eval_dir, 'results.json'), eval_report.json_safe(results)
  )
  np.savez(os.path.join(eval_dir, 'per_position.npz'), **per_position)
  record = {
      'key': run.key,
      'seed': run.seed,
      'train_seconds': t1 - t0,
      'eval_seconds': t2 - t1,
      'finished': datetime.datetime.now(datetime.UTC).isoformat(),
      'train_result': eval_report.json_safe(
          train_out if isinstance(train_out, (dict, list)) else repr(train_out)
      ),
  }
  write_json(os.path.join(run_dir, DONE), record)
  return record


def run_sweep(
    exp: ml_collections.ConfigDict,
    workdir: str,
    *,
    quick: bool = False,
    run_store: str = '',
    train_fn: TrainFn = default_train,
    eval_fn: EvalFn = default_evaluate,
    max_runs: int = -1,
) -> dict[str, Any]:
  """Runs (or resumes) and measures every run of ``exp``'s grid: at most
  ``max_runs`` new ones (-1: all), in ``run_store`` ('' = ``workdir/runs``, may
  be shared)."""
  store = run_store or os.path.join(workdir, 'runs')
  runs, budget = equalize(
      spec.expand(exp, quick=quick),
      exp.budget,
      cache_path=os.path.join(workdir, 'budget.json'),
  )
  write_json(
      os.path.join(workdir, 'experiment.json'),
      {'experiment': exp.to_dict(), 'quick': quick},
  )
  write_json(
      os.path.join(workdir, 'manifest.json'),
      [
          {
              'arm': r.arm,
              'seed': r.seed,
              'key': r.key,
              'run_dir': os.path.relpath(os.path.join(store, r.key), workdir),
          }
          for r in runs
      ],
  )
  trained, rows, measured = 0, [], {}
  for i, r in enumerate(runs):
    run_dir = os.path.join(store, r.key)
    label = (
        f'[{i + 1}/{len(runs)}] {exp.name} arm={r.arm} seed={r.seed} ({r.key})'
    )
    if r.key in measured or is_done(run_dir):
      logger.info('%s: already done, skipped', label)
    elif 0 <= max_runs <= trained:
      logger.info('%s: not run (max_runs reached)', label)
      rows.append(
          {
              'arm': r.arm,
              'seed': r.seed,
              'key': r.key,
              'run_dir': run_dir,
              'done': False,
          }
      )
      continue
    else:
      logger.info(
          '%s: training %d steps, batch %d',
          label,
          r.config.num_train_steps,
          r.config.batch_size,
      )
      rec = execute_run(
          r, run_dir, tuple(int(k) for k in exp.offsets), train_fn, eval_fn
      )
      trained += 1
      logger.info(
          '%s: done in %.1f s (train) + %.1f s (eval)',
          label,
          rec['train_seconds'],
          rec['eval_seconds'],
      )
    if r.key not in measured:  # Measured once per run, also when arms coincide.
      seconds = measures.load_json(os.path.join(run_dir, DONE))['train_seconds']
      results = measures.load_json(
          os.path.join(run_dir, EVAL_DIR, 'results.json')
      )
      per_position = outputs.load_npz(
          os.path.join(run_dir, EVAL_DIR, 'per_position.npz')
      )
      m = measures.run_measures(
          run_dir,
          results,
          int(r.config.num_train_steps),
          seconds,
          per_position,
          float(exp.rare_exposure),
      )
      measured[r.key] = {
          'key': r.key,
          'run_dir': run_dir,
          'done': True,
          'measures': m,
      }
    rows.append(dict(measured[r.key], arm=r.arm, seed=r.seed, config=r.config))
  return {
      'runs': rows,
      'budget': dataclasses.asdict(budget),
      'complete': all(x['done'] for x in rows),
      'quick': quick,
  }
