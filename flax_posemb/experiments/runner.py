"""One call from an experiment config to its REPORT.md: sweep, then report."""

from __future__ import annotations

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
