"""The registry of Hugging Face model families: one module per family, found by ``families()``;
each family's tiny model reads and writes back to the same architecture; lookups and refusals."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import sys
from pathlib import Path

import pytest

from megatron.rl.models.hf import HFCheckpointError, families as registry, gguf, hf_config_dict
from megatron.rl.models.hf.config import hf_model_config
from megatron.rl.models.hf.families import (
    HFFamily,
    export_family_of,
    families,
    family_named,
    family_of,
)
from megatron.rl.models.hf.tiny import TINY_FAMILIES, tiny_config

PACKAGE = Path(registry.__file__).parent
RECIPES = [(family, recipe) for family in families() for recipe in family.tiny]
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
SHAPE_KEYS += ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")
SHAPE_KEYS += ("rms_norm_eps", "tie_word_embeddings")


def tiny_config_json(family: HFFamily, recipe: str) -> dict:
    """The ``config.json`` that ``make_tiny_checkpoint(recipe, ...)`` writes (without weights)."""
    return {**tiny_config(recipe, 320).to_dict(), "architectures": [family.architectures[0]]}


BY_ORDER = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"]
"""The built-in families as ``families()`` lists them: by their ``order``."""


def test_the_registry_lists_exactly_the_family_modules_of_the_package():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "base"))
    assert sorted(f.name for f in families()) == modules == sorted(BY_ORDER)
    assert [f.name for f in families()] == BY_ORDER


def test_the_package_docstring_names_every_family_module():
    unnamed = [f.name for f in families() if f"``{f.name}.py``" not in registry.__doc__]
    assert not unnamed, f"megatron/rl/models/hf/families/__init__.py does not name {unnamed}"


def test_tiny_recipes_keep_their_order():
    """``tests/grpo_testing/hf_models.py`` seeds each tiny checkpoint by its index here."""
    assert TINY_FAMILIES == ("llama", "llama3", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")
    assert TINY_FAMILIES == tuple(recipe.name for _, recipe in RECIPES)


@pytest.mark.parametrize("family, recipe", RECIPES, ids=[r.name for _, r in RECIPES])
def test_every_tiny_config_reads_writes_and_reads_back_to_the_same_architecture(family, recipe):
    import transformers

    cfg = tiny_config_json(family, recipe.name)
    assert cfg["model_type"] in family.model_types
    hf = hf_model_config(cfg)
    assert (hf.family, hf.vocab_size) == (family.name, 320)
    assert hf.arch.qk_layernorm == family.qk_norm and hf.arch.add_qkv_bias == family.qkv_bias
    written = hf_config_dict(hf.arch, hf.family, hf.vocab_size)
    assert written["architectures"] == [family.architectures[0]]
    assert written["model_type"] == family.model_types[0]
    assert {k: written[k] for k in SHAPE_KEYS} == {k: cfg[k] for k in SHAPE_KEYS}
    again = hf_model_config(written)
    assert (again.family, again.arch, again.vocab_size) == (hf.family, hf.arch, hf.vocab_size)
    theirs = transformers.AutoConfig.for_model(**written).to_dict()  # transformers reads it alike
    assert theirs["rope_parameters"] == cfg["rope_parameters"]


def test_lookup_by_model_type_architectures_entry_and_name():
    for family in families():
        assert family_named(family.name) is family
        for model_type in family.model_types:
            assert family_of(model_type) is family
        for entry in family.architectures:
            assert family_of({"architectures": [entry]}) is family
    assert gguf.SUPPORTED_MODEL_TYPES == ("llama", "qwen2", "qwen3", "mistral")


def test_an_unknown_family_is_refused_naming_the_supported_ones():
    with pytest.raises(HFCheckpointError) as err:
        family_of("gpt2")
    assert str(err.value) == (
        "model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3, mistral, qwen3_moe, "
        "mixtral)"
    )
    with pytest.raises(HFCheckpointError) as err:
        family_of({"architectures": ["GPT2LMHeadModel"]}, "/ckpt/config.json")
    assert str(err.value) == (
        "/ckpt/config.json: architectures: 'GPT2LMHeadModel' is not supported (supported: "
        "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
        "Qwen3MoeForCausalLM, MixtralForCausalLM)"
    )
    with pytest.raises(HFCheckpointError, match="architectures: expected one entry, got None"):
        family_of({"model_type": "llama"})
    with pytest.raises(ValueError, match=r"family 'gpt2' is not one of \['llama', 'mistral', "):
        family_named("gpt2")


def test_an_architecture_without_a_checkpoint_is_exported_as_exactly_one_family():
    base = hf_model_config(tiny_config_json(family_named("llama"), "llama")).arch
    for qk, qkv_bias, bias in itertools.product([False, True], repeat=3):
        arch = dataclasses.replace(
            base, qk_layernorm=qk, add_qkv_bias=qkv_bias, add_bias_linear=bias
        )
        accepting = [f.name for f in families() if f.exported_for and f.exported_for(arch)]
        assert len(accepting) <= 1
        expected = "qwen3" if qk else "qwen2" if qkv_bias and not bias else "llama"
        assert export_family_of(arch).name == expected
    for family, recipe in RECIPES:  # a family that can be chosen is chosen for its own models
        if family.exported_for is not None:
            arch = hf_model_config(tiny_config_json(family, recipe.name)).arch
            assert export_family_of(arch) is family


FALCON = """
from megatron.rl.models.hf.families.base import HFFamily

FAMILY = HFFamily(
    name="{name}", architectures=("FalconForCausalLM",), model_types=("{model_type}",), order=9,
    max_position_embeddings=2048,
)
"""


@pytest.fixture
def extra_module(tmp_path, monkeypatch):
    """Writes a module into a folder added to the package's path; removed from ``sys.modules``
    afterwards."""
    monkeypatch.setattr(registry, "__path__", [*registry.__path__, str(tmp_path)])
    written = []

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)

    yield write
    for name in written:
        sys.modules.pop(f"{registry.__name__}.{name}", None)


def test_adding_a_module_adds_its_family(extra_module):
    extra_module("falcon", FALCON.format(name="falcon", model_type="falcon"))
    assert [f.name for f in families()] == [*BY_ORDER, "falcon"]
    assert family_of("falcon").architectures == ("FalconForCausalLM",)
    assert "falcon" in str(pytest.raises(HFCheckpointError, family_of, "gpt2").value)


@pytest.mark.parametrize(
    "name, source, message",
    [
        pytest.param("falcon", "X = 1\n", "must define FAMILY = HFFamily(name='falcon'", id="none"),
        pytest.param(
            "falcon",
            FALCON.format(name="falcon2", model_type="falcon"),
            "must define FAMILY = HFFamily(name='falcon'",
            id="misnamed",
        ),
        pytest.param(
            "falcon",
            FALCON.format(name="falcon", model_type="llama"),
            "the same model_type twice: ['llama']",
            id="claimed-twice",
        ),
    ],
)
def test_a_malformed_family_module_is_named(extra_module, name, source, message):
    extra_module(name, source)
    with pytest.raises(TypeError) as err:
        families()
    assert message in str(err.value)


def test_family_modules_import_no_hugging_face_package_when_loaded():
    """Entries are plain data: transformers is imported only by the tiny builders that use them."""
    hf_packages = ("transformers", "tokenizers", "safetensors")
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] in hf_packages], path.name
