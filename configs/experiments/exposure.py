"""exposure: how position exposure (packing, padding, offsets, length schedule)
shapes rows.

  python -m flax_posemb.experiments configs/experiments/exposure.py \
      --workdir runs/exposure --run_store runs/store

Arms: five position policies on the synthetic corpus ('syn/...'). Real text is
the subject of `long_text.py` (long documents, context 512, deep windows): the
context-64 arms on the standard-library sources that used to live here had
almost no exposure skew to test (their documents nearly fill the rows). Budget:
every arm gets the same scored tokens per step (``spec.TARGET_TOKENS_PER_STEP``;
rows per step set from each policy's measured scored tokens per row), and the
same steps. Baselines: the packed arms see every position equally often with
equally long attention spans, so they are the control for "late". """

from flax_posemb.experiments import spec

POLICIES = (
    'packed',
    'packed_reset',
    'natural',
    'random_offset',
    'length_schedule',
)
# Content-matched crops (synthetic documents are generated for their position
# ids, so every policy here draws the same content): natural's exposure packed
# into full rows, and late rows seen 1/100 as often as the first.
CROPS = {
    'crops/natural': 'natural',
    'crops/skew:0.3': 'skew:0.3',
    'crops/skew:0.1': 'skew:0.1',
    'crops/skew:0.03': 'skew:0.03',
    'crops/skew:0.01': 'skew:0.01',
}
# Bucket 16-24 (of 8-position buckets): past the first buckets, whose loss
# still falls as the regime is inferred from context.
MID_BUCKET = 2


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'exposure',
      'Position exposure and the quality of late rows',
      'Claims under test: late positions receive weaker gradient signal; their'
      ' rows are less reliable (excess loss and `recovered` by bucket, on the'
      ' synthetic corpus whose optimal loss is known; real text: see the'
      ' long_text experiment); the model does worse on text that fills the'
      ' context. Counter-claim: the signal **per occurrence** is larger at late'
      ' positions — from long context, or because under-trained positions'
      ' simply have larger errors? (correlated with the per-position training'
      ' loss; `packed` is the control). We also report where the penalty sits'
      ' (rare rows vs all of the second half) and the wall-clock cost of each'
      ' arm.',
      scale,
  )
  arms = []
  for p in POLICIES:
    arms.append(spec.arm(f'syn/{p}', {'data.position_policy': p}))
  for name, lengths in CROPS.items():
    overrides = {
        'data.position_policy': 'crops',
        'data.crop_lengths': lengths,
    }
    arms.append(spec.arm(f'syn/{name}', overrides))
  c.arms = tuple(arms)
  c.offsets = (0, 16) if scale == 'cpu' else (0, 128)
  c.quick_offsets = (0, 8)
  c.mid_bucket = MID_BUCKET
  k = c.offsets[-1]
  cl = []
  for corpus in ('syn',):
    n, pk = f'{corpus}/natural', f'{corpus}/packed'
    cl += [
        spec.claim(
            f'{corpus}:exposure',
            f'{corpus}: late rows are seen less often (natural)',
            'exposure_late_over_early',
            n,
            pk,
            'less',
        ),
        spec.claim(
            f'{corpus}:row_grad',
            f'{corpus}: late rows get a weaker table gradient',
            'row_grad_late_over_early',
            n,
            pk,
            'less',
        ),
        spec.claim(
            f'{corpus}:update',
            f'{corpus}: late rows are updated less (Adam included)',
            'update_late_over_early',
            n,
            pk,
            'less',
        ),
        spec.claim(
            f'{corpus}:fills_context',
            f'{corpus}: worse on text that fills the context (excess loss,'
            ' last minus mid bucket)',
            'excess_late_minus_mid',
            n,
            pk,
            'greater',
        ),
        spec.claim(
            f'{corpus}:per_occurrence',
            f'{corpus}: counter-claim: larger signal per '
            'occurrence at late positions (natural, vs packed control)',
            'occ_signal_late_over_early',
            n,
            pk,
            'greater',
        ),
        spec.claim(
            f'{corpus}:per_downstream',
            f'{corpus}: larger signal per downstream target '
            'at late positions (natural, vs packed control)',
            'downstream_signal_late_over_early',
            n,
            pk,
            'greater',
        ),
        spec.claim(
            f'{corpus}:signal_vs_loss',
            f'{corpus}: per-occurrence signal tracks the '
            'per-position training loss (natural; correlation > 0)',
            'signal_loss_corr',
            n,
            '',
            'greater',
        ),
    ]
  cl += [
      spec.claim(
          'syn:excess_late',
          'syn: late rows are less reliable (excess loss, natural)',
          'excess_late',
          'syn/natural',
          'syn/packed',
          'greater',
      ),
      spec.claim(
          'syn:recovered_late',
          'syn: late rows recover less of the position value',
          'recovered_late',
          'syn/natural',
          'syn/packed',
          'less',
      ),
      spec.claim(
          'syn:random_offset_fixes',
          'syn: random offsets remove the late penalty',
          'excess_late',
          'syn/random_offset',
          'syn/natural',
          'less',
      ),
      spec.claim(
          'syn:schedule_fixes',
          'syn: a length schedule reduces the late penalty',
          'excess_late',
          'syn/length_schedule',
          'syn/natural',
          'less',
      ),
      spec.claim(
          'syn:padding_irrelevant',
          'syn: packed_reset (no padding) matches natural '
          '(same exposure) on late excess loss',
          'excess_late',
          'syn/packed_reset',
          'syn/natural',
          'equivalent',
          0.05,
      ),
      spec.claim(
          'natural_costs_more',
          'natural rows are mostly padding: more wall-clock per '
          'step (same scored tokens per step) than packed_reset',
          'step_seconds',
          'syn/natural',
          'syn/packed_reset',
          'greater',
      ),
  ]
  cl += [
      spec.claim(
          'syn:rare_late',
          'syn: late rows seen 1/100 as often as the first are less reliable'
          ' (excess loss, last minus mid bucket; packed crops)',
          'excess_late_minus_mid',
          'syn/crops/skew:0.01',
          'syn/packed',
          'greater',
          about_late_rows=True,
      ),
      spec.claim(
          'syn:packing_irrelevant',
          "syn: natural's exposure packed into full rows (crops/natural)"
          ' matches natural on late excess loss',
          'excess_late',
          'syn/crops/natural',
          'syn/natural',
          'equivalent',
          0.05,
      ),
  ]
  c.claims = tuple(cl)
  # Against syn/packed, the claims' control: synthetic documents are shorter
  # than the context, so packed_reset sees its late rows as rarely as natural
  # (~28 times against ~15,500) and is a dose here, not the flat control it
  # is on long_text.
  c.doses = (
      spec.dose(
          'synthetic',
          (
              'syn/packed_reset',
              'syn/crops/natural',
              'syn/crops/skew:0.3',
              'syn/crops/skew:0.1',
              'syn/crops/skew:0.03',
              'syn/crops/skew:0.01',
          ),
          'syn/packed',
      ),
  )
  # The doses are in the dose-response table and figure.
  syn = tuple(f'syn/{p}' for p in POLICIES) + (
      'syn/crops/natural',
      'syn/crops/skew:0.01',
  )
  c.profiles = (
      spec.profile(
          'bucket_exposure', syn, '', 'syn: training exposure per row'
      ),
      spec.profile(
          'bucket_excess', syn, 'syn/packed', 'syn: excess loss over Bayes'
      ),
      spec.profile(
          'bucket_recovered',
          syn,
          'syn/packed',
          'syn: share of the position value recovered',
      ),
      spec.profile(
          'bucket_row_grad',
          syn,
          'syn/packed',
          'syn: table-gradient row norm (RMS/step)',
      ),
      spec.profile(
          'bucket_occ_signal', syn, 'syn/packed', 'syn: signal per occurrence'
      ),
      spec.profile(
          'bucket_update_rss', syn, 'syn/packed', 'syn: cumulative update norm'
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
          '12 of 13 verdicts are unchanged. `syn:padding_irrelevant`'
          ' (packed_reset matches natural on late excess loss within 0.05 nats)'
          ' went from supported (+0.0006 [-0.0064, +0.0076]) to inconclusive'
          ' (+0.059 [-0.064, +0.183]): under the new data order, seed 3 of'
          ' packed_reset scores the last bucket 0.23 nats worse than natural'
          ' (excess 0.44 against 0.14-0.22 for every other run of either arm),'
          ' while the other four seeds agree within 0.05. Rows 56-63 are seen'
          ' only about 200 times in 500 steps under both policies, so their'
          ' outcome varies from seed to seed more than the previous report'
          ' showed.'
      ),
  )
  c.quick_arms = ('syn/packed', 'syn/natural')
  c.rare_exposure = 100.0
  c.report_scalars = (
      'rare_row_fraction',
      'excess_rare_rows',
      'excess_common_late_rows',
      'loss_rare_rows',
      'loss_common_late_rows',
      f'offset_penalty_{k}',
      'signal_loss_corr',
      'train_tokens_per_second',
  )
  return c
