"""The experiments that separate the rows from the context at the rarest
real-text dose (a suite: ``EXPERIMENTS``): the mechanism and its mitigations,
and init under rare exposure; apart from all.py and doses.py because of their
cost (docs/experiments.md).

  python -m flax_posemb.experiments configs/experiments/rows.py \
      --workdir runs/experiments --report_dir docs/experiments

Run it with doses.py's ``--workdir`` (one run store): long_text_doses'
`crops/skew:0.003` and its twin are mechanism's `adam_b2_0.95` pair and
init_rare_text's `gpt2` pair, trained once. Cost on 2 idle CPU cores, about 35
minutes: mechanism 30 new runs (~21 min), init_rare 30 small synthetic runs and
12 new long_text runs (~13 min); the machine is shared, so up to 2.5x that.
"""

# File names relative to this file's directory.
EXPERIMENTS = (
    'mechanism.py',
    'init_rare_synthetic.py',
    'init_rare_text.py',
)
