"""Citations of docs/DESIGN.md name one of its sections, in one form.

The code (docstrings and comments of the package, configs, benchmarks and
tests) writes `docs/DESIGN.md § Training outputs`; the pages of docs/ link
`[DESIGN.md § Training outputs](DESIGN.md#training-outputs-workdir)`. A
section is a `##` heading less its parenthesis; docs/conf.py holds the map
from sections to anchors and links the citations of the docstrings.
"""

import ast
import importlib.util
import io
import pathlib
import re
import tokenize
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# All but this file, whose text shows the forms refused.
CODE = sorted(
    path
    for folder in ('flax_posemb', 'configs', 'benchmarks', 'tests')
    for path in (ROOT / folder).rglob('*.py')
    if path != pathlib.Path(__file__).resolve()
)
PAGES = sorted((ROOT / 'docs').glob('*.md')) + [ROOT / 'README.md']
# A page may link the whole document.
WHOLE_DOCUMENT = re.compile(r'\]\((?:docs/)?DESIGN\.md\)')


def load_conf() -> types.ModuleType:
  spec = importlib.util.spec_from_file_location('conf', ROOT / 'docs/conf.py')
  assert spec is not None and spec.loader is not None
  conf = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(conf)
  return conf


CONF = load_conf()


def docstrings_and_comments(source: str) -> str:
  """The docstrings and the comments (without `#`) of Python `source`."""
  texts = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(
        node,
        (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef),
    ):
      docstring = ast.get_docstring(node, clean=False)
      if docstring:
        texts.append(docstring)
  tokens = tokenize.generate_tokens(io.StringIO(source).readline)
  comments = [t.string[1:] for t in tokens if t.type == tokenize.COMMENT]
  return '\n'.join(texts + ['\n'.join(comments)])


def excerpt(text: str, start: int) -> str:
  return ' '.join(text[max(0, start - 20) : start + 40].split())


def bad_code_citations(text: str) -> list[str]:
  """The mentions of DESIGN in `text` that are not a citation of a section."""
  cited = [m.span() for m in CONF._DESIGN_CITATION.finditer(text)]
  bad = []
  for mention in re.finditer(r'DESIGN', text):
    start = mention.start()
    if not any(a <= start < b for a, b in cited):
      bad.append(excerpt(text, start))
  return bad


def bad_page_citations(text: str) -> list[str]:
  """The mentions of DESIGN.md in a page that are neither a link to the whole
  document nor `[DESIGN.md § Section](DESIGN.md#its-anchor)`."""
  allowed = [m.span() for m in WHOLE_DOCUMENT.finditer(text)]
  link = re.compile(r'\[DESIGN\.md\s+§\s+([^\]]+)\]\(DESIGN\.md#([^)]+)\)')
  bad = []
  for match in link.finditer(text):
    section = ' '.join(match.group(1).split())
    if CONF.DESIGN_SECTIONS.get(section) != match.group(2):
      bad.append(match.group(0))
    allowed.append(match.span())
  allowed += [m.span() for m in CONF._DESIGN_CITATION.finditer(text)]
  for mention in re.finditer(r'DESIGN\.md', text):
    start = mention.start()
    if not any(a <= start < b for a, b in allowed):
      bad.append(excerpt(text, start))
  return bad


def test_the_sections_are_the_headings_of_design():
  assert CONF.DESIGN_SECTIONS['Training outputs'] == 'training-outputs-workdir'
  assert CONF.DESIGN_SECTIONS['Config'] == 'config'
  assert len(CONF.DESIGN_SECTIONS) >= 10


@pytest.mark.parametrize('path', CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_cites_design_sections_in_one_form(path):
  text = docstrings_and_comments(path.read_text())
  assert not bad_code_citations(text)


@pytest.mark.parametrize('path', PAGES, ids=lambda p: p.name)
def test_pages_link_design_sections_by_their_anchors(path):
  assert not bad_page_citations(path.read_text())


def test_other_forms_and_missing_sections_are_refused():
  assert bad_code_citations('see docs/DESIGN.md § Training outputs.') == []
  assert bad_code_citations('see docs/DESIGN.md §\n  Training outputs.') == []
  for text in (
      'see docs/DESIGN.md, "Training outputs".',
      'see DESIGN §Config.',
      'see docs/DESIGN.md § Nowhere.',
      'see docs/DESIGN.md.',
  ):
    assert bad_code_citations(text), text
  good = '[DESIGN.md § Config](DESIGN.md#config) and [Design](DESIGN.md)'
  assert bad_page_citations(good) == []
  assert bad_page_citations('[DESIGN.md § Config](DESIGN.md#model)')
  assert bad_page_citations('[DESIGN.md, Config](DESIGN.md#config)')


def test_docstring_citations_become_links_to_the_section():
  app = types.SimpleNamespace(
      env=types.SimpleNamespace(docname='_autosummary/flax_posemb.model'),
      builder=types.SimpleNamespace(
          get_relative_uri=lambda source, target: f'../{target}.html'
      ),
  )
  lines = ['Paths: docs/DESIGN.md §', '  Training outputs.']
  CONF._link_design_citations(app, 'function', 'f', None, {}, lines)
  assert lines == [
      'Paths: `DESIGN.md § Training outputs'
      ' <../DESIGN.html#training-outputs-workdir>`__.'
  ]
