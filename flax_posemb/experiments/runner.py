"""One call from experiment configs to their reports: sweep, then report (one or a suite)."""

from __future__ import annotations

import collections
import logging
import os
import shlex
import sys
from typing import Any

from flax_posemb.experiments import report, spec, sweep

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str) -> None:
  """JAX's persistent compilation cache, so runs of equal shapes compile once."""
  import jax  # pylint: disable=g-import-not-at-top
  if not cache_dir:
    return
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', cache_dir)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def run_experiment(config_path: str, workdir: str, *, quick: bool = False,
                   run_store: str = '', report_dir: str = '', max_runs: int = -1,
                   command: str = '', **sweep_kwargs: Any) -> dict[str, Any]:
  """Runs (or resumes) an experiment and writes its report.

  Args:
    config_path: ``configs/experiments/NAME.py[:scale]``.
    workdir: experiment workdir (run workdirs live in ``workdir/runs`` by default).
    quick: two arms, one seed, a few steps of a tiny model (pipeline check).
    run_store: shared directory of run workdirs; '' = ``workdir/runs``.
    report_dir: where REPORT.md, summary.json and plots go; '' = ``workdir``.
    max_runs: train at most this many new runs, then report on what is finished (-1: all).
    command: command line recorded in the report ('' = this process's argv).
    **sweep_kwargs: passed to ``sweep.run_sweep`` (train_fn, eval_fn, estimator).

  Returns:
    The summary dict (also written as summary.json).
  """
  exp = spec.load(config_path)
  out = sweep.run_sweep(exp, workdir, quick=quick, run_store=run_store, max_runs=max_runs,
                        **sweep_kwargs)
  command = command or 'python -m flax_posemb.experiments ' + ' '.join(
      shlex.quote(a) for a in sys.argv[1:])
  summary = report.write(exp, out, report_dir or workdir, command)
  logger.info('report: %s', os.path.join(report_dir or workdir, 'REPORT.md'))
  return summary


def run_suite(config_paths: list[str], workdir: str, *, quick: bool = False,
              run_store: str = '', report_dir: str = '', max_runs: int = -1,
              command: str = '', **sweep_kwargs: Any) -> dict[str, dict[str, Any]]:
  """Runs several experiments in this one process, sharing one run store, plus an index.

  One process keeps JAX's in-memory caches warm across experiments; runs whose resolved
  configs coincide across experiments are trained once (``spec.run_key``).

  Args:
    config_paths: experiment configs and/or suite files (``spec.expand_paths``).
    workdir: each experiment uses ``workdir/NAME``.
    quick: as in ``run_experiment``.
    run_store: shared run directory; '' = ``workdir/store``.
    report_dir: each report goes to ``report_dir/NAME``, the index to
      ``report_dir/README.md`` ('' = ``workdir``).
    max_runs: new runs to train over the whole suite (-1: all).
    command: command line recorded in the reports ('' = this process's argv).
    **sweep_kwargs: passed to ``sweep.run_sweep``.

  Returns:
    Experiment name -> summary dict.
  """
  paths = spec.expand_paths(config_paths)
  store = run_store or os.path.join(workdir, 'store')
  out_root = report_dir or workdir
  command = command or 'python -m flax_posemb.experiments ' + ' '.join(
      shlex.quote(a) for a in sys.argv[1:])
  summaries: dict[str, dict[str, Any]] = {}
  for path in paths:
    name = spec.load(path).name
    before = _count_done(store)
    summaries[name] = run_experiment(
        path, os.path.join(workdir, name), quick=quick, run_store=store,
        report_dir=os.path.join(out_root, name), max_runs=max_runs, command=command,
        **sweep_kwargs)
    if max_runs >= 0:
      max_runs = max(0, max_runs - (_count_done(store) - before))
  write_index(summaries, out_root, command)
  return summaries


def _count_done(store: str) -> int:
  if not os.path.isdir(store):
    return 0
  return sum(sweep.is_done(os.path.join(store, d)) for d in os.listdir(store))


def write_index(summaries: dict[str, dict[str, Any]], out_dir: str, command: str) -> str:
  """Writes ``out_dir/README.md``: one section per experiment, its verdict counts and link.

  Args:
    summaries: experiment name -> summary dict (``report.aggregate`` + figures).
    out_dir: directory holding ``NAME/REPORT.md`` per experiment.
    command: the command that produced them.

  Returns:
    The index path.
  """
  lines = ['# Experiments', '', f'Produced by `{command}` (one process, one shared run '
           'store: arms whose resolved configs coincide across experiments are one run).', '']
  for name, s in summaries.items():
    count = lambda key: ', '.join(f'{n} {v}' for v, n in collections.Counter(
        c.get(key, c['verdict']) for c in s['claims']).items()) or 'no claims'
    verdicts = count('verdict')
    m = s.get('multiplicity')
    if m:
      verdicts += (f' ({m["claims_tested"]} claims tested; after Holm-Bonferroni: '
                   f'{count("verdict_holm")})')
    partial = '' if s.get('complete', True) else ' **(partial sweep)**'
    lines += [f'## [{s["title"]}]({name}/REPORT.md){partial}', '', s['question'], '',
              f'Verdicts: {verdicts}. Data: [`summary.json`]({name}/summary.json).', '']
    if s.get('figures'):
      lines += [f'![{name}]({name}/{s["figures"][0]})', '']
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, 'README.md')
  with open(path, 'w') as f:
    f.write('\n'.join(lines))
  return path
