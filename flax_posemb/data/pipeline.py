"""Grain pipelines and the data config check (docs/DESIGN.md § Data policies and
tokens)."""

from collections.abc import Callable, Iterator, Sequence
import difflib
import functools
import json
import math
import os
import threading
import time
from typing import Any

from absl import flags
import grain
import ml_collections
import numpy as np
import numpy.typing as npt

from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import policies
from flax_posemb.data import sources
from flax_posemb.data import synthetic as synthetic_lib
from flax_posemb.data import text_sources
from flax_posemb.data import windows

SOURCES = ('synthetic', 'stdlib', 'local_text', 'tfds', 'long_text')
TOKENIZERS = ('byte', 'sentencepiece', 'hf')
WINDOW_STARTS = ('first', 'deep')
# data.crop_weighting of the `crops` policy.
CROP_WEIGHTINGS = ('token', 'document')
# Evaluation rows: full-length windows, or the training rows (natural).
EVAL_POLICIES = ('windows', 'natural')
# [B] beside an eval batch's [B, T].
PROVENANCE_KEYS = ('doc', 'start', 'doc_len', 'kind')
# "Infinite" number of rows (Grain datasets are indexed lazily).
_BIG = 2**62 // 64
_PACK_CHUNK = 256  # Documents per Grain element fed to the packer.
# (row, (doc, start, doc_len))
Window = tuple[dict[str, np.ndarray], tuple[int, int, int]]


def validate_config(data_config, max_len: int) -> None:
  """The one check of `config.data` (a position table of `max_len` rows):
  raises ValueError naming the first problem (later checks assume the earlier
  ones passed)."""
  c = data_config
  seq_len = int(c.seq_len)
  max_len = int(max_len)
  for key, choices in (
      ('source', SOURCES),
      ('position_policy', policies.POLICIES),
      ('on_decode_error', sources.DECODE_ERROR_MODES),
  ):
    if c.get(key, 'replace') not in choices:
      raise ValueError(_unknown_value(f'data.{key}', c[key], choices))
  for key in ('num_workers', 'prefetch', 'shuffle_rows'):
    if int(c.get(key, 0)) < 0:
      raise ValueError(f'data.{key} must be >= 0, got {c[key]}.')
  if not 0 <= int(c.val_percent) <= 100:
    raise ValueError(
        f'data.val_percent must be in [0, 100], got {c.val_percent}.'
    )
  if not 1 <= seq_len <= max_len:
    raise ValueError(
        f'data.seq_len={seq_len} must be in [1, {max_len}]: a row longer than'
        f' the position table (model.max_len={max_len}) indexes missing rows;'
        ' lower seq_len or raise max_len.'
    )
  if int(c.min_doc_len) < 2:
    raise ValueError(
        'data.min_doc_len must be >= 2 (one input/target pair), got'
        f' {c.min_doc_len}.'
    )
  if c.position_policy == 'length_schedule':
    short_len = int(c.schedule_seq_len)
    fraction = float(c.schedule_fraction)
    if not (1 <= short_len <= seq_len and 0 <= fraction <= 1):
      raise ValueError(
          f'data.schedule_seq_len={c.schedule_seq_len} must be in [1,'
          f' data.seq_len={seq_len}] and'
          f' data.schedule_fraction={c.schedule_fraction} in [0, 1].'
      )
  if c.position_policy == 'resampled':
    lengths_lib.parse(c.resample_dist, seq_len)
  if c.position_policy == 'crops':
    _check_crops(c)
  if c.source == 'synthetic':
    _validate_synthetic(c)
  else:
    _validate_text(c)


