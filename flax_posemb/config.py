"""Typed, validated config sections (docs/DESIGN.md § Config).

The `configs/*.py` files and every `--config.x=y` override stay
`ml_collections.ConfigDict`s, as users know them; each entry point converts the
ConfigDict once, with `RunConfig.from_config_dict`, and every module receives
these frozen dataclasses. Each section checks its own fields in
`__post_init__`; the rules that join sections live in `check_across_sections`.
The defaults here are the defaults of `flax_posemb.defaults.base()`.
"""

from collections.abc import Mapping
import dataclasses
import json
import math
from typing import Any

from flax_posemb import buckets as buckets_lib
from flax_posemb import data as data_lib
from flax_posemb import initializers
from flax_posemb import model as model_lib
from flax_posemb.data import config as data_config_lib
from flax_posemb.data import windows as windows_lib

ModelConfig = model_lib.ModelConfig
# The data section lives with the data layer, whose position policies check
# their own fields in it.
DataConfig = data_config_lib.DataConfig
SyntheticConfig = data_config_lib.SyntheticConfig

# The largest `seed` (a non-negative int32): every consumer takes this range
# (numpy, Grain, jax.random.key).
MAX_SEED = 2**31 - 1
# optimizer.position_optimizer: the table shares the model's Adam, or has
# row-sparse Adam, or SGD with momentum (flax_posemb.optim).
POSITION_OPTIMIZERS = ('adam', 'lazy_adam', 'sgd')
# The optimizer's numeric fields; row_lr_* only matter with row_lr_scale.
_OPTIMIZER_NUMBERS = (
    'learning_rate',
    'warmup_steps',
    'end_lr_ratio',
    'b1',
    'b2',
    'eps',
    'weight_decay',
    'grad_clip_norm',
)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer section: AdamW + warmup/cosine schedule (optax)."""

  # Peak learning rate.
  learning_rate: float = 3e-3
  # Linear warmup steps from 0 to the peak.
  warmup_steps: int = 20
  # Cosine decay to learning_rate * end_lr_ratio at num_train_steps.
  end_lr_ratio: float = 0.1

  # Adam beta1.
  b1: float = 0.9
  # Adam beta2 (stated explicitly: it sets how fast rare rows' second moments
  # decay).
  b2: float = 0.95
  # Adam epsilon.
  eps: float = 1e-8

  # Decoupled weight decay on 2-D weights.
  weight_decay: float = 0.1
  # Weight decay on the position table (nanoGPT: yes; minGPT: no).
  decay_position_table: bool = True
  # Weight decay on the token table.
  decay_token_table: bool = True
  # Global gradient-norm clip; <= 0 disables.
  grad_clip_norm: float = 1.0

  # Scale each position row's update by (mean exposure / row exposure)**power,
  # after Adam.
  row_lr_scale: bool = False
  # Exponent of the per-row exposure scale.
  row_lr_power: float = 0.5
  # Upper bound of the per-row scale.
  row_lr_max: float = 10.0

  # The position table's own optimizer (learned tables; the rest keep AdamW):
  # 'adam' shares the model's Adam (one step count for all rows); 'lazy_adam'
  # is row-sparse Adam: a row's moments, its own bias-correction count and its
  # weight decay change only at steps where its gradient is nonzero (a rarely
  # seen row's second moment does not decay between its occurrences, so an
  # occurrence is not a sign-like step); 'sgd' is SGD with momentum.
  position_optimizer: str = 'adam'
  # Momentum of the table's SGD (position_optimizer='sgd').
  position_momentum: float = 0.9
  # The table's SGD learning rate: the schedule's times this
  # (position_optimizer='sgd'; SGD steps are gradient-sized, Adam's are not).
  position_lr_scale: float = 1.0

  def __post_init__(self):
    """Raises ValueError naming the field, its flag and the fix; each check
    may assume that the ones before it passed."""
    numbers = _OPTIMIZER_NUMBERS
    if self.row_lr_scale:
      numbers += ('row_lr_power', 'row_lr_max')
    for name in numbers:
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f'optimizer.{name} must be finite (a number), got {value!r}; set'
            f' --config.optimizer.{name}=VALUE.'
        )
    if not self.learning_rate > 0:
      raise _out_of_range('optimizer.learning_rate', self.learning_rate, '> 0')
    if not (self.warmup_steps >= 0 and self.warmup_steps % 1 == 0):
      raise _out_of_range(
          'optimizer.warmup_steps', self.warmup_steps, 'an int >= 0'
      )
    if not self.end_lr_ratio >= 0:
      raise _out_of_range(
          'optimizer.end_lr_ratio',
          self.end_lr_ratio,
          '>= 0 (a fraction of the peak learning rate)',
      )
    if not 0 <= self.b1 < 1:
      raise _out_of_range('optimizer.b1', self.b1, 'in [0, 1)')
    if not 0 <= self.b2 < 1:
      raise _out_of_range('optimizer.b2', self.b2, 'in [0, 1)')
    if not self.eps >= 0:
      raise _out_of_range('optimizer.eps', self.eps, '>= 0')
    if not self.weight_decay >= 0:
      raise _out_of_range('optimizer.weight_decay', self.weight_decay, '>= 0')
    if self.row_lr_scale and not self.row_lr_max > 0:
      raise _out_of_range('optimizer.row_lr_max', self.row_lr_max, '> 0')
    if self.position_optimizer not in POSITION_OPTIMIZERS:
      raise ValueError(
          'optimizer.position_optimizer must be one of'
          f' {", ".join(POSITION_OPTIMIZERS)}, got'
          f' {self.position_optimizer!r}; set'
          ' --config.optimizer.position_optimizer=adam.'
      )
    if self.position_optimizer == 'sgd':
      for name in ('position_momentum', 'position_lr_scale'):
        value = getattr(self, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
          raise ValueError(
              f'optimizer.{name} must be finite (a number), got {value!r};'
              f' set --config.optimizer.{name}=VALUE.'
          )
      if not 0 <= self.position_momentum < 1:
        raise _out_of_range(
            'optimizer.position_momentum', self.position_momentum, 'in [0, 1)'
        )
      if not self.position_lr_scale > 0:
        raise _out_of_range(
            'optimizer.position_lr_scale', self.position_lr_scale, '> 0'
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Evaluation section: loss by position bucket (periodic eval and
  eval.py)."""

  # Width of position buckets (used unless `bucket_edges` is set).
  bucket_size: int = 16
  # Comma-separated bucket edges, e.g. '0,128,256,512', or 'log2'.
  bucket_edges: str = ''

  # Evaluation windows (T + 1 consecutive tokens each) per evaluation.
  num_windows: int = 64
  # Windows per evaluation batch.
  batch_size: int = 32
  # Evaluation window length in tokens; 0 = model.max_len (the table size).
  window_len: int = 0
  # windows (full-length documents, positions 0..T-1) | natural (the training
  # distribution).
  position_policy: str = 'windows'
  # windows: first (a document's first T + 1 tokens) | deep (token-uniform
  # windows inside long documents; text sources; docs/DESIGN.md § Evaluation
  # outputs).
  window_start: str = 'first'
  # deep: only documents of at least this many tokens; 0 = 4 * window length.
  min_doc_len: int = 0
  # deep: no window starts before this token of its document; 0 = the window
  # length.
  min_start: int = 0
  # Seed that picks the evaluation documents (the same texts across runs).
  seed: int = 0

  def __post_init__(self):
    """Raises ValueError naming the field, its flag and the fix (the window
    length and the buckets, which need the model: `check_across_sections`)."""
    if self.num_windows < 1:
      raise _out_of_range('eval.num_windows', self.num_windows, '>= 1')
    if self.batch_size < 1:
      raise _out_of_range('eval.batch_size', self.batch_size, '>= 1')
    if self.position_policy not in windows_lib.EVAL_POLICIES:
      raise ValueError(
          'Unknown evaluation position_policy'
          f' {self.position_policy!r}; use one of'
          f' {windows_lib.EVAL_POLICIES}'
          ' (--config.eval.position_policy).'
      )
    windows_lib.check_window_start(self.window_start)
    if self.min_doc_len < 0:
      raise _out_of_range(
          'eval.min_doc_len', self.min_doc_len, '>= 0 (0 = its default)'
      )
    if self.min_start < 0:
      raise _out_of_range(
          'eval.min_start', self.min_start, '>= 0 (0 = its default)'
      )
    if self.seed < 0:
      raise _out_of_range('eval.seed', self.seed, '>= 0')


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run: the training loop's own fields and the four sections."""

  # Seed for model init, dropout and data order (paired across arms).
  seed: int = 0
  # Optimizer steps.
  num_train_steps: int = 200
  # Global rows per optimizer step (split across devices and microbatches).
  batch_size: int = 32
  # Microbatches per optimizer step (the same update); 0 = auto: ~1k-token
  # ones on CPU (cache-sized, faster), 1 on accelerators (flax_posemb.auto).
  grad_accum_steps: int = 0

  # Write metrics, statistics and a table snapshot every this many steps.
  log_every_steps: int = 20
  # Periodic held-out evaluation; <= 0 disables.
  eval_every_steps: int = 100
  # Periodic checkpoint; one is always written at the end.
  checkpoint_every_steps: int = 100
  # Checkpoints kept (the step-0 checkpoint is always kept too).
  max_to_keep: int = 3
  # Per-position gradient statistics in the train step.
  collect_stats: bool = True
  # Shard large matrices over the 'data' mesh axis as well as the batch.
  fsdp: bool = False
  # tqdm progress bar with loss and tokens/s.
  progress_bar: bool = True
  # Resume even if the config changed in meaning (recorded in metrics.jsonl).
  allow_config_change: bool = False
  # Stop (exit 3, nothing saved) when a step's loss exceeds this; < 0 = 3 *
  # ln(model.vocab_size).
  divergence_loss: float = -1.0
  # Start from this workdir's parameters (newest step; e.g. an imported
  # Hugging Face checkpoint) instead of a fresh init; '' = fresh. The model's
  # shape must be its (configs/gpt2_pretrained.py:WORKDIR copies it).
  init_from: str = ''
  # Position-table rows beyond init_from's (model.max_len larger):
  # copy_last | interpolate | init (model.position_init's draw).
  init_from_new_rows: str = 'copy_last'

  data: DataConfig = DataConfig()
  model: ModelConfig = ModelConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  eval: EvalConfig = EvalConfig()

  def __post_init__(self):
    """Raises ValueError naming the field, its flag and the fix; each check
    may assume that the ones before it passed."""
    if self.num_train_steps < 1:
      raise _out_of_range('num_train_steps', self.num_train_steps, '>= 1')
    if self.log_every_steps < 1:
      raise _out_of_range('log_every_steps', self.log_every_steps, '>= 1')
    if self.checkpoint_every_steps < 1:
      raise _out_of_range(
          'checkpoint_every_steps', self.checkpoint_every_steps, '>= 1'
      )
    if self.batch_size < 1:
      raise _out_of_range('batch_size', self.batch_size, '>= 1')
    # Orbax's LatestN(0) would keep step 0 alone: every newer step deleted.
    if self.max_to_keep < 1:
      raise ValueError(
          f'max_to_keep must be >= 1, got {self.max_to_keep}: the newest'
          ' checkpoint is the one a resume needs. Fix: set'
          ' --config.max_to_keep=1 or more.'
      )
    if not 0 <= self.seed <= MAX_SEED:
      raise ValueError(
          f'seed must be an int in [0, {MAX_SEED}], got {self.seed}; set'
          ' --config.seed=0 (or another seed in range).'
      )
    if not math.isfinite(self.divergence_loss):
      raise ValueError(
          f'divergence_loss must be finite, got {self.divergence_loss}; set'
          ' --config.divergence_loss=-1 (3 * ln(model.vocab_size)) or a'
          ' loss.'
      )
    if self.init_from_new_rows not in initializers.EXTEND_RULES:
      raise ValueError(
          f'Unknown init_from_new_rows {self.init_from_new_rows!r}; valid:'
          f' {", ".join(initializers.EXTEND_RULES)}'
          ' (--config.init_from_new_rows).'
      )

  @classmethod
  def from_config_dict(cls, config: Mapping[str, Any] | Any) -> 'RunConfig':
    """Converts a whole config (a ConfigDict or nested mapping) once.

    Args:
      config: the run's config, `defaults.base()`'s layout.

    Returns:
      The typed config: each section has checked its own fields, then
      `check_across_sections` the rules that join them.

    Raises:
      ValueError: naming the first field that is unknown or invalid, its
        flag and the fix.
    """
    values = _to_dict(config)
    sections = {
        'data': _build(DataConfig, values.pop('data', {}), 'data'),
        'model': ModelConfig.from_config(values.pop('model', {})),
        'optimizer': _build(
            OptimizerConfig, values.pop('optimizer', {}), 'optimizer'
        ),
        'eval': _build(EvalConfig, values.pop('eval', {}), 'eval'),
    }
    run_config = _build(cls, values, '', **sections)
    check_across_sections(run_config)
    return run_config

  def to_dict(self) -> dict[str, Any]:
    """The config as the nested dict of `defaults.base()`'s layout."""
    return dataclasses.asdict(self)

  def to_json(self, **kwargs) -> str:
    """The config as JSON (``json.dumps`` ``kwargs``): config.json's text and
    the values a checkpoint's config is compared with."""
    return json.dumps(self.to_dict(), **kwargs)


