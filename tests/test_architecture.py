"""The package's shape, read from its source: imports point one way (no cycle, function-level
imports included), no module reaches into another's private names, functions and files stay
short enough to read, every kernel backend is one subfolder behind the registry, and the
module paths that moved still import (with a warning) as the module that holds their code."""

import ast
import importlib
import pathlib
import sys
import warnings

import pytest

import elastic_jax
from elastic_jax import deprecated
from elastic_jax.attention import registry

PACKAGE = pathlib.Path(elastic_jax.__file__).parent
MAX_FUNCTION_LINES = 200
MAX_FILE_LINES = 1200


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text("utf-8")) for name, path in MODULES.items()}


def _imported(name: str, tree: ast.Module):
  """(module imported, names taken from it) for every import of the package in the module,
  wherever it stands (function bodies included)."""
  package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("elastic_jax"):
          yield alias.name, ()
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([node.module] if node.module else []))
      if not base.startswith("elastic_jax"):
        continue
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield (sub, ()) if sub in MODULES else (base, (alias.name,))


def _graph() -> dict[str, set[str]]:
  graph = {name: set() for name in MODULES}
  for name, tree in TREES.items():
    for target, _ in _imported(name, tree):
      if target in MODULES and target != name:
        graph[name].add(target)
  return graph


def _cycles(graph) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def test_the_import_graph_has_no_cycle():
  graph = _graph()
  assert sum(map(len, graph.values())) > 100          # the walk sees the package's imports
  assert "elastic_jax.attention.registry" in graph["elastic_jax.attention"]
  assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [["a", "b", "c"]]


def test_no_module_takes_another_modules_private_names():
  offences = []
  for name, tree in TREES.items():
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("elastic_jax"):
        for alias in node.names:
          if alias.name.startswith("_"):
            offences.append(f"{name} imports {node.module}.{alias.name}")
          if f"{node.module}.{alias.name}" in MODULES:
            aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if alias.name.startswith("elastic_jax") and alias.asname:
            aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        offences.append(f"{name} reads {aliases[node.value.id]}.{node.attr}")
  assert offences == []


def test_functions_and_files_stay_short():
  long_files = {name: n for name, path in MODULES.items()
                if (n := len(path.read_text("utf-8").splitlines())) > MAX_FILE_LINES}
  long_functions = {
      f"{name}.{node.name}": node.end_lineno - node.lineno + 1
      for name, tree in TREES.items() for node in ast.walk(tree)
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
      and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
  assert long_files == {} and long_functions == {}


def test_every_backend_is_one_subfolder_behind_the_registry():
  for name, backend in registry.BACKENDS.items():
    folder = PACKAGE / "attention" / name
    assert (folder / "__init__.py").is_file(), name
    package = importlib.import_module(f"elastic_jax.attention.{name}")
    assert package.BACKEND is backend and backend.name == name
    for fn in (backend.hybrid, backend.decode):   # its kernels live in a backend's folder
      homes = [m for m in MODULES if m.split(".")[2:3] and m.split(".")[2] in registry.BACKENDS
               and any(v is fn for v in vars(importlib.import_module(m)).values())]
      assert homes, (name, fn)
  # Nothing outside the registry (and the backends themselves) picks a backend by name.
  for module, tree in TREES.items():
    if module.startswith(("elastic_jax.attention.registry",
                          *(f"elastic_jax.attention.{b}" for b in registry.BACKENDS))):
      continue
    for target, _ in _imported(module, tree):
      assert not any(target.startswith(f"elastic_jax.attention.{b}")
                     for b in registry.BACKENDS), f"{module} imports {target}"


@pytest.mark.parametrize("old", sorted(deprecated.MOVED))
def test_moved_modules_import_with_a_warning_as_their_new_module(old):
  new = importlib.import_module(deprecated.MOVED[old])
  sys.modules.pop(old, None)
  with pytest.warns(DeprecationWarning, match=f"module {old} is now {deprecated.MOVED[old]}"):
    moved = importlib.import_module(old)
  assert moved is new
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert importlib.import_module(old) is new       # once imported, no second warning


def test_the_wheel_lists_every_package():
  """pyproject.toml lists its packages (configs/ ships as elastic_jax.configs): every folder of
  the package must be among them, or an installed wheel misses its modules."""
  import tomllib
  listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text("utf-8"))
               ["tool"]["setuptools"]["packages"])
  folders = {".".join(p.parent.relative_to(PACKAGE.parent).parts)
             for p in PACKAGE.rglob("__init__.py")}
  assert folders and folders <= listed, sorted(folders - listed)
