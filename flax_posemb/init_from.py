"""A run started from another workdir's parameters (config init_from): the
source's shape and tokenizer for the config, its parameters fitted to the new
model, and a run that resumes and evaluates from its own files once the source
is gone (docs/pretrained.md, "Starting a run from a workdir")."""

import dataclasses
import hashlib
import os
from typing import Any

from absl import logging
from flax import traverse_util
import jax
import ml_collections
from ml_collections import config_dict
import numpy as np

from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import evaluation
from flax_posemb import initializers
from flax_posemb import model as model_lib
from flax_posemb import outputs
from flax_posemb import own_tokenizer
from flax_posemb import trees
from flax_posemb import workdir as workdir_lib

# ModelConfig fields a source's shape sets (an imported model's: the
# checkpoint's), which the run's must match.
SHAPE_FIELDS = (
    'vocab_size',
    'num_layers',
    'num_heads',
    'emb_dim',
    'mlp_dim',
    'position_embedding',
)


# The data fields that name a run's tokenizer (a run started from a workdir
# takes its).
TOKENIZER_FIELDS = ('tokenizer', 'hf_tokenizer', 'spm_model')
# (section, field) of the config that a run started from a workdir takes from
# it: the shape, max_len and the tokenizer.
SOURCE_FIELDS = tuple(
    [('model', key) for key in SHAPE_FIELDS + ('max_len',)]
    + [('data', key) for key in TOKENIZER_FIELDS]
)


def source_config(workdir: str) -> dict[str, Any]:
  """The config of the workdir `init_from` names (its config.json, else its
  newest checkpoint's), its paths resolved through it; ValueError if it has
  neither."""
  saved = workdir_lib.saved_config(workdir)
  if saved is not None:
    return saved
  if not os.path.isdir(checkpointing.checkpoint_dir(workdir)):
    raise ValueError(
        f'init_from={workdir!r} is not a workdir (no {outputs.CONFIG_FILE},'
        f' no {outputs.CHECKPOINTS_DIR}/); import a Hugging Face model with'
        ' python -m flax_posemb.commands.import_hf, or name a trained run.'
    )
  with checkpointing.Checkpointer(
      checkpointing.checkpoint_dir(workdir), max_to_keep=1, read_only=True
  ) as ckpt:
    return own_tokenizer.resolve_paths(ckpt.latest_config(), workdir)


