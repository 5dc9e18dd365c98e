"""The package's layering, read from the import statements of flax_posemb/.

Two parts (docs/DESIGN.md § Layout): the core library, importable into any
training loop, and the runner, which trains and evaluates workdirs. The core
imports no runner module; no two modules import each other, directly or
through others; no import of the package sits inside a function (where it
would hide a circle); Orbax and matplotlib each have one module that talks to
them.

The graph is built with `ast`, without importing anything: an edge A -> B for
every ``import B``, ``from B import name`` and ``from P import B`` (a
submodule) in A, wherever it stands in A. The parent packages Python runs
before a submodule (``flax_posemb/__init__.py`` before ``flax_posemb.model``)
are not edges: every package would otherwise be in a circle with its own
submodules.
"""

import ast
import pathlib

import pytest

from conftest import ROOT

PACKAGE = 'flax_posemb'
# The runner (docs/DESIGN.md § Layout); every other module is the core.
# `outputs` (the workdir's file names, whole-file writes, npz reading; numpy
# and the standard library only) is core: the statistics object writes window
# files and the tokenizers their files with it.
RUNNER = (
    'training',
    'resume',
    'checkpointing',
    'workdir',
    'own_tokenizer',
    'eval_workdir',
    'eval_report',
    'analysis_report',
    'plots',
    'tensorboard',
    'cli',
    'gallery',
    'preemption',
    'pretrained',
    'hf_import',
    'init_from',
)
RUNNER_PACKAGES = ('commands', 'experiments')
# Third-party packages that only one module may import.
OWNERS = {'orbax': 'checkpointing', 'matplotlib': 'plots'}


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  """``flax_posemb/data/pipeline.py`` -> ``flax_posemb.data.pipeline``."""
  parts = list(path.relative_to(root).with_suffix('').parts)
  if parts[-1] == '__init__':
    parts.pop()
  return '.'.join(parts)


def package_modules(root: pathlib.Path) -> dict[str, ast.Module]:
  """Every module of the package under ``root``, parsed."""
  return {
      module_name(path, root): ast.parse(path.read_text(), str(path))
      for path in sorted((root / PACKAGE).rglob('*.py'))
  }


