"""Pretrained models: a Hugging Face GPT-2 imported from a local directory gives
transformers' logits (linen and NNX, both weight layouts), scores text in its
own tokens, evaluates by position, fine-tunes with statistics on an extended
table, and every checkpoint it cannot represent is refused in one line.

The checkpoints are tiny random models built in the test with transformers
(FlaxGPT2LMHeadModel: in the test extra, no torch needed; PyTorch
GPT2LMHeadModel: only where torch is installed) and a BPE tokenizer trained in
the test."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from flax import nnx
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save_file
import tokenizers

from conftest import ROOT
from conftest import SUBPROCESS_ENV
from flax_posemb import checkpointing
from flax_posemb import defaults
from flax_posemb import hf_import
from flax_posemb import init_from as init_from_lib
from flax_posemb import initializers
from flax_posemb import model as model_lib
from flax_posemb import nnx as nnx_lib
from flax_posemb import pretrained
from flax_posemb.data import tokenizers as tokenizers_lib

VOCAB = 300
SEP = '<|endoftext|>'
WORDS = (
    'the a of to and in is it that was for on are with as his they be at one'
    ' have this from or had by hot word but what some we can out other were'
    ' all there when up use your how said an each she which do their time if'
).split()


def corpus_texts(num: int, seed: int = 0) -> list[str]:
  """`num` documents of 150 to 400 words."""
  rng = np.random.default_rng(seed)
  return [
      ' '.join(rng.choice(WORDS, int(rng.integers(150, 400))))
      for _ in range(num)
  ]


@pytest.fixture(scope='module')
def bpe():
  """A byte-level BPE tokenizer of `VOCAB` ids, `SEP` = id 0."""
  tok = tokenizers.ByteLevelBPETokenizer()
  tok.train_from_iterator(
      corpus_texts(50, seed=1),
      vocab_size=VOCAB,
      min_frequency=1,
      special_tokens=[SEP],
      show_progress=False,
  )
  return tok


def gpt2_config(**overrides):
  from transformers import GPT2Config

  values = dict(
      vocab_size=VOCAB,
      n_positions=16,
      n_embd=32,
      n_layer=2,
      n_head=4,
      bos_token_id=0,
      eos_token_id=0,
  )
  values.update(overrides)
  return GPT2Config(**values)


def flax_gpt2(seed: int = 0, **overrides):
  from transformers import FlaxGPT2LMHeadModel

  return FlaxGPT2LMHeadModel(gpt2_config(**overrides), seed=seed)


def hub_names(flax_params) -> dict[str, np.ndarray]:
  """transformers' Flax params under the hub's PyTorch names (Conv1D weights
  [in, out]), as GPT2LMHeadModel.save_pretrained writes them."""
  leaf_names = {
      'kernel': 'weight',
      'scale': 'weight',
      'embedding': 'weight',
      'bias': 'bias',
  }
  out = {}
  flat = traverse_util.flatten_dict(jax.device_get(flax_params), sep='/')
  for name, value in flat.items():
    *parents, leaf = name.split('/')
    value = np.asarray(value)
    if leaf == 'kernel':
      value = value.T
    out['.'.join(parents + [leaf_names[leaf]])] = np.ascontiguousarray(value)
  return out


def write_hf_dir(path, flax_model, layout, tokenizer=None, vocab_files=False):
  """A Hugging Face directory of `flax_model` in `layout` ('flax':
  save_pretrained's flax_model.msgpack; 'safetensors': the hub's PyTorch
  names), with the tokenizer's files."""
  os.makedirs(path, exist_ok=True)
  if layout == 'flax':
    flax_model.save_pretrained(path)
  else:
    flax_model.config.save_pretrained(path)
    save_file(
        hub_names(flax_model.params),
        os.path.join(path, 'model.safetensors'),
        metadata={'format': 'pt'},
    )
  if tokenizer is not None and vocab_files:
    tokenizer.save_model(str(path))
  elif tokenizer is not None:
    tokenizer.save(os.path.join(path, 'tokenizer.json'))
  return str(path)


def batch(seed: int = 0, length: int = 16):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, VOCAB, (2, length)).astype(np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (2, length))
  return ids, positions


def our_logits(checkpoint: pretrained.Checkpoint, ids, positions):
  """Logits of the imported params through the linen and the NNX model."""
  cfg = model_lib.ModelConfig(**checkpoint.model)
  linen = model_lib.TransformerLM(cfg).apply(
      {'params': checkpoint.params}, jnp.asarray(ids), jnp.asarray(positions)
  )
  net = nnx_lib.load_linen_params(
      nnx_lib.TransformerLM(cfg, rngs=nnx.Rngs(0)), checkpoint.params
  )
  return np.asarray(linen), np.asarray(net(jnp.asarray(ids), positions))


