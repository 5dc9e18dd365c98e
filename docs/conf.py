"""Sphinx configuration of the flax_posemb documentation.

Sphinx with MyST and autodoc, the form jax, flax, optax and orbax publish their
documentation in: the pages are Markdown that reads the same on GitHub (MyST),
the API reference comes from the docstrings (autodoc and autosummary, Google
style through napoleon), and the theme is theirs (sphinx-book-theme). .ci/run
builds it with warnings as errors:

  python3 -m sphinx -W --keep-going -q -b html docs docs/_build/html
"""

import os
import pathlib
import re
import sys

from myst_parser import slugs

# The package from this checkout, installed or not.
sys.path.insert(0, os.path.abspath('..'))

project = 'flax_posemb'
copyright = '2025, the flax_posemb authors'  # noqa: A001 (Sphinx's name)
author = 'the flax_posemb authors'

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.autosummary',
    'sphinx.ext.napoleon',
]
source_suffix = {'.md': 'markdown', '.rst': 'restructuredtext'}
templates_path = ['_templates']
exclude_patterns = ['_build', 'Thumbs.db', '.DS_Store']

# MyST: heading anchors, so that pages link to sections of DESIGN.md as GitHub
# does (`DESIGN.md#statistics-flax_posembstats`).
myst_heading_anchors = 3

# The one form a section of DESIGN.md is cited in: `docs/DESIGN.md § Section`
# in the package's docstrings and comments, `[DESIGN.md § Section](anchor)` in
# these pages. Section is the `##` heading less its parenthesis, as GitHub's
# and MyST's anchors are the whole heading's.
_DESIGN_HEADINGS = re.findall(
    r'^## (.+)$',
    pathlib.Path(__file__).with_name('DESIGN.md').read_text(),
    re.M,
)
DESIGN_SECTIONS = {
    re.sub(r' \(.*\)$', '', heading): slugs.github_slugify(
        heading.replace('`', '')
    )
    for heading in _DESIGN_HEADINGS
}
# A citation may wrap at any space; the longest name first.
_DESIGN_CITATION = re.compile(
    r'docs/DESIGN\.md\s+§\s+('
    + '|'.join(
        r'\s+'.join(map(re.escape, name.split()))
        for name in sorted(DESIGN_SECTIONS, key=len, reverse=True)
    )
    + r')\b'
)

# The API reference: one page per module, generated at build time into
# docs/_autosummary (not committed) from docs/_templates/autosummary/.
autosummary_generate = True
autodoc_default_options = {
    'members': True,
    'show-inheritance': True,
    # A package's re-exports are documented once, in their own module.
    'ignore-module-all': True,
}
autodoc_member_order = 'bysource'
autodoc_typehints = 'signature'
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The docstrings write code in single backticks, as Markdown does.
default_role = 'code'

html_theme = 'sphinx_book_theme'
html_title = 'flax_posemb'
html_theme_options = {
    'show_toc_level': 2,
}
# Code blocks wrap their long lines (docs/_static/code.css): the theme's
# content column cuts them at a 1280-px window.
html_static_path = ['_static']
html_css_files = ['code.css']


def _link_design_citations(app, what, name, obj, options, lines):
  """Makes each DESIGN.md citation of a docstring a link to its section."""
  del what, name, obj, options  # Every docstring alike.
  uri = app.builder.get_relative_uri(app.env.docname, 'DESIGN')

  def link(match):
    section = ' '.join(match.group(1).split())
    anchor = DESIGN_SECTIONS[section]
    return f'`DESIGN.md § {section} <{uri}#{anchor}>`__'

  lines[:] = _DESIGN_CITATION.sub(link, '\n'.join(lines)).split('\n')


def setup(app):
  app.connect('autodoc-process-docstring', _link_design_citations)