def imported_names(
    node: ast.Import | ast.ImportFrom, importer: str, is_package: bool
) -> list[str]:
  """The dotted names one import statement of ``importer`` brings in:
  ``import a.b`` -> ``a.b``; ``from P import x`` -> ``P.x`` (a submodule, or a
  name defined in P)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  base = node.module or ''
  if node.level:
    # A relative import: the importer's package, `level - 1` levels up.
    package = importer.split('.')
    if not is_package:
      package.pop()
    package = package[: len(package) - (node.level - 1)]
    base = '.'.join(package + ([base] if base else []))
  return [f'{base}.{alias.name}' for alias in node.names]


def import_statements(
    modules: dict[str, ast.Module],
) -> list[tuple[str, ast.Import | ast.ImportFrom, list[str]]]:
  """(importer, statement, the names it brings in) of every import."""
  out = []
  for name, tree in modules.items():
    is_package = name == PACKAGE or any(
        other.startswith(name + '.') for other in modules
    )
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        out.append((name, node, imported_names(node, name, is_package)))
  return out


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
  """module -> the package's modules it imports."""
  graph: dict[str, set[str]] = {name: set() for name in modules}
  for importer, node, names in import_statements(modules):
    for name in names:
      parent = name.rpartition('.')[0]
      if name in modules:
        graph[importer].add(name)
      elif isinstance(node, ast.ImportFrom) and parent in modules:
        # `from P import x` of a name x defined in P.
        graph[importer].add(parent)
    graph[importer].discard(importer)
  return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  lowlink: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  circles = []

  def visit(node: str) -> None:
    index[node] = len(index)
    lowlink[node] = index[node]
    stack.append(node)
    on_stack.add(node)
    for target in sorted(graph[node]):
      if target not in index:
        visit(target)
        lowlink[node] = min(lowlink[node], lowlink[target])
      elif target in on_stack:
        lowlink[node] = min(lowlink[node], index[target])
    if lowlink[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return circles


def nested_imports(
    modules: dict[str, ast.Module],
) -> list[tuple[str, int, str]]:
  """(module, line, statement) of every import of the package inside a
  function or class body."""
  out = []
  for name, tree in modules.items():
    for scope in ast.walk(tree):
      if not isinstance(
          scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
      ):
        continue
      for node in ast.walk(scope):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
          continue
        names = imported_names(node, name, is_package=False)
        if any(n == PACKAGE or n.startswith(PACKAGE + '.') for n in names):
          out.append((name, node.lineno, ast.unparse(node)))
  return sorted(set(out))


def is_runner(module: str) -> bool:
  parts = module.split('.')
  if len(parts) < 2:
    return False
  return parts[1] in RUNNER or parts[1] in RUNNER_PACKAGES


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
  """(core module, runner module it imports)."""
  return sorted(
      (module, target)
      for module, targets in graph.items()
      if not is_runner(module)
      for target in targets
      if is_runner(target)
  )


def foreign_imports(
    modules: dict[str, ast.Module],
) -> list[tuple[str, str]]:
  """(module, package) of every import of an `OWNERS` package outside its
  owner module."""
  out = []
  for importer, _, names in import_statements(modules):
    for name in names:
      top = name.split('.')[0]
      owner = f'{PACKAGE}.{OWNERS[top]}' if top in OWNERS else ''
      # The owner may be a package: its modules share the package's right.
      if owner and importer != owner and not importer.startswith(owner + '.'):
        out.append((importer, top))
  return sorted(set(out))


@pytest.fixture(scope='module')
def modules():
  return package_modules(ROOT)


def test_no_import_circle(modules):
  assert find_circles(import_graph(modules)) == []


def test_no_package_import_inside_a_function(modules):
  assert nested_imports(modules) == []


def test_the_core_imports_no_runner_module(modules):
  assert upward_imports(import_graph(modules)) == []


def test_only_checkpointing_imports_orbax_and_only_plots_matplotlib(modules):
  assert foreign_imports(modules) == []


def test_every_runner_module_named_exists(modules):
  # A renamed runner module would silently count as core.
  for name in RUNNER + RUNNER_PACKAGES:
    assert f'{PACKAGE}.{name}' in modules


def _write_package(tmp_path: pathlib.Path, files: dict[str, str]) -> None:
  for relative, text in files.items():
    path = tmp_path / PACKAGE / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checks_see_each_kind_of_violation(tmp_path):
  _write_package(
      tmp_path,
      {
          '__init__.py': '',
          'model.py': 'from flax_posemb import layers\n',
          # Reaches model through the package and a submodule import.
          'layers.py': 'from flax_posemb.data import pipeline\n',
          'data/__init__.py': '',
          'data/pipeline.py': 'import flax_posemb.model\n',
          'stats.py': 'def f():\n  from flax_posemb import model\n',
          'buckets.py': 'from flax_posemb import training\nimport orbax\n',
          'training.py': 'import matplotlib.pyplot as plt\n',
          # The owner is a package: its modules may import matplotlib, a
          # module whose name only starts like it may not.
          'plots/__init__.py': 'import matplotlib\n',
          'plots/tables.py': 'import matplotlib.pyplot as plt\n',
          'plots_extra.py': 'import matplotlib\n',
      },
  )
  fake = package_modules(tmp_path)
  graph = import_graph(fake)
  assert find_circles(graph) == [
      ['flax_posemb.data.pipeline', 'flax_posemb.layers', 'flax_posemb.model']
  ]
  assert nested_imports(fake) == [
      ('flax_posemb.stats', 2, 'from flax_posemb import model')
  ]
  assert upward_imports(graph) == [
      ('flax_posemb.buckets', 'flax_posemb.training')
  ]
  assert foreign_imports(fake) == [
      ('flax_posemb.buckets', 'orbax'),
      ('flax_posemb.plots_extra', 'matplotlib'),
      ('flax_posemb.training', 'matplotlib'),
  ]
