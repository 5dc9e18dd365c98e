"""Position-exposure report of a config (docs/DESIGN.md § Data policies and
tokens; the maths: `flax_posemb.data.report`).

  python -m flax_posemb.commands.data_report --config configs/tiny.py \
      --num_batches 100 [--num_source_docs 0] [--json FILE] [--png FILE]
      [--config.data.position_policy=packed]

Exit codes (flax_posemb.cli): 0 done, 2 bad input (one message, no traceback;
--debug shows it)."""

import json
import os

from absl import flags
from ml_collections import config_flags

from flax_posemb import cli
from flax_posemb import plots
from flax_posemb.data import report

PROG = 'python -m flax_posemb.commands.data_report'
cli.name_main_module(PROG, __name__)

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file (configs/NAME.py).'
)
_NUM_BATCHES = flags.DEFINE_integer(
    'num_batches', 100, 'Training batches to count.', lower_bound=1
)
_NUM_DOCS = flags.DEFINE_integer(
    'num_source_docs',
    2000,
    'Source documents sampled for the '
    'length distribution and policy shares (0 = all).',
    lower_bound=0,
)
_JSON = flags.DEFINE_string('json', '', 'Write the report as JSON here.')
_PNG = flags.DEFINE_string(
    'png', '', 'Write a plot of exposure per position here.'
)
cli.define_debug_flag()
flags.mark_flags_as_required(['config'])


def main(argv):
  """Prints (and with --json / --png writes) the exposure report of --config."""
  del argv  # cli.run refuses positional arguments.
  # The output directories are checked before the report is computed.
  if _JSON.value:
    cli.check_output_dir(
        os.path.dirname(os.path.abspath(_JSON.value)), 'the directory of --json'
    )
  if _PNG.value:
    cli.check_output_dir(
        os.path.dirname(os.path.abspath(_PNG.value)), 'the directory of --png'
    )
  rep = report.exposure(_CONFIG.value, _NUM_BATCHES.value, _NUM_DOCS.value)
  print(report.format_report(rep))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(rep, f, indent=1)
  if _PNG.value:
    print(f'plot: {plots.data_exposure(rep, _PNG.value)}')


if __name__ == '__main__':
  cli.run(main, PROG)
