"""CLI: python -m flax_posemb.experiments CONFIG[:scale] [CONFIG ...] --workdir
DIR [--quick] ...

Layout: docs/DESIGN.md § Experiments outputs; exit codes: flax_posemb.cli."""

import logging
import os

from absl import flags
from absl import logging as absl_logging

from flax_posemb import cli

PROG = 'python -m flax_posemb.experiments'
cli.name_main_module(PROG, __name__)

# After name_main_module: the flags these modules define are titled PROG.
import jax  # noqa: E402

from flax_posemb import experiments  # noqa: E402
from flax_posemb import preemption  # noqa: E402
from flax_posemb.experiments import spec  # noqa: E402

flags.DEFINE_string(
    'workdir', None, 'Experiment workdir (resumed if it exists).'
)
flags.DEFINE_bool(
    'quick', False, 'Two tiny arms, one seed, a few steps (pipeline check).'
)
flags.DEFINE_string('run_store', '', 'Run workdirs shared across experiments.')
flags.DEFINE_string(
    'report_dir', '', 'REPORT.md destination (default: the workdir).'
)
flags.DEFINE_integer(
    'max_runs', -1, 'Train at most N new runs (-1: all).', lower_bound=-1
)
flags.DEFINE_string(
    'compilation_cache',
    os.path.expanduser('~/.cache/flax_posemb/jax_cache'),
    "JAX persistent compilation cache ('' disables).",
)
flags.DEFINE_bool(
    'rerender',
    False,
    'Render the reports in --report_dir again from their summary.json (new'
    ' report sections; n/a where a summary lacks them); trains nothing.',
)
cli.define_debug_flag()
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
  rerendering = FLAGS.rerender and bool(FLAGS.report_dir)
  if len(argv) < 2 or not (FLAGS.workdir or rerendering):
    raise cli.UserError(
        'an experiment config (e.g. configs/experiments/init_comparison.py, '
        'or the suite all.py) and --workdir are required (--rerender:'
        ' --report_dir instead of --workdir).'
    )
  # Before anything is written: the process may restart.
  cli.start_on_huge_pages()
  for flag in ('workdir', 'run_store', 'report_dir'):
    directory = FLAGS[flag].value
    if directory:
      cli.check_output_dir(directory, f'--{flag}')
  paths = spec.expand_paths(argv[1:])
  for path in paths:  # Every experiment config is checked before anything runs.
    spec.load(path)
  # One line per run; Orbax/TFDS INFO only with --verbosity.
  if not FLAGS['verbosity'].present:
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger('flax_posemb').setLevel(logging.INFO)
  # JAX's persistent cache: runs of equal shapes compile once.
  if FLAGS.compilation_cache:
    jax.config.update('jax_compilation_cache_dir', FLAGS.compilation_cache)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
  kwargs = dict(
      quick=FLAGS.quick,
      run_store=FLAGS.run_store,
      report_dir=FLAGS.report_dir,
      max_runs=FLAGS.max_runs,
  )
  if FLAGS.rerender:
    out = FLAGS.report_dir or FLAGS.workdir
    experiments.rerender_suite(argv[1:], out)
    print(os.path.join(out, 'README.md' if len(paths) > 1 else 'REPORT.md'))
    return
  try:
    if len(paths) == 1:
      summaries = {
          '': experiments.run_experiment(paths[0], FLAGS.workdir, **kwargs)
      }
    else:
      summaries = experiments.run_suite(argv[1:], FLAGS.workdir, **kwargs)
  except preemption.Preempted as e:
    cli.fail(PROG, str(e), cli.EXIT_PREEMPTED)
  out = FLAGS.report_dir or FLAGS.workdir
  for name, summary in summaries.items():
    for claim in summary['claims']:
      print(f"{claim['verdict']:>28}  {claim['id']}: {claim['text']}")
    for figure in summary['figures']:
      print(f'plot: {os.path.join(out, name, figure)}')
    print(os.path.join(out, name, 'REPORT.md'))
  if len(summaries) > 1:
    print(os.path.join(out, 'README.md'))


if __name__ == '__main__':
  cli.run(main, PROG, positional=True)
