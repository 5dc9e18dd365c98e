"""CLI: python -m flax_posemb.experiments CONFIG[:scale] [CONFIG ...] --workdir DIR [--quick] ...

One experiment config: its runs in WORKDIR/runs (or --run_store), its report in WORKDIR (or
--report_dir). Several configs, or a suite file such as configs/experiments/all.py: all of
them in this one process, experiment NAME in WORKDIR/NAME, runs shared in WORKDIR/store (or
--run_store), reports in REPORT_DIR/NAME plus an index REPORT_DIR/README.md.

Exit codes (flax_posemb.cli): 0 done, 2 bad input (one message, no traceback; --debug or
FLAX_POSEMB_DEBUG=1 shows it), 3 a run's loss became non-finite.
"""

from __future__ import annotations

import argparse
import logging
import os

from flax_posemb import cli
from flax_posemb.experiments import runner, spec

PROG = 'python -m flax_posemb.experiments'


class _Parser(argparse.ArgumentParser):
  """argparse with the CLIs' convention: one line on stderr, exit code 2."""

  def error(self, message):
    cli.fail(PROG, f'{message} (see --help).')


@cli.guarded(PROG)
def main(argv: list[str] | None = None) -> None:
  p = _Parser(prog=PROG, description=__doc__)
  p.add_argument('config', nargs='+',
                 help='configs/experiments/NAME.py (or a suite such as all.py), optionally '
                 ':cpu or :accelerator')
  p.add_argument('--workdir', required=True, help='experiment workdir (resumed if it exists)')
  p.add_argument('--quick', action='store_true', help='two tiny arms, one seed, a few steps')
  p.add_argument('--run_store', default='', help='run workdirs shared across experiments')
  p.add_argument('--report_dir', default='', help='REPORT.md destination (default: workdir)')
  p.add_argument('--max_runs', type=int, default=-1, help='train at most N new runs')
  p.add_argument('--compilation_cache', default=os.path.join(
      os.path.expanduser('~'), '.cache', 'flax_posemb', 'jax_cache'),
                 help="JAX persistent compilation cache ('' disables)")
  p.add_argument('--debug', action='store_true', help='show the traceback of user errors')
  args = p.parse_args(argv)
  if args.debug:
    os.environ['FLAX_POSEMB_DEBUG'] = '1'
  if args.max_runs < -1:
    raise cli.UserError(f'--max_runs must be >= 0, or -1 for all; got {args.max_runs}.')
  for flag in ('workdir', 'run_store', 'report_dir'):
    if getattr(args, flag):
      cli.check_output_dir(getattr(args, flag), f'--{flag}')
  paths = spec.expand_paths(args.config)
  for path in paths:  # Every experiment config is checked before anything runs.
    spec.load(path)
  logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(message)s')
  logging.getLogger('flax_posemb.experiments').setLevel(logging.INFO)
  runner.enable_compilation_cache(args.compilation_cache)
  if len(paths) == 1:
    summaries = {'': runner.run_experiment(
        paths[0], args.workdir, quick=args.quick, run_store=args.run_store,
        report_dir=args.report_dir, max_runs=args.max_runs)}
  else:
    summaries = runner.run_suite(paths, args.workdir, quick=args.quick,
                                 run_store=args.run_store, report_dir=args.report_dir,
                                 max_runs=args.max_runs)
  for name, summary in summaries.items():
    for c in summary['claims']:
      print(f"{c['verdict']:>28}  {c['id']}: {c['text']}")
    print(os.path.join(args.report_dir or args.workdir, name, 'REPORT.md'))
  if len(summaries) > 1:
    print(os.path.join(args.report_dir or args.workdir, 'README.md'))


if __name__ == '__main__':
  main()
