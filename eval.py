"""Loss by position bucket of trained runs (and offset probe, table analysis,
comparison).

  python eval.py --workdir runs/tiny
  python eval.py --workdir runs/a --workdir runs/b --window_start deep
  python eval.py --analyze --table gpt2.safetensors:wpe.weight --output out/wpe
  python eval.py --analyze --stats runs/mine/stats --output out/mine

(a paired A-B comparison; any table, no run; any window files, no run.)

Restores only params + config of each run's latest (or --step) checkpoint onto
the available devices; writes WORKDIR/eval/step_N/ (or --output) and prints the
bucket table, the windows' provenance, loss by window group and the plot path
(flax_posemb.eval_workdir, analysis_report). Exit codes (flax_posemb.cli): 0
done, 2 bad input (one message, no traceback; --debug shows it).
"""

import os

from absl import flags

from flax_posemb import analysis_report
from flax_posemb import cli
from flax_posemb import eval_workdir
from flax_posemb import outputs
from flax_posemb.data import windows

flags.DEFINE_multi_string(
    'workdir', None, 'Training workdir(s); several give a comparison.'
)
flags.DEFINE_integer(
    'step', None, 'Checkpoint step (default: latest).', lower_bound=0
)
flags.DEFINE_string(
    'split', None, 'Data split (default: config.data.eval_split).'
)
flags.DEFINE_integer(
    'bucket_size', None, 'Width of uniform position buckets.', lower_bound=1
)
flags.DEFINE_enum(
    'buckets', None, ['log2'], 'Bucket scheme: log2 = 0, 1, 2, 4, ..., T.'
)
flags.DEFINE_string(
    'bucket_edges', None, 'Explicit bucket edges, e.g. 0,128,256,512.'
)
flags.DEFINE_integer(
    'num_windows', None, 'Evaluation windows (documents).', lower_bound=1
)
flags.DEFINE_integer(
    'batch_size', None, 'Windows per evaluation batch.', lower_bound=1
)
flags.DEFINE_string(
    'offsets',
    None,
    'Offset probe: comma-separated position shifts, e.g. 0,16,64.',
)
flags.DEFINE_enum(
    'position_policy',
    None,
    ['windows', 'natural'],
    'windows: full-length documents at positions 0..T-1; natural: training'
    ' rows.',
)
flags.DEFINE_string(
    'window_start',
    None,
    "windows: first (a document's first T tokens) or deep (token-uniform"
    ' windows deep inside long documents; text sources).',
)
flags.DEFINE_integer(
    'min_doc_len',
    None,
    'deep: documents of at least this many tokens '
    '(default: eval.min_doc_len; 0 = 4 T).',
    lower_bound=0,
)
flags.DEFINE_integer(
    'min_start',
    None,
    'deep: no window starts before this token of its '
    'document (default: eval.min_start; 0 = T).',
    lower_bound=0,
)
flags.DEFINE_string(
    'output', None, 'Output directory (default WORKDIR/eval/step_N[_OPTIONS]).'
)
flags.DEFINE_bool(
    'analyze',
    False,
    'Also analyse the position table (norms, drift, PCA, probe).',
)
flags.DEFINE_string(
    'table',
    None,
    'With --analyze --output and no --workdir: analyse this '
    'table file, PATH.npy, PATH.npz[:KEY] or PATH.safetensors[:KEY].',
)
flags.DEFINE_string(
    'stats',
    None,
    'With --analyze --output and no --workdir: analyse this '
    'directory of statistics window files (window_STEP.npz).',
)
cli.define_debug_flag()
FLAGS = flags.FLAGS


def _known_window_start(value: str | None) -> bool:
  """A flag validator: the data layer's message (it names the retired
  'random')."""
  if value is not None:
    try:
      windows.check_window_start(value)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from None
  return True


flags.register_validator('window_start', _known_window_start)


