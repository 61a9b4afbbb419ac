"""Layers import one way: ``pretrain_grpo.py`` -> ``megatron.trainer`` -> ``megatron.rl`` ->
``megatron.core``; ``examples/`` builds on ``megatron.rl`` only.

Every import statement of every module is read (``ast``), including imports inside functions and
``TYPE_CHECKING`` blocks: a module of ``megatron/rl`` that imports the trainer, an example or the
entry script fails here, and so does an example that imports the trainer. The modules named
below import themselves through no other module of ``megatron/``, reading imports the same way.
The trainer's modules also import no Hugging Face package until a checkpoint or tokenizer of
theirs is used.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def import_statements(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names imported from it) of every import statement in ``path`` (no names
    for ``import module``); relative imports resolved to absolute names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base, [a.name for a in node.names]))
    return found


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``; relative imports resolved to absolute names."""
    found = []
    for line, base, names in import_statements(path):
        found += [(line, base)] + [(line, f"{base}.{name}") for name in names]
    return found


def violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    """``file:line imports module`` for each import of a ``forbidden`` module or its children."""
    bad = []
    for path in files:
        for line, module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return sorted(set(bad))


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


ENTRY_AND_UPPER = ("megatron.trainer", "pretrain_grpo", "examples", "tools", "tests")


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        pytest.param("megatron/rl", ENTRY_AND_UPPER, id="rl-imports-only-rl-and-core"),
        pytest.param("examples", ("megatron.trainer", "pretrain_grpo", "tools"), id="examples"),
        pytest.param("megatron/trainer", ("pretrain_grpo", "examples", "tools"), id="trainer"),
    ],
)
def test_layers_import_one_way(folder, forbidden):
    files = python_files(folder)
    assert files, folder
    assert violations(files, forbidden) == []


def test_the_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    module = ROOT / "megatron" / "rl" / "_layering_probe.py"
    source = (
        "def f():\n    from megatron.trainer.config import loss_config\n    return loss_config\n"
    )
    monkeypatch.setattr(Path, "read_text", lambda self: source)
    assert violations([module], ENTRY_AND_UPPER) == [
        "megatron/rl/_layering_probe.py:2 imports megatron.trainer.config",
        "megatron/rl/_layering_probe.py:2 imports megatron.trainer.config.loss_config",
    ]


def test_the_default_run_imports_no_hugging_face_package():
    """``pip install -e .`` (no ``hf`` extra) runs the default job: the trainer's modules import
    safetensors, transformers and tokenizers only when a Hugging Face checkpoint or tokenizer is
    used."""
    code = (
        "import sys\n"
        "import megatron.trainer.flags.parse, megatron.trainer.grpo\n"
        "print(sorted({'safetensors', 'transformers', 'tokenizers'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[-2] == "[]", out.stdout


def module_name(path: Path) -> str:
    """The dotted name of the module (the package, for ``__init__.py``) at ``path``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` it imports; ``from pkg import name`` imports the module
    ``pkg.name`` when that is one of them, else ``pkg``."""
    modules = {module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for _, base, names in import_statements(path):
            subs = [f"{base}.{n}" for n in names]
            imported |= {sub if sub in modules else base for sub in subs} or {base}
        graph[name] = (imported & set(modules)) - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another, directly or through others (a strongly
    connected component of more than one module), as a sorted list; sorted."""
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo += graph[module]
        reach[start] = seen
    cycles = {tuple(sorted(m for m in reach[a] if a in reach[m])) for a in graph if a in reach[a]}
    return sorted(list(cycle) for cycle in cycles)


def test_no_module_of_megatron_is_in_an_import_cycle():
    """Counting every import statement (in functions and ``TYPE_CHECKING`` blocks too), no module
    of ``megatron/`` imports itself through others: a type two modules share lives in the lower
    one or in a module of its own (``rl/grpo/loss_inputs.py``, ``rl/inference/keys.py``), and the
    config tree imports nothing of the trainer it configures."""
    assert import_cycles(import_graph(python_files("megatron"))) == []


COMMANDS_WITH_OWN_FLAGS = ("serve.py", "evaluate.py", "checkpoint_model.py")


def test_no_flags_namespace_below_the_entry():
    """Only the config tree (``megatron/trainer/flags``) and the commands that add flags of their
    own parse a command line; every other module of the trainer gets the frozen ``RunConfig`` or
    its sections, never an argparse namespace, and ``megatron/rl`` only its own typed configs."""
    trainer = [
        p
        for p in python_files("megatron/trainer")
        if "flags" not in p.relative_to(ROOT / "megatron/trainer").parts[:-1]
        and p.name not in COMMANDS_WITH_OWN_FLAGS
    ]
    assert violations(trainer, ("argparse",)) == []
    assert violations(python_files("megatron/rl"), ("megatron.trainer.flags",)) == []


def test_the_cycle_check_sees_type_checking_imports(monkeypatch):
    rl = ROOT / "megatron" / "rl"
    sources = {
        rl / "_a.py": "from megatron.rl._b import B\n",
        rl / "_b.py": "if TYPE_CHECKING:\n    from megatron.rl import _a\n",
        rl / "_c.py": "import megatron.rl._a\n",
    }
    monkeypatch.setattr(Path, "read_text", lambda self: sources[self])
    graph = import_graph(list(sources))
    assert graph == {
        "megatron.rl._a": {"megatron.rl._b"},
        "megatron.rl._b": {"megatron.rl._a"},
        "megatron.rl._c": {"megatron.rl._a"},
    }
    assert import_cycles(graph) == [["megatron.rl._a", "megatron.rl._b"]]


def room(module: str, package: str) -> str:
    """The room of ``module`` in ``package``: its subpackage, or the module itself when it sits
    at the package's top (``megatron.trainer.train.step`` -> ``megatron.trainer.train``)."""
    return ".".join(module.split(".")[: len(package.split(".")) + 1])


def room_graph(package: str) -> dict[str, set[str]]:
    """Room -> the rooms of ``package`` its modules import (a room's own imports left out)."""
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph(python_files(package.replace(".", "/"))).items():
        if module == package:
            continue
        here = room(module, package)
        graph.setdefault(here, set())
        graph[here] |= {room(m, package) for m in imported if m != package} - {here}
    return graph


@pytest.mark.parametrize("package", ["megatron.trainer", "megatron.rl"])
def test_no_room_of_a_package_imports_itself_through_another(package):
    """The subpackages (and top-level modules) of the trainer and of the library import one
    another one way: ``trainer/runtime`` never reaches back into ``trainer/train`` through
    ``trainer/tiers``, and so on, so each room can be read knowing only the rooms below it.
    Shared low-level types live in modules of their own (``trainer/parallel.py``,
    ``trainer/errors.py``) for that reason."""
    assert import_cycles(room_graph(package)) == []


def test_the_room_check_sees_a_cycle_between_subpackages(monkeypatch):
    trainer = ROOT / "megatron" / "trainer"
    sources = {
        trainer / "_x" / "a.py": "from megatron.trainer._y.b import B\n",
        trainer / "_y" / "b.py": "def f():\n    from megatron.trainer._x import a\n",
    }
    monkeypatch.setattr(Path, "read_text", lambda self: sources[self])
    monkeypatch.setattr(sys.modules[__name__], "python_files", lambda *_: list(sources))
    assert import_cycles(room_graph("megatron.trainer")) == [
        ["megatron.trainer._x", "megatron.trainer._y"]
    ]
