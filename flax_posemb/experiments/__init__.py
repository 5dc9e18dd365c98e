"""Experiments: paired sweeps of training runs, their statistics, and the report.

  python -m flax_posemb.experiments configs/experiments/init_comparison.py \
      --workdir runs/init_comparison [--quick] [--run_store runs/store] [--max_runs N]

Modules: ``spec`` (experiment configs and the arms x seeds grid), ``budget`` (same scored
tokens per step across arms), ``sweep`` (resumable runner), ``measures`` (per-run numbers
from the workdir files), ``paired`` (t-intervals of paired differences, the verdict rule,
Holm-Bonferroni), ``report`` (summary.json and REPORT.md).
"""

from flax_posemb.experiments.paired import judge, t_interval, verdict, with_holm
from flax_posemb.experiments.spec import arm, claim, expand, load, profile
from flax_posemb.experiments.runner import run_experiment

__all__ = ['arm', 'claim', 'expand', 'judge', 'load', 'profile', 'run_experiment',
           't_interval', 'verdict', 'with_holm']
