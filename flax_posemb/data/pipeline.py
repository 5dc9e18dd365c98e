"""Grain pipelines: training iterator, evaluation batches, config checks.

Training (`make_train_iterator`) for one-document-per-row policies is a random-access
chain: a shuffled, repeated document order (a new shuffle every epoch, from `seed`) ->
the process-local rows of each global batch -> row building -> batching; a row is the
first T pairs of its document. The streaming policies (`packed`, `packed_reset`,
`natural_chunked`) stream each process's share of the document order (documents ``g`` with
``g % process_count == process_index``) whole, without truncation, into rows, then shuffle
the rows in windows of `data.shuffle_rows` (docs/DESIGN.md "Row order"). The returned
Grain iterator has ``get_state()`` / ``set_state()``, so a restore continues exactly.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, Iterator

from absl import flags
import grain
import numpy as np

from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import policies
from flax_posemb.data import sources
from flax_posemb.data import synthetic as synthetic_lib

SOURCES = ('synthetic', 'stdlib', 'local_text', 'tfds', 'long_text')
TOKENIZERS = ('byte', 'sentencepiece')
DECODE_ERROR_MODES = sources.DECODE_ERROR_MODES
_BIG = 2**62 // 64  # "Infinite" number of rows (Grain datasets are indexed lazily).
_PACK_CHUNK = 256  # Documents per Grain element fed to the packer.


def validate_config(data_config, max_len: int) -> None:
  """Raises ValueError naming the problem and the fix for a bad data config.

  Args:
    data_config: the `config.data` ConfigDict.
    max_len: rows of the model's position table (`config.model.max_len`).
  """
  c = data_config
  if c.source not in SOURCES:
    raise ValueError(f'Unknown data.source {c.source!r}; use one of {SOURCES}.')
  if c.position_policy not in policies.POLICIES:
    raise ValueError(f'Unknown data.position_policy {c.position_policy!r}; use one of '
                     f'{policies.POLICIES}.')
  if sources.decode_mode(c) not in DECODE_ERROR_MODES:
    raise ValueError(f'Unknown data.on_decode_error {c.on_decode_error!r}; use one of '
                     f'{DECODE_ERROR_MODES}.')
  for key in ('num_workers', 'prefetch', 'shuffle_rows'):
    if int(c.get(key, 0)) < 0:
      raise ValueError(f'data.{key} must be >= 0, got {c[key]}.')
  t = int(c.seq_len)
  if t < 1:
    raise ValueError(f'data.seq_len must be >= 1, got {t}.')
  if t > max_len:
    raise ValueError(
        f'data.seq_len={t} is longer than the position table (model.max_len={max_len}): '
        'positions would index rows that do not exist. Lower data.seq_len or raise '
        'model.max_len.')
  if int(c.min_doc_len) < 2:
    raise ValueError(f'data.min_doc_len must be >= 2 (one input/target pair), got '
                     f'{c.min_doc_len}.')
  if c.position_policy == 'length_schedule':
    if not 1 <= int(c.schedule_seq_len) <= t:
      raise ValueError(f'data.schedule_seq_len={c.schedule_seq_len} must be in [1, '
                       f'data.seq_len={t}].')
    if not 0.0 <= float(c.schedule_fraction) <= 1.0:
      raise ValueError(f'data.schedule_fraction={c.schedule_fraction} must be in [0, 1].')
  if c.position_policy == 'resampled':
    lengths_lib.parse(c.resample_dist, t)
  if c.source == 'synthetic':
    lengths_lib.parse(c.length_dist, t)
    corp = synthetic_lib.from_config(c)
    if c.position_policy in policies.PACKED_POLICIES and t % corp.period:
      raise ValueError(
          f'Policy {c.position_policy!r} cannot be honoured on the synthetic source with '
          f'seq_len={t}: documents wrapping into the next row restart at position 0, which '
          f'keeps their dynamics only if num_regimes*segment_len={corp.period} divides '
          'seq_len. Change data.seq_len or data.synthetic.segment_len/num_regimes.')
    for split in (c.train_split, c.eval_split):
      if split not in synthetic_lib.SPLIT_IDS:
        raise ValueError(f'Synthetic split {split!r} unknown; use one of '
                         f'{sorted(synthetic_lib.SPLIT_IDS)}.')
  else:
    if c.tokenizer not in TOKENIZERS:
      raise ValueError(f'Unknown data.tokenizer {c.tokenizer!r}; use one of {TOKENIZERS}.')
    if c.source == 'tfds' and not c.name:
      raise ValueError("data.source='tfds' needs data.name (e.g. 'wiki40b/en', 'pg19').")
    if c.source == 'local_text' and not c.local_glob:
      raise ValueError("data.source='local_text' needs data.local_glob (e.g. "
                       "'/path/docs/*.txt').")
    if c.source == 'local_text' and c.local_split_by not in ('file', 'line', 'paragraph'):
      raise ValueError(f'data.local_split_by={c.local_split_by!r}: use file | line | '
                       'paragraph.')


def make_source(data_config, split: str) -> sources.DocSource:
  """The `DocSource` of `split` for this config."""
  c = data_config
  if c.source == 'synthetic':
    dist = lengths_lib.parse(c.length_dist, int(c.seq_len))
    return sources.SyntheticSource(synthetic_lib.from_config(c), split,
                                   int(c.synthetic.num_docs), dist,
                                   min_pairs=int(c.min_doc_len) - 1)
  from flax_posemb.data import text_sources  # pylint: disable=g-import-not-at-top
  return text_sources.make_text_source(c, split)


def vocab_size(data_config) -> int:
  """Token ids produced by this config are < this."""
  if data_config.source == 'synthetic':
    return int(data_config.synthetic.vocab_size)
  from flax_posemb.data import text_sources  # pylint: disable=g-import-not-at-top
  return int(text_sources.make_tokenizer(data_config).vocab_size)


def reference_losses(data_config, length: int) -> dict[str, np.ndarray] | None:
  """Per-position reference losses for the synthetic source, else None.

  Returns:
    {'bayes_loss': [length], 'filter_loss': [length]} float64; entry p is the expected loss
    of the target at input position p (the token at position id p + 1) for a document
    starting at position 0. None for real text.
  """
  if data_config.source != 'synthetic':
    return None
  return synthetic_lib.reference_losses(synthetic_lib.from_config(data_config), int(length))


def _check_batch(batch: dict[str, np.ndarray], bound: int | None = None,
                 keep_doc_ids: bool = False) -> dict[str, np.ndarray]:
  if not keep_doc_ids:
    batch = {k: v for k, v in batch.items() if k != policies.DOC_IDS}
  pos = batch['positions']
  t = pos.shape[1] if bound is None else bound
  if pos.size and (pos.min() < 0 or pos.max() >= t):
    raise RuntimeError(f'Data pipeline bug: position ids in [{pos.min()}, {pos.max()}] '
                       f'outside [0, {t}).')
  return batch


def _check_nonempty(src: sources.DocSource, min_tokens: int, max_pairs: int) -> None:
  """Raises if the first documents (up to 1000) contain none with `min_tokens` tokens."""
  n = len(src)
  if n == 0:
    raise ValueError('The corpus is empty (0 documents); check data.source / data.name / '
                     'data.local_glob.')
  for i in range(min(n, 1000)):
    if len(src.doc(i, max_pairs=max_pairs)) >= min_tokens:
      return
  raise ValueError(f'None of the first {min(n, 1000)} documents has >= data.min_doc_len='
                   f'{min_tokens} tokens; the corpus is (nearly) empty.')


def make_train_iterator(data_config, *, batch_size: int, seed: int, num_train_steps: int,
                        process_index: int = 0, process_count: int = 1,
                        max_len: int | None = None, with_doc_ids: bool = False
                        ) -> grain.DatasetIterator:
  """Infinite iterator of process-local training batches.

  Args:
    data_config: `config.data`.
    batch_size: global rows per step; each process yields ``batch_size // process_count``.
    seed: shuffle and policy randomness (offsets, resampled lengths).
    num_train_steps: sets the switch step of `length_schedule`.
    process_index: this process (`jax.process_index()`).
    process_count: `jax.process_count()`.
    max_len: rows of the position table (`config.model.max_len`); only `packed_reset`
      uses it: a document keeps its in-document positions up to ``max_len - 1`` across
      rows, then restarts at 0 as a new segment. None: ``seq_len`` (positions stay below
      the row length, as in every other policy).
    with_doc_ids: batches also carry ``doc_ids`` ``[b, T]`` int32, the split's index of the
      document of every token (-1: padding), for reports on batch diversity.

  Returns:
    A Grain `DatasetIterator` of batch dicts, arrays ``[batch_size // process_count, T]``
    (T = `schedule_seq_len` for the first ``schedule_fraction * num_train_steps`` batches of
    `length_schedule`, else `seq_len`), with ``get_state()`` / ``set_state(state)``.
  """
  c = data_config
  table = int(c.seq_len) if max_len is None else int(max_len)
  validate_config(c, max_len=table)
  if batch_size < 1 or batch_size % process_count:
    raise ValueError(f'batch_size={batch_size} must be a positive multiple of '
                     f'process_count={process_count}.')
  if seed < 0:
    raise ValueError(f'seed must be >= 0, got {seed}.')
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index} not in [0, {process_count}).')
  src = make_source(c, c.train_split)
  t, policy, b = int(c.seq_len), c.position_policy, batch_size // process_count
  min_tokens = int(c.min_doc_len)
  if not src.positional:
    _check_nonempty(src, min_tokens, t)
  order = DocOrder(len(src), seed, bool(c.shuffle))

  if policy in policies.STREAM_POLICIES:
    ds = _stream_dataset(c, src, order, seed, table, process_index, process_count)
  else:
    ds = _row_dataset(c, src, order, seed, batch_size, process_index, process_count)
  ds = ds.batch(b, drop_remainder=True)
  if policy == 'length_schedule':
    num_short = int(float(c.schedule_fraction) * int(num_train_steps))
    ds = policies.ScheduleCropIterDataset(ds, int(c.schedule_seq_len), num_short)
  ds = ds.map(functools.partial(_check_batch, bound=max(table, t), keep_doc_ids=with_doc_ids))
  if int(c.num_workers) > 0:
    if not flags.FLAGS.is_parsed():  # Grain workers read absl flags (a library caller
      flags.FLAGS.mark_as_parsed()  # outside app.run has not parsed any).
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(c.num_workers)),
                        worker_init_fn=exit_with_parent)
  return iter(ds)


def _stream_dataset(c, src: sources.DocSource, order: DocOrder, seed: int, table: int,
                    process_index: int, process_count: int) -> grain.IterDataset:
  """Rows of the streaming policies (packed, packed_reset, natural_chunked): whole documents
  packed across rows, this process reading every ``process_count``-th document; the rows
  then shuffled in windows of ``data.shuffle_rows``."""
  t, policy = int(c.seq_len), c.position_policy
  reset, chunked = policy == 'packed_reset', policy == 'natural_chunked'

  def fetch(i: int) -> np.ndarray:
    g = np.arange(i * _PACK_CHUNK, (i + 1) * _PACK_CHUNK) * process_count + process_index
    return order.take(g)  # Document indices; the packer materializes them.

  def materialize(chunk, column: int):
    if not src.positional:
      return _WholeDocs(src, chunk)  # Tokenized one at a time, untruncated.
    # Synthetic documents (<= T pairs by construction) are generated for the position
    # ids they occupy: from 0 (packed_reset, natural_chunked) or their row column.
    pairs = src.pairs_many(chunk, t)
    starts = np.zeros_like(pairs) if reset or chunked else (
        column + np.concatenate([[0], np.cumsum(pairs)[:-1]])) % t
    return src.docs_many(chunk, starts, t)

  ds = grain.MapDataset.range(_BIG).map(fetch).to_iter_dataset(_read_options(c))
  ds = policies.PackIterDataset(ds, materialize, t, reset=reset, min_tokens=int(c.min_doc_len),
                                max_len=table if reset else None, chunked=chunked)
  window = int(c.shuffle_rows)
  if c.shuffle and window > 1:
    # Consecutive rows of the stream hold consecutive pieces of one document; a batch of
    # them would compare batch diversity, not position exposure, with the row policies.
    # Grain's window shuffle restores exactly (it re-reads the window from its start).
    ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=window, seed=seed)
  return ds


def _row_dataset(c, src: sources.DocSource, order: DocOrder, seed: int, batch_size: int,
                 process_index: int, process_count: int) -> grain.IterDataset:
  """Rows of the one-window policies (natural, random_offset, length_schedule, resampled):
  one document per row, its first T pairs; this process reads its block of each batch."""
  t, policy, b = int(c.seq_len), c.position_policy, batch_size // process_count
  target = (lengths_lib.parse(c.resample_dist, t) if policy == 'resampled' else None)

  def make_row(i: int) -> dict[str, np.ndarray]:
    g = (i // b) * batch_size + process_index * b + i % b  # Global row index.
    d = int(order[g])
    row = _window_row(g, d)
    row[policies.DOC_IDS] = np.where(row['segment_ids'] > 0, d, -1).astype(np.int32)
    return row

  def _window_row(g: int, d: int) -> dict[str, np.ndarray]:
    if policy == 'random_offset':
      rng = np.random.default_rng([seed, g, 1])
      if src.positional:
        m = _num_pairs(src, d, t)
        o = int(rng.integers(0, t - m + 1))
        return policies.natural_row(src.doc(d, start=o, max_pairs=t), t, start=o)
      toks = src.doc(d, max_pairs=t)
      o = int(rng.integers(0, t - max(len(toks) - 1, 0) + 1))
      return policies.natural_row(toks, t, start=o)
    if policy == 'resampled':
      rng = np.random.default_rng([seed, g, 2])
      m = target.sample(*rng.random(2))
      return policies.natural_row(src.doc(d, max_pairs=t, num_pairs=m), t)
    return policies.natural_row(src.doc(d, max_pairs=t), t)

  ds = grain.MapDataset.range(_BIG).map(make_row).to_iter_dataset(_read_options(c))
  if not src.positional:
    min_tokens = int(c.min_doc_len)
    ds = ds.filter(lambda r: r['segment_ids'].sum() >= min_tokens - 1)
  return ds


class _WholeDocs:
  """Lazy sequence of untruncated documents: tokenized when the packer reaches them."""

  def __init__(self, src: sources.DocSource, indices: np.ndarray):
    self._src, self._indices = src, indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, j: int) -> np.ndarray:
    return self._src.doc(int(self._indices[j]), max_pairs=None)


def exit_with_parent(worker_index: int = 0, worker_count: int = 1,
                     interval: float = 1.0) -> None:
  """Grain ``worker_init_fn``: the worker ends itself when its parent process is gone.

  A parent killed by SIGKILL (OOM killer, ``kill -9``, a scheduler) cannot stop its Grain
  workers, which then keep running, reparented, holding memory. Grain has no option for
  this; ``PR_SET_PDEATHSIG`` is unsuitable because it fires when the parent *thread* that
  started the worker exits (Grain's mp_prefetch makes its worker iterators in a thread
  pool). So a daemon thread
  polls ``os.getppid()`` every ``interval`` seconds and exits the worker when it changed.
  """
  del worker_index, worker_count
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(interval)
    os._exit(0)  # pylint: disable=protected-access

  threading.Thread(target=watch, name='exit_with_parent', daemon=True).start()


class DocOrder:
  """Document index of global stream position ``g``: epoch ``g // n`` is a fresh
  permutation of ``range(n)`` drawn from ``(seed, epoch)`` (identity if not shuffled)."""

  def __init__(self, n: int, seed: int, shuffle: bool = True):
    self.n, self.seed, self.shuffle = int(n), int(seed), shuffle
    self._cache: dict[int, np.ndarray] = {}  # Two epochs: the current and the next.

  def _perm(self, epoch: int) -> np.ndarray:
    perm = self._cache.get(epoch)
    if perm is None:
      perm = np.random.default_rng([self.seed, epoch, 0x0D0C]).permutation(self.n)
      if len(self._cache) >= 2:
        self._cache.pop(min(self._cache))
      self._cache[epoch] = perm
    return perm

  def __getitem__(self, g: int) -> int:
    epoch, i = divmod(int(g), self.n)
    return int(self._perm(epoch)[i]) if self.shuffle else i

  def take(self, gs: np.ndarray) -> np.ndarray:
    """Vectorized lookup: ``[m]`` stream positions -> ``[m]`` document indices."""
    gs = np.asarray(gs, np.int64)
    if not self.shuffle:
      return gs % self.n
    out = np.empty_like(gs)
    epochs = gs // self.n
    for e in np.unique(epochs):
      sel = epochs == e
      out[sel] = self._perm(int(e))[gs[sel] % self.n]
    return out


def _num_pairs(src: sources.DocSource, index: int, max_pairs: int) -> int:
  """Pairs of document `index` after truncation (cheap for the synthetic source)."""
  if isinstance(src, sources.SyntheticSource):
    return min(src.num_pairs(index), max_pairs)
  return max(len(src.doc(index, max_pairs=max_pairs)) - 1, 0)


def _read_options(c) -> grain.ReadOptions:
  """One background reader thread builds elements ahead when `prefetch` > 0.

  Rows are built in Python (GIL-bound), so more reader threads only add contention;
  use `num_workers` (processes) to scale.
  """
  return grain.ReadOptions(num_threads=1 if int(c.prefetch) > 0 else 0,
                           prefetch_buffer_size=max(int(c.prefetch), 1) * 16)


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([r[k] for r in rows]) for k in policies.KEYS}


EVAL_POLICIES = ('windows', 'natural')
WINDOW_STARTS = ('first', 'deep')
# Per-row provenance in evaluation batches ([B] arrays beside the [B, T] batch arrays).
PROVENANCE_KEYS = ('doc', 'start', 'doc_len', 'kind')


def make_eval_batches(data_config, *, split: str, window_len: int, num_windows: int,
                      batch_size: int, policy: str = 'windows', seed: int = 0,
                      window_start: str = 'first', min_doc_len: int = 0,
                      min_start: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """Finite iterator of evaluation batches (the distribution of each mode: docs/DESIGN.md,
  "Evaluation outputs").

  Args:
    data_config: `config.data`.
    split: split name (e.g. `data_config.eval_split`).
    window_len: W, tokens per row.
    num_windows: rows in total.
    batch_size: rows per batch; the last batch is padded with empty rows
      (``segment_ids == 0``, ``loss_mask == 0``) to keep the shape.
    policy: 'windows': W + 1 consecutive tokens of a document at positions ``0..W-1``
      (synthetic: a full-length document generated from position 0). 'natural': rows as
      the training `natural` policy makes them (documents truncated to W pairs, padded).
    seed: chooses the documents and windows (the same arguments give the same windows).
    window_start: 'windows' policy only: 'first' (a document's first W + 1 tokens) or
      'deep' (`_deep_windows`; text sources only).
    min_doc_len: 'deep': documents with fewer tokens give no window (0: 4 * W).
    min_start: 'deep': no window starts before this token of its document (0: W).

  Returns:
    Iterator of batch dicts: the batch arrays ``[batch_size, W]`` plus the provenance
    ``PROVENANCE_KEYS`` ``[batch_size]``: document index in the split, token offset of the
    window's first input token in it, document length in tokens, its kind
    (`DocSource.kind`); padding rows have doc -1.

  Raises:
    ValueError: unknown policy or window start, or fewer documents (deep: slots) than
      `num_windows` (the message says how many exist).
  """
  if policy not in EVAL_POLICIES:
    raise ValueError(f'Unknown eval policy {policy!r}; use one of {EVAL_POLICIES}.')
  if window_start not in WINDOW_STARTS:
    raise ValueError(f'Unknown window_start {window_start!r}; use one of {WINDOW_STARTS} '
                     "('random', one window per document, was replaced by 'deep': "
                     'token-uniform windows deep inside long documents).')
  if window_len < 1 or num_windows < 1 or batch_size < 1:
    raise ValueError(f'window_len, num_windows and batch_size must be >= 1; got '
                     f'{window_len}, {num_windows}, {batch_size}.')
  src = make_source(data_config, split)
  w, n = int(window_len), len(src)
  if policy == 'windows' and window_start == 'deep':
    if src.positional:
      raise ValueError("window_start='deep' needs a text source: synthetic documents are "
                       'generated for the positions they occupy, so a window cut from inside '
                       "one would not match its reference losses. Use window_start='first'.")
    min_doc_len, min_start = deep_limits(w, min_doc_len, min_start)
    return _batches(src, _deep_windows(src, split, w, num_windows, min_doc_len, min_start,
                                       seed), batch_size, w)
  order = np.random.default_rng([int(seed), 0xE7A1]).permutation(n)
  need = w + 1 if policy == 'windows' else int(data_config.min_doc_len)
  windows = _first_windows(src, order, w, need, num_windows, full=policy == 'windows')
  if len(windows) < num_windows:
    raise ValueError(
        f'Split {split!r} has only {len(windows)} documents with >= {need} tokens (of {n}), '
        f'but num_windows={num_windows} were requested; lower eval.num_windows or the window '
        'length, or use a corpus with longer documents (wiki40b, pg19; synthetic: raise '
        'data.synthetic.num_docs).')
  return _batches(src, windows, batch_size, w)


Window = tuple[dict[str, np.ndarray], tuple[int, int, int]]  # (row, (doc, start, doc_len))


def _first_windows(src: sources.DocSource, order: np.ndarray, w: int, need: int,
                   num_windows: int, full: bool) -> list[Window]:
  """The first ``w + 1`` tokens of the first documents (in ``order``) with at least
  ``need`` tokens; synthetic documents are generated with ``w`` pairs if ``full``."""
  out = []
  for d in order[:num_windows if full and src.positional else None].tolist():
    if src.positional:
      toks = src.doc(d, max_pairs=w, num_pairs=w if full else None)
      doc_len = len(toks) if full else src.num_pairs(d) + 1
    else:
      toks = src.doc(d, max_pairs=None)
      doc_len = len(toks)
    if len(toks) >= need:
      out.append((policies.natural_row(toks, w), (d, 0, doc_len)))
      if len(out) == num_windows:
        break
  return out


def _deep_windows(src: sources.DocSource, split: str, w: int, num_windows: int,
                  min_doc_len: int, min_start: int, seed: int) -> list[Window]:
  """Windows drawn token-uniformly (up to slot granularity) from the documents of at least
  `min_doc_len` tokens, none starting before token `min_start` of its document.

  Each such document's region ``[min_start, L)`` is cut into ``(L - min_start) // (w + 1)``
  consecutive slots of ``w + 1`` tokens from a random origin in the region's slack; then
  `num_windows` slots are drawn without replacement among all slots of all documents (so a
  long document gives several non-overlapping windows). Tokenizes every document of the
  split to learn its length: O(split).
  """
  lengths = np.array([len(src.doc(i, max_pairs=None)) for i in range(len(src))], np.int64)
  span = w + 1
  region = deep_region(lengths, min_doc_len, min_start)
  slots = region // span
  rng = np.random.default_rng([int(seed), 0xDEE9])
  origin = min_start + rng.integers(0, region - slots * span + 1)
  total = int(slots.sum())
  if total < num_windows:
    raise ValueError(
        f'Split {split!r} has only {total} deep window slots ({span} tokens each, from token '
        f'{min_start} of the {int((slots > 0).sum())} documents with >= {min_doc_len} tokens '
        f'that fit one; {len(lengths)} documents in all), but num_windows={num_windows} were '
        'requested; lower eval.num_windows, eval.min_doc_len, eval.min_start or the window '
        'length, or use a corpus with longer documents (pg19).')
  pick = np.sort(rng.choice(total, num_windows, replace=False))
  ends = np.cumsum(slots)
  docs = np.searchsorted(ends, pick, side='right')
  starts = origin[docs] + (pick - (ends - slots)[docs]) * span
  out, toks, last = [], None, -1
  for d, a in zip(docs.tolist(), starts.tolist()):
    if d != last:  # Windows are sorted by document: tokenize each once.
      toks, last = src.doc(d, max_pairs=None), d
    out.append((policies.natural_row(toks[a:a + span], w), (d, a, int(lengths[d]))))
  return out


def deep_limits(window_len: int, min_doc_len: int, min_start: int) -> tuple[int, int]:
  """'deep' windows' shortest document and first start; 0 means the default, 4 windows'
  length and one window's length."""
  return int(min_doc_len) or 4 * int(window_len), int(min_start) or int(window_len)


def deep_region(lengths, min_doc_len: int, min_start: int) -> np.ndarray:
  """``[n]`` tokens of each document (of these lengths) that 'deep' windows may cover: 0
  below `min_doc_len` tokens, else those from token `min_start` on; ``region // (T + 1)``
  windows fit."""
  lengths = np.asarray(lengths, np.int64)
  return np.where(lengths >= min_doc_len, np.maximum(lengths - min_start, 0), 0)


def _batches(src: sources.DocSource, windows: list[Window], batch_size: int,
             w: int) -> Iterator[dict[str, Any]]:
  pad = (policies.empty_row(w), (-1, 0, 0))
  for i in range(0, len(windows), batch_size):
    chunk = windows[i:i + batch_size]
    chunk += [pad] * (batch_size - len(chunk))
    batch = _stack([row for row, _ in chunk])
    prov = np.array([p for _, p in chunk], np.int64).reshape(-1, 3)
    batch.update(doc=prov[:, 0], start=prov[:, 1], doc_len=prov[:, 2],
                 kind=np.array([src.kind(d) if d >= 0 else '' for d in prov[:, 0].tolist()]))
    yield batch
