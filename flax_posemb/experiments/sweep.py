"""The sweep runner: trains, evaluates and measures every run of an experiment grid, resumably.

All runs execute in this one process, seed-major, so runs of one shape share JAX's
compilation caches. The experiment workdir and run store: docs/DESIGN.md "Experiments
outputs".
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from typing import Any, Callable, Mapping

import ml_collections
import numpy as np

from flax_posemb import eval_report, outputs
from flax_posemb.experiments import budget as budget_lib
from flax_posemb.experiments import measures, spec

logger = logging.getLogger(__name__)
DONE = 'DONE.json'
EVAL_DIR = 'experiment_eval'

# (training config, run dir) -> anything JSON-serializable (training's return value).
TrainFn = Callable[[ml_collections.ConfigDict, str], Any]
# (training config, run dir, offsets) -> (results dict, per-position dict of arrays).
EvalFn = Callable[[ml_collections.ConfigDict, str, tuple[int, ...]],
                  tuple[dict[str, Any], dict[str, np.ndarray]]]


class Preempted(Exception):
  """SIGTERM stopped a run's training (checkpoint saved); re-running resumes the sweep."""


def default_train(config: ml_collections.ConfigDict, run_dir: str) -> Any:
  """``training.train_and_evaluate`` (resumes from checkpoints); raises ``Preempted``."""
  from flax_posemb import training  # pylint: disable=g-import-not-at-top
  result = training.train_and_evaluate(config, run_dir)
  if result.get('preempted'):
    raise Preempted(f'{run_dir} was preempted at step {result["step"]} (checkpoint saved); '
                    're-run the same command to resume the sweep.')
  return result


