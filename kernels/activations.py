"""The activations a routed expert applies to its gate projection, declared once.

ACTIVATIONS maps a checkpoint's `hidden_act` to the PyTorch function the references apply;
ACTIVATION_CODES to the integer the Triton and HIP kernels branch on (csrc/w4a16_fdot2.cu:
0 silu, 1 gelu with erf, as F.gelu's default).
"""
from __future__ import annotations

import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
ACTIVATION_NAMES = tuple(ACTIVATIONS)
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATION_NAMES)}