def _check_crops(c) -> None:
  """The `crops` policy's fields (ValueError naming the field and the fix)."""
  seq_len = int(c.seq_len)
  spec = str(c.crop_lengths)
  if c.crop_weighting not in CROP_WEIGHTINGS:
    raise ValueError(
        f'Unknown data.crop_weighting {c.crop_weighting!r}; use one of'
        f' {CROP_WEIGHTINGS}.'
    )
  if c.crop_weighting == 'document' and spec != 'natural':
    raise ValueError(
        "data.crop_weighting='document' crops each document to its own"
        " length (at most data.seq_len); set data.crop_lengths='natural',"
        f' not {spec!r}.'
    )
  if c.source == 'synthetic' and (
      c.crop_weighting == 'document' or spec == 'schedule'
  ):
    raise ValueError(
        'Synthetic documents are generated for their position ids, so their'
        " content is matched already: use data.crop_weighting='token' with"
        " crop_lengths other than 'schedule' (BERT's schedule there:"
        " position_policy='length_schedule')."
    )
  if spec == 'schedule':
    short = int(c.schedule_seq_len)
    fraction = float(c.schedule_fraction)
    if not 1 <= short <= seq_len or not 0 <= fraction <= 1:
      raise ValueError(
          f'data.schedule_seq_len={short} must be in [1,'
          f' data.seq_len={seq_len}] and data.schedule_fraction={fraction} in'
          ' [0, 1].'
      )
  elif spec.startswith('skew:'):
    skew_ratio(spec)
  elif spec != 'natural':
    lengths_lib.parse(spec, seq_len)


def skew_ratio(spec: str) -> float:
  """R of ``data.crop_lengths='skew:R'`` (ValueError unless 0 < R <= 1)."""
  try:
    ratio = float(spec.removeprefix('skew:'))
  except ValueError:
    ratio = -1.0
  if not 0 < ratio <= 1:
    raise ValueError(
        f'data.crop_lengths={spec!r}: R in skew:R is the exposure of the last'
        ' row relative to the first and must be a number in (0, 1], e.g.'
        " 'skew:0.01'."
    )
  return ratio


def piece_lengths(data_config) -> lengths_lib.PieceLengths:
  """The crop lengths of token-weighted `crops`, on the train split
  (docs/DESIGN.md § Data policies and tokens)."""
  c = data_config
  seq_len = int(c.seq_len)
  spec = str(c.crop_lengths)
  if spec == 'schedule':
    return lengths_lib.skewed_pieces(1.0, seq_len)
  if spec.startswith('skew:'):
    return lengths_lib.skewed_pieces(skew_ratio(spec), seq_len)
  if spec != 'natural':
    return lengths_lib.dist_pieces(lengths_lib.parse(spec, seq_len))
  if c.source == 'synthetic':
    dist = lengths_lib.parse(c.length_dist, seq_len)
    return lengths_lib.dist_pieces(dist, int(c.min_doc_len) - 1)
  return lengths_lib.empirical_pieces(natural_pairs(c, c.train_split), seq_len)


def natural_pairs(data_config, split: str) -> np.ndarray:
  """``[n]`` pairs of the rows `natural` makes of the documents of ``split``:
  ``min(tokens - 1, seq_len)`` of those with >= data.min_doc_len tokens.

  Tokenizes the split once per process and data config (cached).
  """
  key = json.dumps(data_config.to_dict(), sort_keys=True, default=str)
  return np.asarray(_natural_pairs(key, split), np.int64)


@functools.lru_cache(maxsize=4)
def _natural_pairs(data_json: str, split: str) -> tuple[int, ...]:
  c = ml_collections.ConfigDict(json.loads(data_json))
  src = make_source(c, split)
  seq_len = int(c.seq_len)
  pairs = []
  for i in range(len(src)):
    tokens = len(src.doc(i, max_pairs=seq_len))
    if tokens >= int(c.min_doc_len):
      pairs.append(tokens - 1)
  return tuple(pairs)


