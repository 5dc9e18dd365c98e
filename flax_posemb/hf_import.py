"""A Hugging Face GPT-2-family checkpoint written as a workdir, built aside and
swapped in (docs/DESIGN.md § Pretrained models; the reading and the checks:
`flax_posemb.pretrained`).

Like `commands.prepare`, the import writes a hidden ``.NAME.import-*``
directory beside the target and renames it into place only when it is
complete: an import stopped by SIGTERM, a failure or ``kill -9`` never leaves a
half workdir at the target, and the next import of the same name removes what a
killed one left.
"""

from collections.abc import Mapping
import dataclasses
import errno
import glob
import json
import os
import shutil
import tempfile
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections

from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import data as data_lib
from flax_posemb import outputs
from flax_posemb import own_tokenizer
from flax_posemb import preemption
from flax_posemb import pretrained
from flax_posemb import workdir as workdir_lib

# The hidden directory an import of NAME builds in, beside NAME.
BUILD_PREFIX = '.{name}.import-'


def fit_to_positions(config: ml_collections.ConfigDict, max_len: int) -> None:
  """Fits ``data.seq_len`` to a checkpoint of `max_len` positions when the
  config asks for more (configs/gpt2_pretrained.py's 1024 on a smaller
  model), and ``eval.bucket_size`` with it, so that the evaluation keeps the
  number of buckets the config meant; one log line says so."""
  seq_len = config.data.seq_len
  if seq_len <= max_len:
    return
  config.data.seq_len = max_len
  note = ''
  bucket_size = config.eval.bucket_size
  if not config.eval.bucket_edges and bucket_size > 0:
    fitted = max(1, bucket_size * max_len // seq_len)
    config.eval.bucket_size = fitted
    note = f' and eval.bucket_size {bucket_size} -> {fitted}'
  logging.warning(
      'The checkpoint has %d positions: data.seq_len %d -> %d%s (pass'
      ' --config.data.seq_len=N with N <= %d to choose).',
      max_len,
      seq_len,
      max_len,
      note,
      max_len,
  )


def import_config(
    config: ml_collections.ConfigDict,
    model: Mapping[str, Any],
    tokenizer_dir: str,
) -> config_lib.RunConfig:
  """`config` (a `defaults.base()` config: data, evaluation, dtypes) with the
  checkpoint's `model` shape, its sequence length fitted to the checkpoint's
  positions (`fit_to_positions`) and data.tokenizer='hf' of the workdir's own
  copy (``tokenizer``, relative to the workdir), converted once and validated
  with the tokenizer in `tokenizer_dir` (ValueError naming the field)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.update(dict(model))
  fit_to_positions(config, int(model['max_len']))
  config.data.tokenizer = 'hf'
  # Validated with the tokenizer the import copies.
  config.data.hf_tokenizer = os.path.abspath(tokenizer_dir)
  config.init_from = ''
  run_config = config_lib.RunConfig.from_config_dict(config)
  data_lib.check_fits_model(run_config.data, max_len=run_config.model.max_len)
  data = dataclasses.replace(
      run_config.data, hf_tokenizer=outputs.TOKENIZER_DIR
  )
  return dataclasses.replace(run_config, data=data)


def import_checkpoint(
    hf_dir: str, workdir: str, config: ml_collections.ConfigDict
) -> dict[str, Any]:
  """Writes `workdir` from the checkpoint in `hf_dir` (docs/DESIGN.md
  § Pretrained models): config.json (`import_config`), a step-0 checkpoint of
  its parameters, tokenizer/ (a copy of its tokenizer files) and imported.json,
  built aside and renamed into place. Returns imported.json's record."""
  if os.path.isdir(workdir) and set(os.listdir(workdir)) - {outputs.LOCK_FILE}:
    raise workdir_lib.WorkdirError(
        f'--workdir {workdir} is not empty; nothing was changed. Import into'
        ' a new directory.'
    )
  checkpoint = pretrained.read_checkpoint(hf_dir)
  tokenizer = pretrained.read_tokenizer(hf_dir)
  vocab = checkpoint.model['vocab_size']
  if tokenizer.vocab_size > vocab:
    raise pretrained.HFCheckpointError(
        f'The tokenizer in {hf_dir} has {tokenizer.vocab_size} ids but'
        f" config.json vocab_size={vocab}: it is not this model's tokenizer."
    )
  config = import_config(config, checkpoint.model, hf_dir)
  model_config = config.model
  # Device arrays: checkpoint integrity digests params on their devices.
  params = jax.tree.map(
      lambda x: jnp.asarray(x, model_config.storage_dtype), checkpoint.params
  )
  record = {
      'hf_dir': os.path.abspath(hf_dir),
      'layout': checkpoint.layout,
      'files': [os.path.basename(p) for p in checkpoint.files],
      'model_type': checkpoint.hf_config.get('model_type'),
      'architectures': checkpoint.hf_config.get('architectures'),
      'transformers_version': checkpoint.hf_config.get('transformers_version'),
      'model': checkpoint.model,
      'parameters': int(sum(x.size for x in jax.tree.leaves(params))),
      'tokenizer': {
          'files': list(own_tokenizer.tokenizer_files(hf_dir)),
          'vocab_size': tokenizer.vocab_size,
          'separator_id': tokenizer.sep_id,
      },
  }
  parent, name = os.path.split(os.path.abspath(workdir))
  os.makedirs(parent, exist_ok=True)
  remove_leftovers(parent, name)
  build_dir = tempfile.mkdtemp(
      prefix=BUILD_PREFIX.format(name=name), dir=parent
  )
  try:
    with workdir_lib.Lock(build_dir):
      _write(build_dir, hf_dir, params, config, record)
      _swap_in(build_dir, workdir)
  except OSError as e:
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
      raise
    raise OSError(
        e.errno,
        f'{e.strerror} while importing into {workdir}: nothing was left there;'
        ' free some space and re-run the same command.',
    ) from None
  finally:
    # A second SIGTERM must not stop the removal.
    with preemption.defer_sigterm(install=False):
      shutil.rmtree(build_dir, ignore_errors=True)
  return record


def _write(
    build_dir: str,
    hf_dir: str,
    params: Any,
    config: config_lib.RunConfig,
    record: dict[str, Any],
) -> None:
  """The import's files in `build_dir`; imported.json last."""
  own_tokenizer.copy_tokenizer(
      hf_dir, os.path.join(build_dir, outputs.TOKENIZER_DIR)
  )
  with checkpointing.Checkpointer(
      checkpointing.checkpoint_dir(build_dir), max_to_keep=1
  ) as ckpt:
    ckpt.save(
        0,
        params=params,
        opt_state=None,
        data_iter=None,
        stats=None,
        config=config,
    )
  workdir_lib.write_config(build_dir, config)
  with outputs.atomic_write(
      os.path.join(build_dir, outputs.IMPORT_FILE), 'w'
  ) as f:
    json.dump(record, f, indent=1)


def remove_leftovers(parent: str, name: str) -> None:
  """Removes the build directories of killed imports of `name` in `parent`;
  refuses while another import of `name` is running (it holds its build
  directory's lock)."""
  pattern = os.path.join(parent, BUILD_PREFIX.format(name=name) + '*')
  for leftover in glob.glob(pattern):
    try:
      with workdir_lib.Lock(leftover):
        shutil.rmtree(leftover)
    except workdir_lib.WorkdirError:
      raise workdir_lib.WorkdirError(
          f'Another import into {os.path.join(parent, name)} is running'
          f' ({leftover}); wait for it to finish.'
      ) from None


def _swap_in(build_dir: str, workdir: str) -> None:
  """Renames the complete `build_dir` to `workdir` (absent, empty, or holding
  only a lock file nobody holds)."""
  if os.path.isdir(workdir) and os.listdir(workdir):
    if not workdir_lib.remove_unused(workdir):
      raise workdir_lib.WorkdirError(
          f'--workdir {workdir} is in use or was written during the import;'
          ' nothing was changed. Import into a new directory.'
      )
  os.rename(build_dir, workdir)
