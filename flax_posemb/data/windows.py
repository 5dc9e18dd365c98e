"""Which tokens of a document 'deep' evaluation windows may cover
(docs/DESIGN.md § Evaluation outputs); `pipeline` draws the windows from it and
`long_text` counts them for its held-out guarantee."""

import numpy as np


def deep_region(lengths, min_doc_len: int, min_start: int) -> np.ndarray:
  """``[n]`` tokens of each document that 'deep' windows may cover."""
  lengths = np.asarray(lengths, np.int64)
  return np.where(lengths >= min_doc_len, np.maximum(lengths - min_start, 0), 0)