def _validate_synthetic(c) -> None:
  """`validate_config`'s checks of the synthetic source."""
  seq_len = int(c.seq_len)
  synthetic = c.synthetic
  if (
      int(synthetic.vocab_size) < 2
      or int(synthetic.num_regimes) < 1
      or int(synthetic.segment_len) < 1
      or not 0 < float(synthetic.concentration) < math.inf
      or int(synthetic.num_docs) < 1
      or int(synthetic.seed) < 0
  ):
    raise ValueError(
        'data.synthetic needs vocab_size >= 2, num_regimes >= 1, segment_len'
        ' >= 1, a finite concentration > 0, num_docs >= 1 and seed >= 0; got'
        f' {synthetic.to_dict()}.'
    )
  lengths_lib.parse(c.length_dist, seq_len)
  period = int(synthetic.num_regimes) * int(synthetic.segment_len)
  if c.position_policy in policies.PACKED_POLICIES and seq_len % period:
    raise ValueError(
        f'Policy {c.position_policy!r} cannot be honoured on the synthetic'
        ' source: a document wrapping into the next row keeps its dynamics'
        f' only if num_regimes*segment_len={period} divides'
        f' seq_len={seq_len}; change data.seq_len or'
        ' segment_len/num_regimes.'
    )
  for split in (c.train_split, c.eval_split):
    if split not in synthetic_lib.SPLIT_IDS:
      raise ValueError(_unknown_synthetic_split(split))


def _validate_text(c) -> None:
  """`validate_config`'s checks of the text sources."""
  if c.tokenizer not in TOKENIZERS:
    raise ValueError(_unknown_value('data.tokenizer', c.tokenizer, TOKENIZERS))
  if (
      c.tokenizer == 'sentencepiece'
      and c.spm_model
      and not os.path.isfile(c.spm_model)
  ):
    raise ValueError(
        f'data.spm_model={c.spm_model!r} is not a file; set it to an existing'
        " .model file or to '' to train one on the corpus."
    )
  if c.tokenizer == 'hf' and not os.path.isdir(c.hf_tokenizer):
    raise ValueError(
        "data.tokenizer='hf' needs data.hf_tokenizer, a Hugging Face tokenizer"
        ' directory (tokenizer.json, or vocab.json + merges.txt); got'
        f' {c.hf_tokenizer!r}.'
    )
  if c.source == 'tfds' and not c.name:
    raise ValueError(
        "data.source='tfds' needs data.name (e.g. 'wiki40b/en', 'pg19')."
    )
  if c.source == 'local_text':
    if not c.local_glob:
      raise ValueError(
          "data.source='local_text' needs data.local_glob (e.g."
          " '/path/docs/*.txt')."
      )
    if c.local_split_by not in ('file', 'line', 'paragraph'):
      raise ValueError(
          f'data.local_split_by={c.local_split_by!r}: use file | line |'
          ' paragraph.'
      )
  splits = (c.train_split, c.eval_split)
  if c.source != 'tfds' and not set(splits) <= {'train', 'validation'}:
    raise ValueError(
        f"Splits {splits} of {c.source}: use 'train' or 'validation'."
    )


def _unknown_value(field: str, value: Any, choices: tuple[str, ...]) -> str:
  """The message of a value not among ``choices``, with the closest one."""
  close = difflib.get_close_matches(str(value), choices, n=1)
  suggestion = ''
  if close:
    suggestion = f' did you mean {close[0]!r}?'
  return f'Unknown {field} {value!r};{suggestion} use one of {choices}.'


def _unknown_synthetic_split(split: str) -> str:
  return (
      f'Synthetic split {split!r} unknown; use one of'
      f' {sorted(synthetic_lib.SPLIT_IDS)}.'
  )


def check_split(data_config, split: str) -> None:
  """ValueError unless the synthetic source has ``split`` (a text source
  refuses a split it lacks when it opens it: `text_sources.data_source`)."""
  if data_config.source == 'synthetic' and split not in synthetic_lib.SPLIT_IDS:
    raise ValueError(_unknown_synthetic_split(split))


def make_source(data_config, split: str) -> sources.DocSource:
  """The `DocSource` of `split` for this (valid) config."""
  if data_config.source == 'synthetic':
    return sources.SyntheticSource(
        synthetic_lib.from_config(data_config),
        split,
        int(data_config.synthetic.num_docs),
        lengths_lib.parse(data_config.length_dist, int(data_config.seq_len)),
        min_pairs=int(data_config.min_doc_len) - 1,
    )
  return text_sources.make_text_source(data_config, split)


