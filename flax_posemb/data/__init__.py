"""Data layer: sources, tokenizers, policies, Grain pipelines, report
(docs/DESIGN.md § Batch)."""

from flax_posemb.data.pipeline import dataset_identity
from flax_posemb.data.pipeline import make_eval_batches
from flax_posemb.data.pipeline import make_source
from flax_posemb.data.pipeline import make_train_iterator
from flax_posemb.data.pipeline import reference_losses
from flax_posemb.data.pipeline import validate_config
from flax_posemb.data.pipeline import vocab_size
from flax_posemb.data.policies import POLICIES

__all__ = [
    'dataset_identity',
    'make_train_iterator',
    'make_eval_batches',
    'vocab_size',
    'reference_losses',
    'validate_config',
    'make_source',
    'POLICIES',
]
