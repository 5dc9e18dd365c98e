"""Trains a model and records per-position statistics (flax_posemb.training).

  python train.py --config configs/tiny.py --workdir runs/tiny [--config.key=value ...]

Re-running the same command on a workdir with checkpoints resumes from the latest one.
Multi-host: pass --coordinator_address/--num_processes/--process_id (or --distributed to
let jax.distributed.initialize() detect a cluster); each process reads its own data rows.
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

config_flags.DEFINE_config_file('config', None, 'Config file (configs/NAME.py).',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, metrics, statistics).')
flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (auto-detect).')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 (multi-host).')
flags.DEFINE_integer('num_processes', None, 'Processes in a multi-host run.')
flags.DEFINE_integer('process_id', None, 'This process (0 .. num_processes-1).')
flags.DEFINE_string('cpu_collectives', None, "CPU collectives for multi-process CPU runs, e.g. 'gloo'.")
flags.mark_flags_as_required(['config', 'workdir'])
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO.
  import jax  # pylint: disable=g-import-not-at-top
  if FLAGS.cpu_collectives:
    jax.config.update('jax_cpu_collectives_implementation', FLAGS.cpu_collectives)
  if FLAGS.distributed or FLAGS.coordinator_address:
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                               num_processes=FLAGS.num_processes,
                               process_id=FLAGS.process_id)
  from flax_posemb import training  # pylint: disable=g-import-not-at-top
  result = training.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  state = 'preempted at' if result['preempted'] else 'finished at'
  print(f"Training {state} step {result['step']}; last window loss {result['loss']}.")


if __name__ == '__main__':
  app.run(main)
