"""megatron-core imported with its ``torch.compile`` decorators deferred to each function's first
call (``megatron/rl/deferred_compile.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron.rl.deferred_compile import CompileOnFirstCall, compile_deferred, deferred


class CompileSpy:
    """A stand-in for ``torch.compile`` that records its calls and returns a doubling wrapper."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, fn, **options):
        self.calls.append((fn.__name__, options))
        return lambda *args, **kwargs: 2 * fn(*args, **kwargs)


def add(a, b):
    """Adds."""
    return a + b


@pytest.mark.parametrize(
    "decorate, options",
    [
        pytest.param(lambda d: d(add), {}, id="bare-decorator"),
        pytest.param(lambda d: d(mode="max-autotune")(add), {"mode": "max-autotune"}, id="options"),
        pytest.param(lambda d: d(add, dynamic=True), {"dynamic": True}, id="call-with-options"),
    ],
)
def test_a_function_is_compiled_on_its_first_call_with_the_same_options(decorate, options):
    spy = CompileSpy()
    fn = decorate(deferred(spy))
    assert isinstance(fn, CompileOnFirstCall) and fn.__name__ == "add" and fn.__doc__ == "Adds."
    assert spy.calls == []  # decorating compiles nothing
    assert fn(1, 2) == 6 and fn(2, 3) == 10  # the compiled function runs, from the first call on
    assert spy.calls == [("add", options)]  # compiled once


def test_a_deferred_method_binds_to_its_instance():
    spy = CompileSpy()

    class Router:
        def __init__(self, bias):
            self.bias = bias

        @deferred(spy)
        def route(self, x):
            return x + self.bias

    assert Router(1).route(2) == 6 and Router(10).route(2) == 24
    assert spy.calls == [("route", {})]  # one compiled function, shared by the instances


def test_the_real_torch_compile_is_back_after_the_block_even_on_an_error():
    real = torch.compile
    with pytest.raises(ZeroDivisionError):
        with compile_deferred():
            assert torch.compile is not real
            1 / 0
    assert torch.compile is real


def test_a_deferred_torch_compile_computes_what_the_function_does():
    with compile_deferred():
        fn = torch.compile(backend="eager")(lambda x: torch.nn.functional.gelu(x) * x)
    x = torch.randn(16, generator=torch.Generator().manual_seed(0))
    assert isinstance(fn, CompileOnFirstCall)
    torch.testing.assert_close(fn(x), torch.nn.functional.gelu(x) * x, rtol=0, atol=0)


def imports_in_a_fresh_process(first: str) -> list[str]:
    """What a new interpreter reports after ``first``, then ``import megatron.core``."""
    code = (
        f"{first}\n"
        "import sys, torch, megatron.core\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_gelu\n"
        "from megatron.rl.deferred_compile import CompileOnFirstCall, _WatchMegatronCore\n"
        "print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules)\n"
        "print(jit.jit_fuser is torch.compile, type(fused_bias_gelu.bias_gelu).__name__)\n"
        "print(any(isinstance(f, _WatchMegatronCore) for f in sys.meta_path))\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True
    )
    return out.stdout.split("\n")[-4:-1]


def test_importing_ours_first_defers_megatron_cores_compiled_functions():
    assert imports_in_a_fresh_process("import megatron.trainer") == [
        "False False",  # neither TorchDynamo nor Inductor was imported
        "False CompileOnFirstCall",  # jit_fuser defers; the real torch.compile is back
        "False",  # the watch stepped aside
    ]


def test_megatron_core_imported_before_ours_is_left_as_it_is():
    assert imports_in_a_fresh_process("import megatron.core, megatron.rl") == [
        "True True",
        "True function",
        "False",
    ]
