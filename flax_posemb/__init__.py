"""flax_posemb: learned position embeddings in JAX/Flax.

The package's own names (the model side) load on first use (PEP 562): importing
the package loads no JAX, so `python -m flax_posemb.commands.NAME` holds SIGTERM
from its module's first line, before JAX loads (docs/failures.md)."""

import importlib
from typing import Any

# Each name of the package and the module that defines it.
_EXPORTS = {
    'LearnedPositionEmbedding': 'flax_posemb.embeddings',
    'ModelConfig': 'flax_posemb.model',
    'POSITION_TABLE_PATH': 'flax_posemb.model',
    'SinusoidalPositionEmbedding': 'flax_posemb.embeddings',
    'TokenEmbedding': 'flax_posemb.embeddings',
    'TransformerLM': 'flax_posemb.model',
    'apply_rope': 'flax_posemb.embeddings',
    'initializers': 'flax_posemb.initializers',
    'position_table': 'flax_posemb.model',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  """The package's name `name`, importing its module on first use."""
  if name not in _EXPORTS:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  module = importlib.import_module(_EXPORTS[name])
  if module.__name__ == f'{__name__}.{name}':
    return module
  return getattr(module, name)
