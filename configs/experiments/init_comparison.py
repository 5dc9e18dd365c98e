"""init_comparison: does the position-table init matter under uniform exposure
(packed)?

  python -m flax_posemb.experiments configs/experiments/init_comparison.py \
      --workdir runs/init_comparison --run_store runs/store          # CPU scale
  python -m flax_posemb.experiments
      configs/experiments/init_comparison.py:accelerator \\ --workdir
      runs/init_comparison_acc                             # GPT-2-small shapes

The token table uses Flax's default init (normal, std 1/sqrt(width)), not 0.02,
so that 'same_as_token' is a distinct arm. All arms share the packed policy;
rows per step are set to the scale's scored-token budget
(``spec.TARGET_TOKENS_PER_STEP``) like every experiment. """

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
# Largest paired difference in final held-out loss (nats/token) still called
# "similar".
MARGIN = 0.02


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'init_comparison',
      'Position-table init under uniform exposure (packed)',
      'Claim under test: "both approaches work similarly because training'
      ' quickly overrides '
      'the initialization". Every init of the learned position table is trained'
      ' with the '
      '`packed` policy (every position seen equally often) and compared with'
      ' `gpt2` '
      '(normal, std 0.02) on final held-out loss, with an equivalence'
      ' margin of '
      f"{MARGIN} nats fixed before running. We also report when the tables' "
      'cosine-similarity structures converge across inits (from the saved'
      ' snapshots) and '
      'how far each bucket of rows drifted from its init.',
      scale,
  )
  c.base_overrides = (('data.position_policy', 'packed'),)
  c.arms = tuple(
      spec.arm(name, {'model.position_init': name}) for name in INITS
  )
  c.claims = tuple(
      spec.claim(
          f'{name}~gpt2',
          f'`{name}` init reaches the same final loss as `gpt2`',
          'final_loss',
          name,
          'gpt2',
          'equivalent',
          MARGIN,
      )
      for name in INITS[1:]
  )
  c.profiles = (
      spec.profile(
          'bucket_loss', INITS, 'gpt2', 'Held-out loss by position bucket'
      ),
      spec.profile(
          'bucket_drift', INITS, '', 'Drift of rows from their init (L2)'
      ),
      spec.profile(
          'bucket_excess', INITS, 'gpt2', 'Excess loss over the Bayes optimum'
      ),
  )
  c.analyses = ('cosine_convergence',)
  c.convergence_threshold = 0.9
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
          'On the synthetic corpus documents are at most one row long, so'
          ' batches were already diverse: all 6 verdicts are unchanged (primary'
          " and after Holm), and every claim's mean moved by at most 0.0002"
          ' nats.'
      ),
  )
  c.quick_arms = ('gpt2', 'zeros')
  c.report_scalars = ('drift_mean', 'drift_late_over_early', 'update_rss_late')
  return c
