"""The oracle on this (CPU) machine: choice, logged refusals, forcing by name."""
from __future__ import annotations

import logging

import pytest
import torch

from kernels.oracle import BackendUnavailable, choose_backend
from kernels.quant import QuantScheme

CPU = torch.device("cpu")
SYMMETRIC = QuantScheme(bits=4, group_size=128, symmetric=True, act_order=False)
ASYMMETRIC = QuantScheme(bits=4, group_size=128, symmetric=False, act_order=False)
ACT_ORDER = QuantScheme(bits=4, group_size=128, symmetric=True, act_order=True)


def test_cpu_is_chosen_and_gpu_refusals_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="kernels.oracle"):
        choice = choose_backend(CPU, SYMMETRIC, "silu")
    assert choice.backend.name == "cpu"
    assert set(choice.refusals) == {"triton", "hip_fdot2"}
    assert all("not a" in reason for reason in choice.refusals.values())
    log = caplog.text
    assert "kernel backend 'cpu' for cpu" in log
    assert "kernel backend 'triton' refused" in log and "kernel backend 'hip_fdot2' refused" in log


@pytest.mark.parametrize("scheme,why", [(ASYMMETRIC, "zero 8"), (ACT_ORDER, "act-order")])
def test_unsupported_schemes_fall_back_to_reference(scheme, why):
    choice = choose_backend(CPU, scheme, "silu")
    assert choice.backend.name == "reference"
    assert why in choice.refusals["cpu"]


def test_group_size_outside_cpu_kernel_falls_back():
    choice = choose_backend(CPU, QuantScheme(4, 512, True, False), "silu")
    assert choice.backend.name == "reference"
    assert "group size" in choice.refusals["cpu"]


def test_forced_backend_that_cannot_run_fails_loudly():
    with pytest.raises(BackendUnavailable, match=r"forced kernel backend 'triton' cannot run .*triton: device cpu"):
        choose_backend(CPU, SYMMETRIC, "silu", forced="triton")
    with pytest.raises(BackendUnavailable, match=r"forced kernel backend 'cpu' .*act-order"):
        choose_backend(CPU, ACT_ORDER, "silu", forced="cpu")


def test_forced_backend_that_can_run_is_used():
    assert choose_backend(CPU, ASYMMETRIC, "silu", forced="reference").backend.name == "reference"


def test_unknown_backend_and_activation_are_refused():
    with pytest.raises(BackendUnavailable, match="unknown kernel backend 'fdot3'"):
        choose_backend(CPU, SYMMETRIC, "silu", forced="fdot3")
    with pytest.raises(BackendUnavailable, match=r"no kernel backend .*reference: activation 'relu'"):
        choose_backend(CPU, SYMMETRIC, "relu")
