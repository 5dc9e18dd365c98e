"""Pretrained models: a local Hugging Face GPT-2-family checkpoint read and
checked (docs/DESIGN.md § Pretrained models; written as a workdir by
`flax_posemb.hf_import`).

The importer reads ``config.json`` and ``model.safetensors`` (the hub's PyTorch
names; sharded: ``model.safetensors.index.json``) or ``flax_model.msgpack``
(transformers' Flax names) with safetensors / flax.serialization: neither
transformers nor torch is needed. What the model cannot represent is refused,
naming the file and the problem (`HFCheckpointError`).
"""

import dataclasses
import json
import os
from typing import Any

from flax import serialization
from flax import traverse_util
import jax
import numpy as np
from safetensors import safe_open

from flax_posemb import evaluation
from flax_posemb import layers
from flax_posemb import model as model_lib
from flax_posemb.data import tokenizers as tokenizers_lib

HF_CONFIG = 'config.json'
SAFETENSORS = 'model.safetensors'
SAFETENSORS_INDEX = 'model.safetensors.index.json'
FLAX_MSGPACK = 'flax_model.msgpack'
MODEL_TYPES = ('gpt2',)  # GPT-2 and DistilGPT2 both say 'gpt2'.
ARCHITECTURES = (
    'GPT2LMHeadModel',
    'GPT2Model',
    'FlaxGPT2LMHeadModel',
    'FlaxGPT2Model',
)
# GELU's tanh approximation under its transformers names (`layers.block`'s).
TANH_GELUS = ('gelu_new', 'gelu_pytorch_tanh', 'gelu_fast')
# What transformers' GPT2Config assumes for a key config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    'vocab_size': 50257,
    'n_positions': 1024,
    'n_embd': 768,
    'n_layer': 12,
    'n_head': 12,
    'n_inner': None,
    'activation_function': 'gelu_new',
    'layer_norm_epsilon': 1e-5,
    'scale_attn_weights': True,
    'scale_attn_by_inverse_layer_idx': False,
    'add_cross_attention': False,
    'tie_word_embeddings': True,
}
# Each tensor as (hub PyTorch name, transformers' Flax name, linen path); block
# tensors are under h.{i} / block_{i}. PyTorch's Conv1D stores `weight` [in,
# out]: the kernels are transposed to the linen [out, in].
_TOP_NAMES = (
    ('wte.weight', 'wte/embedding', 'token_embed/embedding'),
    ('wpe.weight', 'wpe/embedding', 'pos_embed/embedding'),
    ('ln_f.weight', 'ln_f/scale', 'ln_f/scale'),
    ('ln_f.bias', 'ln_f/bias', 'ln_f/bias'),
)
_BLOCK_NAMES = (
    ('ln_1.weight', 'ln_1/scale', 'ln_1/scale'),
    ('ln_1.bias', 'ln_1/bias', 'ln_1/bias'),
    ('attn.c_attn.weight', 'attn/c_attn/kernel', 'qkv/kernel'),
    ('attn.c_attn.bias', 'attn/c_attn/bias', 'qkv/bias'),
    ('attn.c_proj.weight', 'attn/c_proj/kernel', 'attn_out/kernel'),
    ('attn.c_proj.bias', 'attn/c_proj/bias', 'attn_out/bias'),
    ('ln_2.weight', 'ln_2/scale', 'ln_2/scale'),
    ('ln_2.bias', 'ln_2/bias', 'ln_2/bias'),
    ('mlp.c_fc.weight', 'mlp/c_fc/kernel', 'mlp_in/kernel'),
    ('mlp.c_fc.bias', 'mlp/c_fc/bias', 'mlp_in/bias'),
    ('mlp.c_proj.weight', 'mlp/c_proj/kernel', 'mlp_out/kernel'),
    ('mlp.c_proj.bias', 'mlp/c_proj/bias', 'mlp_out/bias'),
)
# The output head, [V, D] in PyTorch and [D, V] in Flax: only tied (equal to
# the token table) is representable.
_HEADS = {'safetensors': 'lm_head.weight', 'flax': 'lm_head/kernel'}
# PyTorch buffers of older checkpoints (the causal mask), not weights.
_BUFFERS = ('.attn.bias', '.attn.masked_bias')
# Prefixes of GPT2LMHeadModel's names (GPT2Model's have none).
_PREFIXES = {'safetensors': 'transformer.', 'flax': 'transformer/'}


