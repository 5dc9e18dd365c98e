"""CLI: python -m flax_posemb.experiments CONFIG[:scale] --workdir DIR [--quick] ..."""

from __future__ import annotations

import argparse
import logging
import os

from flax_posemb.experiments import runner


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog='python -m flax_posemb.experiments', description=__doc__)
  p.add_argument('config', help='configs/experiments/NAME.py, optionally :cpu or :accelerator')
  p.add_argument('--workdir', required=True, help='experiment workdir (resumed if it exists)')
  p.add_argument('--quick', action='store_true', help='two tiny arms, one seed, a few steps')
  p.add_argument('--run_store', default='', help='run workdirs shared across experiments')
  p.add_argument('--report_dir', default='', help='REPORT.md destination (default: workdir)')
  p.add_argument('--max_runs', type=int, default=-1, help='train at most N new runs')
  p.add_argument('--compilation_cache', default=os.path.join(
      os.path.expanduser('~'), '.cache', 'flax_posemb', 'jax_cache'),
                 help="JAX persistent compilation cache ('' disables)")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
  runner.enable_compilation_cache(args.compilation_cache)
  summary = runner.run_experiment(args.config, args.workdir, quick=args.quick,
                                  run_store=args.run_store, report_dir=args.report_dir,
                                  max_runs=args.max_runs)
  for c in summary['claims']:
    print(f"{c['verdict']:>28}  {c['id']}: {c['text']}")
  print(os.path.join(args.report_dir or args.workdir, 'REPORT.md'))


if __name__ == '__main__':
  main()
