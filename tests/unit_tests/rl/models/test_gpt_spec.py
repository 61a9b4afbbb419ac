"""Layer-spec backend selection: Transformer Engine on CUDA when it imports, SDPA otherwise."""

from __future__ import annotations

import pytest

from megatron.rl.models import gpt_spec
from megatron.rl.models.attention import SDPACoreAttention


class FakeTESpecProvider(gpt_spec.SDPASpecProvider):
    """Stands in for megatron-core's TESpecProvider (Transformer Engine is not installed here)."""


@pytest.fixture
def te_importable(monkeypatch):
    monkeypatch.setattr(gpt_spec, "transformer_engine_importable", lambda: True)
    monkeypatch.setattr(gpt_spec, "_te_spec_provider", FakeTESpecProvider)


def test_cpu_uses_the_sdpa_backend_even_when_transformer_engine_imports(te_importable):
    backend = gpt_spec.select_backend(cuda=False)
    assert type(backend) is gpt_spec.SDPASpecProvider


def test_cuda_uses_transformer_engine_when_it_imports(te_importable):
    assert isinstance(gpt_spec.select_backend(cuda=True), FakeTESpecProvider)


def test_cuda_falls_back_to_the_sdpa_backend_without_transformer_engine(monkeypatch):
    monkeypatch.setattr(gpt_spec, "transformer_engine_importable", lambda: False)
    backend = gpt_spec.select_backend(cuda=True)
    assert type(backend) is gpt_spec.SDPASpecProvider
    spec = gpt_spec.gpt_layer_spec(backend)
    assert spec.submodules.self_attention.submodules.core_attention is SDPACoreAttention


@pytest.mark.parametrize(
    "outcome, importable",
    [
        pytest.param(lambda: object(), True, id="imports"),
        pytest.param(ImportError("No module named 'transformer_engine'"), False, id="missing"),
        pytest.param(OSError("libtransformer_engine.so: cannot open"), False, id="broken-lib"),
        pytest.param(RuntimeError("CUDA driver too old"), False, id="broken-runtime"),
    ],
)
def test_importability_is_probed_by_importing_transformer_engine(monkeypatch, outcome, importable):
    probed = []

    def fake_import(name):
        probed.append(name)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome()

    monkeypatch.setattr(gpt_spec.importlib, "import_module", fake_import)
    gpt_spec.transformer_engine_importable.cache_clear()
    try:
        assert gpt_spec.transformer_engine_importable() is importable
        assert gpt_spec.transformer_engine_importable() is importable  # cached: probed once
    finally:
        gpt_spec.transformer_engine_importable.cache_clear()
    assert probed == ["transformer_engine.pytorch"]


def test_the_real_transformer_engine_provider_builds_a_fused_spec():
    pytest.importorskip("transformer_engine.pytorch")
    backend = gpt_spec._te_spec_provider()
    spec = gpt_spec.gpt_layer_spec(backend)
    assert backend.fuse_layernorm_and_linear()
    assert spec.submodules.self_attention.submodules.core_attention is backend.core_attention()
