"""What a data config reads: its documents per split, their vocabulary and
identity, the synthetic corpus's reference losses, and the evaluation windows
drawn from them (docs/DESIGN.md § Data policies and tokens)."""

from collections.abc import Iterator
import functools

import numpy as np

from flax_posemb.data import config as config_lib
from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import sources
from flax_posemb.data import synthetic as synthetic_lib
from flax_posemb.data import text_sources
from flax_posemb.data import windows

DataConfig = config_lib.DataConfig


def check_split(data: DataConfig, split: str) -> None:
  """ValueError unless the synthetic source has ``split`` (a text source
  refuses a split it lacks when it opens it: `text_sources.data_source`)."""
  if data.source == 'synthetic' and split not in synthetic_lib.SPLIT_IDS:
    raise ValueError(config_lib.unknown_synthetic_split(split))


def make_source(data: DataConfig, split: str) -> sources.DocSource:
  """The documents of ``split``."""
  if data.source == 'synthetic':
    return sources.SyntheticSource(
        synthetic_lib.from_config(data),
        split,
        data.synthetic.num_docs,
        lengths_lib.parse(data.length_dist, data.seq_len),
        min_pairs=data.min_doc_len - 1,
    )
  return text_sources.make_text_source(data, split)


def dataset_identity(data: DataConfig) -> str | None:
  """What a run trains on, beyond its config (`text_sources.dataset_identity`);
  None for the synthetic source, which its config defines."""
  if data.source == 'synthetic':
    return None
  return text_sources.dataset_identity(data)


def vocab_size(data: DataConfig) -> int:
  """Token ids produced by this config are < this."""
  if data.source == 'synthetic':
    return data.synthetic.vocab_size
  return text_sources.make_tokenizer(data).vocab_size


def reference_losses(
    data: DataConfig, length: int
) -> dict[str, np.ndarray] | None:
  """Synthetic source: {'bayes_loss', 'filter_loss'} ``[length]``; None for real
  text."""
  if data.source != 'synthetic':
    return None
  corpus = synthetic_lib.from_config(data)
  return synthetic_lib.reference_losses(corpus, length)


@functools.lru_cache(maxsize=4)
def _natural_pairs(data: DataConfig, split: str) -> tuple[int, ...]:
  src = make_source(data, split)
  pairs = []
  for i in range(len(src)):
    tokens = len(src.doc(i, max_pairs=data.seq_len))
    if tokens >= data.min_doc_len:
      pairs.append(tokens - 1)
  return tuple(pairs)


def natural_pairs(data: DataConfig, split: str) -> np.ndarray:
  """``[n]`` pairs of the rows `natural` makes of the documents of ``split``:
  ``min(tokens - 1, seq_len)`` of those with >= data.min_doc_len tokens.

  Tokenizes the split once per process and data config (cached).
  """
  return np.asarray(_natural_pairs(data, split), np.int64)


def make_eval_batches(
    data: DataConfig,
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
  """The evaluation windows of ``split`` in batches (`windows.eval_batches`).

  Args:
    data: the data section.
    split: the split the windows come from.
    window_len: W, tokens scored per window.
    num_windows: windows in all (the last batch is padded).
    batch_size: windows per batch.
    policy: 'windows' (full-length documents) or 'natural' (training rows).
    seed: picks the documents.
    window_start: 'first' or 'deep' (docs/DESIGN.md § Evaluation outputs).
    min_doc_len: deep: shortest document (0: 4 W).
    min_start: deep: first start (0: W).

  Returns:
    Batches ``[batch_size, W]`` plus `windows.PROVENANCE_KEYS`
    ``[batch_size]`` (padding rows: doc -1).
  """
  windows.check_window_start(window_start)
  return windows.eval_batches(
      make_source(data, split),
      split=split,
      window_len=window_len,
      num_windows=num_windows,
      batch_size=batch_size,
      full=policy == 'windows',
      seed=seed,
      window_start=window_start,
      natural_min_tokens=data.min_doc_len,
      min_doc_len=min_doc_len,
      min_start=min_start,
  )
