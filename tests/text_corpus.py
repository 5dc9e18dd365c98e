"""A small local_text corpus for data tests: documents of geometric lengths,
random lowercase bytes."""

import pathlib

import numpy as np


def geometric_corpus(
    root: pathlib.Path, seq_len: int, num_docs: int = 300, mean: int = 150
) -> dict:
  """Writes ``num_docs`` documents under ``root`` and returns the DataConfig
  fields that read them (rows of ``seq_len``, no prefetch, 64-row shuffle
  windows)."""
  (root / 'corpus').mkdir()
  rng = np.random.default_rng(0)
  for i in range(num_docs):
    n = int(rng.geometric(1 / mean)) + 3
    text = ''.join(chr(c) for c in rng.integers(97, 123, n))
    (root / 'corpus' / f'{i}.txt').write_text(text)
  return dict(
      source='local_text',
      local_glob=str(root / 'corpus' / '*.txt'),
      val_percent=0,
      data_dir=str(root / 'data'),
      seq_len=seq_len,
      prefetch=0,
      shuffle_rows=64,
  )