class HFCheckpointError(ValueError):
  """A Hugging Face directory that cannot be imported; the message names the
  file and the problem."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A GPT-2-family checkpoint read from a Hugging Face directory.

  Attributes:
    model: ModelConfig fields of its shape (`model_fields`).
    params: the linen params tree (numpy, the stored dtype).
    layout: 'safetensors' (PyTorch names) or 'flax'.
    files: the weight files read.
    hf_config: config.json, with transformers' defaults filled in.
  """

  model: dict[str, Any]
  params: dict[str, Any]
  layout: str
  files: tuple[str, ...]
  hf_config: dict[str, Any]


def read_hf_config(hf_dir: str) -> dict[str, Any]:
  """Reads a Hugging Face GPT-2-family ``config.json``.

  Args:
    hf_dir: a local checkpoint directory (``config.json`` and weights).

  Returns:
    The config as a dict, with GPT2Config's defaults filled in.

  Raises:
    HFCheckpointError: not a GPT-2-family causal LM this model can
      represent, or a field that is null, fractional or of the wrong type
      (named).
  """
  path = os.path.join(hf_dir, HF_CONFIG)
  if not os.path.isfile(path):
    raise HFCheckpointError(
        f'{path} not found: --hf_dir must be a local Hugging Face model'
        ' directory (config.json plus model.safetensors or'
        ' flax_model.msgpack).'
    )
  try:
    with open(path, encoding='utf-8') as f:
      stored = json.load(f)
  except (OSError, ValueError) as e:
    raise HFCheckpointError(f'{path} is not readable JSON: {e}') from None
  if not isinstance(stored, dict):
    raise HFCheckpointError(f'{path} is not a JSON object.')
  hf_config = dict(HF_DEFAULTS, **stored)
  _check_types(hf_config, path)
  _check_architecture(hf_config, path)
  return hf_config


def _check_types(hf_config: dict[str, Any], path: str) -> None:
  """Refuses a value of the wrong type: null, fractional or a string where
  GPT2Config has a count, a non-boolean flag, a non-numeric epsilon."""
  for key in ('vocab_size', 'n_positions', 'n_embd', 'n_layer', 'n_head'):
    _check_count(hf_config, key, path)
  if hf_config['n_inner'] is not None:
    _check_count(hf_config, 'n_inner', path)
  epsilon = hf_config['layer_norm_epsilon']
  if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
    raise HFCheckpointError(
        f'{path}: layer_norm_epsilon must be a number, got {epsilon!r}.'
    )
  flags = (
      'scale_attn_weights',
      'scale_attn_by_inverse_layer_idx',
      'add_cross_attention',
      'tie_word_embeddings',
  )
  for key in flags:
    if not isinstance(hf_config[key], bool):
      raise HFCheckpointError(
          f'{path}: {key} must be true or false, got'
          f' {json.dumps(hf_config[key])}.'
      )


