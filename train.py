"""Trains a model and records per-position statistics (flax_posemb.training).

  python train.py --config configs/tiny.py --workdir runs/tiny
  [--config.key=value ...]

Re-running the same command on a workdir with checkpoints resumes from the
latest one. Multi-host: pass --coordinator_address/--num_processes/--process_id
(or --distributed to let jax.distributed.initialize() detect a cluster); each
process reads its own data rows.

Exit codes (flax_posemb.cli): 0 done, 2 bad input (one message, nothing
written), 3 the loss became non-finite, 75 preempted by SIGTERM (re-run the same
command to resume)."""

import signal

# Held, not lost, until the one handler takes it (cli.exit_early_on_sigterm, in
# main).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

PROG = 'train.py'

from absl import flags
from ml_collections import config_flags

from flax_posemb import cli

config_flags.DEFINE_config_file(
    'config', None, 'Config file (configs/NAME.py).', lock_config=True
)
flags.DEFINE_string(
    'workdir', None, 'Run directory (checkpoints, metrics, statistics).'
)
flags.DEFINE_bool(
    'distributed', False, 'Call jax.distributed.initialize() (auto-detect).'
)
flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0 (multi-host).'
)
flags.DEFINE_integer('num_processes', None, 'Processes in a multi-host run.')
flags.DEFINE_integer('process_id', None, 'This process (0 .. num_processes-1).')
flags.DEFINE_string(
    'cpu_collectives',
    None,
    "CPU collectives for multi-process CPU runs, e.g. 'gloo'.",
)
cli.define_debug_flag()
flags.mark_flags_as_required(['config', 'workdir'])
FLAGS = flags.FLAGS


def main(argv):
  del argv  # cli.run refuses positional arguments.
  # Writes nothing: a bad --workdir is refused before the restart below, which
  # would import everything a second time.
  cli.check_output_dir(FLAGS.workdir)
  # Before anything is written: the process may restart.
  cli.start_on_huge_pages()
  # The config is checked first in train_and_evaluate, before JAX starts a
  # backend.
  multi = FLAGS.distributed or FLAGS.coordinator_address
  with cli.exit_early_on_sigterm(PROG, FLAGS.workdir, remove=not multi):
    # Imported here, under the handler: a SIGTERM while they load exits 75.
    import jax

    if FLAGS.cpu_collectives:
      jax.config.update(
          'jax_cpu_collectives_implementation', FLAGS.cpu_collectives
      )
    if multi:
      jax.distributed.initialize(
          FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id
      )
    from flax_posemb import training

    result = training.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  if result['preempted']:
    print(
        f"Training preempted at step {result['step']} (checkpoint saved);"
        f' re-run the same command to resume. Exit code {cli.EXIT_PREEMPTED}.',
        flush=True,
    )
    return cli.EXIT_PREEMPTED
  loss = ''
  if result['loss'] is not None:
    loss = f"; last window loss {result['loss']:.4f}"
  print(f"Training finished at step {result['step']}{loss}.")
  return cli.EXIT_OK


if __name__ == '__main__':
  cli.run(main, PROG)
