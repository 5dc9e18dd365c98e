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

from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import data as data_lib
from flax_posemb import eval_report
from flax_posemb import evaluation
from flax_posemb import outputs
from flax_posemb import preemption
from flax_posemb import train_step
from flax_posemb import training
from flax_posemb.experiments import measures
from flax_posemb.experiments import spec

logger = logging.getLogger(__name__)
DONE = 'DONE.json'
EVAL_DIR = 'experiment_eval'

# Files of EVAL_DIR: the windows' bucket sums (and the offset probe's, shift K).
WINDOWS = 'windows.npz'
PROBE_WINDOWS = 'windows_offset_{}.npz'
# The run's training tokens by document kind.
MIX = 'mix.json'

# The run's typed config (converted once, in `execute_run`), run dir ->
# anything JSON-serializable (training's return value).
TrainFn = Callable[[config_lib.RunConfig, str], Any]
# (training config, run dir, offsets) -> evaluation.EvalOutput.
EvalFn = Callable[
    [config_lib.RunConfig, str, tuple[int, ...]], evaluation.EvalOutput
]
# (training config, num_batches) -> mean scored targets per row.
Estimator = Callable[[config_lib.RunConfig, int], float]


def estimate_scored_per_row(
    config: config_lib.RunConfig, num_batches: int
) -> float:
  """Mean ``loss_mask`` sum per row of ``config``'s training pipeline
  (the budget rule, docs/DESIGN.md § Experiments outputs)."""
  phases = config.data.policy.budget_phases(config.data)
  if phases:
    # A policy whose rows change in length during the run: the estimate of
    # each phase's rows, weighted by its share of the steps.
    estimate = 0.0
    for share, fields in phases:
      data = dataclasses.replace(config.data, **fields)
      phase_config = dataclasses.replace(config, data=data)
      estimate += share * estimate_scored_per_row(phase_config, num_batches)
    return estimate
  it = data_lib.make_train_iterator(
      config.data,
      batch_size=config.batch_size,
      seed=config.seed,
      num_train_steps=config.num_train_steps,
      max_len=config.model.max_len,
  )
  scored = [
      np.asarray(next(it)['loss_mask']).sum(1) for _ in range(num_batches)
  ]
  return float(np.mean(scored))


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
  arms = {run.arm: run.config for run in runs}
  # Unset, or not among --quick's two arms: the first.
  reference = budget_config.reference_arm
  if reference not in arms:
    reference = next(iter(arms))
  base_rows = {arm: config.batch_size for arm, config in arms.items()}
  if budget_config.equalize == 'none':
    return runs, Budget('none', reference, float('nan'), {}, base_rows)
  # Scored targets per row at seed 0, cached by run key: a resumed sweep keeps
  # its batches.
  cache = {}
  if cache_path and os.path.exists(cache_path):
    cache = measures.load_json(cache_path)
  per_row = {}
  for arm, config in arms.items():
    probe = spec.apply_overrides(config, (('seed', 0),), f'arm {arm!r}')
    key = spec.run_key(probe)
    if key not in cache:
      logger.info(
          'budget: arm %s: scored tokens per row over %d batches ...',
          arm,
          budget_config.estimate_batches,
      )
      probe_config = config_lib.RunConfig.from_config_dict(probe)
      batches = budget_config.estimate_batches
      cache[key] = float(estimator(probe_config, batches))
    per_row[arm] = cache[key]
    if not per_row[arm] > 0:
      raise ValueError(
          f'arm {arm!r}: its pipeline gave no scored targets per row; check'
          ' its data settings.'
      )
  if cache_path:
    write_json(cache_path, dict(sorted(cache.items())))
  target = budget_config.target_tokens_per_step
  if target <= 0:
    target = base_rows[reference] * per_row[reference]
  batch = {arm: max(1, int(round(target / per_row[arm]))) for arm in arms}
  out = []
  for run in runs:
    overrides = (('batch_size', batch[run.arm]),)
    config = spec.apply_overrides(run.config, overrides, f'arm {run.arm!r}')
    out.append(dataclasses.replace(run, config=config))
  return out, Budget('real_tokens', reference, target, per_row, batch)


def default_train(config: config_lib.RunConfig, run_dir: str) -> Any:
  """``training.train_and_evaluate`` (resumes from checkpoints); raises
  `preemption.Preempted` when SIGTERM stopped the run (checkpoint saved)."""
  result = training.train_and_evaluate(config, run_dir)
  if result.get('preempted'):
    raise preemption.Preempted(
        f'{run_dir} was preempted at step {result["step"]} (checkpoint saved); '
        're-run the same command to resume the sweep.'
    )
  return result