@pytest.mark.parametrize('layout', ['safetensors', 'flax'])
def test_imported_logits_equal_transformers_logits(tmp_path, layout):
  from transformers import FlaxGPT2LMHeadModel

  reference = flax_gpt2(seed=3)
  hf_dir = write_hf_dir(tmp_path / 'hf', reference, layout)
  ids, positions = batch()
  # transformers itself reads the directory (its PyTorch-name reader for
  # safetensors): the hub-named file holds the reference's weights.
  loaded = FlaxGPT2LMHeadModel.from_pretrained(
      hf_dir, from_pt=layout == 'safetensors'
  )
  want = np.asarray(loaded(ids).logits)
  np.testing.assert_array_equal(want, np.asarray(reference(ids).logits))
  checkpoint = pretrained.read_checkpoint(hf_dir)
  assert checkpoint.layout == layout
  for got in our_logits(checkpoint, ids, positions):
    assert np.abs(got - want).max() <= 1e-5


def test_pytorch_model_logits_match_where_torch_is_installed(tmp_path):
  """transformers' own PyTorch GPT2LMHeadModel.save_pretrained directory
  (model.safetensors, tied head left out) imports to its logits."""
  torch = pytest.importorskip('torch')
  from transformers import GPT2LMHeadModel

  torch.manual_seed(0)
  reference = GPT2LMHeadModel(gpt2_config(n_layer=3)).eval()
  reference.save_pretrained(tmp_path)
  assert 'transformer.h.2.attn.c_attn.weight' in load_file(
      tmp_path / 'model.safetensors'
  )
  ids, positions = batch(seed=1)
  with torch.no_grad():
    want = reference(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  checkpoint = pretrained.read_checkpoint(str(tmp_path))
  for got in our_logits(checkpoint, ids, positions):
    assert np.abs(got - want).max() <= 1e-5


def test_tokenizer_json_and_vocab_merges_give_transformers_ids(tmp_path, bpe):
  from transformers import GPT2TokenizerFast

  text = 'the word was hot, and ' + SEP + ' ûnicode!  twice'
  write_hf_dir(tmp_path / 'json', flax_gpt2(), 'flax', bpe)
  write_hf_dir(tmp_path / 'bpe', flax_gpt2(), 'flax', bpe, vocab_files=True)
  from_json = tokenizers_lib.HFTokenizer(str(tmp_path / 'json'))
  from_files = tokenizers_lib.HFTokenizer(str(tmp_path / 'bpe'))
  hf = GPT2TokenizerFast(
      vocab_file=str(tmp_path / 'bpe' / 'vocab.json'),
      merges_file=str(tmp_path / 'bpe' / 'merges.txt'),
  )
  # A separator written in the text is text, as in tiktoken's default.
  want = hf(text.replace(SEP, '<|end of text|>'))['input_ids']
  assert from_json.encode(text.replace(SEP, '<|end of text|>')) == want
  assert from_json.encode(text) == from_files.encode(text)
  assert 0 not in from_json.encode(text)
  # config.json's bos_token_id separates documents.
  assert from_json.sep_id == from_files.sep_id == 0
  assert from_json.vocab_size == VOCAB
  assert from_json.decode(from_json.encode_doc(text)) == text


def test_encode_doc_is_exact_when_tokens_are_longer_than_assumed(bpe, tmp_path):
  write_hf_dir(tmp_path, flax_gpt2(), 'flax', bpe)
  tok = tokenizers_lib.HFTokenizer(str(tmp_path))
  tok.CHARS_PER_TOKEN = 1  # A pre-cut far too short.
  text = corpus_texts(1)[0]
  assert tok.encode_doc(text, 40) == tok.encode_doc(text)[:40]


def test_table_extended_from_16_to_32_rows_keeps_its_rows():
  rng = np.random.default_rng(0)
  table = rng.normal(size=(16, 8)).astype(np.float32)
  fresh = rng.normal(size=(32, 8)).astype(np.float32)
  copied = initializers.extend_rows(table, 32, 'copy_last')
  interpolated = initializers.extend_rows(table, 32, 'interpolate')
  drawn = initializers.extend_rows(table, 32, 'init', fresh)
  for extended in (copied, interpolated, drawn):
    assert extended.shape == (32, 8) and extended.dtype == np.float32
    np.testing.assert_array_equal(extended[:16], table)
  np.testing.assert_array_equal(copied[16:], table)
  np.testing.assert_array_equal(
      initializers.extend_rows(table, 20, 'copy_last')[16:], table[12:16]
  )
  # New row i: the table linearly resampled to 32 rows, at i * 15 / 31.
  x = np.arange(16, 32) * 15 / 31
  lo = np.floor(x).astype(int)
  w = (x - lo)[:, None]
  want = (1 - w) * table[lo] + w * table[np.minimum(lo + 1, 15)]
  np.testing.assert_allclose(interpolated[16:], want, rtol=1e-6)
  np.testing.assert_array_equal(drawn[16:], fresh[16:])
  np.testing.assert_array_equal(
      initializers.extend_rows(table, 10, 'init'), table[:10]
  )


def refusal(hf_dir) -> str:
  with pytest.raises(pretrained.HFCheckpointError) as info:
    pretrained.read_checkpoint(str(hf_dir))
  message = str(info.value)
  assert '\n' not in message
  return message


def edit_json(path, **changes):
  with open(path) as f:
    values = json.load(f)
  values.update(changes)
  with open(path, 'w') as f:
    json.dump(values, f)


def edit_tensors(path, drop=(), **replace):
  tensors = load_file(path)
  for name in drop:
    del tensors[name]
  tensors.update(replace)
  save_file(tensors, path)


def test_checkpoints_it_cannot_represent_are_refused(tmp_path):
  model = flax_gpt2()
  hf = write_hf_dir(tmp_path / 'hf', model, 'safetensors')
  config = os.path.join(hf, 'config.json')
  weights = os.path.join(hf, 'model.safetensors')
  edit_json(config, model_type='llama')
  assert "config.json: model_type 'llama' is not a GPT-2-family" in refusal(hf)
  edit_json(config, model_type='gpt2', activation_function='relu')
  assert "activation_function 'relu' is not representable" in refusal(hf)
  edit_json(config, activation_function='gelu_new', n_inner=64)
  assert (
      'model.safetensors: h.0.mlp.c_fc.weight has shape (32, 128) but'
      ' config.json (n_embd=32, n_inner=64'
  ) in refusal(hf)
  assert 'gives (32, 64)' in refusal(hf)
  edit_json(config, n_inner=None)
  edit_tensors(weights, drop=['transformer.h.1.mlp.c_fc.bias'])
  assert 'model.safetensors has no tensor h.1.mlp.c_fc.bias' in refusal(hf)
  hf = write_hf_dir(tmp_path / 'hf2', model, 'safetensors')
  weights = os.path.join(hf, 'model.safetensors')
  extra = np.zeros((32, 96), np.float32)
  edit_tensors(
      weights, **{'transformer.h.0.crossattention.c_attn.weight': extra}
  )
  assert 'cannot represent: h.0.crossattention.c_attn.weight' in refusal(hf)
  hf = write_hf_dir(tmp_path / 'hf3', model, 'safetensors')
  edit_json(os.path.join(hf, 'config.json'), tie_word_embeddings=False)
  edit_tensors(
      os.path.join(hf, 'model.safetensors'),
      **{'lm_head.weight': np.ones((VOCAB, 32), np.float32)},
  )
  assert 'lm_head.weight is not the token table' in refusal(hf)
  os.remove(os.path.join(hf, 'model.safetensors'))
  assert 'holds no model.safetensors' in refusal(hf)


def test_a_tokenizer_that_cannot_be_read_is_refused(tmp_path, bpe):
  hf = write_hf_dir(tmp_path, flax_gpt2(), 'flax', bpe)
  with open(os.path.join(hf, 'tokenizer.json'), 'w') as f:
    f.write('{"not": "a tokenizer"')
  with pytest.raises(pretrained.HFCheckpointError, match='tokenizer.json'):
    pretrained.read_tokenizer(hf)
  os.remove(os.path.join(hf, 'tokenizer.json'))
  with pytest.raises(pretrained.HFCheckpointError, match='holds no tokenizer'):
    pretrained.read_tokenizer(hf)


def run_command(*args, timeout=600):
  proc = subprocess.run(
      [sys.executable, *args],
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=timeout,
      env=SUBPROCESS_ENV,
  )
  return proc


IMPORT = ('-m', 'flax_posemb.commands.import_hf')


@pytest.mark.slow
def test_import_refusals_are_one_line_naming_the_file_exit_2(tmp_path, bpe):
  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(), 'safetensors', bpe)
  edit_tensors(
      os.path.join(hf, 'model.safetensors'),
      drop=['transformer.h.0.ln_1.bias'],
  )
  with open(os.path.join(tmp_path, 'config.py'), 'w') as f:
    f.write(
        'from flax_posemb import defaults\n'
        'def get_config():\n'
        '  return defaults.base()\n'
    )
  proc = run_command(
      *IMPORT,
      f'--hf_dir={hf}',
      f'--workdir={tmp_path / "w"}',
      f'--config={tmp_path / "config.py"}',
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and 'Traceback' not in proc.stderr
  assert f'{hf}/model.safetensors has no tensor h.0.ln_1.bias' in lines[0]
  assert not os.path.exists(tmp_path / 'w')


def local_text_flags(corpus, data_dir) -> list[str]:
  return [
      '--config.data.source=local_text',
      f'--config.data.local_glob={corpus}/*.txt',
      '--config.data.val_percent=0',
      '--config.data.eval_split=train',
      f'--config.data.data_dir={data_dir}',
      '--config.data.seq_len=16',
      '--config.model.dtype=float32',
      '--config.eval.bucket_size=4',
      '--config.eval.num_windows=16',
      '--config.eval.batch_size=8',
  ]


@pytest.mark.slow
def test_imported_models_evaluate_by_position_compare_and_fine_tune(
    tmp_path, bpe
):
  """Two imported GPT-2s (1 and 2 layers) scored in their own tokens on deep
  windows, offset probe, table analysis and a paired comparison with eval.py;
  then train.py starts from one with its table extended 16 -> 32 rows and
  writes per-position statistics."""
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for i, text in enumerate(corpus_texts(12, seed=2)):
    (corpus / f'doc{i}.txt').write_text(text)
  flags = local_text_flags(corpus, tmp_path / 'data')
  config_file = str(ROOT / 'configs' / 'gpt2_pretrained.py')
  workdirs = []
  for layers, layout in ((1, 'safetensors'), (2, 'flax')):
    hf = write_hf_dir(
        tmp_path / f'hf{layers}', flax_gpt2(n_layer=layers), layout, bpe
    )
    workdir = str(tmp_path / f'gpt2_{layers}')
    proc = run_command(
        *IMPORT,
        f'--hf_dir={hf}',
        f'--workdir={workdir}',
        f'--config={config_file}',
        *flags,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'separator id 0' in proc.stdout
    workdirs.append(workdir)
  saved = json.load(open(os.path.join(workdirs[0], 'config.json')))
  assert saved['model']['num_layers'] == 1 and saved['model']['max_len'] == 16
  assert saved['data']['hf_tokenizer'] == 'tokenizer'  # Its own copy.
  proc = run_command(
      str(ROOT / 'eval.py'),
      f'--workdir={workdirs[0]}',
      f'--workdir={workdirs[1]}',
      '--offsets=0,4',
      '--analyze',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  variant = 'step_0_offsets-0-4_analyze'
  results = json.load(
      open(os.path.join(workdirs[0], 'eval', variant, 'results.json'))
  )
  assert results['settings']['window_start'] == 'deep'
  assert results['settings']['window_len'] == 16
  assert [b['end'] for b in results['buckets']] == [4, 8, 12, 16]
  windows = np.load(os.path.join(workdirs[0], 'eval', variant, 'windows.npz'))
  assert len(windows['doc']) == 16
  # Deep in the documents, in this tokenizer's tokens.
  tok = tokenizers_lib.HFTokenizer(os.path.join(workdirs[0], 'tokenizer'))
  texts = {i: (corpus / f'doc{i}.txt').read_text() for i in range(12)}
  lengths = {len(tok.encode_doc(t)) for t in texts.values()}
  assert set(windows['doc_len']) <= lengths
  assert windows['start'].min() >= 16
  assert sorted(results['offset_probe']['offsets']) == [0, 4]
  analysis = os.path.join(workdirs[0], 'eval', variant, 'analysis')
  assert json.load(open(os.path.join(analysis, 'analysis.json')))['rows'] == 16
  comparison = [d for d in os.listdir(tmp_path) if d.startswith('compare_')]
  paired = json.load(open(tmp_path / comparison[0] / 'comparison.json'))
  # The same windows (one tokenizer), paired.
  assert (paired['paired'][0]['label'], paired['paired'][0]['minus']) == (
      'gpt2_2',
      'gpt2_1',
  )
  assert {b['windows'] for b in paired['paired'][0]['buckets']} == {16}
  # Fine-tune the 2-layer model with its table extended to 32 rows.
  run = str(tmp_path / 'fine_tune')
  proc = run_command(
      str(ROOT / 'train.py'),
      f'--config={config_file}:{workdirs[1]}',
      f'--workdir={run}',
      *flags,
      '--config.model.max_len=32',
      '--config.data.seq_len=32',
      '--config.init_from_new_rows=interpolate',
      '--config.num_train_steps=4',
      '--config.batch_size=4',
      '--config.log_every_steps=2',
      '--config.eval_every_steps=0',
      '--config.checkpoint_every_steps=4',
      '--config.optimizer.warmup_steps=1',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  imported, _, _ = checkpointing.restore_params(workdirs[1])
  old = np.asarray(model_lib.position_table(imported))
  start = np.load(os.path.join(run, 'tables', 'table_0.npy'))
  np.testing.assert_array_equal(start[:16], old)
  np.testing.assert_allclose(
      start[16:], initializers.fit_rows(old, 32, 'interpolate')[16:], rtol=1e-6
  )
  record = json.load(open(os.path.join(run, 'init_from.json')))
  assert (record['rows'], record['max_len'], record['new_rows']) == (
      16,
      32,
      'interpolate',
  )
  window = np.load(os.path.join(run, 'stats', 'window_4.npz'))
  assert window['count'].shape == (32,) and window['count'][16:].sum() > 0
  assert np.isfinite(window['occ_norm'][window['count'] > 0]).all()
  # The table analysis and the statistics show the old and new rows apart.
  proc = run_command(str(ROOT / 'eval.py'), f'--workdir={run}', '--analyze')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '(interpolate new rows): rows 0..15 (old):' in proc.stdout
  analysis = json.load(
      open(
          os.path.join(
              run, 'eval', 'step_4_analyze', 'analysis', 'analysis.json'
          )
      )
  )
  split = analysis['init_from_rows']
  assert (split['old']['rows'], split['new']['rows']) == ([0, 16], [16, 32])
  assert (
      split['from'] == workdirs[1] and split['new_rows_rule'] == 'interpolate'
  )
  for group in ('old', 'new'):
    assert split[group]['exposure'] > 0 and split[group]['drift'] > 0
    assert split[group]['signal_per_occurrence'] > 0
  # The imported workdir holds parameters only: no run resumes from it.
  proc = run_command(
      str(ROOT / 'train.py'),
      f'--config={config_file}:{workdirs[1]}',
      f'--workdir={workdirs[1]}',
      *flags,
      '--config.init_from=',
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert 'holds an imported model (imported.json), which no run resumes' in (
      proc.stderr.strip().splitlines()[-1]
  )


def test_import_config_takes_the_shape_and_the_tokenizer(tmp_path, bpe):
  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(), 'flax', bpe)
  config = defaults.base()
  config.data.source = 'stdlib'
  config.data.seq_len = 16
  config.model.dtype = 'bfloat16'
  workdir = str(tmp_path / 'w')
  record = hf_import.import_checkpoint(hf, workdir, config)
  assert record['tokenizer']['files'] == ['tokenizer.json', 'config.json']
  params, stored, _ = checkpointing.restore_params(workdir)
  assert stored['model']['dtype'] == 'bfloat16'
  assert stored['data']['hf_tokenizer'] == 'tokenizer'  # Its own copy.
  want = pretrained.read_checkpoint(hf).params
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), want)
  with pytest.raises(ValueError, match='not empty; nothing was changed'):
    hf_import.import_checkpoint(hf, workdir, config)


def test_import_fits_seq_len_and_buckets_to_the_checkpoint_positions(
    tmp_path, bpe, caplog
):
  """configs/gpt2_pretrained.py's T=1024 and 16 buckets of 64 on a checkpoint
  of 16 positions: T=16 in 16 buckets of 1, said in one log line."""
  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(), 'flax', bpe)
  config = defaults.base()
  config.data.source = 'stdlib'
  config.data.seq_len = 1024
  config.eval.bucket_size = 64
  workdir = str(tmp_path / 'w')
  hf_import.import_checkpoint(hf, workdir, config)
  saved = json.load(open(os.path.join(workdir, 'config.json')))
  assert saved['data']['seq_len'] == 16 and saved['eval']['bucket_size'] == 1
  lines = [r.getMessage() for r in caplog.records if 'seq_len' in r.message]
  assert lines == [
      'The checkpoint has 16 positions: data.seq_len 1024 -> 16 and'
      ' eval.bucket_size 64 -> 1 (pass --config.data.seq_len=N with N <= 16 to'
      ' choose).'
  ]


@pytest.mark.parametrize(
    'key, value, says',
    [
        ('n_embd', None, 'n_embd must be a positive integer, got null.'),
        ('n_positions', 64.5, 'n_positions must be a positive integer, got'),
        ('n_layer', '2', 'n_layer must be a positive integer, got "2".'),
        ('n_head', 0, 'n_head must be a positive integer, got 0.'),
        ('n_inner', 1.5, 'n_inner must be a positive integer, got 1.5.'),
        ('layer_norm_epsilon', None, 'layer_norm_epsilon must be a number'),
        ('scale_attn_weights', 'yes', 'scale_attn_weights must be true or'),
    ],
)
def test_hf_config_values_of_the_wrong_type_are_refused_naming_the_field(
    tmp_path, key, value, says
):
  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(), 'safetensors')
  edit_json(os.path.join(hf, 'config.json'), **{key: value})
  assert f'{hf}/config.json: {says}' in refusal(hf)


