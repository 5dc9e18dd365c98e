"""Experiments: paired sweeps of training runs, their measures, and the report
(``python -m flax_posemb.experiments``; docs/DESIGN.md "Experiments outputs")."""

from flax_posemb.experiments.paired import judge, t_interval, verdict, with_holm
from flax_posemb.experiments.runner import run_experiment
from flax_posemb.experiments.spec import arm, claim, expand, load, profile

__all__ = ['arm', 'claim', 'expand', 'judge', 'load', 'profile', 'run_experiment',
           't_interval', 'verdict', 'with_holm']
