"""The package's import contract, over every import statement (function-local ones included),
read from the source with ``ast`` (nothing is imported):

- layers, each importing only from its own layer or those below it:
  base (``errors``, ``quiet``, ``progress``) < ``superposition`` < ``runtime`` < ``data`` <
  ``models`` (with ``upstream``, the workarounds they enter) < ``training`` (the launch layer
  and the loop plug-in) < ``conversion`` (with ``plots``, a tool);
- no import cycle between modules (an import of ``a.b.c`` also runs ``a.b``'s ``__init__``);
- a function-local import only for a heavy or optional module, saying so in a ``#`` comment on
  its line or just above its block.

The checker itself is tested on planted violations in a copy of the package.
"""

from __future__ import annotations

import ast
import os
import shutil
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "tst_megatron"

#: Layer of each top-level part of the package, lowest first.
LAYERS = {
    "errors": 0,
    "quiet": 0,
    "progress": 0,
    "superposition": 1,
    "runtime": 2,
    "data": 3,
    "models": 4,
    "upstream": 4,
    "training": 5,
    "conversion": 6,
    "plots": 6,
}


def modules(root: str) -> dict[str, str]:
    """``{dotted module name: file}`` of the package under ``root``."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _nearest(name: str, known) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(root: str) -> list[tuple[str, str, int, bool, bool]]:
    """``(importer, imported module, line, function-local, commented)`` for every import in the
    package: the package module it imports, or the outside module's name as written;
    ``commented``: a ``#`` comment on the import's line or on the line just above its block
    of imports."""
    known = modules(root)
    found = []
    for module, path in known.items():
        source = open(path).read()
        lines = source.splitlines()
        tree = ast.parse(source)
        top = {id(node) for node in tree.body}
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for parent in ast.walk(tree):
            body = getattr(parent, "body", None)
            if not isinstance(body, list):
                continue
            blocks, block = [], []  # runs of consecutive import statements
            for node in body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    block.append(node)
                elif block:
                    blocks, block = blocks + [block], []
            for run in blocks + ([block] if block else []):
                start, end = run[0].lineno, run[-1].end_lineno
                above = lines[start - 2].strip() if start >= 2 else ""
                commented = above.startswith("#") or any("#" in x for x in lines[start - 1 : end])
                for node in run:
                    found += _targets(module, package, node, known, id(node) not in top, commented)
    return found


def _targets(module, package, node, known, local, commented) -> list:
    """The rows of :func:`imports` for one import statement ``node`` of ``module``."""
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" for a in node.names] or [base]
        targets = {_nearest(n, known) or _nearest(base, known) or base for n in names}
    else:
        targets = {_nearest(a.name, known) or a.name for a in node.names}
    return [(module, t, node.lineno, local, commented) for t in targets]


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else 0


def problems(root: str) -> list[str]:
    """Every breach of the contract in the package under ``root``, one line each."""
    found, edges = [], {}
    for importer, imported, line, local, commented in imports(root):
        where = f"{importer}:{line}"
        if local and not commented:
            found.append(f"{where}: a function-local import of {imported} without a comment")
        if not imported.startswith(PACKAGE + ".") and imported != PACKAGE:
            continue  # an outside module: only the comment rule
        if importer != imported and _layer(imported) > _layer(importer):
            found.append(f"{where} imports {imported}, a higher layer")
        targets = [imported] + [  # the packages whose __init__ the import runs
            imported.rsplit(".", k)[0]
            for k in range(1, imported.count("."))
            if not (importer + ".").startswith(imported.rsplit(".", k)[0] + ".")
        ]
        for target in targets:
            if target != importer:
                edges.setdefault(importer, set()).add(target)
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(edges)]
    return found


def cycles(edges: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_keeps_its_import_contract():
    assert problems(ROOT) == []


def test_every_top_level_part_has_a_layer():
    parts = {m.split(".")[1] for m in modules(ROOT) if m.count(".")}
    assert parts == set(LAYERS)


def _plant(tmp_path, module: str, code: str) -> str:
    root = str(tmp_path)
    shutil.copytree(os.path.join(ROOT, PACKAGE), os.path.join(root, PACKAGE))
    path = os.path.join(root, *module.split(".")) + ".py"
    with open(path, "a") as f:
        f.write("\n\n" + textwrap.dedent(code))
    return root


def test_a_planted_upward_import_is_found(tmp_path):
    # function-local, and commented: still an upward import
    root = _plant(
        tmp_path,
        "tst_megatron.data.files",
        """
        def planted():
            # heavy
            from tst_megatron.conversion import mlm

            return mlm
        """,
    )
    found = problems(root)
    assert any("tst_megatron.data.files:" in p and "tst_megatron.conversion" in p for p in found)
    assert any("higher layer" in p for p in found)


def test_a_planted_import_of_the_launch_layer_from_the_models_is_found(tmp_path):
    """The models sit below the launch layer: ``models.family`` importing ``training.checks``
    (as it did before the models had a package of their own) is an upward import."""
    root = _plant(
        tmp_path,
        "tst_megatron.models.family",
        """
        from tst_megatron.training.checks import model as _rules  # noqa
        """,
    )
    found = problems(root)
    assert any(
        p.startswith("tst_megatron.models.family:")
        and "imports tst_megatron.training.checks.model, a higher layer" in p
        for p in found
    ), found


def test_a_planted_cycle_and_an_uncommented_local_import_are_found(tmp_path):
    # training.plan imports training.switch, which imports training.plan back
    root = _plant(
        tmp_path,
        "tst_megatron.training.plan",
        """
        def planted():
            from tst_megatron.training import switch

            return switch
        """,
    )
    with open(os.path.join(root, PACKAGE, "training", "switch.py"), "a") as f:
        f.write("\nfrom tst_megatron.training import plan as _plan  # noqa\n")
    found = problems(root)
    assert any(p.startswith("import cycle:") and "tst_megatron.training.plan" in p for p in found)
    assert any("function-local import of tst_megatron.training.switch without" in p for p in found)


def test_an_uncommented_local_import_of_an_outside_module_is_found(tmp_path):
    root = _plant(
        tmp_path,
        "tst_megatron.runtime.slurm",
        """
        def planted():
            import json

            return json
        """,
    )
    assert problems(root) == [
        f"tst_megatron.runtime.slurm:{_last_line(root, 'runtime/slurm.py') - 2}: a "
        "function-local import of json without a comment"
    ]


def _last_line(root: str, path: str) -> int:
    with open(os.path.join(root, PACKAGE, path)) as f:
        return len(f.read().splitlines())