def test_older_hub_files_without_prefix_and_with_mask_buffers_import(tmp_path):
  """The original GPT-2 upload: GPT2Model names (no 'transformer.'), the causal
  mask buffers h.i.attn.bias / masked_bias, a tied lm_head.weight."""
  reference = flax_gpt2(seed=4)
  hf = write_hf_dir(tmp_path, reference, 'safetensors')
  tensors = {
      name.removeprefix('transformer.'): value
      for name, value in hub_names(reference.params).items()
  }
  mask = np.tril(np.ones((16, 16), np.float32))[None, None]
  for i in range(2):
    tensors[f'h.{i}.attn.bias'] = mask
    tensors[f'h.{i}.attn.masked_bias'] = np.float32([-1e4])
  tensors['lm_head.weight'] = tensors['wte.weight']
  save_file(tensors, os.path.join(hf, 'model.safetensors'))
  ids, positions = batch(seed=2)
  want = np.asarray(reference(ids).logits)
  for got in our_logits(pretrained.read_checkpoint(hf), ids, positions):
    assert np.abs(got - want).max() <= 1e-5


@pytest.mark.parametrize('rule', ['copy_last', 'init'])
def test_a_run_starts_from_a_workdir_with_its_table_extended(
    tmp_path, bpe, rule
):
  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(), 'flax', bpe)
  config = defaults.base()
  config.data.source = 'stdlib'
  config.data.seq_len = 16
  source = str(tmp_path / 'w')
  hf_import.import_checkpoint(hf, source, config)
  config.init_from = source
  config.init_from_new_rows = rule
  config.model.max_len = 32
  init_from_lib.apply_source(config, source)
  assert config.model.max_len == 16 and config.model.num_layers == 2
  config.model.max_len = 32
  init_from_lib.check_init_from(config)
  model = model_lib.TransformerLM(
      model_lib.ModelConfig.from_config(config.model)
  )
  params, record = init_from_lib.start_params(config, model, jax.random.key(0))
  table = np.asarray(model_lib.position_table(params))
  old = np.asarray(
      pretrained.read_checkpoint(hf).params['pos_embed']['embedding']
  )
  np.testing.assert_array_equal(table[:16], old)
  if rule == 'copy_last':
    np.testing.assert_array_equal(table[16:], old)
  else:
    # model.position_init's draw (gpt2: normal, std 0.02).
    assert 0.01 < table[16:].std() < 0.03 and not np.isin(table[16:], old).any()
  assert record['rows'] == 16 and record['new_rows'] == rule
  config.model.num_layers = 3
  with pytest.raises(ValueError, match='num_layers=2 .config: 3.'):
    init_from_lib.check_init_from(config)


