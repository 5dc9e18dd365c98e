"""The tokenizer a workdir holds: a copy of the one its run reads, recorded
relative to the workdir and resolved through it (Paths in docs/DESIGN.md §
Training outputs).

A run reads one tokenizer from outside its workdir: a Hugging Face tokenizer
directory (``data.tokenizer='hf'``, ``data.hf_tokenizer``) or a SentencePiece
model file (``data.tokenizer='sentencepiece'``, ``data.spm_model``). Both are
copied into the workdir (``tokenizer/``, ``tokenizer.model``) when config.json
is written, so that a moved workdir, its original tokenizer deleted, trains and
evaluates as before. A SentencePiece model the run trained on the corpus
(``data.spm_model=''``) is derived from the data, and stays in the data's cache.
"""

import dataclasses
import hashlib
import os
from typing import Any

from flax_posemb import config as config_lib
from flax_posemb import outputs
from flax_posemb.data import tokenizers as tokenizers_lib

# data field naming the tokenizer -> the name of the workdir's copy.
OWN_NAMES = {
    'hf_tokenizer': outputs.TOKENIZER_DIR,
    'spm_model': outputs.SPM_MODEL_FILE,
}


def named_field(data: dict[str, Any]) -> str | None:
  """The field of a config's data section (a dict) that names a tokenizer
  outside the data ('hf_tokenizer', 'spm_model'), or None when it names none
  (byte tokens, a SentencePiece model trained on the corpus)."""
  if data.get('tokenizer') == 'hf' and data.get('hf_tokenizer'):
    return 'hf_tokenizer'
  if data.get('tokenizer') == 'sentencepiece' and data.get('spm_model'):
    return 'spm_model'
  return None


def tokenizer_files(directory: str) -> tuple[str, ...]:
  """A Hugging Face tokenizer's files in `directory` and those naming its
  special tokens (config.json included: its bos/eos ids)."""
  files = tokenizers_lib.hf_tokenizer_files(directory) or ()
  extra = tokenizers_lib.HF_SPECIAL_FILES + (tokenizers_lib.HF_MODEL_CONFIG,)
  present = tuple(
      n for n in extra if os.path.isfile(os.path.join(directory, n))
  )
  return files + present


def copy_tokenizer(source: str, target: str) -> None:
  """Copies a tokenizer to `target`, each file whole: the Hugging Face
  tokenizer in directory `source` (`tokenizer_files`) into directory
  `target`, or the model file `source` to the file `target`."""
  if not os.path.isdir(source):
    with open(source, 'rb') as f:
      content = f.read()
    with outputs.atomic_write(target) as f:
      f.write(content)
    return
  os.makedirs(target, exist_ok=True)
  for name in tokenizer_files(source):
    copy_tokenizer(os.path.join(source, name), os.path.join(target, name))


def tokenizer_digest(path: str) -> str:
  """SHA-256 of a tokenizer: a Hugging Face tokenizer directory's files
  (names and bytes) or a model file's bytes; two byte-identical copies have one
  digest, wherever they are."""
  digest = hashlib.sha256()
  if not os.path.isdir(path):
    with open(path, 'rb') as f:
      digest.update(f.read())
    return digest.hexdigest()
  for name in sorted(tokenizer_files(path)):
    digest.update(name.encode() + b'\0')
    with open(os.path.join(path, name), 'rb') as f:
      digest.update(f.read())
  return digest.hexdigest()


def _same_tokenizer(a: str, b: str) -> bool:
  """Whether `a` and `b` both exist and hold the same tokenizer."""
  if not (os.path.exists(a) and os.path.exists(b)):
    return False
  return tokenizer_digest(a) == tokenizer_digest(b)


def _own_tokenizer(named: str, workdir: str, field: str) -> str:
  """The tokenizer a workdir's config means by `named` (its `field`): a
  relative path is the workdir's own; an absolute one that is gone (the
  workdir was moved, the run's source deleted) or holds the same files is the
  workdir's copy, if it has one; otherwise `named` itself."""
  own = os.path.abspath(os.path.join(workdir, OWN_NAMES[field]))
  if not os.path.isabs(named):
    return os.path.abspath(os.path.join(workdir, named))
  if not os.path.exists(own):
    return named
  if not os.path.exists(named) or _same_tokenizer(named, own):
    return own
  return named


def record(data: dict[str, Any], workdir: str) -> dict[str, Any]:
  """The data section (a dict) config.json records: a tokenizer outside the
  workdir copied in first (`copy_tokenizer`, unless the workdir has its copy)
  and named by its relative name (`OWN_NAMES`)."""
  field = named_field(data)
  if field is None:
    return data
  named = data[field]
  own = os.path.join(workdir, OWN_NAMES[field])
  if not os.path.exists(own):
    copy_tokenizer(named, own)
  if not _same_tokenizer(named, own):
    return data
  return dict(data, **{field: OWN_NAMES[field]})


def resolve_paths(saved: dict[str, Any], workdir: str) -> dict[str, Any]:
  """A config the workdir recorded (config.json, a checkpoint's) with its
  tokenizer resolved through the workdir (`_own_tokenizer`)."""
  data = saved.get('data')
  if not isinstance(data, dict):
    return saved
  field = named_field(data)
  if field is None:
    return saved
  resolved = _own_tokenizer(data[field], workdir, field)
  return dict(saved, data=dict(data, **{field: resolved}))


def use_own_tokenizer(
    config: config_lib.RunConfig, workdir: str
) -> config_lib.RunConfig:
  """`config` with its tokenizer (a command line's, relative to the current
  directory) replaced by the workdir's copy when it holds one and the one named
  is gone or the same (`_own_tokenizer`); an unset ``data.hf_tokenizer`` is
  the copy too (an unset ``data.spm_model`` means a model trained on the
  corpus, and stays)."""
  data = config.data
  field = named_field(dataclasses.asdict(data))
  own = os.path.join(workdir, outputs.TOKENIZER_DIR)
  if field is not None:
    named = _own_tokenizer(
        os.path.abspath(getattr(data, field)), workdir, field
    )
    data = _with_tokenizer(data, field, named)
  elif data.tokenizer == 'hf' and os.path.isdir(own):
    data = dataclasses.replace(data, hf_tokenizer=os.path.abspath(own))
  return dataclasses.replace(config, data=data)


def comparable(config: config_lib.RunConfig) -> config_lib.RunConfig:
  """`config` with its tokenizer named by its digest (`tokenizer_digest`), for
  comparing runs: copies of one tokenizer in two workdirs are the same
  tokenizer."""
  field = named_field(dataclasses.asdict(config.data))
  if field is None:
    return config
  named = getattr(config.data, field)
  if not os.path.exists(named):
    return config
  digest = f'sha256:{tokenizer_digest(named)}'
  data = _with_tokenizer(config.data, field, digest)
  return dataclasses.replace(config, data=data)


def _with_tokenizer(
    data: config_lib.DataConfig, field: str, named: str
) -> config_lib.DataConfig:
  """`data` with its tokenizer `field` naming `named`."""
  changes: dict[str, Any] = {field: named}
  return dataclasses.replace(data, **changes)
