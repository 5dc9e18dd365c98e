"""All four experiments in one process, sharing one run store (a suite:
``EXPERIMENTS``).

  python -m flax_posemb.experiments configs/experiments/all.py \\
      --workdir runs/experiments --report_dir docs/experiments

Each experiment gets ``WORKDIR/NAME/`` and its report in ``REPORT_DIR/NAME/``;
runs live in ``WORKDIR/store/`` (``--run_store``), so arms whose resolved
configs coincide across experiments (init_comparison ``gpt2`` = exposure
``syn/packed``; init_x_exposure ``gpt2/decay`` = exposure ``syn/packed_reset``)
are trained once. ``REPORT_DIR/README.md`` links the four reports. ``long_text``
needs its corpus (see configs/long_text.py). Append ``:accelerator`` for
GPT-2-small shapes. """

# File names relative to this file's directory.
EXPERIMENTS = (
    'init_comparison.py',
    'exposure.py',
    'init_x_exposure.py',
    'long_text.py',
)
