"""Default configuration sections shared by every `configs/*.py`
(docs/DESIGN.md, Config)."""

import dataclasses

import ml_collections

from flax_posemb import model as model_lib


def data() -> ml_collections.ConfigDict:
  """Data section: source, tokenizer, context length and position policy."""
  config = ml_collections.ConfigDict()

  # Where documents come from:
  # synthetic | stdlib | local_text | long_text | tfds.
  config.source = 'synthetic'
  # TFDS dataset name when source == 'tfds' (e.g. 'wiki40b/en', 'pg19').
  config.name = ''
  # Feature holding the text in a TFDS dataset.
  config.text_feature = 'text'
  # Split used for training.
  config.train_split = 'train'
  # Split used for periodic and offline evaluation.
  config.eval_split = 'validation'
  # Where TFDS datasets are built and read; '' = $FLAX_POSEMB_DATA_DIR or
  # ~/.cache/flax_posemb.
  config.data_dir = ''
  # Glob of .txt/.jsonl files when source == 'local_text'.
  config.local_glob = ''
  # local_text document unit: file | line | paragraph.
  config.local_split_by = 'file'
  # local_text/stdlib (long_text: its short documents): percent of the
  # documents (by key hash) in 'validation'.
  config.val_percent = 5
  # Invalid UTF-8 text: replace (U+FFFD; counted, reported) | skip (drop the
  # document; counted) | error (refuse, naming the file).
  config.on_decode_error = 'replace'

  # Tokens. byte | sentencepiece | hf (ignored by the synthetic source).
  config.tokenizer = 'byte'
  # SentencePiece model file; '' = train one on the corpus.
  config.spm_model = ''
  # hf: a Hugging Face tokenizer directory (tokenizer.json, or vocab.json +
  # merges.txt), e.g. the one an imported workdir holds (docs/pretrained.md).
  config.hf_tokenizer = ''
  # Vocabulary size when training a SentencePiece model.
  config.spm_vocab_size = 4096

  # Tokens per training row (context length); must be <= model.max_len.
  config.seq_len = 128
  # natural | natural_chunked | packed | packed_reset | random_offset |
  # length_schedule | resampled | crops (docs/DESIGN.md, Data policies).
  config.position_policy = 'natural'
  # crops: where crops come from. token = consecutive stretches of the document
  # stream (the tokens of packed/packed_reset, content-matched) | document = one
  # crop per document, documents drawn uniformly (natural's weighting), at a
  # uniform offset inside the document.
  config.crop_weighting = 'token'
  # crops with crop_weighting=token: crop lengths in pairs. natural (the rows of
  # natural: each document's length, at most seq_len) | skew:R (geometric; the
  # last row is seen R times as often as the first) | schedule (BERT: pieces of
  # schedule_seq_len for schedule_fraction of the steps, then full rows) | a
  # length distribution as resample_dist.
  config.crop_lengths = 'natural'
  # length_schedule: row length during the short phase.
  config.schedule_seq_len = 32
  # length_schedule: fraction of num_train_steps at the short length.
  config.schedule_fraction = 0.9
  # resampled: uniform | full | comma-separated shares per length bucket.
  config.resample_dist = 'uniform'
  # Synthetic document lengths: wikipedia | uniform | full | comma-separated
  # shares.
  config.length_dist = 'wikipedia'
  # Documents shorter than this many tokens are dropped.
  config.min_doc_len = 2

  # Shuffle documents (deterministically from `seed`).
  config.shuffle = True
  # packed, packed_reset, natural_chunked: rows are shuffled in windows of
  # this many rows (a long document does not fill consecutive batches); <= 1
  # keeps stream order.
  config.shuffle_rows = 8192
  # Grain worker processes (0 = in-process).
  config.num_workers = 0
  # Batches prefetched by the Grain iterator.
  config.prefetch = 2

  config.synthetic = ml_collections.ConfigDict()
  # Tokens in the synthetic vocabulary.
  config.synthetic.vocab_size = 64
  # K: transition matrices cycled through by position.
  config.synthetic.num_regimes = 4
  # S: positions per regime before switching (K*S <= smallest bucket).
  config.synthetic.segment_len = 4
  # Dirichlet concentration of transition rows (lower = more predictable).
  config.synthetic.concentration = 0.1
  # Seed of the corpus itself (transition matrices), not of sampling.
  config.synthetic.seed = 1234
  # Documents per split (procedural: costs no storage).
  config.synthetic.num_docs = 100_000
  return config


def model() -> ml_collections.ConfigDict:
  """Model section: `flax_posemb.model.ModelConfig`'s fields and defaults
  (documented there)."""
  return ml_collections.ConfigDict(dataclasses.asdict(model_lib.ModelConfig()))


