"""long_text_doses: the late-row penalty on real text against the exposure of
the late rows, at late/early exposure 1, 0.3, 0.1, 0.03 and 0.01.

  python -m flax_posemb.experiments configs/experiments/doses.py \
      --workdir runs/experiments --report_dir docs/experiments

The long_text experiment's corpus, model, budget and windows
(configs/experiments/long_text.py); every arm takes the control's tokens
(`crops`, token weighting) and differs in position exposure only: geometric crop
lengths whose last row is seen R times as often as the first, R = 0.3, 0.1,
0.03, 0.01 and 0.003; `packed` is R = 1. The synthetic corpus' doses are in
the exposure experiment.

Twins (issue 36): every crops arm `crops/X` has its random-offset twin
`crops/X/twin` (`data.offset_twin`): the same rows, tokens and contexts with
positions shifted by a random offset per row, so its late rows are not rare
while every token keeps its context. Claims about the *rows* are arm minus
twin (`rows:X`); claims about *long-context training* (fewer long crops at
rarer doses) are twin minus control (`context:X`); both on the last bucket's
own loss, so a claim about late rows needs the late bucket to move. `packed`
has no twin: its rows already see every position equally (a twin would only
make contexts shorter than positions). An arm and its twin train on the same
token instances (the twin moves the arm's rows), so the `rows:X` claims carry
no content noise; the control and the arms of other policies draw their own
seed-random ~5% of the corpus, so `context:X` and `late:X` do. One token stream
per seed (`data.shared_stream`) would match them, but on this corpus a long
work fills a row slot for many steps (a run trains on 432 documents, the
largest four 27% of its tokens, against 959 and 6%; the control's final loss
2.521 [2.410, 2.633] against 2.441 [2.392, 2.489], every interval 2-3x wider;
docs/data.md), so it is off.
The arm names of the previous report are unchanged (its claims `late:X` and
`offset:X` too).

Cost on 2 CPU cores: 14 arms x 5 seeds = 70 runs of ~42 s on an idle
machine, about 50 minutes (docs/experiments.md; the machine is shared, so up
to 2.5x that).
"""

import os
import runpy

from flax_posemb.experiments import spec

_LONG_TEXT = runpy.run_path(
    os.path.join(os.path.dirname(__file__), 'long_text.py')
)
CONTROL = _LONG_TEXT['CONTROL']
# 0.003: late rows seen a few dozen times in 400 steps (0.01: about a hundred).
DOSES = ('skew:0.3', 'skew:0.1', 'skew:0.03', 'skew:0.01', 'skew:0.003')
# The crops arms with a twin: natural's exposure, then the doses.
TWINNED = ('natural',) + DOSES
TWIN = {'data.offset_twin': True}


def twin(name: str) -> str:
  """The name of arm ``name``'s random-offset twin."""
  return f'{name}/twin'


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'long_text_doses',
      'The late-row penalty on real text against late-row exposure',
      'On real long documents, with content held fixed, how does the late-row'
      ' penalty (last minus mid bucket, and the offset probe) grow as the late'
      " rows' exposure falls from the first rows' (R = 1) to 1/100 of it?",
      scale,
  )
  _LONG_TEXT['settings'](c, scale)
  c.seeds = (0, 1, 2, 3, 4)
  crops = _LONG_TEXT['crops']
  arms = [
      spec.arm(CONTROL, {'data.position_policy': 'packed_reset'}),
      spec.arm('packed', {'data.position_policy': 'packed'}),
      spec.arm('crops/natural', crops('natural')),
  ]
  arms += [spec.arm(f'crops/{d}', crops(d)) for d in DOSES]
  arms += [spec.arm(twin(f'crops/{d}'), crops(d, **TWIN)) for d in TWINNED]
  c.arms = tuple(arms)
  doses = ('packed',) + tuple(f'crops/{d}' for d in DOSES)
  penalty = f'offset_penalty_{c.offsets[-1]}'
  claims = []
  for d in DOSES:
    claims.append(
        spec.claim(
            f'late:{d}',
            f'crops/{d} scores late minus mid worse than the control',
            'loss_late_minus_mid',
            f'crops/{d}',
            CONTROL,
            'greater',
            about_late_rows=True,
        )
    )
    claims.append(
        spec.claim(
            f'offset:{d}',
            f'crops/{d}: shifting text later costs more than for the control',
            penalty,
            f'crops/{d}',
            CONTROL,
            'greater',
        )
    )
  for d in TWINNED:
    claims.append(
        spec.claim(
            f'rows:{d}',
            f"crops/{d}: the rows' own part: the last bucket scores worse"
            ' than the twin (same tokens and contexts, positions offset)',
            'loss_late',
            f'crops/{d}',
            twin(f'crops/{d}'),
            'greater',
        )
    )
    claims.append(
        spec.claim(
            f'context:{d}',
            f"crops/{d}'s twin: less long-context training scores the last"
            ' bucket worse than the control (late rows not rare)',
            'loss_late',
            twin(f'crops/{d}'),
            CONTROL,
            'greater',
        )
    )
  c.claims = tuple(claims)
  c.doses = (spec.dose('long_text', doses + ('crops/natural',), CONTROL),)
  c.profiles = (
      spec.profile(
          'bucket_loss',
          (CONTROL,) + doses,
          CONTROL,
          'held-out loss, deep full-context windows',
      ),
      spec.profile(
          'bucket_loss',
          (CONTROL,) + tuple(twin(f'crops/{d}') for d in TWINNED),
          CONTROL,
          'twins: held-out loss, deep full-context windows',
      ),
      spec.profile(
          'bucket_exposure', (CONTROL,) + doses, '', 'training exposure per row'
      ),
      spec.profile(
          'bucket_exposure',
          (CONTROL, twin('crops/skew:0.003')),
          '',
          'a twin: training exposure per row',
      ),
  )
  c.quick_arms = (CONTROL, 'crops/skew:0.01')
  c.report_scalars = (penalty, 'loss_late_minus_mid', 'final_loss')
  return c
