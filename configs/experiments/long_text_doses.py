"""long_text_doses: the late-row penalty on real text against the exposure of
the late rows, at late/early exposure 1, 0.3, 0.1, 0.03 and 0.01.

  python -m flax_posemb.experiments configs/experiments/doses.py \
      --workdir runs/experiments --report_dir docs/experiments

The long_text experiment's corpus, model, budget and windows
(configs/experiments/long_text.py); every arm takes the control's tokens
(`crops`, token weighting) and differs in position exposure only: geometric crop
lengths whose last row is seen R times as often as the first, R = 0.3, 0.1,
0.03, 0.01 and 0.003; `packed` is R = 1. Arms that coincide with long_text's
are the same runs (shared run store). The synthetic corpus' doses are in the
exposure experiment.
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
          'bucket_exposure', (CONTROL,) + doses, '', 'training exposure per row'
      ),
  )
  c.quick_arms = (CONTROL, 'crops/skew:0.01')
  c.report_scalars = (penalty, 'loss_late_minus_mid', 'final_loss')
  return c
