"""The dose-response and scale experiments (a suite: ``EXPERIMENTS``), apart
from all.py because of their cost (docs/experiments.md).

  python -m flax_posemb.experiments configs/experiments/doses.py \
      --workdir runs/experiments --report_dir docs/experiments

Runs shared with all.py's experiments and with rows.py's (same ``--workdir``,
so the same run store) are trained once: long_text_doses' `crops/skew:0.003`
and its twin are mechanism's `adam_b2_0.95` pair and init_rare_text's `gpt2`
pair. The synthetic corpus' doses are in exposure.py. Cost on 2 idle CPU
cores: long_text_doses 70 runs (~50 min, its twins included), scale 30 runs of
25 to 145 s (~35 min); the machine is shared, so up to 2.5x that.
"""

# File names relative to this file's directory.
EXPERIMENTS = ('long_text_doses.py', 'scale.py')