def check_across_sections(config: RunConfig) -> None:
  """The rules that join sections, in order (each section has checked its own
  fields): the data against the model (`data.check_fits_model`: seq_len <=
  max_len, ...), the optimizer's per-row scale against the
  position embedding, the evaluation window against the position table and
  the buckets against the window.

  Raises:
    ValueError: naming the first rule broken, its flags and the fix.
  """
  model = config.model
  data_lib.check_fits_model(config.data, max_len=model.max_len)
  learned = model.position_embedding == 'learned'
  position_optimizer = config.optimizer.position_optimizer
  if position_optimizer != 'adam' and not learned:
    raise ValueError(
        f'optimizer.position_optimizer={position_optimizer} needs a learned'
        ' position table; set --config.optimizer.position_optimizer=adam or'
        ' --config.model.position_embedding=learned.'
    )
  if config.optimizer.row_lr_scale and not learned:
    raise ValueError(
        'optimizer.row_lr_scale=True needs a learned position table; set'
        ' --config.optimizer.row_lr_scale=False or'
        ' --config.model.position_embedding=learned.'
    )
  window_len = config.eval.window_len or model.max_len
  if not 1 <= window_len <= model.max_len:
    raise ValueError(
        f'evaluation window of {window_len} tokens exceeds the model'
        f' context / position table (max_len={model.max_len}). Fix:'
        f' evaluate with 1 <= window_len <= {model.max_len} (0 ='
        ' max_len; --config.eval.window_len, eval.py --window_len).'
    )
  try:
    buckets_lib.make_edges(
        window_len, config.eval.bucket_size, config.eval.bucket_edges
    )
  except ValueError as e:
    raise ValueError(f'eval.bucket_size / eval.bucket_edges: {e}') from None


