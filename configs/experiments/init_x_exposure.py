"""init_x_exposure: inits under natural exposure (packed_reset), weight decay on
the table on/off.

  python -m flax_posemb.experiments configs/experiments/init_x_exposure.py \
      --workdir runs/init_x_exposure --run_store runs/store

Do small or structured inits (zeros, sinusoidal) reduce the late-bucket penalty
because rarely updated rows stay near their init, and does weight decay erase
unused rows? Judged by loss, cumulative update norm, drift and final row norm.
With a shared --run_store, the arm 'gpt2/decay' is the same run as exposure's
'syn/packed_reset' (trained once). """

from flax_posemb.experiments import spec

INITS = (
    'gpt2',
    'gpt2_openai',
    'bert',
    'same_as_token',
    'word2vec',
    'zeros',
    'sinusoidal',
)


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'init_x_exposure',
      'Position-table init x natural exposure x weight decay on the table',
      'Claims under test: under natural exposure (`packed_reset`: positions'
      ' restart per document, so late rows are rare), small or structured inits'
      ' (zeros, sinusoidal) reduce the late-bucket penalty because rarely'
      ' updated rows stay near their init; weight decay on the table erases'
      ' rarely used rows. Judged by excess loss, cumulative update norm, drift'
      ' and final row norm by bucket.',
      scale,
  )
  c.base_overrides = (('data.position_policy', 'packed_reset'),)
  arms = []
  for init in INITS:
    arms.append(
        spec.arm(
            f'{init}/decay',
            {
                'model.position_init': init,
                'optimizer.decay_position_table': True,
            },
        )
    )
    arms.append(
        spec.arm(
            f'{init}/no_decay',
            {
                'model.position_init': init,
                'optimizer.decay_position_table': False,
            },
        )
    )
  c.arms = tuple(arms)
  cl = []
  for wd in ('decay', 'no_decay'):
    for init in ('zeros', 'sinusoidal'):
      cl.append(
          spec.claim(
              f'{init}:{wd}:late',
              f'{init} init lowers the late-bucket excess loss vs gpt2 ({wd})',
              'excess_late',
              f'{init}/{wd}',
              f'gpt2/{wd}',
              'less',
          )
      )
      cl.append(
          spec.claim(
              f'{init}:{wd}:late_minus_early',
              f'{init} init lowers the late '
              f'minus early loss gap vs gpt2 ({wd})',
              'loss_late_minus_early',
              f'{init}/{wd}',
              f'gpt2/{wd}',
              'less',
          )
      )
  for init in ('gpt2', 'zeros', 'sinusoidal'):
    cl.append(
        spec.claim(
            f'{init}:decay_erases',
            'decay shrinks rarely used (late) rows '
            f'relative to early ones ({init})',
            'row_norm_late_over_early',
            f'{init}/decay',
            f'{init}/no_decay',
            'less',
        )
    )
    cl.append(
        spec.claim(
            f'{init}:decay_late_loss',
            f'decay on the table raises the late excess loss ({init})',
            'excess_late',
            f'{init}/decay',
            f'{init}/no_decay',
            'greater',
        )
    )
  c.claims = tuple(cl)
  decay = tuple(f'{i}/decay' for i in INITS)
  no_decay = tuple(f'{i}/no_decay' for i in INITS)
  c.profiles = (
      spec.profile(
          'bucket_excess',
          decay,
          'gpt2/decay',
          'decay on: excess loss by bucket',
      ),
      spec.profile(
          'bucket_excess',
          no_decay,
          'gpt2/no_decay',
          'decay off: excess loss by bucket',
      ),
      spec.profile(
          'bucket_update_rss', decay + no_decay, '', 'cumulative update norm'
      ),
      spec.profile('bucket_drift', decay + no_decay, '', 'drift from init'),
      spec.profile(
          'bucket_row_norm',
          ('gpt2/decay', 'gpt2/no_decay', 'zeros/decay', 'zeros/no_decay'),
          '',
          'final row norm',
      ),
  )
  c.notes = (  # What changed since the previous committed report.
      (
          'Rows of the streaming policies (packed, packed_reset,'
          ' natural_chunked) are now shuffled in windows of 8192 rows'
          ' (`data.shuffle_rows`) instead of following the document stream, and'
          ' intervals inside a run are clustered by document (here one window'
          ' per document, so unchanged). Every run was retrained with the new'
          ' data order.'
      ),
      (
          'All 14 verdicts after Holm are unchanged. Three primary verdicts,'
          ' none of which was decisive after Holm before, are now inconclusive:'
          ' `gpt2:decay_erases` (was supported), `gpt2:decay_late_loss` and'
          ' `zeros:decay_erases` (were contradicted). The zeros-vs-gpt2'
          ' intervals widened (late excess loss with decay: -0.0005 [-0.060,'
          ' +0.059], was +0.007 [-0.007, +0.021]): the per-seed differences now'
          ' range from -0.081 (seed 3, whose gpt2/decay run, shared with'
          " exposure's syn/packed_reset, scores the rarely seen last bucket"
          ' 0.44 nats above Bayes) to +0.035.'
      ),
  )
  c.quick_arms = ('gpt2/decay', 'zeros/decay')
  c.report_scalars = (
      'update_rss_late',
      'drift_late',
      'row_norm_late_over_early',
      'excess_rare_rows',
      'excess_common_late_rows',
  )
  return c
