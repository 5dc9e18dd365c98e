"""The batch contract (docs/DESIGN.md), defined once; no dependencies beyond numpy.

Every batch is a dict of ``[B, T]`` arrays: ``inputs``, ``targets``, ``positions``,
``segment_ids`` (int32; 0 = padding) and ``loss_mask`` (float32; 1 where the target at ``t``
is scored). The data pipeline produces it; the train and eval steps consume it.
"""

BATCH_KEYS = ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')
