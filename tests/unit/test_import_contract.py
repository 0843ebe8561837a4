"""The package's import contract, over every import statement (function-local ones included),
read from the source with ``ast`` (nothing is imported):

- layers, each importing only from its own layer or those below it:
  base (``errors``, ``quiet``, ``progress``) < ``superposition`` < ``runtime`` < ``data`` <
  ``models`` and ``loop`` (the loop plug-in; with ``upstream``, the workarounds they enter) <
  ``training`` (the launch layer) < ``conversion`` (with ``plots``, a tool);
- no import cycle between modules (an import of ``a.b.c`` also runs ``a.b``'s ``__init__``);
- a function-local import only of a module on the allow-list (:data:`LOCAL_IMPORTS`, each
  entry with its reason; megatron-core's modules by importer, :data:`LOCAL_MEGATRON_CORE`,
  where the module must import without them), saying why in a ``#`` comment on its line or
  just above its block; every other import at the module's top.

The checker itself is tested on planted violations in a copy of the package.
"""

from __future__ import annotations

import ast
import os
import shutil
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "tst_megatron"

#: The modules a function may import (prefix of the imported module's name) and why; every
#: other function-local import breaks the contract.
LOCAL_IMPORTS = {
    "megatron.training": "Megatron-LM's training package: the method, the models, the data "
    "and the converter import without it (megatron-core users), and it is imported where "
    "the launch runs it, after the command line was checked",
    "transformers": "the [hf] extra (Hugging Face conversion, HF tokenizers)",
    "safetensors": "the [hf] extra",
    "huggingface_hub": "the [hf] extra",
    "torch.distributed.checkpoint": "torch's DCP reader, for a checkpoint folder being read",
    "matplotlib": "plots.py is imported by every benchmark report, most of which draw nothing",
    "tensorboard.backend": "TensorBoard's event reader, for plots from a run's events only",
    "pydoc_data": "the stdlib's documentation text, for that one corpus source only",
}

#: megatron-core modules a function may import, by (importer, module), and why: the module
#: must import without them.
LOCAL_MEGATRON_CORE = {
    ("tst_megatron.runtime.cpu", "megatron.core"): "check_version reads megatron-core's "
    "version before any of its modules is imported, so a release outside the range is one line",
    (
        "tst_megatron.runtime.cpu",
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
    ): "imported by megatron-core's torch_dist strategy only when it saves; "
    "fork_checkpoint_results_queue runs once the CPU runtime redirected it (enable)",
    ("tst_megatron.data.files", "megatron.core.datasets.indexed_dataset"): "the data tools "
    "(corpus, tokenizer, preprocessing) import data.files without megatron-core's model code",
    ("tst_megatron.data.pickle_scan", "megatron.core.safe_globals"): "its import registers "
    "megatron-core's globals with torch.serialization (process-wide): only once a checkpoint "
    "is read",
    (
        "tst_megatron.conversion.mlm",
        "megatron.core.tokenizers.utils.build_tokenizer",
    ): "its tokenizer backends load transformers/tiktoken; only for a checkpoint without "
    "--vocab-size",
    ("tst_megatron.data.gpt_datasets", "megatron.core.datasets"): "helpers_cpp, the compiled "
    "dataset helper, is absent in a source checkout",
}


def allowed_local(importer: str, imported: str) -> bool:
    """Whether ``importer`` may import ``imported`` inside a function."""
    if any(imported == p or imported.startswith(p + ".") for p in LOCAL_IMPORTS):
        return True
    return (importer, imported) in LOCAL_MEGATRON_CORE


#: Layer of each top-level part of the package, lowest first.
LAYERS = {
    "errors": 0,
    "quiet": 0,
    "progress": 0,
    "superposition": 1,
    "runtime": 2,
    "data": 3,
    "models": 4,
    "loop": 4,
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
        if local and not allowed_local(importer, imported):
            found.append(
                f"{where}: a function-local import of {imported}, which is not on the "
                "allow-list (import it at the module's top)"
            )
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
    # loop.plan imports loop.switch, which imports loop.plan back
    root = _plant(
        tmp_path,
        "tst_megatron.loop.plan",
        """
        def planted():
            from tst_megatron.loop import switch

            return switch
        """,
    )
    with open(os.path.join(root, PACKAGE, "loop", "switch.py"), "a") as f:
        f.write("\nfrom tst_megatron.loop import plan as _plan  # noqa\n")
    found = problems(root)
    assert any(p.startswith("import cycle:") and "tst_megatron.loop.plan" in p for p in found)
    assert any("function-local import of tst_megatron.loop.switch without" in p for p in found)


def test_a_planted_commented_local_import_off_the_allow_list_is_found(tmp_path):
    root = _plant(
        tmp_path,
        "tst_megatron.loop.plan",
        """
        def planted():
            # megatron-core: heavy, imported when used
            from megatron.core import parallel_state

            return parallel_state
        """,
    )
    assert problems(root) == [
        f"tst_megatron.loop.plan:{_last_line(root, 'loop/plan.py') - 2}: a "
        "function-local import of megatron.core, which is not on the allow-list (import it "
        "at the module's top)"
    ]


def test_every_allow_list_entry_is_used():
    """An entry no import needs any more is taken off (the list stays the reasons that hold)."""
    rows = [(i, m) for i, m, _, local, _ in imports(ROOT) if local]
    for prefix in LOCAL_IMPORTS:
        assert any(m == prefix or m.startswith(prefix + ".") for _, m in rows), prefix
    for pair in LOCAL_MEGATRON_CORE:
        assert pair in rows, pair


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
    where = f"tst_megatron.runtime.slurm:{_last_line(root, 'runtime/slurm.py') - 2}"
    assert problems(root) == [
        f"{where}: a function-local import of json without a comment",
        f"{where}: a function-local import of json, which is not on the allow-list (import it "
        "at the module's top)",
    ]


def _last_line(root: str, path: str) -> int:
    with open(os.path.join(root, PACKAGE, path)) as f:
        return len(f.read().splitlines())
