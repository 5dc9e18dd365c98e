"""Data layer: sources, tokenizers, position policies, Grain pipeline, exposure report.

Public API (see docs/DESIGN.md for the batch contract):

* `make_train_iterator(data_config, *, batch_size, seed, num_train_steps, process_index=0,
  process_count=1)`: infinite Grain iterator of batch dicts ``[B_local, T]`` with
  ``get_state()`` / ``set_state()``.
* `make_eval_batches(data_config, *, split, window_len, num_windows, batch_size,
  policy='windows', seed=0, window_start='first', min_doc_len=0, min_start=0)`: finite
  iterator of batch dicts ``[batch_size, window_len]`` with each row's provenance
  (``PROVENANCE_KEYS``, ``[batch_size]``).
* `vocab_size(data_config)`: token ids are < this.
* `reference_losses(data_config, length)`: synthetic Bayes / filter losses ``[length]``.
* `validate_config(data_config, max_len)`: clear errors for bad configs.
"""

from flax_posemb.data.pipeline import make_eval_batches
from flax_posemb.data.pipeline import make_source
from flax_posemb.data.pipeline import make_train_iterator
from flax_posemb.data.pipeline import reference_losses
from flax_posemb.data.pipeline import validate_config
from flax_posemb.data.pipeline import vocab_size
from flax_posemb.data.policies import POLICIES

__all__ = ['make_train_iterator', 'make_eval_batches', 'vocab_size', 'reference_losses',
           'validate_config', 'make_source', 'POLICIES']
