"""Every figure of the project: each function draws arrays or results dicts into
one PNG. The only modules that talk to matplotlib.

`evaluation`: loss by position, comparisons, the offset probe and the
statistics' curve images; `tables`: a position table's analysis and the data
report's exposure; `experiments`: a sweep's report figures; `common`: what they
share.
"""

import matplotlib

# Files, never a window: set before any submodule imports pyplot.
matplotlib.use('Agg')