def start_import(hf, workdir, config_file, *flags):
  return subprocess.Popen(
      [
          sys.executable,
          *IMPORT,
          f'--hf_dir={hf}',
          f'--workdir={workdir}',
          f'--config={config_file}',
          *flags,
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=ROOT,
      env=SUBPROCESS_ENV,
  )


def wait_for_build(parent, name, proc, timeout=300):
  """Waits until the import's hidden build directory holds a checkpoint being
  written."""
  pattern = os.path.join(parent, f'.{name}.import-*', 'checkpoints')
  deadline = time.time() + timeout
  while not glob.glob(pattern):
    assert proc.poll() is None, proc.communicate()
    assert time.time() < deadline
    time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGKILL, signal.SIGTERM])
def test_an_interrupted_import_leaves_nothing_and_the_same_command_succeeds(
    tmp_path, bpe, signum
):
  """kill -9 or SIGTERM while the checkpoint is written: nothing at the
  target (SIGTERM: exit 75, the build directory removed), and the same
  command then imports."""
  # Wide enough that its checkpoint takes a moment to write.
  model = flax_gpt2(n_embd=512, n_layer=6, n_positions=64)
  hf = write_hf_dir(tmp_path / 'hf', model, 'safetensors', bpe)
  config_file = str(ROOT / 'configs' / 'gpt2_pretrained.py')
  flags = local_text_flags(tmp_path, tmp_path / 'data')
  workdir = str(tmp_path / 'runs' / 'gpt2')
  proc = start_import(hf, workdir, config_file, *flags)
  wait_for_build(tmp_path / 'runs', 'gpt2', proc)
  proc.send_signal(signum)
  _, stderr = proc.communicate(timeout=120)
  assert not os.path.exists(workdir)
  if signum == signal.SIGTERM:
    assert proc.returncode == 75, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (
        f'python -m {IMPORT[1]}: SIGTERM: the import stopped and left'
        f' nothing in {workdir}. Re-run the same command.'
    )
    assert os.listdir(tmp_path / 'runs') == []
  else:
    assert proc.returncode == -signal.SIGKILL
  proc = start_import(hf, workdir, config_file, *flags)
  stdout, stderr = proc.communicate(timeout=600)
  assert proc.returncode == 0, stderr[-3000:]
  assert 'imported' in stdout
  # The killed import's build directory is gone too.
  assert os.listdir(tmp_path / 'runs') == ['gpt2']
  assert os.path.exists(os.path.join(workdir, 'imported.json'))


