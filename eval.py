"""Loss by position bucket of trained runs (and offset probe, table analysis, comparison).

  python eval.py --workdir runs/tiny
  python eval.py --workdir runs/a --workdir runs/b --offsets 0,16,64 --analyze

Restores only params + config from each run's latest (or --step) Orbax checkpoint onto the
available devices; writes WORKDIR/eval/step_N/ (or --output) and prints the bucket table and
the plot path. See flax_posemb.evaluation.evaluate_workdir.
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
flags.mark_flag_as_required('workdir')
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO.
  from flax_posemb import eval_report  # pylint: disable=g-import-not-at-top
  from flax_posemb import evaluation  # pylint: disable=g-import-not-at-top
  if FLAGS.buckets and FLAGS.bucket_edges:
    raise app.UsageError('Give either --buckets log2 or --bucket_edges, not both.')
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
    print(f"== {label} (step {run['step']})\n{run['table']}")
    print(f"results: {run['files']['json']}")
    print(f"plot: {run['files']['plot']}")
  if len(runs) > 1:
    out_dir = FLAGS.output or os.path.join(os.path.dirname(os.path.abspath(workdirs[0])), 'compare')
    try:
      comp = eval_report.compare(labels, [r['results'] for r in runs], out_dir)
    except ValueError as e:
      sys.exit(f'eval.py: {e}')
    print(f"== comparison\n{comp['table']}")
    print(f"comparison: {comp['files']['json']}")
    print(f"plot: {comp['files']['plot']}")


if __name__ == '__main__':
  app.run(main)
