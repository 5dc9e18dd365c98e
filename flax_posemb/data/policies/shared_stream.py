"""One token stream per seed (data.shared_stream): every policy recuts the
same documents, offsets and order (docs/DESIGN.md § Data policies and
tokens).

Without it, arms of one seed read one document order but consume it
differently: the policies of one document per row take a document per row
(and only its first context), the stream cutters take it pair by pair, and
all of them shuffle their rows in windows of data.shuffle_rows rows. A run
that trains on fewer rows than a window draws a seed-random part of that
window, and the window's rows differ between policies (different cuts of
the stream): two arms of one seed then share about as many token instances
as two seeds do.

With it, row slot ``r`` of every global batch reads its own share of the
document stream, every ``batch_size``-th document from ``r`` on, and cuts
it into the policy's rows in order; rows are not shuffled (each batch holds
``batch_size`` different parts of the stream, so a long document never
fills a batch). At equal scored tokens, any two policies have consumed the
same prefix of each slot's share, less at most a row or a crop at its end.
On the synthetic source, whose tokens are generated for their positions,
every stretch is generated again where the policy places it
(`twin.in_phase`): the same documents, offsets and draws in every arm.
"""

import dataclasses
import functools
from typing import Any

import grain
import numpy as np

from flax_posemb.data import packers
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources
from flax_posemb.data.policies import exposure as exposure_lib
from flax_posemb.data.policies import registry
from flax_posemb.data.policies import twin


class SharedStream(registry.Policy):
  """A registered policy's rows cut slot by slot from one stream per seed;
  not registered itself (`DataConfig.policy` wraps the policy when
  data.shared_stream)."""

  def __init__(self, inner: registry.Policy):
    self.inner = inner

  def check(self, data: Any) -> None:
    self.inner.check(data)
    if not self.inner.recuts_stream(data):
      raise ValueError(
          f'data.shared_stream: {data.position_policy!r} draws its own'
          ' documents or lengths per row and cannot recut the shared stream;'
          ' use natural, natural_chunked, packed, packed_reset or crops with'
          " crop_weighting='token', or set data.shared_stream=False."
      )

  def rows(self, data: Any, setup: rows_lib.RowSetup) -> grain.IterDataset:
    per_process = setup.batch_size // setup.process_count
    in_order = dataclasses.replace(data, shuffle_rows=0)
    slots = []
    for r in range(per_process):
      slot = setup.process_index * per_process + r
      # Each slot draws its own crop lengths (seed), from its own documents.
      seed = int(
          np.random.SeedSequence([setup.seed, slot]).generate_state(1)[0]
      )
      slot_setup = dataclasses.replace(
          setup,
          seed=seed,
          substream=(slot, setup.batch_size),
          # A slot's chunks are document indices, cheap to make: no reader
          # thread per slot (a batch of 512 rows would start 512).
          read_options=grain.ReadOptions(num_threads=0),
      )
      slots.append(self.inner.rows(in_order, slot_setup))
    rows = packers.InterleavedIterDataset(slots)
    if isinstance(setup.src, sources.SyntheticSource):
      # A synthetic document's stretch placed at other positions than its
      # own (a crop from position 0) is generated again where it sits.
      regenerate = twin.synthetic_regenerate(setup.src, data.synthetic.period)
      rows = rows.map(functools.partial(_in_phase, regenerate))
    return rows

  def short_phase(self, data: Any) -> registry.ShortPhase | None:
    return self.inner.short_phase(data)

  def budget_phases(self, data: Any) -> tuple[tuple[float, dict], ...]:
    return self.inner.budget_phases(data)

  def position_count(self, data: Any, max_len: int) -> int:
    return self.inner.position_count(data, max_len)

  def exposure(
      self, data: Any, corpus: exposure_lib.CorpusLengths
  ) -> exposure_lib.Exposure:
    return self.inner.exposure(data, corpus)

  def rows_per_document(self, data: Any, pairs: np.ndarray) -> np.ndarray:
    return self.inner.rows_per_document(data, pairs)


def _in_phase(
    regenerate: twin.Regenerate, row: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
  return twin.in_phase(row, regenerate)