def dataset_identity(data_config) -> str | None:
  """What a run trains on, beyond its config (`text_sources.dataset_identity`);
  None for the synthetic source, which its config defines."""
  if data_config.source == 'synthetic':
    return None
  return text_sources.dataset_identity(data_config)


def vocab_size(data_config) -> int:
  """Token ids produced by this config are < this."""
  if data_config.source == 'synthetic':
    return int(data_config.synthetic.vocab_size)
  return int(text_sources.make_tokenizer(data_config).vocab_size)


def reference_losses(data_config, length: int) -> dict[str, np.ndarray] | None:
  """Synthetic source: {'bayes_loss', 'filter_loss'} ``[length]``; None for real
  text."""
  if data_config.source != 'synthetic':
    return None
  corpus = synthetic_lib.from_config(data_config)
  return synthetic_lib.reference_losses(corpus, int(length))


class DocOrder:
  """Document of stream position ``g``: epoch ``g // n`` is a permutation drawn
  from ``(seed, epoch)`` (identity if not shuffled); not `MapDataset.shuffle`:
  Row order in docs/DESIGN.md § Data policies and tokens."""

  def __init__(self, n: int, seed: int, shuffle: bool = True):
    self.n = int(n)
    self.seed = int(seed)
    self.shuffle = shuffle

  def take(self, stream_positions: npt.ArrayLike) -> np.ndarray:
    """``[m]`` stream positions -> ``[m]`` document indices."""
    positions = np.asarray(stream_positions, np.int64)
    if not self.shuffle:
      return positions % self.n
    out = np.empty_like(positions)
    epochs = positions // self.n
    for epoch in np.unique(epochs):
      in_epoch = epochs == epoch
      permutation = _permutation(self.n, self.seed, int(epoch))
      out[in_epoch] = permutation[positions[in_epoch] % self.n]
    return out


@functools.lru_cache(maxsize=4)  # The current and the next epoch of two orders.
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch, 0x0D0C]).permutation(n)


def make_train_iterator(
    data_config,
    *,
    batch_size: int,
    seed: int,
    num_train_steps: int,
    process_index: int = 0,
    process_count: int = 1,
    max_len: int | None = None,
    with_doc_ids: bool = False,
) -> grain.DatasetIterator:
  """Infinite, resumable iterator of this process's ``[batch_size //
  process_count, T]`` batches (docs/DESIGN.md § Batch); `max_len` is
  `packed_reset`'s L (None: ``seq_len``); `with_doc_ids` adds ``doc_ids`` ``[b,
  T]`` int32 (-1: padding)."""
  c = data_config
  table = int(c.seq_len) if max_len is None else int(max_len)
  src = make_source(c, c.train_split)
  _check_long_enough(src, int(c.seq_len), int(c.min_doc_len))
  order = DocOrder(len(src), seed, bool(c.shuffle))
  if c.position_policy in policies.STREAM_POLICIES:
    ds = _stream_dataset(
        c, src, order, seed, table, process_index, process_count
    )
  else:
    ds = _row_dataset(
        c, src, order, seed, batch_size, process_index, process_count
    )
  ds = ds.batch(batch_size // process_count, drop_remainder=True)
  num_short = int(float(c.schedule_fraction) * int(num_train_steps))
  short: policies.BatchTransform | None = None
  if c.position_policy == 'length_schedule':
    short = policies.crop_columns
  if c.position_policy == 'crops' and c.crop_lengths == 'schedule':
    short = policies.cut_rows
  if short is not None:
    ds = policies.ScheduleIterDataset(
        ds, short, int(c.schedule_seq_len), num_short
    )
  if not with_doc_ids:
    ds = ds.map(_without_doc_ids)
  if int(c.num_workers) > 0:
    # Grain workers read absl flags: a library caller outside app.run has not
    # parsed any.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=int(c.num_workers)),
        worker_init_fn=exit_with_parent,
    )
  return iter(ds)


