"""Exposure report CLI: real-token count per position and document lengths.

  python -m flax_posemb.data --config configs/tiny.py --num_batches 100 \
      [--num_source_docs 0] [--json FILE] [--png FILE] [--config.data.position_policy=packed]

Prints the measured exposure of the configured policy, the untruncated document-length
distribution and, per policy, the share of corpus tokens it uses.
"""

import json

from absl import app
from absl import flags
from ml_collections import config_flags

from flax_posemb.data import report

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (configs/NAME.py).')
_NUM_BATCHES = flags.DEFINE_integer('num_batches', 100, 'Training batches to count.')
_NUM_DOCS = flags.DEFINE_integer('num_source_docs', 2000, 'Source documents sampled for the '
                                 'length distribution and policy shares (0 = all).')
_JSON = flags.DEFINE_string('json', '', 'Write the report as JSON here.')
_PNG = flags.DEFINE_string('png', '', 'Write a plot of exposure per position here.')


def main(argv):
  del argv
  if _CONFIG.value is None:
    raise app.UsageError('--config is required, e.g. --config configs/tiny.py')
  rep = report.exposure(_CONFIG.value, _NUM_BATCHES.value, _NUM_DOCS.value)
  print(report.format_report(rep))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(rep, f, indent=1)
  if _PNG.value:
    from flax_posemb import plots  # pylint: disable=g-import-not-at-top
    plots.data_exposure(rep, _PNG.value)


if __name__ == '__main__':
  app.run(main)