def default_evaluate(
    config: config_lib.RunConfig, run_dir: str, offsets: tuple[int, ...]
) -> evaluation.EvalOutput:
  """``evaluation.run_evaluation`` of the latest checkpoint's params."""
  params, _, info = checkpointing.restore_params(run_dir)
  probe_offsets = list(offsets) if any(offsets) else None
  return evaluation.run_evaluation(
      train_step.make_model(config),
      params,
      config,
      step=info.step,
      offsets=probe_offsets,
  )


def write_json(path: str, obj: Any) -> None:
  """``obj`` as indented JSON, written atomically."""

  # ConfigDicts inside tuples (the arms), numpy values.
  def default(value):
    if isinstance(value, ml_collections.ConfigDict):
      return value.to_dict()
    if isinstance(value, (np.generic, np.ndarray)):
      return value.tolist()
    return str(value)

  with outputs.atomic_write(path, 'w') as f:
    json.dump(obj, f, indent=1, default=default)


def is_done(run_dir: str) -> bool:
  """Whether the run finished (its completion marker `DONE.json` exists)."""
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
  # The run's one conversion: its ConfigDict stays its identity (run.json).
  run_config = config_lib.RunConfig.from_config_dict(run.config)
  t0 = time.perf_counter()
  train_out = train_fn(run_config, run_dir)
  t1 = time.perf_counter()
  out = eval_fn(run_config, run_dir, tuple(offsets))
  t2 = time.perf_counter()
  eval_dir = os.path.join(run_dir, EVAL_DIR)
  write_json(
      os.path.join(eval_dir, 'results.json'), eval_report.json_safe(out.results)
  )
  outputs.save_npz(os.path.join(eval_dir, 'per_position.npz'), out.per_position)
  outputs.save_npz(os.path.join(eval_dir, WINDOWS), out.per_window)
  for shift, windows in (out.probe_windows or {}).items():
    outputs.save_npz(
        os.path.join(eval_dir, PROBE_WINDOWS.format(shift)), windows
    )
  write_json(os.path.join(run_dir, MIX), measures.training_mix(run_config))
  # The record is JSON: anything else training returned is kept as its repr.
  train_result = train_out
  if not isinstance(train_out, (dict, list)):
    train_result = repr(train_out)
  record = {
      'key': run.key,
      'seed': run.seed,
      'train_seconds': t1 - t0,
      'eval_seconds': t2 - t1,
      'finished': datetime.datetime.now(datetime.UTC).isoformat(),
      'train_result': eval_report.json_safe(train_result),
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
              'arm': run.arm,
              'seed': run.seed,
              'key': run.key,
              'run_dir': os.path.relpath(os.path.join(store, run.key), workdir),
          }
          for run in runs
      ],
  )
  offsets = spec.offsets(exp, quick)
  trained = 0
  rows: list[dict[str, Any]] = []
  # run key -> its row (measured once per run, also when arms coincide).
  measured: dict[str, dict[str, Any]] = {}
  for i, run in enumerate(runs):
    run_dir = os.path.join(store, run.key)
    label = (
        f'[{i + 1}/{len(runs)}] {exp.name} arm={run.arm} seed={run.seed}'
        f' ({run.key})'
    )
    if run.key in measured or is_done(run_dir):
      logger.info('%s: already done, skipped', label)
    elif 0 <= max_runs <= trained:
      logger.info('%s: not run (max_runs reached)', label)
      rows.append(
          {
              'arm': run.arm,
              'seed': run.seed,
              'key': run.key,
              'run_dir': run_dir,
              'done': False,
          }
      )
      continue
    else:
      logger.info(
          '%s: training %d steps, batch %d',
          label,
          run.config.num_train_steps,
          run.config.batch_size,
      )
      record = execute_run(run, run_dir, offsets, train_fn, eval_fn)
      trained += 1
      logger.info(
          '%s: done in %.1f s (train) + %.1f s (eval)',
          label,
          record['train_seconds'],
          record['eval_seconds'],
      )
    if run.key not in measured:
      measured[run.key] = {
          'key': run.key,
          'run_dir': run_dir,
          'done': True,
          'measures': _measure(run, run_dir, exp),
      }
    rows.append(
        dict(measured[run.key], arm=run.arm, seed=run.seed, config=run.config)
    )
  return {
      'runs': rows,
      'budget': dataclasses.asdict(budget),
      'complete': all(row['done'] for row in rows),
      'quick': quick,
  }


def _measure(
    run: spec.Run, run_dir: str, exp: ml_collections.ConfigDict
) -> dict[str, Any]:
  """`measures.run_measures` of a finished run, from its files."""
  seconds = measures.load_json(os.path.join(run_dir, DONE))['train_seconds']
  results = measures.load_json(os.path.join(run_dir, EVAL_DIR, 'results.json'))
  per_position = outputs.load_npz(
      os.path.join(run_dir, EVAL_DIR, 'per_position.npz')
  )
  return measures.run_measures(
      run_dir,
      results,
      int(run.config.num_train_steps),
      seconds,
      per_position,
      float(exp.rare_exposure),
      int(exp.mid_bucket),
  )