def _check_long_enough(
    src: sources.DocSource, seq_len: int, min_doc_len: int
) -> None:
  """Refuses a text corpus whose first documents are all shorter than
  `min_doc_len` tokens: the row filter and the packer would never end."""
  # Synthetic documents have at least min_doc_len - 1 pairs by construction.
  if isinstance(src, sources.SyntheticSource):
    return
  checked = min(len(src), 1000)
  if not any(
      len(src.doc(i, max_pairs=seq_len)) >= min_doc_len for i in range(checked)
  ):
    raise ValueError(
        f'None of the first {checked} documents has >='
        f' data.min_doc_len={min_doc_len} tokens; the corpus is (nearly)'
        ' empty.'
    )


def _without_doc_ids(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {k: batch[k] for k in policies.KEYS}


def _stream_dataset(
    c,
    src: sources.DocSource,
    order: DocOrder,
    seed: int,
    table: int,
    process_index: int,
    process_count: int,
) -> grain.IterDataset:
  """Rows of the `STREAM_POLICIES`: this process's every ``process_count``-th
  document."""
  seq_len = int(c.seq_len)
  policy = c.position_policy
  reset = policy == 'packed_reset'
  chunked = policy == 'natural_chunked'

  def chunk(i: int) -> dict[str, np.ndarray]:
    # This process's documents.
    stream_positions = (
        np.arange(i * _PACK_CHUNK, (i + 1) * _PACK_CHUNK) * process_count
        + process_index
    )
    return {
        'doc': order.take(stream_positions),
        'stream_position': stream_positions,
    }

  def tokenize(chunk, column: int):
    del column
    # Lazy: a document is tokenized when the packer reaches it.
    return grain.MapDataset.source(chunk['doc']).map(
        lambda d: src.doc(int(d), max_pairs=None)
    )

  ds = grain.MapDataset.range(_BIG).map(chunk)
  ds = ds.to_iter_dataset(_read_options(c))
  if policy == 'crops':
    ds = _crops(c, src, ds, tokenize, seed)
  else:
    materialize: Callable[[Any, int], Sequence[np.ndarray]] = tokenize
    if isinstance(src, sources.SyntheticSource):
      materialize = _generator(src, seq_len, from_zero=reset or chunked)
    ds = policies.PackIterDataset(
        ds,
        materialize,
        seq_len,
        reset=reset,
        min_tokens=int(c.min_doc_len),
        max_len=table if reset else None,
        chunked=chunked,
    )
  if c.shuffle and int(c.shuffle_rows) > 1:
    ds = grain.experimental.WindowShuffleIterDataset(
        ds, window_size=int(c.shuffle_rows), seed=seed
    )
  return ds


def _generator(
    src: sources.SyntheticSource, seq_len: int, from_zero: bool
) -> Callable[[dict[str, np.ndarray], int], list[np.ndarray]]:
  """The packers' ``materialize`` of synthetic documents, generated for their
  position ids: from 0 (``from_zero``) or from their row column."""

  def generate(chunk: dict[str, np.ndarray], column: int) -> list[np.ndarray]:
    pairs = src.pairs_many(chunk['doc'], seq_len)
    if from_zero:
      starts = np.zeros_like(pairs)
    else:
      starts = (column + np.cumsum(pairs) - pairs) % seq_len
    return src.docs_many(chunk['doc'], starts, seq_len)

  return generate


def _crops(
    c,
    src: sources.DocSource,
    chunks: grain.IterDataset,
    tokenize: Callable[[Any, int], Any],
    seed: int,
) -> grain.IterDataset:
  """Rows of the `crops` policy (docs/DESIGN.md § Data policies and tokens)."""
  seq_len = int(c.seq_len)
  if c.crop_weighting == 'document':

    def crop(tokens: np.ndarray, stream_position: int) -> np.ndarray:
      # The document's own length (natural's rows) at a uniform offset.
      pairs = len(tokens) - 1
      m = min(pairs, seq_len)
      rng = np.random.default_rng([seed, stream_position, 0xC4])
      start = int(rng.integers(0, pairs - m + 1))
      return tokens[start : start + m + 1]

    return policies.CropIterDataset(
        chunks,
        tokenize,
        seq_len,
        min_tokens=int(c.min_doc_len),
        seed=seed,
        crop=crop,
    )
  lengths = piece_lengths(c)
  if not isinstance(src, sources.SyntheticSource):
    return policies.CropIterDataset(
        chunks,
        tokenize,
        seq_len,
        min_tokens=int(c.min_doc_len),
        seed=seed,
        lengths=lengths,
    )

  def generate(chunk, column: int):
    # One synthetic document per crop, generated for positions 0 .. m - 1 with
    # the crop's length, drawn from its place in the document order.
    del column
    pairs = np.array(
        [
            lengths.sample(np.random.default_rng([seed, int(g), 0xC21]), 1)[0]
            for g in chunk['stream_position']
        ],
        np.int64,
    )
    return src.docs_many(chunk['doc'], np.zeros_like(pairs), seq_len, pairs)

  return policies.CropIterDataset(
      chunks, generate, seq_len, min_tokens=2, seed=seed, crop=_whole_document
  )


def _whole_document(tokens: np.ndarray, stream_position: int) -> np.ndarray:
  del stream_position
  return tokens


def _row_dataset(
    c,
    src: sources.DocSource,
    order: DocOrder,
    seed: int,
    batch_size: int,
    process_index: int,
    process_count: int,
) -> grain.IterDataset:
  """Rows of the other policies, one document each; this process's block of each
  batch."""
  seq_len = int(c.seq_len)
  per_process = batch_size // process_count
  random_offset = c.position_policy == 'random_offset'
  target = None
  if c.position_policy == 'resampled':
    target = lengths_lib.parse(c.resample_dist, seq_len)

  def make_row(i: int) -> dict[str, np.ndarray]:
    # The row's index in the stream of global batches.
    row_index = (i // per_process) * batch_size
    row_index += process_index * per_process + i % per_process
    doc = int(order.take([row_index])[0])
    num_pairs = None
    if target is not None:
      uniforms = np.random.default_rng([seed, row_index, 2]).random(2)
      num_pairs = target.sample(uniforms[0], uniforms[1])
    # random_offset: a uniform start that keeps the document's pairs in the row.
    if not random_offset:
      start = 0
      tokens = src.doc(doc, max_pairs=seq_len, num_pairs=num_pairs)
    elif isinstance(src, sources.SyntheticSource):
      # Synthetic tokens depend on their positions: draw the start first.
      rng = np.random.default_rng([seed, row_index, 1])
      room = seq_len - min(src.num_pairs(doc), seq_len)
      start = int(rng.integers(0, room + 1))
      tokens = src.doc(doc, start=start, max_pairs=seq_len, num_pairs=num_pairs)
    else:
      rng = np.random.default_rng([seed, row_index, 1])
      tokens = src.doc(doc, max_pairs=seq_len, num_pairs=num_pairs)
      room = seq_len - max(len(tokens) - 1, 0)
      start = int(rng.integers(0, room + 1))
    row = policies.natural_row(tokens, seq_len, start=start)
    in_doc = row['segment_ids'] > 0
    row[policies.DOC_IDS] = np.where(in_doc, doc, -1).astype(np.int32)
    return row

  ds = (
      grain.MapDataset.range(_BIG)
      .map(make_row)
      .to_iter_dataset(_read_options(c))
  )
  if not isinstance(src, sources.SyntheticSource):
    min_tokens = int(c.min_doc_len)
    ds = ds.filter(lambda r: r['segment_ids'].sum() >= min_tokens - 1)
  return ds


def exit_with_parent(worker_index: int = 0, worker_count: int = 1) -> None:
  """Grain ``worker_init_fn``: the worker exits when its parent process is gone
  (polled: ``PR_SET_PDEATHSIG`` fires when the parent *thread* exits, and
  mp_prefetch uses threads)."""
  del worker_index, worker_count
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(0)

  threading.Thread(target=watch, name='exit_with_parent', daemon=True).start()


def _read_options(c) -> grain.ReadOptions:
  # Rows are built in Python (GIL-bound): one reader thread; `num_workers`
  # scales.
  return grain.ReadOptions(
      num_threads=1 if int(c.prefetch) > 0 else 0,
      prefetch_buffer_size=max(int(c.prefetch), 1) * 16,
  )


def check_window_start(window_start: str) -> None:
  """ValueError unless `window_start` is one of `WINDOW_STARTS`; the retired
  'random' is named as such."""
  if window_start == 'random':
    raise ValueError(
        "window_start 'random' was retired (one window per document mostly"
        " scored the openings of short documents); use 'deep' (token-uniform"
        " windows inside long documents) or 'first'."
    )
  if window_start not in WINDOW_STARTS:
    raise ValueError(
        f'Unknown window_start {window_start!r}; use one of {WINDOW_STARTS}.'
    )


def make_eval_batches(
    data_config,
    *,
    split: str,
    window_len: int,
    num_windows: int,
    batch_size: int,
    policy: str = 'windows',
    seed: int = 0,
    window_start: str = 'first',
    min_doc_len: int = 0,
    min_start: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
  """Finite iterator of `num_windows` evaluation rows of `window_len` tokens in
  batches ``[batch_size, W]`` plus ``PROVENANCE_KEYS`` ``[batch_size]`` (padding
  rows: doc -1); policies and window starts: docs/DESIGN.md § Evaluation
  outputs."""
  check_window_start(window_start)
  src = make_source(data_config, split)
  # 'windows': full-length documents only.
  full = policy == 'windows'
  deep = full and window_start == 'deep'
  if deep and isinstance(src, sources.SyntheticSource):
    raise ValueError(
        "window_start='deep' needs a text source (an inner window of a"
        ' synthetic document would not match its reference losses); use'
        " 'first'."
    )
  window_len = int(window_len)
  if deep:
    min_doc_len, min_start = deep_limits(window_len, min_doc_len, min_start)
    picked = _deep_windows(
        src, split, window_len, num_windows, min_doc_len, min_start, seed
    )
  else:
    picked = _first_windows(
        src,
        split,
        window_len,
        num_windows,
        full,
        int(data_config.min_doc_len),
        seed,
    )
  return _batches(src, picked, batch_size, window_len)


def _first_windows(
    src: sources.DocSource,
    split: str,
    window_len: int,
    num_windows: int,
    full: bool,
    min_doc_len: int,
    seed: int,
) -> list[Window]:
  """The first ``window_len + 1`` tokens of the first `num_windows` documents
  (in a seeded order) that fill a window (`full`) or have `min_doc_len`
  tokens."""
  if full:
    need = window_len + 1
  else:
    need = min_doc_len
  order = np.random.default_rng([int(seed), 0xE7A1]).permutation(len(src))
  synthetic = isinstance(src, sources.SyntheticSource)
  if full and synthetic:
    # Every synthetic document is generated at the full length.
    order = order[:num_windows]
  out: list[Window] = []
  for doc in order.tolist():
    if not isinstance(src, sources.SyntheticSource):
      tokens = src.doc(doc, max_pairs=None)
      doc_len = len(tokens)
    elif full:
      tokens = src.doc(doc, max_pairs=window_len, num_pairs=window_len)
      doc_len = len(tokens)
    else:
      tokens = src.doc(doc, max_pairs=window_len)
      doc_len = src.num_pairs(doc) + 1
    if len(tokens) >= need:
      row = policies.natural_row(tokens, window_len)
      out.append((row, (doc, 0, doc_len)))
      if len(out) == num_windows:
        break
  _check_enough(
      len(out),
      num_windows,
      f'Split {split!r} has only {len(out)} '
      f'documents with >= {need} tokens (of {len(src)})',
      'the window length',
      deep=False,
  )
  return out


class TooFewWindowsError(ValueError):
  """A split holds fewer evaluation windows than requested. ``what``: the
  split's count in words; ``found``, ``requested``: windows; ``deep``: deep
  windows (then ``min_doc_len`` / ``min_start`` limit them). The message names
  the config fields; a command names its own flags from these."""

  def __init__(
      self, what: str, found: int, requested: int, lower: str, deep: bool
  ):
    super().__init__(
        f'{what}, but num_windows={requested} were requested; lower '
        f'eval.num_windows or {lower}, or use a corpus with longer documents '
        '(wiki40b, pg19; synthetic: more data.synthetic.num_docs).'
    )
    self.what = what
    self.found = found
    self.requested = requested
    self.deep = deep


def _check_enough(
    found: int, num_windows: int, what: str, lower: str, deep: bool
) -> None:
  if found < num_windows:
    raise TooFewWindowsError(what, found, num_windows, lower, deep)


def _deep_windows(
    src: sources.DocSource,
    split: str,
    w: int,
    num_windows: int,
    min_doc_len: int,
    min_start: int,
    seed: int,
) -> list[Window]:
  """`num_windows` random slots of ``w + 1`` tokens of the `deep_region`s
  (docs/DESIGN.md § Evaluation outputs)."""
  lengths = np.array(
      [len(src.doc(i, max_pairs=None)) for i in range(len(src))], np.int64
  )
  span = w + 1
  region = deep_region(lengths, min_doc_len, min_start)
  slots = region // span
  rng = np.random.default_rng([int(seed), 0xDEE9])
  origin = min_start + rng.integers(0, region - slots * span + 1)
  total = int(slots.sum())
  _check_enough(
      total,
      num_windows,
      f'Split {split!r} has only {total} deep window slots ({span} tokens each,'
      f' from token {min_start} of the {int((slots > 0).sum())} documents with'
      f' >= {min_doc_len} tokens that fit one; {len(lengths)} documents in'
      ' all)',
      'eval.min_doc_len, eval.min_start or the window length',
      deep=True,
  )
  pick = np.sort(rng.choice(total, num_windows, replace=False))
  ends = np.cumsum(slots)
  docs = np.searchsorted(ends, pick, side='right')
  starts = origin[docs] + (pick - (ends - slots)[docs]) * span
  out: list[Window] = []
  tokens = np.zeros(0, np.int32)
  tokenized = -1
  for doc, start in zip(docs.tolist(), starts.tolist()):
    # Windows are sorted by document: tokenize each once.
    if doc != tokenized:
      tokens = src.doc(doc, max_pairs=None)
      tokenized = doc
    row = policies.natural_row(tokens[start : start + span], w)
    out.append((row, (doc, start, int(lengths[doc]))))
  return out


def deep_limits(
    window_len: int, min_doc_len: int, min_start: int
) -> tuple[int, int]:
  """'deep' windows' shortest document and first start (0: 4 windows' length,
  one's)."""
  shortest = int(min_doc_len) or 4 * int(window_len)
  first_start = int(min_start) or int(window_len)
  return shortest, first_start


deep_region = windows.deep_region


def _batches(
    src: sources.DocSource, windows: list[Window], batch_size: int, w: int
) -> Iterator[dict[str, Any]]:
  pad = (policies.empty_row(w), (-1, 0, 0))
  for i in range(0, len(windows), batch_size):
    chunk = windows[i : i + batch_size]
    chunk += [pad] * (batch_size - len(chunk))
    batch = {k: np.stack([row[k] for row, _ in chunk]) for k in policies.KEYS}
    prov = np.array([p for _, p in chunk], np.int64).reshape(-1, 3)
    batch.update(
        doc=prov[:, 0],
        start=prov[:, 1],
        doc_len=prov[:, 2],
        kind=np.array(
            [src.kind(d) if d >= 0 else '' for d in prov[:, 0].tolist()]
        ),
    )
    yield batch
