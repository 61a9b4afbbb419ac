"""Layers import one way: ``pretrain_grpo.py`` -> ``megatron.trainer`` -> ``megatron.rl`` ->
``megatron.core``; ``examples/`` builds on ``megatron.rl`` only.

Every import statement of every module is read (``ast``), including imports inside functions and
``TYPE_CHECKING`` blocks: a module of ``megatron/rl`` that imports the trainer, an example or the
entry script fails here, and so does an example that imports the trainer. The trainer's modules
also import no Hugging Face package until a checkpoint or tokenizer of theirs is used.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``; relative imports resolved to absolute names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
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
