"""``make_data_plane``: the backends by name, and a clear error without the optional extra."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from megatron.rl.dataplane import KeyedDataPlane, make_data_plane


def test_in_process_is_the_keyed_plane_with_rank_0_holding_the_store():
    plane = make_data_plane("in-process", 0, 1, torch.device("cpu"))
    assert isinstance(plane, KeyedDataPlane) and plane.is_owner and plane.store is not None
    other = make_data_plane("in-process", 1, 2, torch.device("cpu"))
    assert not other.is_owner and other.store is None
    with pytest.raises(RuntimeError, match="rank 1 does not hold the store"):
        other.put("train", 0, ["a"], {"x": [torch.ones(1)]})


def test_an_unknown_backend_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"'redis'.*\['in-process', 'transferqueue'\]"):
        make_data_plane("redis", 0, 1, torch.device("cpu"))


@pytest.mark.skipif(find_spec("transfer_queue") is not None, reason="the extra is installed")
def test_transferqueue_without_the_extra_names_the_flag_and_the_extra():
    with pytest.raises(ImportError, match=r"--rl-data-plane transferqueue needs the transferqueue"):
        make_data_plane("transferqueue", 0, 1, torch.device("cpu"))
