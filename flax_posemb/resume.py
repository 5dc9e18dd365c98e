"""What a run checks before it starts or continues a workdir (Resume in
docs/DESIGN.md § Training outputs): a fresh start on a workdir without trained
outputs, a resume on a run of this model and config; the loop (`training`)
restores after these."""

from typing import Any

from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import evaluation
from flax_posemb import outputs
from flax_posemb import train_step as step_lib
from flax_posemb import workdir as workdir_lib


def check_start(
    workdir: str,
    ckpt: checkpointing.Checkpointer,
    latest: int | None,
    config: config_lib.RunConfig,
    dataset: str | None,
) -> dict[str, list[Any]]:
  """Refuses, before anything is restored or written, what would lose work.

  Every host calls it (they read the same files, so they all stop together).

  Args:
    workdir: the run's directory.
    ckpt: its checkpoints.
    latest: the newest checkpoint step (None: a fresh start).
    config: the run's config.
    dataset: the identity of the text it trains on (`data.dataset_identity`).

  Returns:
    The config changes a resume makes (`workdir.check_resume_config`; {} on a
    fresh start).
  """
  if latest is None:
    workdir_lib.check_fresh_start(workdir)
    return {}
  workdir_lib.check_not_imported(workdir)
  check_latest_is_the_runs(workdir, ckpt, latest)
  return workdir_lib.check_resume_config(
      workdir,
      config,
      ckpt.latest_config(),
      stored_dataset=ckpt.step_metadata(latest).get('dataset'),
      dataset=dataset,
  )


def check_latest_is_the_runs(
    workdir: str, ckpt: checkpointing.Checkpointer, step: int
) -> None:
  """CheckpointMismatchError if the newest checkpoint does not fit the run's
  own model (`workdir.run_config`): another model's step, not a change of
  config (the drift check, after this, compares with the config given)."""
  where = ckpt.directory / str(step)
  try:
    reference = workdir_lib.run_config(workdir, ckpt.first_config)
    stored = ckpt.stored_tree(step, 'params')
  except (checkpointing.CheckpointDamagedError, FileNotFoundError):
    # Damaged (no readable step): the read that follows names it, with the
    # step to resume from.
    return
  model = step_lib.stored_model(reference)
  resume_from = 'the step before it'
  older = [s for s in ckpt.all_steps() if s < step]
  if older:
    resume_from += f' ({older[-1]})'
  checkpointing.check_model(
      where,
      'params',
      stored,
      evaluation.expected_params(model),
      fix=(
          f"It is not this run's ({outputs.CONFIG_FILE} / its first"
          f' checkpoint). Nothing was changed. Move it aside (mv {where} /tmp/)'
          f' and re-run to resume from {resume_from}, or use a fresh'
          ' --workdir.'
      ),
  )
