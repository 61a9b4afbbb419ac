"""Loading user classes by module or file, and the seeded, serialized calls into their code."""

from __future__ import annotations

import asyncio
import random

import numpy
import pytest

from megatron.rl.agent.user_code import call, load_class, positional_parameters, seeded

ENV_FILE = """\
import random


class Env:
    async def get_prompt(self, validation):
        return str(random.random()), None
"""


def test_a_file_is_imported_once_and_its_class_returned(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    monkeypatch.chdir(tmp_path)
    first = load_class("my_env.py:Env")
    assert first is load_class(f"{tmp_path}/my_env.py:Env")  # same file, same module
    assert first.__module__.startswith("_megatron_rl_user_my_env_")


def test_a_file_that_fails_to_import_names_the_error_and_can_be_fixed(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('missing dependency')\n")
    with pytest.raises(ValueError, match="RuntimeError: missing dependency"):
        load_class(f"{path}:Env")
    path.write_text(ENV_FILE.replace("Env", "Fixed"))
    assert load_class(f"{path}:Fixed").__name__ == "Fixed"


def test_seeded_blocks_are_pure_functions_of_the_seed_and_restore_the_global_rngs():
    async def draw(seed: int, pause: bool) -> tuple[float, float]:
        async with seeded(seed):
            a = random.random()
            if pause:
                await asyncio.sleep(0.01)  # another block must not run meanwhile
            return a, float(numpy.random.random())

    async def run():
        return await asyncio.gather(draw(1, True), draw(2, False), draw(1, False))

    random.seed(7)
    numpy.random.seed(7)
    state, numpy_state = random.getstate(), numpy.random.get_state()[1].copy()
    a, b, c = asyncio.run(run())
    assert random.getstate() == state and (numpy.random.get_state()[1] == numpy_state).all()
    assert a == c and a != b
    random.seed(1)
    numpy.random.seed(1)
    assert a == (random.random(), float(numpy.random.random()))


def test_call_awaits_only_what_is_awaitable():
    async def twice(x):
        return 2 * x

    assert asyncio.run(call(twice, 3)) == 6 and asyncio.run(call(lambda x: x + 1, 3)) == 4


def test_positional_parameters():
    assert positional_parameters(lambda response, golden, finish_reason: 0) == 3
    assert positional_parameters(lambda response, golden: 0) == 2
    assert positional_parameters(lambda *args: 0) > 3
