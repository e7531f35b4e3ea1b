"""Where `artgw serve --engines N` runs each supervised engine (engine/placement.py): a GPU each, or a slice of
the cores each, for any machine the functions are told of."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.placement import cpu_shares, engine_environments, visible_gpus


def test_one_engine_runs_as_it_always_has() -> None:
    assert engine_environments(1, gpus=("0", "1"), cpus=range(16)) == [{}]
    assert engine_environments(1, gpus=(), cpus=range(2)) == [{}]


def test_with_gpus_each_engine_gets_its_own() -> None:
    assert engine_environments(2, gpus=("4", "5", "6"), cpus=range(16)) == [
        {"CUDA_VISIBLE_DEVICES": "4"},
        {"CUDA_VISIBLE_DEVICES": "5"},
    ]


def test_more_engines_than_gpus_is_one_line_naming_both() -> None:
    with pytest.raises(ValueError) as error:
        engine_environments(3, gpus=("0", "1"), cpus=range(16))
    assert str(error.value) == ("--engines 3 needs a GPU per engine; 2 visible (0,1): give --engines 2 or fewer")


def test_on_cpu_the_cores_but_one_are_split_into_slices_of_their_own() -> None:
    # 16 cores: one kept for the gateway (as one engine leaves it), 15 split 8 + 7.
    assert engine_environments(2, gpus=(), cpus=range(16)) == [
        {"OMP_NUM_THREADS": "8", "VLLM_CPU_OMP_THREADS_BIND": "0-7"},
        {"OMP_NUM_THREADS": "7", "VLLM_CPU_OMP_THREADS_BIND": "8-14"},
    ]
    # The cores this process may use, whatever their numbers.
    assert cpu_shares(2, [2, 3, 5, 6, 7]) == [[2, 3], [5, 6]]
    assert engine_environments(2, gpus=(), cpus=[2, 3, 5, 6, 7])[0]["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert engine_environments(2, gpus=(), cpus=[1, 3, 4, 9])[0]["VLLM_CPU_OMP_THREADS_BIND"] == "1,3"


def test_on_few_cores_none_is_kept_back_and_engines_share_when_they_must() -> None:
    assert cpu_shares(2, [0, 1]) == [[0], [1]]  # this machine: a core each
    assert cpu_shares(3, [0, 1]) == [[0], [1], [0]]
    assert cpu_shares(2, [0]) == [[0], [0]]


def test_visible_gpus_are_cuda_visible_devices_else_the_device_nodes(tmp_path: Path) -> None:
    for node in ("nvidia0", "nvidia1", "nvidia10", "nvidiactl", "nvidia-uvm"):
        (tmp_path / node).touch()
    assert visible_gpus({}, tmp_path) == ("0", "1", "10")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 1"}, tmp_path) == ("3", "1")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == ()  # GPUs hidden: the engines go on CPU
    assert visible_gpus({}, tmp_path / "none") == ()
