"""flax_posemb: learned position embeddings in JAX/Flax (the package imports the
model side)."""

from flax_posemb import initializers
from flax_posemb.embeddings import LearnedPositionEmbedding
from flax_posemb.embeddings import SinusoidalPositionEmbedding
from flax_posemb.embeddings import TokenEmbedding
from flax_posemb.embeddings import apply_rope
from flax_posemb.model import POSITION_TABLE_PATH
from flax_posemb.model import ModelConfig
from flax_posemb.model import TransformerLM
from flax_posemb.model import position_table

__all__ = [
    'LearnedPositionEmbedding',
    'ModelConfig',
    'POSITION_TABLE_PATH',
    'SinusoidalPositionEmbedding',
    'TokenEmbedding',
    'TransformerLM',
    'apply_rope',
    'initializers',
    'position_table',
]
