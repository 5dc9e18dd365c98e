"""init_rare: does the position table's init matter where late rows are rare?
A suite of two experiments (``EXPERIMENTS``), one per corpus, because each
corpus has its own shape and tokens per step (`spec.new`'s budget is one per
experiment).

  python -m flax_posemb.experiments configs/experiments/init_rare.py \
      --workdir runs/experiments --report_dir docs/experiments

* `init_rare_synthetic.py`: the synthetic corpus (optimal loss known), context
  64, crops skew:0.003;
* `init_rare_text.py`: the long_text corpus at long_text_doses' rarest dose
  (crops skew:0.003).

Both pre-register same_as_token and sinusoidal against gpt2 with every arm's
random-offset twin (the arms of a seed share one data config, so they train
on the same token instances; a twin moves its arm's rows); the margins and
verdict rules are in each file. Cost on 2 CPU cores: about 13 minutes idle
(30 small synthetic runs of ~8 s, 12 new long_text runs of ~42 s; 6 long_text
runs are long_text_doses'), up to 2.5x that on the shared machine.
"""

from flax_posemb.experiments import spec

# File names relative to this file's directory.
EXPERIMENTS = ('init_rare_synthetic.py', 'init_rare_text.py')
CONTROL = 'gpt2'
INITS = (CONTROL, 'same_as_token', 'sinusoidal')
# The README's "inits reach the same loss within 0.02" (init_comparison).
FINAL_LOSS_MARGIN = 0.02
TWIN = {'data.offset_twin': True}


def twin(name: str) -> str:
  """The name of arm ``name``'s random-offset twin."""
  return f'{name}/twin'


def build(
    c, dose_overrides: dict, late_metric: str, late_margin: float
) -> None:
  """Gives experiment config ``c`` the inits' arms (each with its twin), their
  pre-registered claims and profiles.

  Args:
    c: an experiment config (`spec.new`) with its corpus and budget set.
    dose_overrides: the rare dose's data overrides, shared by every arm.
    late_metric: the last bucket's metric of the late-row claims.
    late_margin: the equivalence margin of ``late_metric``.
  """
  arms = []
  for init in INITS:
    overrides = {**dose_overrides, 'model.position_init': init}
    arms.append(spec.arm(init, overrides))
    arms.append(spec.arm(twin(init), {**overrides, **TWIN}))
  c.arms = tuple(arms)
  claims = [
      spec.claim(
          f'{CONTROL}:rows_part',
          'manipulation check: with gpt2 init the rare rows score the last'
          ' bucket worse than their twin (same tokens and contexts)',
          late_metric,
          CONTROL,
          twin(CONTROL),
          'greater',
      )
  ]
  for init in INITS[1:]:
    claims += [
        spec.claim(
            f'{init}:final_loss',
            f'{init} init reaches the held-out loss of gpt2 init within'
            f' {FINAL_LOSS_MARGIN} nats where late rows are rare',
            'final_loss',
            init,
            CONTROL,
            'equivalent',
            FINAL_LOSS_MARGIN,
        ),
        spec.claim(
            f'{init}:late',
            f'{init} init scores the rare last bucket like gpt2 init (within'
            f' {late_margin} nats)',
            late_metric,
            init,
            CONTROL,
            'equivalent',
            late_margin,
        ),
        spec.claim(
            f'{init}:rows_part',
            f'with {init} init the rare rows still score the last bucket'
            ' worse than their twin',
            late_metric,
            init,
            twin(init),
            'greater',
        ),
    ]
  c.claims = tuple(claims)
  names = tuple(arm.name for arm in arms)
  c.profiles = (
      spec.profile('bucket_loss', names, CONTROL, 'held-out loss by bucket'),
      spec.profile(
          'bucket_exposure',
          (CONTROL, twin(CONTROL)),
          '',
          'training exposure per row',
      ),
      spec.profile('bucket_drift', names, '', 'drift from init'),
  )
  c.quick_arms = ('same_as_token', twin('same_as_token'))
