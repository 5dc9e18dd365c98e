"""Evaluation windows of a split's documents, with their provenance
(docs/DESIGN.md § Evaluation outputs).

A window is ``W + 1`` consecutive tokens of one document, scored at positions
0 .. W-1: a document's first tokens ('first'), or token-uniform slots inside
long documents ('deep', text sources); `long_text` counts the deep windows of
its held-out split with `deep_region`.
"""

from collections.abc import Iterator
from typing import Any

import numpy as np

from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources

WINDOW_STARTS = ('first', 'deep')
# Evaluation rows: full-length windows, or the training rows (natural).
EVAL_POLICIES = ('windows', 'natural')
# [B] beside an eval batch's [B, T].
PROVENANCE_KEYS = ('doc', 'start', 'doc_len', 'kind')
# (row, (doc, start, doc_len))
Window = tuple[dict[str, np.ndarray], tuple[int, int, int]]


def deep_region(lengths, min_doc_len: int, min_start: int) -> np.ndarray:
  """``[n]`` tokens of each document of ``lengths`` ``[n]`` that 'deep'
  windows may cover."""
  lengths = np.asarray(lengths, np.int64)
  return np.where(lengths >= min_doc_len, np.maximum(lengths - min_start, 0), 0)


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


def eval_batches(
    src: sources.DocSource,
    *,
    split: str,
    window_len: int,
    num_windows: int,
    batch_size: int,
    full: bool,
    seed: int,
    window_start: str,
    natural_min_tokens: int,
    min_doc_len: int,
    min_start: int,
) -> Iterator[dict[str, np.ndarray]]:
  """Finite iterator of `num_windows` evaluation rows of `window_len` tokens.

  Args:
    src: the split's documents.
    split: its name (for messages).
    window_len: W.
    num_windows: windows in all.
    batch_size: windows per batch.
    full: only documents that fill a window (eval.position_policy 'windows');
      False: natural's rows of documents of `natural_min_tokens` tokens.
    seed: picks the documents (and the deep slots).
    window_start: one of `WINDOW_STARTS` (checked: `check_window_start`).
    natural_min_tokens: data.min_doc_len.
    min_doc_len: deep: shortest document (0: 4 W).
    min_start: deep: first start (0: W).

  Returns:
    Batches ``[batch_size, W]`` plus ``PROVENANCE_KEYS`` ``[batch_size]``
    (padding rows: doc -1).
  """
  deep = full and window_start == 'deep'
  if deep and isinstance(src, sources.SyntheticSource):
    raise ValueError(
        "window_start='deep' needs a text source (an inner window of a"
        ' synthetic document would not match its reference losses); use'
        " 'first'."
    )
  if deep:
    min_doc_len, min_start = deep_limits(window_len, min_doc_len, min_start)
    picked = _deep_windows(
        src, split, window_len, num_windows, min_doc_len, min_start, seed
    )
  else:
    picked = _first_windows(
        src, split, window_len, num_windows, full, natural_min_tokens, seed
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
  order = np.random.default_rng([seed, 0xE7A1]).permutation(len(src))
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
      row = rows_lib.natural_row(tokens, window_len)
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
  rng = np.random.default_rng([seed, 0xDEE9])
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
    row = rows_lib.natural_row(tokens[start : start + span], w)
    out.append((row, (doc, start, int(lengths[doc]))))
  return out


def deep_limits(
    window_len: int, min_doc_len: int, min_start: int
) -> tuple[int, int]:
  """'deep' windows' shortest document and first start (0: 4 windows' length,
  one's)."""
  shortest = min_doc_len or 4 * window_len
  first_start = min_start or window_len
  return shortest, first_start


def _batches(
    src: sources.DocSource, windows: list[Window], batch_size: int, w: int
) -> Iterator[dict[str, Any]]:
  pad = (rows_lib.empty_row(w), (-1, 0, 0))
  for i in range(0, len(windows), batch_size):
    chunk = windows[i : i + batch_size]
    chunk += [pad] * (batch_size - len(chunk))
    batch = {k: np.stack([row[k] for row, _ in chunk]) for k in rows_lib.KEYS}
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