TRAIN_FLAGS = (
    '--config.num_train_steps=2',
    '--config.batch_size=4',
    '--config.log_every_steps=1',
    '--config.eval_every_steps=0',
    '--config.checkpoint_every_steps=2',
    '--config.optimizer.warmup_steps=1',
)


@pytest.mark.slow
def test_moved_workdirs_evaluate_and_resume_with_their_sources_deleted(
    tmp_path, bpe
):
  """An imported workdir and a run fine-tuned from it are moved, the Hugging
  Face directory and the import deleted: both evaluate from their own files,
  the fine-tuned run resumes with the command that started it, and a resume
  changing its max_len is refused as a config change."""
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for i, text in enumerate(corpus_texts(12, seed=2)):
    (corpus / f'doc{i}.txt').write_text(text)
  flags = local_text_flags(corpus, tmp_path / 'data')
  config_file = str(ROOT / 'configs' / 'gpt2_pretrained.py')
  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(), 'safetensors', bpe)
  source = str(tmp_path / 'gpt2')
  proc = run_command(
      *IMPORT,
      f'--hf_dir={hf}',
      f'--workdir={source}',
      f'--config={config_file}',
      *flags,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  run = str(tmp_path / 'fine_tune')
  train = (str(ROOT / 'train.py'), f'--config={config_file}:{source}', *flags)
  proc = run_command(*train, f'--workdir={run}', *TRAIN_FLAGS)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.load(open(os.path.join(run, 'init_from.json')))
  assert record['workdir'] == source and len(record['digest']) == 64
  saved = json.load(open(os.path.join(run, 'config.json')))
  assert saved['data']['hf_tokenizer'] == 'tokenizer'
  # The import moved, the Hugging Face directory gone.
  moved = str(tmp_path / 'elsewhere' / 'gpt2')
  os.makedirs(os.path.dirname(moved))
  shutil.move(source, moved)
  shutil.rmtree(hf)
  proc = run_command(str(ROOT / 'eval.py'), f'--workdir={moved}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The fine-tuned run moved, its source deleted.
  shutil.rmtree(moved)
  moved_run = str(tmp_path / 'elsewhere' / 'fine_tune')
  shutil.move(run, moved_run)
  proc = run_command(str(ROOT / 'eval.py'), f'--workdir={moved_run}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.exists(
      os.path.join(moved_run, 'eval', 'step_2', 'results.json')
  )
  proc = run_command(*train, f'--workdir={moved_run}', *TRAIN_FLAGS)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Training finished at step 2' in proc.stdout
  assert 'is gone: the run takes its shape and tokenizer from' in proc.stderr
  # The source gone, a command line's max_len is still the run's: a change.
  max_len = saved['model']['max_len']
  proc = run_command(
      *train,
      f'--workdir={moved_run}',
      *TRAIN_FLAGS,
      f'--config.model.max_len={2 * max_len}',
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert (
      f'holds a run with another config (model.max_len: {max_len} ->'
      f' {2 * max_len})' in proc.stderr
  )
  # A fresh start from the deleted source is refused.
  proc = run_command(*train, f'--workdir={tmp_path / "fresh"}', *TRAIN_FLAGS)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert f'init_from={source!r} is not a workdir' in proc.stderr


@pytest.mark.slow
def test_a_moved_workdir_with_a_given_sentencepiece_model_needs_no_original(
    tmp_path,
):
  """A run trained with data.spm_model is moved and the model file deleted:
  it evaluates and resumes from its own copy, with the command that started
  it."""
  import sentencepiece

  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  texts = corpus_texts(20, seed=3)
  for i, text in enumerate(texts):
    (corpus / f'doc{i}.txt').write_text(text)
  model_file = tmp_path / 'spm' / 'words.model'
  model_file.parent.mkdir()
  with open(model_file, 'wb') as f:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=f,
        vocab_size=64,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
  train = (
      str(ROOT / 'train.py'),
      f'--config={ROOT / "configs" / "tiny.py"}',
      *local_text_flags(corpus, tmp_path / 'data'),
      '--config.data.tokenizer=sentencepiece',
      f'--config.data.spm_model={model_file}',
      '--config.model.vocab_size=64',
      '--config.model.max_len=16',
      '--config.data.position_policy=packed',
      *TRAIN_FLAGS,
  )
  run = str(tmp_path / 'run')
  proc = run_command(*train, f'--workdir={run}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  saved = json.load(open(os.path.join(run, 'config.json')))
  assert saved['data']['spm_model'] == 'tokenizer.model'
  moved = str(tmp_path / 'elsewhere' / 'run')
  os.makedirs(os.path.dirname(moved))
  shutil.move(run, moved)
  shutil.rmtree(model_file.parent)
  proc = run_command(str(ROOT / 'eval.py'), f'--workdir={moved}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.exists(os.path.join(moved, 'eval', 'step_2', 'results.json'))
  proc = run_command(*train, f'--workdir={moved}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Training finished at step 2' in proc.stdout


def test_init_from_naming_the_run_itself_is_refused(tmp_path):
  config = defaults.base()
  workdir = str(tmp_path / 'w')
  config.init_from = workdir
  with pytest.raises(ValueError, match="names this run's own --workdir"):
    init_from_lib.settle_config(config, workdir)


@pytest.mark.slow
def test_the_documented_import_of_a_64_position_checkpoint_works_unchanged(
    tmp_path, bpe
):
  """docs/pretrained.md's commands, as written, on a GPT-2 of 64 positions:
  the import fits T=1024 to 64 (16 buckets of 4, as 16 of 64 at 1024), and
  the evaluation it prints gives an offset probe of several buckets."""
  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(n_positions=64), 'flax', bpe)
  workdir = str(tmp_path / 'gpt2')
  proc = run_command(
      *IMPORT,
      f'--hf_dir={hf}',
      f'--workdir={workdir}',
      f'--config={ROOT / "configs" / "gpt2_pretrained.py"}',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'data.seq_len 1024 -> 64 and eval.bucket_size 64 -> 4' in proc.stderr
  printed = proc.stdout.strip().splitlines()[-1]
  assert printed == (
      f'Evaluate it: python eval.py --workdir {workdir} [--offsets 0,16'
      ' --analyze]'
  )
  proc = run_command(
      str(ROOT / 'eval.py'), f'--workdir={workdir}', '--offsets=0,16'
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = os.path.join(workdir, 'eval', 'step_0_offsets-0-16')
  results = json.load(open(os.path.join(out, 'results.json')))
  assert len(results['buckets']) == 16
  (paired,) = results['offset_probe']['paired_vs_first']
  assert len(paired['buckets']) == 12  # 48 probed positions in buckets of 4
  assert os.path.getsize(os.path.join(out, 'offsets.png')) > 0


def test_a_failed_import_leaves_nothing_and_says_to_re_run(
    tmp_path, bpe, monkeypatch
):
  """A full disk while the import writes: nothing at the target or beside it,
  and the message says the same command starts again (not that it
  resumes)."""
  import errno

  from flax_posemb import own_tokenizer

  hf = write_hf_dir(tmp_path / 'hf', flax_gpt2(), 'flax', bpe)
  config = defaults.base()
  config.data.source = 'stdlib'
  config.data.seq_len = 16
  runs = tmp_path / 'runs'

  def full_disk(source, target):
    raise OSError(errno.ENOSPC, 'No space left on device')

  monkeypatch.setattr(own_tokenizer, 'copy_tokenizer', full_disk)
  with pytest.raises(OSError, match='nothing was left there; free some space'):
    hf_import.import_checkpoint(hf, str(runs / 'w'), config)
  assert os.listdir(runs) == []
  monkeypatch.undo()
  hf_import.import_checkpoint(hf, str(runs / 'w'), config)
  assert os.listdir(runs) == ['w']
