"""The data section of a run's config, typed and validated once
(docs/DESIGN.md § Config).

`DataConfig` checks its own fields in `__post_init__`; the position policy's
own fields are checked by the policy's class (`flax_posemb.data.policies`),
looked up in the registry. The one rule that needs the model, the context
against the position table, is `check_fits_model`. `flax_posemb.config`
re-exports both classes beside the other sections.
"""

import dataclasses
import difflib
import json
import math
from typing import Any

from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import sources
from flax_posemb.data import synthetic as synthetic_lib
from flax_posemb.data.policies import registry
from flax_posemb.data.policies import shared_stream
from flax_posemb.data.policies import twin

SOURCES = ('synthetic', 'stdlib', 'local_text', 'tfds', 'long_text')
TOKENIZERS = ('byte', 'sentencepiece', 'hf')
LOCAL_SPLITS = ('file', 'line', 'paragraph')


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """The synthetic corpus (flax_posemb.data.synthetic): a position-dependent
  Markov chain whose optimal loss per position is known exactly."""

  # Tokens in the synthetic vocabulary.
  vocab_size: int = 64
  # K: transition matrices cycled through by position.
  num_regimes: int = 4
  # S: positions per regime before switching (K*S <= smallest bucket).
  segment_len: int = 4
  # Dirichlet concentration of transition rows (lower = more predictable).
  concentration: float = 0.1
  # Seed of the corpus itself (transition matrices), not of sampling.
  seed: int = 1234
  # Documents per split (procedural: costs no storage).
  num_docs: int = 100_000

  def __post_init__(self):
    """Raises ValueError naming the fields and their ranges."""
    if (
        self.vocab_size < 2
        or self.num_regimes < 1
        or self.segment_len < 1
        or not 0 < self.concentration < math.inf
        or self.num_docs < 1
        or self.seed < 0
    ):
      raise ValueError(
          'data.synthetic needs vocab_size >= 2, num_regimes >= 1, segment_len'
          ' >= 1, a finite concentration > 0, num_docs >= 1 and seed >= 0; got'
          f' {dataclasses.asdict(self)} (set them with'
          ' --config.data.synthetic.FIELD).'
      )

  @property
  def period(self) -> int:
    """Positions after which the regimes repeat (num_regimes * segment_len)."""
    return self.num_regimes * self.segment_len


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Data section: source, tokenizer, context length and position policy."""

  # Where documents come from:
  # synthetic | stdlib | local_text | long_text | tfds.
  source: str = 'synthetic'
  # TFDS dataset name when source == 'tfds' (e.g. 'wiki40b/en', 'pg19').
  name: str = ''
  # Feature holding the text in a TFDS dataset.
  text_feature: str = 'text'
  # Split used for training.
  train_split: str = 'train'
  # Split used for periodic and offline evaluation.
  eval_split: str = 'validation'
  # Where TFDS datasets are built and read; '' = $FLAX_POSEMB_DATA_DIR or
  # ~/.cache/flax_posemb.
  data_dir: str = ''
  # Glob of .txt/.jsonl files when source == 'local_text'.
  local_glob: str = ''
  # local_text document unit: file | line | paragraph.
  local_split_by: str = 'file'
  # local_text/stdlib (long_text: its short documents): percent of the
  # documents (by key hash) in 'validation'.
  val_percent: int = 5
  # Invalid UTF-8 text: replace (U+FFFD; counted, reported) | skip (drop the
  # document; counted) | error (refuse, naming the file).
  on_decode_error: str = 'replace'

  # Tokens. byte | sentencepiece | hf (ignored by the synthetic source).
  tokenizer: str = 'byte'
  # SentencePiece model file; '' = train one on the corpus.
  spm_model: str = ''
  # hf: a Hugging Face tokenizer directory (tokenizer.json, or vocab.json +
  # merges.txt), e.g. the one an imported workdir holds (docs/pretrained.md).
  hf_tokenizer: str = ''
  # Vocabulary size when training a SentencePiece model.
  spm_vocab_size: int = 4096

  # Tokens per training row (context length); must be <= model.max_len.
  seq_len: int = 128
  # A name of the policy registry, flax_posemb.data.policies (docs/data.md,
  # "Position policies"): natural | natural_chunked | packed | packed_reset |
  # random_offset | length_schedule | resampled | crops.
  position_policy: str = 'natural'
  # crops: where crops come from. token = consecutive stretches of the document
  # stream (the tokens of packed/packed_reset, content-matched) | document = one
  # crop per document, documents drawn uniformly (natural's weighting), at a
  # uniform offset inside the document.
  crop_weighting: str = 'token'
  # crops with crop_weighting=token: crop lengths in pairs. natural (the rows of
  # natural: each document's length, at most seq_len) | skew:R (geometric; the
  # last row is seen R times as often as the first) | schedule (BERT: pieces of
  # schedule_seq_len for schedule_fraction of the steps, then full rows) | a
  # length distribution as resample_dist.
  crop_lengths: str = 'natural'
  # length_schedule: row length during the short phase.
  schedule_seq_len: int = 32
  # length_schedule: fraction of num_train_steps at the short length.
  schedule_fraction: float = 0.9
  # resampled: uniform | full | comma-separated shares per length bucket.
  resample_dist: str = 'uniform'
  # Synthetic document lengths: wikipedia | uniform | full | comma-separated
  # shares.
  length_dist: str = 'wikipedia'
  # Documents shorter than this many tokens are dropped.
  min_doc_len: int = 2

  # Shuffle documents (deterministically from `seed`).
  shuffle: bool = True
  # packed, packed_reset, natural_chunked: rows are shuffled in windows of
  # this many rows (a long document does not fill consecutive batches); <= 1
  # keeps stream order.
  shuffle_rows: int = 8192
  # Grain worker processes (0 = in-process).
  num_workers: int = 0
  # Batches prefetched by the Grain iterator.
  prefetch: int = 2

  # Random-offset twin of the policy: its rows (tokens, segments, each token's
  # context) with each segment moved to a uniform start in the position table
  # (docs/data.md, "Random-offset twins").
  offset_twin: bool = False
  # One token stream per seed: row slot r of every batch recuts its own share
  # of the document stream, so arms of one seed train on the same token
  # instances (docs/data.md, "One token stream per seed").
  shared_stream: bool = False

  # The synthetic corpus (source == 'synthetic').
  synthetic: SyntheticConfig = SyntheticConfig()

  def __post_init__(self):
    """Raises ValueError naming the first bad field and the fix; each check
    may assume that the ones before it passed."""
    if self.source not in SOURCES:
      raise ValueError(_unknown_value('data.source', self.source, SOURCES))
    if self.position_policy not in registry.names():
      raise ValueError(
          _unknown_value(
              'data.position_policy', self.position_policy, registry.names()
          )
      )
    if self.on_decode_error not in sources.DECODE_ERROR_MODES:
      raise ValueError(
          _unknown_value(
              'data.on_decode_error',
              self.on_decode_error,
              sources.DECODE_ERROR_MODES,
          )
      )
    for name in ('num_workers', 'prefetch', 'shuffle_rows'):
      if getattr(self, name) < 0:
        raise ValueError(
            f'data.{name} must be >= 0, got {getattr(self, name)}; set'
            f' --config.data.{name}.'
        )
    if not 0 <= self.val_percent <= 100:
      raise ValueError(
          f'data.val_percent must be in [0, 100], got {self.val_percent}; set'
          ' --config.data.val_percent.'
      )
    if self.seq_len < 1:
      raise ValueError(
          f'data.seq_len must be >= 1, got {self.seq_len}; set'
          ' --config.data.seq_len.'
      )
    if self.min_doc_len < 2:
      raise ValueError(
          'data.min_doc_len must be >= 2 (one input/target pair), got'
          f' {self.min_doc_len}; set --config.data.min_doc_len.'
      )
    if self.source == 'synthetic':
      self._check_synthetic()
    else:
      self._check_text()
    self.policy.check(self)

  def _check_synthetic(self) -> None:
    """The synthetic source's fields (its corpus checked itself)."""
    lengths_lib.parse(self.length_dist, self.seq_len)
    for split in (self.train_split, self.eval_split):
      if split not in synthetic_lib.SPLIT_IDS:
        raise ValueError(unknown_synthetic_split(split))

  def _check_text(self) -> None:
    """The text sources' fields: tokenizer, where the corpus is, splits."""
    if self.tokenizer not in TOKENIZERS:
      raise ValueError(
          _unknown_value('data.tokenizer', self.tokenizer, TOKENIZERS)
      )
    # data.spm_model and data.hf_tokenizer are checked where they are read
    # (`tokenizers`): a config may name a directory an import fills later,
    # and a stored config one that has moved.
    if self.source == 'tfds' and not self.name:
      raise ValueError(
          "data.source='tfds' needs data.name (e.g. 'wiki40b/en', 'pg19')."
      )
    if self.source == 'local_text' and not self.local_glob:
      raise ValueError(
          "data.source='local_text' needs data.local_glob (e.g."
          " '/path/docs/*.txt')."
      )
    if self.source == 'local_text' and self.local_split_by not in LOCAL_SPLITS:
      raise ValueError(
          f'data.local_split_by={self.local_split_by!r}: use file | line |'
          ' paragraph.'
      )
    splits = (self.train_split, self.eval_split)
    if self.source != 'tfds' and not set(splits) <= {'train', 'validation'}:
      raise ValueError(
          f"Splits {splits} of {self.source}: use 'train' or 'validation'."
      )

  @property
  def policy(self) -> registry.Policy:
    """The position policy's object (`flax_posemb.data.policies`), cut from
    the shared stream and twinned as data.shared_stream and data.offset_twin
    ask."""
    policy = registry.get(self.position_policy)
    if self.shared_stream:
      policy = shared_stream.SharedStream(policy)
    if self.offset_twin:
      policy = twin.OffsetTwin(policy)
    return policy

  def to_json(self) -> str:
    """The section as sorted JSON: a hashable key for caches of what it
    builds."""
    return json.dumps(dataclasses.asdict(self), sort_keys=True)


def check_fits_model(data: DataConfig, max_len: int) -> None:
  """The data rule that needs the model: a row fits the position table.

  Args:
    data: the data section.
    max_len: rows of the model's position table (`model.max_len`).

  Raises:
    ValueError: naming both fields and the fix.
  """
  if data.seq_len > max_len:
    raise ValueError(
        f'data.seq_len={data.seq_len} must be in [1, {max_len}]: a row longer'
        f' than the position table (model.max_len={max_len}) indexes missing'
        ' rows; lower --config.data.seq_len or raise --config.model.max_len.'
    )


def unknown_synthetic_split(split: str) -> str:
  """The message of a split the synthetic corpus does not have."""
  return (
      f'Synthetic split {split!r} unknown; use one of'
      f' {sorted(synthetic_lib.SPLIT_IDS)}.'
  )


def _unknown_value(field: str, value: Any, choices: tuple[str, ...]) -> str:
  """The message of a value not among ``choices``, with the closest one."""
  close = difflib.get_close_matches(str(value), choices, n=1)
  suggestion = ''
  if close:
    suggestion = f' did you mean {close[0]!r}?'
  return f'Unknown {field} {value!r};{suggestion} use one of {choices}.'