def apply_source(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Sets `config` to start from `workdir`: init_from, the model's shape
  (`SOURCE_FIELDS`) and its tokenizer (configs/gpt2_pretrained.py).

  A `workdir` that is gone sets init_from and leaves those fields unset
  (placeholders a command line may set): a run that started from it takes
  them from its own files (`fill_from_own_files`); a fresh start refuses it.
  """
  config.init_from = workdir
  if not os.path.isdir(workdir):
    for section, key in SOURCE_FIELDS:
      value_type = type(config[section][key])
      config[section][key] = config_dict.placeholder(value_type)
    return
  source = source_config(workdir)
  for section, key in SOURCE_FIELDS:
    if key in source[section]:
      config[section][key] = source[section][key]


def fill_from_own_files(
    config: ml_collections.ConfigDict, workdir: str
) -> ml_collections.ConfigDict:
  """`config` (a copy) with the fields `apply_source` left unset, its source
  gone, taken from the run in `workdir` that started from it (its
  init_from.json and config.json); a field the command line set stays, so
  that a change of it is a config change. Without such a run, they are the
  source's, and a source still gone is refused (ValueError naming it)."""
  unset = [
      (section, key)
      for section, key in SOURCE_FIELDS
      if key in config[section] and config[section][key] is None
  ]
  if not unset:
    return config
  own_files = _own_files(workdir)
  if own_files is None:
    # A fresh start: refused, naming the source, while it is gone.
    values = source_config(config.init_from)
  else:
    record, values = own_files
    logging.info(
        'init_from=%s is gone: the run takes its shape and tokenizer from %s'
        ' (it started from %s, step %s, params digest %s).',
        config.init_from,
        workdir,
        record.get('workdir'),
        record.get('step'),
        record.get('digest'),
    )
  config = config.copy_and_resolve_references()
  for section, key in unset:
    config[section][key] = values[section][key]
  return config


def _own_files(workdir: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
  """``(init_from.json, config.json)`` of a run in `workdir` that started
  from init_from, or None (no such run)."""
  if not os.path.isdir(workdir):
    return None
  record = workdir_lib.init_record(workdir)
  saved = workdir_lib.saved_config(workdir)
  if record is None or saved is None:
    return None
  return record, saved


def settle_config(
    config: config_lib.RunConfig, workdir: str
) -> config_lib.RunConfig:
  """`config` as the run in `workdir` uses it: init_from may not name the
  workdir itself; a run that started from init_from keeps its recorded
  init_from when the source is the same path or gone; the workdir's copy of
  the tokenizer stands for the one named (`own_tokenizer.use_own_tokenizer`)."""
  source = config.init_from
  if source and _same_directory(source, workdir):
    raise ValueError(
        f"init_from={source!r} names this run's own --workdir; a run cannot"
        ' start from itself. Name the workdir to start from (an import or'
        ' another run), or leave init_from empty.'
    )
  own_files = _own_files(workdir) if source else None
  if own_files is not None:
    record, saved = own_files
    same = os.path.abspath(source) == record.get('workdir')
    if same or not os.path.isdir(source):
      init_from = saved.get('init_from', source)
      config = dataclasses.replace(config, init_from=init_from)
  elif source and not os.path.isdir(source):
    # A fresh start from a source that is gone: refused now, naming it.
    source_config(source)
  return own_tokenizer.use_own_tokenizer(config, workdir)


def _same_directory(a: str, b: str) -> bool:
  """Whether paths `a` and `b` name one directory."""
  if os.path.abspath(a) == os.path.abspath(b):
    return True
  return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)


def params_digest(params: Any) -> str:
  """SHA-256 of a params tree (paths, dtypes, shapes and bytes): the identity
  init_from.json records of the parameters a run started from."""
  digest = hashlib.sha256()
  flat = traverse_util.flatten_dict(params, sep='/')
  for path in sorted(flat):
    array = np.ascontiguousarray(np.asarray(flat[path]))
    digest.update(f'{path} {array.dtype.str} {array.shape}'.encode())
    digest.update(array.tobytes())
  return digest.hexdigest()


def check_init_from(config: config_lib.RunConfig) -> None:
  """The check of init_from before a fresh start: the source's model shape
  must be the config's (ValueError naming the fields and the fix)."""
  source = source_config(config.init_from)['model']
  differ = [
      f'{key}={source.get(key)!r} (config: {getattr(config.model, key)!r})'
      for key in SHAPE_FIELDS
      if source.get(key) != getattr(config.model, key)
  ]
  if differ:
    raise ValueError(
        f'init_from={config.init_from!r} holds another model:'
        f' {", ".join(differ)}. Use its shape:'
        f' --config configs/gpt2_pretrained.py:{config.init_from}, or set'
        ' those model fields.'
    )


def start_params(
    config: config_lib.RunConfig,
    model: model_lib.TransformerLM,
    key: jax.Array,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(params, record)``: the newest readable step of ``config.init_from``
  as the params of `model` (host arrays of its param dtype), the position
  table fitted to ``model.max_len`` by ``config.init_from_new_rows``
  (`initializers.extend_rows`; fresh rows drawn with `key`), and the record
  init_from.json keeps."""
  source = config.init_from
  params, _, info = checkpointing.restore_params(source)
  params = jax.tree.map(np.asarray, params)
  expected = evaluation.expected_params(model)
  cfg = model.config
  learned = cfg.position_embedding == 'learned'
  fitted = expected
  if learned:
    rows = np.shape(model_lib.position_table(params))[0]
    fitted = _with_table_rows(expected, rows)
  trees.check_same_tree(
      'params',
      params,
      fitted,
      f'init_from={source!r} holds another model',
      f'Use its shape: --config configs/gpt2_pretrained.py:{source}.',
      where=f'step {info.step} of {source}',
  )
  record = {
      'workdir': os.path.abspath(source),
      'step': info.step,
      'digest': params_digest(params),
  }
  if learned:
    table = np.asarray(model_lib.position_table(params))
    fresh = None
    if config.init_from_new_rows == 'init':
      shape = (cfg.max_len, cfg.emb_dim)
      fresh = np.asarray(cfg.position_initializer()(key, shape))
    extended = initializers.extend_rows(
        table, cfg.max_len, config.init_from_new_rows, fresh
    )
    pos = model_lib.POSITION_TABLE_PATH
    params[pos[0]] = dict(params[pos[0]], **{pos[1]: extended})
    record.update(
        rows=int(table.shape[0]),
        max_len=cfg.max_len,
        new_rows=config.init_from_new_rows,
    )
  params = jax.tree.map(
      lambda x, want: np.asarray(x, want.dtype), params, expected
  )
  return params, record


def _with_table_rows(expected: Any, rows: int) -> Any:
  """`expected` (ShapeDtypeStructs) with a position table of `rows` rows."""
  pos = model_lib.POSITION_TABLE_PATH
  table = expected[pos[0]][pos[1]]
  resized = jax.ShapeDtypeStruct((rows,) + table.shape[1:], table.dtype)
  return dict(expected, **{pos[0]: dict(expected[pos[0]], **{pos[1]: resized})})
