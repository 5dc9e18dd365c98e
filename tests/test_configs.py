"""Every configs/*.py loads, validates against the model and data checks, and is
documented."""

import ast
import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import config as config_lib
from flax_posemb import data
from flax_posemb import model as model_lib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / 'configs'
CONFIGS = ('tiny', 'default', 'gpt2_small', 'bert_like')
BYTE_VOCAB = 257  # tokenizers.ByteTokenizer.vocab_size


def load(name: str):
  """Loads configs/NAME.py the way ml_collections.config_flags does and calls
  get_config()."""
  spec = importlib.util.spec_from_file_location(
      f'config_{name}', CONFIG_DIR / f'{name}.py'
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def data_vocab(c) -> int:
  if c.data.source == 'synthetic':
    return int(c.data.synthetic.vocab_size)
  return (
      BYTE_VOCAB if c.data.tokenizer == 'byte' else int(c.data.spm_vocab_size)
  )


def num_params(c) -> int:
  cfg = model_lib.ModelConfig.from_config(c.model)
  x = jnp.zeros((1, 8), jnp.int32)
  shapes = jax.eval_shape(
      lambda: model_lib.TransformerLM(cfg).init(jax.random.key(0), x, x)
  )
  return sum(math.prod(s.shape) for s in jax.tree.leaves(shapes['params']))


@pytest.mark.parametrize('name', CONFIGS)
def test_config_loads_and_validates(name):
  c = load(name)
  run = config_lib.RunConfig.from_config_dict(c)
  data.check_fits_model(run.data, run.model.max_len)
  assert c.model.vocab_size == data_vocab(
      c
  ), 'model.vocab_size must equal the data vocabulary'
  assert c.data.seq_len == c.model.max_len
  # 0 = auto
  assert c.grad_accum_steps == 0 or c.batch_size % c.grad_accum_steps == 0
  assert 0 < c.optimizer.warmup_steps < c.num_train_steps


@pytest.mark.parametrize('name', CONFIGS + ('gpt2_pretrained',))
def test_every_override_has_a_comment(name):
  source = (CONFIG_DIR / f'{name}.py').read_text()
  lines = source.splitlines()
  tree = ast.parse(source)
  fn = next(
      n
      for n in tree.body
      if isinstance(n, ast.FunctionDef) and n.name == 'get_config'
  )
  assigns = [
      n
      for n in ast.walk(fn)
      if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Attribute)
  ]
  assert assigns
  for node in assigns:
    # On its line, or (when that line would pass 80 columns) just above it.
    line = lines[node.lineno - 1]
    above = lines[node.lineno - 2].strip()
    commented = '#' in line or above.startswith('#')
    assert commented, f'{name}.py:{node.lineno} override lacks a comment'


def test_model_shapes_match_their_names():
  gpt2 = load('gpt2_small')
  n = num_params(gpt2)
  # GPT-2 small is 124.4M with 50257 tokens; the 32k vocabulary removes 18257 x
  # 768 rows.
  assert abs(n - (124_439_808 - (50_257 - 32_000) * 768)) < 0.01 * n, n
  assert (gpt2.model.num_layers, gpt2.model.num_heads, gpt2.model.emb_dim) == (
      12,
      12,
      768,
  )
  assert (gpt2.model.dtype, gpt2.model.param_dtype) == ('bfloat16', 'float32')
  bert = load('bert_like')
  assert bert.model.position_init == 'bert'
  assert (
      bert.data.position_policy,
      bert.data.schedule_seq_len,
      bert.data.seq_len,
      bert.data.schedule_fraction,
  ) == ('length_schedule', 128, 512, 0.9)
  table = model_lib.ModelConfig.from_config(bert.model).position_initializer()(
      jax.random.key(0), (512, 768), jnp.float32
  )
  assert float(jnp.max(jnp.abs(table))) <= 0.04 + 1e-6  # truncated at 2 std
  assert abs(float(jnp.std(table)) - 0.0176) < 0.001  # not rescaled
  default = load('default')
  assert default.data.source == 'stdlib' and default.model.max_len == 256
  assert np.isclose(num_params(default), 0.86e6, rtol=0.1), num_params(default)
