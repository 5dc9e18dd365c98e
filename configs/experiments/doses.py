"""The full dose-response and scale sweep (a suite: ``EXPERIMENTS``), apart from
all.py because of its cost (docs/experiments.md).

  python -m flax_posemb.experiments configs/experiments/doses.py \
      --workdir runs/experiments --report_dir docs/experiments

Runs shared with all.py's experiments (same ``--workdir``, so the same run
store) are not trained again. The synthetic corpus' doses are in exposure.py.
"""

# File names relative to this file's directory.
EXPERIMENTS = ('long_text_doses.py', 'scale.py')
