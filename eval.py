"""Loss by position bucket of trained runs (and offset probe, table analysis, comparison).

  python eval.py --workdir runs/tiny
  python eval.py --workdir runs/a --workdir runs/b --offsets 0,16,64 --analyze
  python eval.py --analyze --table gpt2.safetensors:wpe.weight --output out/wpe  # any table, no run

Restores only params + config from each run's latest (or --step) Orbax checkpoint onto the
available devices; writes WORKDIR/eval/step_N/ (or --output) and prints the bucket table and
the plot path (flax_posemb.evaluation.evaluate_workdir); --table: analysis.write_table_analysis.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

flags.DEFINE_multi_string('workdir', None, 'Training workdir(s); several give a comparison.')
flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest).')
flags.DEFINE_string('split', None, 'Data split (default: config.data.eval_split).')
flags.DEFINE_integer('bucket_size', None, 'Width of uniform position buckets.')
flags.DEFINE_enum('buckets', None, ['log2'], 'Bucket scheme: log2 = 0, 1, 2, 4, ..., T.')
flags.DEFINE_string('bucket_edges', None, 'Explicit bucket edges, e.g. 0,128,256,512.')
flags.DEFINE_integer('num_windows', None, 'Evaluation windows (documents).')
flags.DEFINE_integer('batch_size', None, 'Windows per evaluation batch.')
flags.DEFINE_string('offsets', None, 'Offset probe: comma-separated position shifts, e.g. 0,16,64.')
flags.DEFINE_enum('position_policy', None, ['windows', 'natural'],
                  'windows: full-length documents at positions 0..T-1; natural: training rows.')
flags.DEFINE_string('output', None, 'Output directory (default WORKDIR/eval/step_N).')
flags.DEFINE_bool('analyze', False, 'Also analyse the position table (norms, drift, PCA, probe).')
flags.DEFINE_string('table', None, 'With --analyze --output and no --workdir: analyse this '
                    'table file, PATH.npy, PATH.npz[:KEY] or PATH.safetensors[:KEY].')
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if FLAGS.buckets and FLAGS.bucket_edges:
    raise app.UsageError('Give either --buckets log2 or --bucket_edges, not both.')
  if FLAGS.table is not None or not FLAGS.workdir:
    return analyze_table_file()  # Before importing jax: a table needs only numpy.
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO.
  from flax_posemb import eval_report  # pylint: disable=g-import-not-at-top
  from flax_posemb import evaluation  # pylint: disable=g-import-not-at-top
  try:
    offsets = [int(k) for k in FLAGS.offsets.split(',')] if FLAGS.offsets else None
  except ValueError:
    raise app.UsageError(f'--offsets must be comma-separated integers, got {FLAGS.offsets!r}.')
  workdirs = FLAGS.workdir
  labels = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(set(labels)) < len(labels):
    labels = [os.path.normpath(w) for w in workdirs]
  runs = []
  for workdir, label in zip(workdirs, labels):
    output = FLAGS.output
    if output and len(workdirs) > 1:
      output = os.path.join(output, label.replace(os.sep, '_'))
    try:
      run = evaluation.evaluate_workdir(
          workdir, step=FLAGS.step, output=output, offsets=offsets, analyze=FLAGS.analyze,
          split=FLAGS.split, policy=FLAGS.position_policy, num_windows=FLAGS.num_windows,
          batch_size=FLAGS.batch_size, bucket_size=FLAGS.bucket_size,
          bucket_edges=FLAGS.buckets or FLAGS.bucket_edges)
    except (ValueError, FileNotFoundError) as e:  # bad input: the message names the fix
      sys.exit(f'eval.py: {workdir}: {e}')
    runs.append(run)
    print(f"== {label} (step {run['step']})\n{run['table']}\nresults: {run['files']['json']}")
    print(f"plot: {run['files']['plot']}")
  if len(runs) > 1:
    out_dir = FLAGS.output or os.path.join(os.path.dirname(os.path.abspath(workdirs[0])), 'compare')
    try:
      comp = eval_report.compare(labels, [r['results'] for r in runs], out_dir)
    except ValueError as e:
      sys.exit(f'eval.py: {e}')
    print(f"== comparison\n{comp['table']}\ncomparison: {comp['files']['json']}")
    print(f"plot: {comp['files']['plot']}")


def analyze_table_file():
  """--table: bad input is one line on stderr and exit code 2, never a traceback."""
  from flax_posemb import analysis  # pylint: disable=g-import-not-at-top
  try:
    if FLAGS.table is None or FLAGS.workdir or not (FLAGS.analyze and FLAGS.output):
      raise ValueError('--table PATH needs --analyze and --output DIR, and no --workdir; '
                       'without --table, give --workdir RUN.')
    summary = analysis.write_table_analysis(
        FLAGS.table, FLAGS.output, bucket_size=FLAGS.bucket_size or 16,
        bucket_edges=FLAGS.buckets or FLAGS.bucket_edges or '')
  except ValueError as e:
    sys.stderr.write(f'eval.py: {e}\n')
    sys.exit(2)
  print(f"position probe R^2 {summary['probe']['r2']:.3f}\nresults: {summary['files']['json']}\n"
        f"plots: {summary['files']['table_plot']} {summary['files']['cosine_plot']}")


if __name__ == '__main__':
  app.run(main)
