"""How many token instances two data configs' training streams share
(docs/data.md, "One token stream per seed").

A token instance is a scored token's provenance: its document and the index
of its input token in the document (`rows.DOC_IDS`, `rows.DOC_OFFSETS`).
Two arms of one seed with data.shared_stream share nearly all of theirs at
equal scored tokens; without it, about as many as two seeds do.
"""

from typing import Any

import numpy as np

from flax_posemb.data import config as config_lib
from flax_posemb.data import pipeline
from flax_posemb.data import rows as rows_lib


def token_instances(
    data: config_lib.DataConfig,
    *,
    batch_size: int,
    seed: int,
    num_tokens: int,
    max_len: int | None = None,
) -> np.ndarray:
  """The first ``num_tokens`` scored token instances of a run's batches.

  Args:
    data: the data section.
    batch_size: global rows per batch.
    seed: the run's seed.
    num_tokens: scored tokens read, in batch and row order.
    max_len: rows of the position table (None: data.seq_len).

  Returns:
    ``[num_tokens]`` int64 instances, ``document * 2**32 + offset``.
  """
  it = pipeline.make_train_iterator(
      data,
      batch_size=batch_size,
      seed=seed,
      num_train_steps=1,
      max_len=max_len,
      with_doc_ids=True,
      with_doc_offsets=True,
  )
  found: list[np.ndarray] = []
  count = 0
  while count < num_tokens:
    batch = next(it)
    scored = batch['loss_mask'] > 0
    docs = batch[rows_lib.DOC_IDS][scored].astype(np.int64)
    offsets = batch[rows_lib.DOC_OFFSETS][scored].astype(np.int64)
    found.append(docs * 2**32 + offsets)
    count += len(docs)
  return np.concatenate(found)[:num_tokens]


def stream_overlap(
    a: config_lib.DataConfig,
    b: config_lib.DataConfig,
    *,
    batch_size: int,
    seed: int,
    num_tokens: int,
    max_len: int | None = None,
) -> dict[str, Any]:
  """The share of token instances two configs train on in common, at equal
  scored tokens (as the experiments compare arms).

  Args:
    a: one arm's data section.
    b: the other's.
    batch_size: global rows per batch.
    seed: the seed both run with.
    num_tokens: scored tokens of each (a run's worth:
      ``num_train_steps`` times the scored tokens of a batch).
    max_len: rows of the position table (None: each one's data.seq_len).

  Returns:
    {'overlap': distinct instances in both over those of the arm with
    fewer, 'a': distinct instances of ``a``, 'b': of ``b``, 'shared': in
    both}.
  """
  instances_a, instances_b = (
      np.unique(
          token_instances(
              config,
              batch_size=batch_size,
              seed=seed,
              num_tokens=num_tokens,
              max_len=max_len,
          )
      )
      for config in (a, b)
  )
  shared = len(np.intersect1d(instances_a, instances_b, assume_unique=True))
  fewer = max(min(len(instances_a), len(instances_b)), 1)
  return {
      'overlap': shared / fewer,
      'a': len(instances_a),
      'b': len(instances_b),
      'shared': shared,
  }