def data_config(values: Mapping[str, Any] | Any) -> DataConfig:
  """The typed data section alone, of a ConfigDict or mapping (a tool's or a
  test's own ``config.data``)."""
  return _build(DataConfig, values, 'data')


def _out_of_range(flag: str, value: Any, want: str) -> ValueError:
  """The refusal of ``--config.FLAG=value`` outside ``want``."""
  return ValueError(
      f'{flag} must be {want}, got {value}. Fix: set --config.{flag}=VALUE'
      f' with VALUE {want}.'
  )


def _to_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
  """A plain nested dict of a ConfigDict or mapping."""
  if hasattr(config, 'to_dict'):
    return config.to_dict()
  return dict(config)


def _build(cls, values: Mapping[str, Any], prefix: str, **sections):
  """``cls(**values, **sections)``, refusing keys ``cls`` does not have."""
  values = _to_dict(values)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    where = f'{prefix}.' if prefix else ''
    raise ValueError(
        f'Unknown config field(s) {", ".join(where + k for k in unknown)};'
        f' valid: {", ".join(sorted(names))}.'
    )
  if cls is DataConfig and 'synthetic' in values:
    values = dict(values)
    values['synthetic'] = _build(
        SyntheticConfig, values['synthetic'], 'data.synthetic'
    )
  return cls(**values, **sections)