def _check_count(hf_config: dict[str, Any], key: str, path: str) -> None:
  """Refuses `key` unless it is a positive integer (JSON 64, not 64.5, null,
  "64" or true)."""
  value = hf_config[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise HFCheckpointError(
        f'{path}: {key} must be a positive integer, got {json.dumps(value)}.'
    )


def _check_architecture(hf_config: dict[str, Any], path: str) -> None:
  """Refuses what `layers.block` does not compute as GPT-2 does."""
  model_type = hf_config.get('model_type')
  if model_type not in MODEL_TYPES:
    raise HFCheckpointError(
        f'{path}: model_type {model_type!r} is not a GPT-2-family model; the'
        f' importer reads model_type {", ".join(MODEL_TYPES)} (GPT-2,'
        ' DistilGPT2 and models of that architecture).'
    )
  other = sorted(set(hf_config.get('architectures') or ()) - set(ARCHITECTURES))
  if other:
    raise HFCheckpointError(
        f'{path}: architecture {", ".join(other)} has weights this causal LM'
        f' does not hold; the importer reads {", ".join(ARCHITECTURES)}.'
    )
  activation = hf_config['activation_function']
  if activation not in TANH_GELUS:
    raise HFCheckpointError(
        f'{path}: activation_function {activation!r} is not representable;'
        f' the blocks use GELU with the tanh approximation'
        f' ({", ".join(TANH_GELUS)}).'
    )
  epsilon = hf_config['layer_norm_epsilon']
  if epsilon != layers.LAYER_NORM_EPSILON:
    raise HFCheckpointError(
        f'{path}: layer_norm_epsilon {epsilon} is not representable; the'
        f" LayerNorms use GPT-2's {layers.LAYER_NORM_EPSILON}."
    )
  refused = {
      'scale_attn_weights': False,
      'scale_attn_by_inverse_layer_idx': True,
      'add_cross_attention': True,
  }
  for key, value in refused.items():
    if bool(hf_config[key]) == value:
      raise HFCheckpointError(
          f'{path}: {key}={str(value).lower()} is not representable; the'
          " attention is GPT-2's (scores scaled by 1/sqrt(head dim), no"
          ' cross-attention).'
      )


def model_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
  """The `model.ModelConfig` fields of a GPT-2 config.

  Args:
    hf_config: a config as `read_hf_config` returns it.

  Returns:
    ``vocab_size``, ``num_layers``, ``num_heads``, ``emb_dim``, ``mlp_dim``,
    ``max_len`` and the other ModelConfig fields the checkpoint fixes.
  """
  emb_dim = int(hf_config['n_embd'])
  mlp_dim = hf_config['n_inner'] or 4 * emb_dim
  return {
      'vocab_size': int(hf_config['vocab_size']),
      'num_layers': int(hf_config['n_layer']),
      'num_heads': int(hf_config['n_head']),
      'emb_dim': emb_dim,
      'mlp_dim': int(mlp_dim),
      'position_embedding': 'learned',
      'max_len': int(hf_config['n_positions']),
  }


def weight_files(hf_dir: str) -> tuple[str, tuple[str, ...]]:
  """Finds the directory's weight files.

  Args:
    hf_dir: a local checkpoint directory.

  Returns:
    ``(layout, paths)``: ``'safetensors'`` and model.safetensors (or its
    shards) if present, else ``'flax'`` and flax_model.msgpack.

  Raises:
    HFCheckpointError: no weights this importer reads (PyTorch ``.bin``
      files are named with the fix).
  """
  single = os.path.join(hf_dir, SAFETENSORS)
  if os.path.isfile(single):
    return 'safetensors', (single,)
  index = os.path.join(hf_dir, SAFETENSORS_INDEX)
  if os.path.isfile(index):
    try:
      with open(index, encoding='utf-8') as f:
        weight_map = json.load(f)['weight_map']
      shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise HFCheckpointError(
          f'{index} is not a safetensors index (a JSON "weight_map"): {e}'
      ) from None
    return 'safetensors', tuple(os.path.join(hf_dir, s) for s in shards)
  msgpack = os.path.join(hf_dir, FLAX_MSGPACK)
  if os.path.isfile(msgpack):
    return 'flax', (msgpack,)
  raise HFCheckpointError(
      f'{hf_dir} holds no {SAFETENSORS}, {SAFETENSORS_INDEX} or'
      f' {FLAX_MSGPACK}. A PyTorch pytorch_model.bin needs torch to read:'
      ' save the model once with save_pretrained(DIR) (safetensors).'
  )


def read_tensors(layout: str, paths: tuple[str, ...]) -> dict[str, np.ndarray]:
  """Reads every tensor of the weight files.

  Args:
    layout: ``'safetensors'`` or ``'flax'`` (`weight_files`).
    paths: the weight files.

  Returns:
    ``{name: array}``, names without GPT2LMHeadModel's prefix:
    ``'h.0.attn.c_attn.weight'`` (safetensors), ``'h/0/attn/c_attn/kernel'``
    (flax); arrays as stored (e.g. ``wpe`` ``[n_positions, n_embd]``).
  """
  prefix = _PREFIXES[layout]
  tensors = {}
  for path in paths:
    for name, array in _read_file(layout, path).items():
      tensors[name.removeprefix(prefix)] = array
  return tensors


def _read_file(layout: str, path: str) -> dict[str, np.ndarray]:
  """One weight file's arrays by their stored names."""
  if not os.path.isfile(path):
    raise HFCheckpointError(f'{path} not found (named by {SAFETENSORS_INDEX}).')
  try:
    if layout == 'flax':
      with open(path, 'rb') as f:
        tree = serialization.msgpack_restore(f.read())
      flat = traverse_util.flatten_dict(tree, sep='/')
      return {name: np.asarray(x) for name, x in flat.items()}
    # Through JAX on the host: numpy has no bfloat16.
    with jax.default_device(jax.local_devices(backend='cpu')[0]):
      with safe_open(path, framework='flax') as f:
        return {name: np.asarray(f.get_tensor(name)) for name in f.keys()}
  except HFCheckpointError:
    raise
  except Exception as e:  # A foreign file: its reader's words.
    reason = (str(e).strip().splitlines() or [''])[0][:300]
    raise HFCheckpointError(
        f'{path} is not a readable {layout} file: {type(e).__name__}: {reason}'
    ) from None


def _names(layout: str, num_layers: int) -> list[tuple[str, str]]:
  """``(stored name, linen path)`` of every tensor of a model of
  `num_layers`."""
  column = 0 if layout == 'safetensors' else 1
  sep = '.' if layout == 'safetensors' else '/'
  names = [(row[column], row[2]) for row in _TOP_NAMES]
  for i in range(num_layers):
    for row in _BLOCK_NAMES:
      names.append((f'h{sep}{i}{sep}{row[column]}', f'block_{i}/{row[2]}'))
  return names


def to_linen(
    tensors: dict[str, np.ndarray],
    layout: str,
    hf_config: dict[str, Any],
    where: str,
) -> dict[str, Any]:
  """Maps stored GPT-2 tensors onto the linen `model.TransformerLM` tree.

  Args:
    tensors: ``{name: array}`` as `read_tensors` returns them.
    layout: their layout, ``'safetensors'`` (Conv1D ``[in, out]`` kernels)
      or ``'flax'``.
    hf_config: the checkpoint's config (`read_hf_config`).
    where: the weight file, named in refusals.

  Returns:
    The params tree, e.g. ``pos_embed/embedding`` ``[max_len, emb_dim]``.

  Raises:
    HFCheckpointError: a missing, unexpected, misshapen or non-finite
      tensor, or an untied head.
  """
  fields = model_fields(hf_config)
  try:
    model = model_lib.TransformerLM(model_lib.ModelConfig(**fields))
  except ValueError as e:
    raise HFCheckpointError(f'{HF_CONFIG} gives no valid model: {e}') from None
  expected = traverse_util.flatten_dict(
      evaluation.expected_params(model), sep='/'
  )
  names = _names(layout, fields['num_layers'])
  head = _HEADS[layout]
  known = {stored for stored, _ in names} | {head}
  unexpected = sorted(
      n for n in tensors if n not in known and not n.endswith(_BUFFERS)
  )
  if unexpected:
    raise HFCheckpointError(
        f'{where} holds {len(unexpected)} tensor(s) this GPT-2 cannot'
        f' represent: {", ".join(unexpected[:4])}.'
    )
  flat = {}
  for stored, path in names:
    if stored not in tensors:
      raise HFCheckpointError(
          f'{where} has no tensor {stored}, which config.json'
          f' (n_layer={hf_config["n_layer"]}) requires.'
      )
    array = tensors[stored]
    # Hub kernels are Conv1D [in, out]; linen's and Flax's are [out, in].
    if layout == 'safetensors' and path.endswith('kernel'):
      array = array.T
    want = tuple(expected[path].shape)
    if array.shape != want:
      stored_shape = tuple(tensors[stored].shape)
      if layout == 'safetensors' and path.endswith('kernel'):
        want = want[::-1]
      raise HFCheckpointError(
          f'{where}: {stored} has shape {stored_shape} but config.json'
          f' (n_embd={hf_config["n_embd"]}, n_inner={hf_config["n_inner"]},'
          f' n_positions={hf_config["n_positions"]},'
          f' vocab_size={hf_config["vocab_size"]}) gives {want}.'
      )
    if not np.isfinite(array.astype(np.float32)).all():
      raise HFCheckpointError(f'{where}: {stored} holds NaN or inf values.')
    flat[path] = array
  _check_head(tensors, layout, hf_config, flat['token_embed/embedding'], where)
  return traverse_util.unflatten_dict(flat, sep='/')


def _check_head(
    tensors: dict[str, np.ndarray],
    layout: str,
    hf_config: dict[str, Any],
    token_table: np.ndarray,
    where: str,
) -> None:
  """Refuses an output head other than the token table: transformers ties it
  (ignoring any stored head) unless tie_word_embeddings is false."""
  if hf_config['tie_word_embeddings']:
    return
  head = _HEADS[layout]
  stored = tensors.get(head)
  if stored is not None and layout == 'flax':
    stored = stored.T
  if stored is None or not np.array_equal(stored, token_table):
    raise HFCheckpointError(
        f'{where}: config.json sets tie_word_embeddings=false and {head} is'
        f' {"absent" if stored is None else "not the token table"}; only a'
        ' head tied to the token table is representable.'
    )


def read_checkpoint(hf_dir: str) -> Checkpoint:
  """Reads a local GPT-2-family checkpoint.

  Args:
    hf_dir: the checkpoint directory (config.json and weights).

  Returns:
    The `Checkpoint`: its config, ModelConfig fields, linen params, layout
    and files.

  Raises:
    HFCheckpointError: it cannot be represented by this model.
  """
  hf_config = read_hf_config(hf_dir)
  layout, files = weight_files(hf_dir)
  where = files[0] if len(files) == 1 else os.path.join(hf_dir, SAFETENSORS)
  params = to_linen(read_tensors(layout, files), layout, hf_config, where)
  return Checkpoint(
      model=model_fields(hf_config),
      params=params,
      layout=layout,
      files=files,
      hf_config=hf_config,
  )


def read_tokenizer(hf_dir: str) -> tokenizers_lib.HFTokenizer:
  """Loads the checkpoint's own tokenizer.

  Args:
    hf_dir: the checkpoint directory (tokenizer.json, or vocab.json and
      merges.txt).

  Returns:
    The `tokenizers_lib.HFTokenizer`.

  Raises:
    HFCheckpointError: no tokenizer there, or one that does not load.
  """
  if tokenizers_lib.hf_tokenizer_files(hf_dir) is None:
    raise HFCheckpointError(
        f'{hf_dir} holds no tokenizer ({tokenizers_lib.HF_TOKENIZER_FILE}, or'
        f' {" + ".join(tokenizers_lib.HF_VOCAB_FILES)}): copy the model\'s'
        ' tokenizer files there; its windows are scored in its own tokens.'
    )
  try:
    return tokenizers_lib.HFTokenizer(hf_dir)
  except ValueError as e:
    raise HFCheckpointError(str(e)) from None
