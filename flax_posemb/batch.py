"""The batch contract, defined once (no dependencies): a dict of ``[B, T]``
arrays ``BATCH_KEYS`` (dtypes and meaning: docs/DESIGN.md § Batch;
``segment_ids`` 0 = padding)."""

BATCH_KEYS = ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')