def default_evaluate(config: ml_collections.ConfigDict, run_dir: str,
                     offsets: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """``evaluation.run_evaluation`` of the latest checkpoint's params; with offsets the main
  table is still the full-window evaluation and the probe is ``results['offset_probe']``."""
  from flax_posemb import checkpointing, evaluation  # pylint: disable=g-import-not-at-top
  from flax_posemb import model as model_lib  # pylint: disable=g-import-not-at-top
  params, _, info = checkpointing.restore_params(run_dir)
  model = model_lib.TransformerLM(model_lib.ModelConfig.from_config(config.model))
  out = evaluation.run_evaluation(model, params, config, step=info.step,
                                  offsets=list(offsets) if any(offsets) else None)
  return eval_report.json_safe(out.results), out.per_position


def _write_json(path: str, obj: Any) -> None:
  def default(x):  # ConfigDicts inside tuples (the arms), numpy values.
    if isinstance(x, ml_collections.ConfigDict):
      return x.to_dict()
    return x.tolist() if isinstance(x, (np.generic, np.ndarray)) else str(x)
  with outputs.atomic_write(path, 'w') as f:
    json.dump(obj, f, indent=1, default=default)


def is_done(run_dir: str) -> bool:
  return os.path.exists(os.path.join(run_dir, DONE))


def execute_run(run: spec.Run, run_dir: str, offsets: tuple[int, ...], train_fn: TrainFn,
                eval_fn: EvalFn) -> dict[str, Any]:
  """Trains (or resumes), evaluates and marks one run done; returns its DONE record."""
  os.makedirs(run_dir, exist_ok=True)
  _write_json(os.path.join(run_dir, 'run.json'),
              {'key': run.key, 'seed': run.seed, 'config': run.config.to_dict()})
  t0 = time.perf_counter()
  train_out = train_fn(run.config, run_dir)
  t1 = time.perf_counter()
  results, per_position = eval_fn(run.config, run_dir, tuple(offsets))
  t2 = time.perf_counter()
  eval_dir = os.path.join(run_dir, EVAL_DIR)
  _write_json(os.path.join(eval_dir, 'results.json'), eval_report.json_safe(results))
  np.savez(os.path.join(eval_dir, 'per_position.npz'),
           **{k: np.asarray(v) for k, v in per_position.items()})
  record = {'key': run.key, 'seed': run.seed, 'train_seconds': t1 - t0, 'eval_seconds': t2 - t1,
            'finished': datetime.datetime.now(datetime.timezone.utc).isoformat(),
            'train_result': eval_report.json_safe(
                train_out if isinstance(train_out, (dict, list)) else repr(train_out))}
  _write_json(os.path.join(run_dir, DONE), record)
  return record


def _measured_row(run: spec.Run, run_dir: str, rare_exposure: float) -> dict[str, Any]:
  """The sweep's row of a finished run, with its measures."""
  record = measures.load_json(os.path.join(run_dir, DONE))
  results = measures.load_json(os.path.join(run_dir, EVAL_DIR, 'results.json'))
  per_position = outputs.load_npz(os.path.join(run_dir, EVAL_DIR, 'per_position.npz'))
  m = measures.run_measures(run_dir, results, int(run.config.num_train_steps),
                            record['train_seconds'], per_position=per_position,
                            rare_exposure=rare_exposure)
  return {'arm': run.arm, 'seed': run.seed, 'key': run.key, 'run_dir': run_dir, 'done': True,
          'record': record, 'measures': m, 'config': run.config}


def _plan(exp: ml_collections.ConfigDict, workdir: str, store: str, quick: bool,
          estimator: budget_lib.Estimator) -> tuple[list[spec.Run], budget_lib.Budget]:
  """The budgeted grid, recorded in ``workdir`` (experiment, budget and manifest JSON)."""
  runs = spec.expand(exp, quick=quick)
  runs, budget = budget_lib.equalize(runs, exp.budget, estimator,
                                     os.path.join(workdir, 'budget.json'))
  _write_json(os.path.join(workdir, 'experiment.json'),
              {'experiment': exp.to_dict(), 'quick': quick})
  _write_json(os.path.join(workdir, 'manifest.json'),
              [{'arm': r.arm, 'seed': r.seed, 'key': r.key,
                'run_dir': os.path.relpath(os.path.join(store, r.key), workdir)} for r in runs])
  return runs, budget


def run_sweep(exp: ml_collections.ConfigDict, workdir: str, *, quick: bool = False,
              run_store: str = '', train_fn: TrainFn = default_train,
              eval_fn: EvalFn = default_evaluate,
              estimator: budget_lib.Estimator = budget_lib.estimate_scored_per_row,
              max_runs: int = -1) -> dict[str, Any]:
  """Runs (or resumes) every run of ``exp``'s grid and measures each.

  ``run_store`` ('' = ``workdir/runs``) may be shared across experiments; ``max_runs``
  (-1: all) stops after that many new runs, and the next call continues. Returns
  ``{'runs': [{arm, seed, key, run_dir, done, record, measures, config}], 'budget',
  'complete', 'store', 'quick'}``.
  """
  store = run_store or os.path.join(workdir, 'runs')
  os.makedirs(store, exist_ok=True)
  runs, budget = _plan(exp, workdir, store, quick, estimator)
  trained, rows, measured = 0, [], {}
  for i, r in enumerate(runs):
    run_dir = os.path.join(store, r.key)
    label = f'[{i + 1}/{len(runs)}] {exp.name} arm={r.arm} seed={r.seed} ({r.key})'
    if r.key in measured or is_done(run_dir):
      logger.info('%s: already done, skipped', label)
    elif 0 <= max_runs <= trained:
      logger.info('%s: not run (max_runs reached)', label)
      rows.append({'arm': r.arm, 'seed': r.seed, 'key': r.key, 'run_dir': run_dir,
                   'done': False})
      continue
    else:
      logger.info('%s: training %d steps, batch %d', label, r.config.num_train_steps,
                  r.config.batch_size)
      rec = execute_run(r, run_dir, tuple(int(k) for k in exp.offsets), train_fn, eval_fn)
      trained += 1
      logger.info('%s: done in %.1f s (train) + %.1f s (eval)', label, rec['train_seconds'],
                  rec['eval_seconds'])
    if r.key not in measured:
      measured[r.key] = _measured_row(r, run_dir, float(exp.rare_exposure))
    rows.append(dict(measured[r.key], arm=r.arm, seed=r.seed, config=r.config))
  return {'runs': rows, 'budget': budget.as_dict(), 'complete': all(x['done'] for x in rows),
          'store': store, 'quick': quick}


def seed_groups(rows: list[Mapping[str, Any]]) -> dict[int, dict[str, str]]:
  """seed -> {arm: run_dir} over finished runs."""
  out: dict[int, dict[str, str]] = {}
  for x in rows:
    if x['done']:
      out.setdefault(x['seed'], {})[x['arm']] = x['run_dir']
  return out
