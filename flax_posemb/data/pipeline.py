"""The training batches of a data config: its position policy's rows,
batched, through Grain (docs/DESIGN.md § Batch)."""

import functools
import os
import threading
import time

from absl import flags
import grain
import numpy as np

from flax_posemb.data import config as config_lib
from flax_posemb.data import corpus
from flax_posemb.data import packers
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources


def make_train_iterator(
    data: config_lib.DataConfig,
    *,
    batch_size: int,
    seed: int,
    num_train_steps: int,
    process_index: int = 0,
    process_count: int = 1,
    max_len: int | None = None,
    with_doc_ids: bool = False,
    with_doc_offsets: bool = False,
) -> grain.DatasetIterator:
  """Infinite, resumable iterator of this process's training batches.

  Args:
    data: the data section; its position policy makes the rows.
    batch_size: global rows per batch.
    seed: the run's seed (document order, drawn offsets and lengths).
    num_train_steps: the run's steps (a schedule's short phase is a share of
      them).
    process_index: this process.
    process_count: processes; each makes its block of every batch.
    max_len: rows of the position table, packed_reset's L (None: seq_len).
    with_doc_ids: add ``doc_ids`` ``[b, T]`` int32 (-1: padding).
    with_doc_offsets: add ``doc_offsets`` ``[b, T]`` int32, each input
      token's index in its document (-1: padding).

  Returns:
    An iterator of ``[batch_size // process_count, T]`` batches (the batch
    contract, `flax_posemb.batch`) that restores exactly from its
    ``get_state``.
  """
  policy = data.policy
  src = corpus.make_source(data, data.train_split)
  _check_long_enough(src, data.seq_len, data.min_doc_len)
  table = data.seq_len
  if max_len is not None:
    table = max_len
  setup = rows_lib.RowSetup(
      src=src,
      order=rows_lib.DocOrder(len(src), seed, data.shuffle),
      seed=seed,
      batch_size=batch_size,
      process_index=process_index,
      process_count=process_count,
      table=table,
      read_options=rows_lib.read_options(data.prefetch),
  )
  ds = policy.rows(data, setup)
  ds = ds.batch(batch_size // process_count, drop_remainder=True)
  phase = policy.short_phase(data)
  if phase is not None:
    num_short = int(phase.fraction * num_train_steps)
    ds = packers.ScheduleIterDataset(
        ds, phase.transform, phase.length, num_short
    )
  kept: tuple[str, ...] = rows_lib.KEYS
  if with_doc_ids:
    kept += (rows_lib.DOC_IDS,)
  if with_doc_offsets:
    kept += (rows_lib.DOC_OFFSETS,)
  ds = ds.map(functools.partial(_only, kept))
  if data.num_workers > 0:
    # Grain workers read absl flags: a library caller outside app.run has not
    # parsed any.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=data.num_workers),
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


def _only(
    keys: tuple[str, ...], batch: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
  return {k: batch[k] for k in keys}


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