def optimizer() -> ml_collections.ConfigDict:
  """Optimizer section: AdamW + warmup/cosine schedule (optax)."""
  config = ml_collections.ConfigDict()

  # Peak learning rate.
  config.learning_rate = 3e-3
  # Linear warmup steps from 0 to the peak.
  config.warmup_steps = 20
  # Cosine decay to learning_rate * end_lr_ratio at num_train_steps.
  config.end_lr_ratio = 0.1

  # Adam beta1.
  config.b1 = 0.9
  # Adam beta2 (stated explicitly: it sets how fast rare rows' second moments
  # decay).
  config.b2 = 0.95
  # Adam epsilon.
  config.eps = 1e-8

  # Decoupled weight decay on 2-D weights.
  config.weight_decay = 0.1
  # Weight decay on the position table (nanoGPT: yes; minGPT: no).
  config.decay_position_table = True
  # Weight decay on the token table.
  config.decay_token_table = True
  # Global gradient-norm clip; <= 0 disables.
  config.grad_clip_norm = 1.0

  # Scale each position row's update by (mean exposure / row exposure)**power,
  # after Adam.
  config.row_lr_scale = False
  # Exponent of the per-row exposure scale.
  config.row_lr_power = 0.5
  # Upper bound of the per-row scale.
  config.row_lr_max = 10.0
  return config


def evaluation() -> ml_collections.ConfigDict:
  """Evaluation section: loss by position bucket (periodic eval and eval.py)."""
  config = ml_collections.ConfigDict()

  # Width of position buckets (used unless `bucket_edges` is set).
  config.bucket_size = 16
  # Comma-separated bucket edges, e.g. '0,128,256,512', or 'log2'.
  config.bucket_edges = ''

  # Evaluation windows (T + 1 consecutive tokens each) per evaluation.
  config.num_windows = 64
  # Windows per evaluation batch.
  config.batch_size = 32
  # Evaluation window length in tokens; 0 = model.max_len (the table size).
  config.window_len = 0
  # windows (full-length documents, positions 0..T-1) | natural (the training
  # distribution).
  config.position_policy = 'windows'
  # windows: first (a document's first T + 1 tokens) | deep (token-uniform
  # windows inside long documents; text sources; docs/DESIGN.md).
  config.window_start = 'first'
  # deep: only documents of at least this many tokens; 0 = 4 * window length.
  config.min_doc_len = 0
  # deep: no window starts before this token of its document; 0 = the window
  # length.
  config.min_start = 0
  # Seed that picks the evaluation documents (the same texts across runs).
  config.seed = 0
  return config


# Fields that do not change what a run computes: the experiments' run identity
# ignores them.
NON_SEMANTIC = (
    'progress_bar',
    'checkpoint_every_steps',
    'max_to_keep',
    'data.num_workers',
    'data.prefetch',
    'data.data_dir',
    'allow_config_change',
)
# What a resume may change without allow_config_change: the non-semantic
# fields (not data.num_workers: the iterator state depends on it), logging and
# evaluation.
RESUME_MAY_CHANGE = tuple(k for k in NON_SEMANTIC if k != 'data.num_workers')
RESUME_MAY_CHANGE += ('log_every_steps', 'eval_every_steps', 'eval')
# What a run saved before a field existed ran with, where not the default (a
# resume compares).
BEFORE_FIELD = {'data.shuffle_rows': 0}


def base() -> ml_collections.ConfigDict:
  """Full default config: training fields plus the four sections above."""
  config = ml_collections.ConfigDict()

  # Seed for model init, dropout and data order (paired across arms).
  config.seed = 0
  # Optimizer steps.
  config.num_train_steps = 200
  # Global rows per optimizer step (split across devices and microbatches).
  config.batch_size = 32
  # Microbatches per optimizer step (the same update); 0 = auto: ~1k-token
  # ones on CPU (cache-sized, faster), 1 on accelerators (flax_posemb.auto).
  config.grad_accum_steps = 0

  # Write metrics, statistics and a table snapshot every this many steps.
  config.log_every_steps = 20
  # Periodic held-out evaluation; <= 0 disables.
  config.eval_every_steps = 100
  # Periodic checkpoint; one is always written at the end.
  config.checkpoint_every_steps = 100
  # Checkpoints kept (the step-0 checkpoint is always kept too).
  config.max_to_keep = 3
  # Per-position gradient statistics in the train step.
  config.collect_stats = True
  # Shard large matrices over the 'data' mesh axis as well as the batch.
  config.fsdp = False
  # tqdm progress bar with loss and tokens/s.
  config.progress_bar = True
  # Resume even if the config changed in meaning (recorded in metrics.jsonl).
  config.allow_config_change = False
  # Stop (exit 3, nothing saved) when a step's loss exceeds this; < 0 = 3 *
  # ln(model.vocab_size).
  config.divergence_loss = -1.0
  # Start from this workdir's parameters (newest step; e.g. an imported
  # Hugging Face checkpoint) instead of a fresh init; '' = fresh. The model's
  # shape must be its (configs/gpt2_pretrained.py:WORKDIR copies it).
  config.init_from = ''
  # Position-table rows beyond init_from's (model.max_len larger):
  # copy_last | interpolate | init (model.position_init's draw).
  config.init_from_new_rows = 'copy_last'

  config.data = data()
  config.model = model()
  config.optimizer = optimizer()
  config.eval = evaluation()
  # A misspelled field in a config file is an error, not a new field.
  config.lock()
  return config
