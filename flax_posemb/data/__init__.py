"""Data layer: the data config, sources, tokenizers, position policies,
training rows, evaluation windows and the exposure report
(docs/DESIGN.md § Batch)."""

from flax_posemb.data import policies
from flax_posemb.data.config import DataConfig
from flax_posemb.data.config import SyntheticConfig
from flax_posemb.data.config import check_fits_model
from flax_posemb.data.corpus import dataset_identity
from flax_posemb.data.corpus import make_eval_batches
from flax_posemb.data.corpus import make_source
from flax_posemb.data.corpus import reference_losses
from flax_posemb.data.corpus import vocab_size
from flax_posemb.data.pipeline import make_train_iterator

__all__ = [
    'DataConfig',
    'SyntheticConfig',
    'check_fits_model',
    'dataset_identity',
    'make_eval_batches',
    'make_source',
    'make_train_iterator',
    'policies',
    'reference_losses',
    'vocab_size',
]
