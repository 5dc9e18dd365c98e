"""scale: the content-matched late-row penalty at three model widths and two
token budgets.

  python -m flax_posemb.experiments configs/experiments/doses.py \
      --workdir runs/experiments --report_dir docs/experiments

The long_text experiment's corpus, windows and tokens per step
(configs/experiments/long_text.py), at widths 32, 64 and 128 (2 layers, 4x MLP,
token init 1/sqrt(width)) and 400 or 800 steps (0.8M or 1.6M scored tokens).
Per cell, the control `packed_reset` against `crops/skew:0.01` (its tokens, late
rows seen 1/100 as often as the first); the penalty is late minus mid bucket,
arm minus control. Width 64 at 400 steps is long_text's own pair of runs.
"""

import math
import os
import runpy

from flax_posemb.experiments import spec

_LONG_TEXT = runpy.run_path(
    os.path.join(os.path.dirname(__file__), 'long_text.py')
)
CONTROL = _LONG_TEXT['CONTROL']
RARE = _LONG_TEXT['RARE']
WIDTHS = (32, 64, 128)
STEPS = (400, 800)


def cell(width: int, steps: int) -> dict:
  """Overrides of one model width and token budget."""
  return {
      'model.emb_dim': width,
      'model.num_heads': max(2, width // 32),
      'model.mlp_dim': 4 * width,
      'model.token_init_std': 1.0 / math.sqrt(width),
      'num_train_steps': steps,
      'checkpoint_every_steps': steps,
      'optimizer.warmup_steps': steps // 10,
  }


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'scale',
      'The late-row penalty against model width and token budget',
      'Does the content-matched late-row penalty (late rows seen 1/100 as'
      " often as the first, on the control's tokens) grow or shrink with the"
      ' model width and the number of training tokens?',
      scale,
  )
  _LONG_TEXT['settings'](c, scale)
  c.seeds = (0, 1, 2)
  crops = _LONG_TEXT['crops']
  arms, claims = [], []
  for steps in STEPS:
    for width in WIDTHS:
      name = f'w{width}/{steps}'
      arms.append(
          spec.arm(
              f'{name}/{CONTROL}',
              {'data.position_policy': 'packed_reset', **cell(width, steps)},
          )
      )
      arms.append(
          spec.arm(f'{name}/{RARE}', crops('skew:0.01', **cell(width, steps)))
      )
      claims.append(
          spec.claim(
              f'{name}',
              f'width {width}, {steps} steps: rare late rows score late'
              ' minus mid worse than the control',
              'loss_late_minus_mid',
              f'{name}/{RARE}',
              f'{name}/{CONTROL}',
              'greater',
              about_late_rows=True,
          )
      )
  c.arms = tuple(arms)
  c.claims = tuple(claims)
  c.quick_arms = (arms[0].name, arms[1].name)
  c.report_scalars = ('loss_late_minus_mid', 'final_loss', 'train_seconds')
  return c
