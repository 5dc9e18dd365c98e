"""Default configuration sections shared by every `configs/*.py`
(docs/DESIGN.md, Config): ConfigDicts built from the typed sections of
`flax_posemb.config`, where every field is documented."""

import dataclasses
from typing import Any

import ml_collections

from flax_posemb import config as config_lib


def _config_dict(section: Any) -> ml_collections.ConfigDict:
  """A ConfigDict of a config dataclass's fields and defaults."""
  return ml_collections.ConfigDict(dataclasses.asdict(section))


def data() -> ml_collections.ConfigDict:
  """Data section: `flax_posemb.config.DataConfig`'s fields and defaults."""
  return _config_dict(config_lib.DataConfig())


def model() -> ml_collections.ConfigDict:
  """Model section: `flax_posemb.model.ModelConfig`'s fields and defaults."""
  return _config_dict(config_lib.ModelConfig())


def optimizer() -> ml_collections.ConfigDict:
  """Optimizer section: `flax_posemb.config.OptimizerConfig`'s fields and
  defaults."""
  return _config_dict(config_lib.OptimizerConfig())


def evaluation() -> ml_collections.ConfigDict:
  """Evaluation section: `flax_posemb.config.EvalConfig`'s fields and
  defaults."""
  return _config_dict(config_lib.EvalConfig())


# Fields that do not change what a run computes: the experiments' run identity
# ignores them.
NON_SEMANTIC = (
    'progress_bar',
    'checkpoint_every_steps',
    'max_to_keep',
    'data.num_workers',
    'data.prefetch',
    'data.data_dir',
    'allow_config_change',
)
# What a resume may change without allow_config_change: the non-semantic
# fields (not data.num_workers: the iterator state depends on it), logging and
# evaluation.
RESUME_MAY_CHANGE = tuple(k for k in NON_SEMANTIC if k != 'data.num_workers')
RESUME_MAY_CHANGE += ('log_every_steps', 'eval_every_steps', 'eval')
# What a run saved before a field existed ran with, where not the default (a
# resume compares).
BEFORE_FIELD = {'data.shuffle_rows': 0}


def base() -> ml_collections.ConfigDict:
  """Full default config: `flax_posemb.config.RunConfig`'s fields and the four
  sections above."""
  config = _config_dict(config_lib.RunConfig())
  # A misspelled field in a config file is an error, not a new field.
  config.lock()
  return config