def main(argv):
  del argv  # cli.run refuses positional arguments.
  if FLAGS.buckets and FLAGS.bucket_edges:
    raise cli.UserError(
        'give either --buckets log2 or --bucket_edges, not both.'
    )
  if FLAGS.table is not None or FLAGS.stats is not None or not FLAGS.workdir:
    return analyze_table_file()
  offsets = parse_offsets(FLAGS.offsets)
  for workdir in FLAGS.workdir:
    if not os.path.isdir(workdir):
      fix = 'give a training workdir.'
      similar = cli.similar_directory(workdir)
      if similar:
        fix = f'did you mean {similar}?'
      raise cli.UserError(f'--workdir {workdir} is not a directory; {fix}')
  check_outputs(FLAGS.workdir, FLAGS.output)
  try:
    runs, comparison = eval_workdir.evaluate_and_compare(
        FLAGS.workdir,
        output=FLAGS.output,
        progress=True,
        step=FLAGS.step,
        offsets=offsets,
        analyze=FLAGS.analyze,
        split=FLAGS.split,
        policy=FLAGS.position_policy,
        window_start=FLAGS.window_start,
        min_doc_len=FLAGS.min_doc_len,
        min_start=FLAGS.min_start,
        num_windows=FLAGS.num_windows,
        batch_size=FLAGS.batch_size,
        bucket_size=FLAGS.bucket_size,
        bucket_edges=FLAGS.buckets or FLAGS.bucket_edges,
    )
  except windows.TooFewWindowsError as e:
    raise cli.UserError(too_few_windows(e)) from None
  for label, run in runs:
    print(
        f"== {label} (step {run['step']})\n{run['table']}\nresults:"
        f" {run['files']['json']}"
    )
    print_figures(run['files'])
  if comparison:
    print(
        f"== comparison\n{comparison['table']}\ncomparison:"
        f" {comparison['files']['json']}"
    )
    print_figures(comparison['files'])


def check_outputs(workdirs: list[str], output: str | None) -> None:
  """Where the results go, settled before anything is restored or evaluated
  (one cli.UserError naming the directory): --output, else each WORKDIR/eval
  and a comparison's directory beside the first run."""
  places = [(output, '--output')]
  if not output:
    places = [
        (os.path.join(w, outputs.EVAL_DIR), 'the results directory')
        for w in workdirs
    ]
    if len(workdirs) > 1:
      beside = os.path.dirname(os.path.normpath(workdirs[0])) or os.curdir
      places.append((beside, "the comparison's directory"))
  for path, what in places:
    try:
      cli.check_output_dir(path, what)
    except cli.UserError as e:
      raise cli.UserError(
          f'{e} Nothing was evaluated; give --output DIR, a directory that'
          ' can be written.'
      ) from None


def print_figures(files: dict[str, str]) -> None:
  """One line per figure written."""
  for path in analysis_report.figures(files):
    print(f'plot: {path}')


def too_few_windows(error: windows.TooFewWindowsError) -> str:
  """The refusal in eval.py's flags."""
  source = "the config's eval.num_windows"
  if FLAGS.num_windows:
    source = '--num_windows'
  fix = f'pass --num_windows {error.found} or fewer'
  if error.deep:
    fix += ', lower --min_doc_len / --min_start'
  return (
      f'{error.what}, but {error.requested} windows were requested ({source});'
      f' {fix}, or evaluate a split or corpus with more (longer) documents.'
  )


def parse_offsets(text: str | None) -> list[int] | None:
  """The --offsets shifts, or None without the flag."""
  if not text:
    return None
  problem = (
      '--offsets must be >= 0 and comma-separated integers, e.g. 0,16,64; '
      f'got {text!r}.'
  )
  try:
    offsets = [int(k) for k in text.split(',')]
  except ValueError:
    raise cli.UserError(problem) from None
  if min(offsets) < 0:
    raise cli.UserError(problem)
  return offsets


def analyze_table_file():
  """--table or --stats: analyse a table file or a directory of window files (no
  run)."""
  one_source = (FLAGS.table is None) != (FLAGS.stats is None)
  if not one_source or FLAGS.workdir or not (FLAGS.analyze and FLAGS.output):
    raise cli.UserError(
        '--table PATH or --stats DIR needs --analyze and --output DIR, and no '
        '--workdir; without them, give --workdir RUN.'
    )
  if FLAGS.stats is not None:
    summary = analysis_report.analyze_stats(
        FLAGS.stats, FLAGS.output, progress=True
    )
  else:
    summary = analysis_report.write_table_analysis(
        FLAGS.table,
        FLAGS.output,
        bucket_size=FLAGS.bucket_size or 16,
        bucket_edges=FLAGS.buckets or FLAGS.bucket_edges or '',
        progress=True,
    )
  print('\n'.join(analysis_report.summary_lines(summary)))
  print(f"results: {summary['files']['json']}")
  print_figures(summary['files'])


if __name__ == '__main__':
  cli.run(main, 'eval.py')
