"""Grain pipelines and the data config check (docs/DESIGN.md "Data policies and
tokens")."""

from collections.abc import Iterator
import functools
import os
import threading
import time
from typing import Any

from absl import flags
import grain
import numpy as np

from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import policies
from flax_posemb.data import sources
from flax_posemb.data import synthetic as synthetic_lib
from flax_posemb.data import text_sources
from flax_posemb.data import windows

SOURCES = ('synthetic', 'stdlib', 'local_text', 'tfds', 'long_text')
TOKENIZERS = ('byte', 'sentencepiece')
WINDOW_STARTS = ('first', 'deep')
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
  ValueError."""
  for problem in _problems(data_config, int(max_len)):
    raise ValueError(problem)


def _problems(c, max_len: int) -> Iterator[str]:
  """The config's problems, in order (later checks assume the earlier ones
  passed)."""
  t, policy = int(c.seq_len), c.position_policy
  for key, choices in (
      ('source', SOURCES),
      ('position_policy', policies.POLICIES),
      ('on_decode_error', sources.DECODE_ERROR_MODES),
  ):
    if c.get(key, 'replace') not in choices:
      yield f'Unknown data.{key} {c[key]!r}; use one of {choices}.'
  for key in ('num_workers', 'prefetch', 'shuffle_rows'):
    if int(c.get(key, 0)) < 0:
      yield f'data.{key} must be >= 0, got {c[key]}.'
  if not 0 <= int(c.val_percent) <= 100:
    yield f'data.val_percent must be in [0, 100], got {c.val_percent}.'
  if not 1 <= t <= max_len:
    yield (
        f'data.seq_len={t} must be in [1, {max_len}]: a row longer than the'
        f' position table (model.max_len={max_len}) indexes missing rows; lower'
        ' seq_len or raise max_len.'
    )
  if int(c.min_doc_len) < 2:
    yield (
        'data.min_doc_len must be >= 2 (one input/target pair), got'
        f' {c.min_doc_len}.'
    )
  if policy == 'length_schedule' and not (
      1 <= int(c.schedule_seq_len) <= t and 0 <= float(c.schedule_fraction) <= 1
  ):
    yield (
        f'data.schedule_seq_len={c.schedule_seq_len} must be in [1,'
        f' data.seq_len={t}] and data.schedule_fraction={c.schedule_fraction}'
        ' in [0, 1].'
    )
  if policy == 'resampled':
    lengths_lib.parse(c.resample_dist, t)
  splits = (c.train_split, c.eval_split)
  if c.source == 'synthetic':
    s = c.synthetic
    if (
        int(s.vocab_size) < 2
        or int(s.num_regimes) < 1
        or int(s.segment_len) < 1
        or not float(s.concentration) > 0
        or int(s.num_docs) < 1
        or int(s.seed) < 0
    ):
      yield (
          'data.synthetic needs vocab_size >= 2, num_regimes >= 1, segment_len'
          ' >= 1, concentration > 0, num_docs >= 1 and seed >= 0; got'
          f' {s.to_dict()}.'
      )
    lengths_lib.parse(c.length_dist, t)
    period = int(s.num_regimes) * int(s.segment_len)
    if policy in policies.PACKED_POLICIES and t % period:
      yield (
          f'Policy {policy!r} cannot be honoured on the synthetic source: a'
          ' document wrapping into the next row keeps its dynamics only if'
          f' num_regimes*segment_len={period} divides seq_len={t}; change'
          ' data.seq_len or segment_len/num_regimes.'
      )
    for split in splits:
      if split not in synthetic_lib.SPLIT_IDS:
        yield _unknown_synthetic_split(split)
    return
  if c.tokenizer not in TOKENIZERS:
    yield f'Unknown data.tokenizer {c.tokenizer!r}; use one of {TOKENIZERS}.'
  if (
      c.tokenizer == 'sentencepiece'
      and c.spm_model
      and not os.path.isfile(c.spm_model)
  ):
    yield (
        f'data.spm_model={c.spm_model!r} is not a file; set it to an existing'
        " .model file or to '' to train one on the corpus."
    )
  if c.source == 'tfds' and not c.name:
    yield "data.source='tfds' needs data.name (e.g. 'wiki40b/en', 'pg19')."
  if c.source == 'local_text' and not c.local_glob:
    yield (
        "data.source='local_text' needs data.local_glob (e.g."
        " '/path/docs/*.txt')."
    )
  if c.source == 'local_text' and c.local_split_by not in (
      'file',
      'line',
      'paragraph',
  ):
    yield (
        f'data.local_split_by={c.local_split_by!r}: use file | line |'
        ' paragraph.'
    )
  if c.source != 'tfds' and not set(splits) <= {'train', 'validation'}:
    yield f"Splits {splits} of {c.source}: use 'train' or 'validation'."


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
  c = data_config
  if c.source == 'synthetic':
    dist = lengths_lib.parse(c.length_dist, int(c.seq_len))
    return sources.SyntheticSource(
        synthetic_lib.from_config(c),
        split,
        int(c.synthetic.num_docs),
        dist,
        min_pairs=int(c.min_doc_len) - 1,
    )
  return text_sources.make_text_source(c, split)


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
  return (
      synthetic_lib.reference_losses(
          synthetic_lib.from_config(data_config), int(length)
      )
      if data_config.source == 'synthetic'
      else None
  )


class DocOrder:
  """Document of stream position ``g``: epoch ``g // n`` is a permutation drawn
  from ``(seed, epoch)`` (identity if not shuffled); not `MapDataset.shuffle`:
  docs/DESIGN.md "Row order"."""

  def __init__(self, n: int, seed: int, shuffle: bool = True):
    self.n, self.seed, self.shuffle = int(n), int(seed), shuffle

  def take(self, gs: np.ndarray) -> np.ndarray:
    """``[m]`` stream positions -> ``[m]`` document indices."""
    gs = np.asarray(gs, np.int64)
    if not self.shuffle:
      return gs % self.n
    out = np.empty_like(gs)
    epochs = gs // self.n
    for e in np.unique(epochs):
      out[epochs == e] = _permutation(self.n, self.seed, int(e))[
          gs[epochs == e] % self.n
      ]
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
  process_count, T]`` batches (docs/DESIGN.md "Batch"); `max_len` is
  `packed_reset`'s L (None: ``seq_len``); `with_doc_ids` adds ``doc_ids`` ``[b,
  T]`` int32 (-1: padding)."""
  c = data_config
  table = int(c.seq_len) if max_len is None else int(max_len)
  src = make_source(c, c.train_split)
  policy, b = c.position_policy, batch_size // process_count
  # With no document long enough, the filter and packer never end.
  n = min(len(src), 1000)
  if not (
      src.positional
      or any(
          len(src.doc(i, max_pairs=int(c.seq_len))) >= int(c.min_doc_len)
          for i in range(n)
      )
  ):
    raise ValueError(
        f'None of the first {n} documents has >='
        f' data.min_doc_len={c.min_doc_len} tokens; the corpus is (nearly)'
        ' empty.'
    )
  order = DocOrder(len(src), seed, bool(c.shuffle))
  if policy in policies.STREAM_POLICIES:
    ds = _stream_dataset(
        c, src, order, seed, table, process_index, process_count
    )
  else:
    ds = _row_dataset(
        c, src, order, seed, batch_size, process_index, process_count
    )
  ds = ds.batch(b, drop_remainder=True)
  if policy == 'length_schedule':
    num_short = int(float(c.schedule_fraction) * int(num_train_steps))
    ds = policies.ScheduleCropIterDataset(
        ds, int(c.schedule_seq_len), num_short
    )
  if not with_doc_ids:
    ds = ds.map(lambda batch: {k: batch[k] for k in policies.KEYS})
  if int(c.num_workers) > 0:
    # Grain workers read absl flags (a library caller
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()  # outside app.run has not parsed any).
    ds = ds.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=int(c.num_workers)),
        worker_init_fn=exit_with_parent,
    )
  return iter(ds)


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
  t, policy = int(c.seq_len), c.position_policy
  reset, chunked = policy == 'packed_reset', policy == 'natural_chunked'

  def materialize(chunk, column: int):
    # Lazy: a document is tokenized when the packer reaches it.
    if not src.positional:
      return grain.MapDataset.source(chunk).map(
          lambda d: src.doc(int(d), max_pairs=None)
      )
    # Synthetic documents are generated for their position ids: from 0 or their
    # row column.
    pairs = src.pairs_many(chunk, t)
    starts = (
        np.zeros_like(pairs)
        if reset or chunked
        else (column + np.cumsum(pairs) - pairs) % t
    )
    return src.docs_many(chunk, starts, t)

  # This process's documents.
  ds = grain.MapDataset.range(_BIG).map(
      lambda i: order.take(
          np.arange(i * _PACK_CHUNK, (i + 1) * _PACK_CHUNK) * process_count
          + process_index
      )
  )
  ds = ds.to_iter_dataset(_read_options(c))
  ds = policies.PackIterDataset(
      ds,
      materialize,
      t,
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
  t, policy, b = int(c.seq_len), c.position_policy, batch_size // process_count
  target = (
      lengths_lib.parse(c.resample_dist, t) if policy == 'resampled' else None
  )

  def make_row(i: int) -> dict[str, np.ndarray]:
    g = (i // b) * batch_size + process_index * b + i % b  # Global row index.
    d, start = int(order.take([g])[0]), 0
    m = (
        None
        if target is None
        else target.sample(*np.random.default_rng([seed, g, 2]).random(2))
    )
    # A uniform start that keeps the document's pairs in the row.
    if policy == 'random_offset':
      rng = np.random.default_rng([seed, g, 1])
      # Synthetic tokens depend on their positions: draw the start first.
      if src.positional:
        start = int(rng.integers(0, t - min(src.num_pairs(d), t) + 1))
    toks = src.doc(d, start=start, max_pairs=t, num_pairs=m)
    if policy == 'random_offset' and not src.positional:
      start = int(rng.integers(0, t - max(len(toks) - 1, 0) + 1))
    row = policies.natural_row(toks, t, start=start)
    row[policies.DOC_IDS] = np.where(row['segment_ids'] > 0, d, -1).astype(
        np.int32
    )
    return row

  ds = (
      grain.MapDataset.range(_BIG)
      .map(make_row)
      .to_iter_dataset(_read_options(c))
  )
  if not src.positional:
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
  rows: doc -1); policies and window starts: docs/DESIGN.md "Evaluation
  outputs"."""
  check_window_start(window_start)
  src = make_source(data_config, split)
  full = policy == 'windows'  # Full-length documents only.
  deep = full and window_start == 'deep'
  if deep and src.positional:
    raise ValueError(
        "window_start='deep' needs a text source (an inner window of a"
        ' synthetic document would not match its reference losses); use'
        " 'first'."
    )
  w = int(window_len)
  if deep:
    min_doc_len, min_start = deep_limits(w, min_doc_len, min_start)
    windows = _deep_windows(
        src, split, w, num_windows, min_doc_len, min_start, seed
    )
  # The first w + 1 tokens of the first documents (seeded order) with >= `need`
  # tokens.
  else:
    order = np.random.default_rng([int(seed), 0xE7A1]).permutation(len(src))
    need = w + 1 if full else int(data_config.min_doc_len)
    windows = []
    for d in order[: num_windows if full and src.positional else None].tolist():
      toks = (
          src.doc(d, max_pairs=w, num_pairs=w if full else None)
          if src.positional
          else src.doc(d, max_pairs=None)
      )
      doc_len = (
          src.num_pairs(d) + 1 if src.positional and not full else len(toks)
      )
      if len(toks) >= need:
        windows.append((policies.natural_row(toks, w), (d, 0, doc_len)))
        if len(windows) == num_windows:
          break
    _check_enough(
        len(windows),
        num_windows,
        f'Split {split!r} has only {len(windows)} '
        f'documents with >= {need} tokens (of {len(src)})',
        'the window length',
    )
  return _batches(src, windows, batch_size, w)


def _check_enough(found: int, num_windows: int, what: str, lower: str) -> None:
  if found < num_windows:
    raise ValueError(
        f'{what}, but num_windows={num_windows} were requested; lower '
        f'eval.num_windows or {lower}, or use a corpus with longer documents '
        '(wiki40b, pg19; synthetic: more data.synthetic.num_docs).'
    )


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
  (docs/DESIGN.md)."""
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
  )
  pick = np.sort(rng.choice(total, num_windows, replace=False))
  ends = np.cumsum(slots)
  docs = np.searchsorted(ends, pick, side='right')
  starts = origin[docs] + (pick - (ends - slots)[docs]) * span
  out, toks, last = [], None, -1
  for d, a in zip(docs.tolist(), starts.tolist()):
    if d != last:  # Windows are sorted by document: tokenize each once.
      toks, last = src.doc(d, max_pairs=None), d
    out.append(
        (policies.natural_row(toks[a : a + span], w), (d, a, int(lengths[d])))
    )
  return out


def deep_limits(
    window_len: int, min_doc_len: int, min_start: int
) -> tuple[int, int]:
  """'deep' windows' shortest document and first start (0: 4 windows' length,
  one's)."""
  return int(min_doc_len) or 4 * int(window_len), int(min_start) or int(
      window_len
  )


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
