"""Small building blocks shared by the sublayers: RMSNorm, residual scaling, partial NeoX RoPE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama-style RMSNorm, `x * rsqrt(mean(x^2) + eps) * w`, computed in fp32 and returned in the weight's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Round the input to the weight dtype first, then normalise in fp32: the public checkpoints' numerics.
        dtype = self.weight.dtype
        normed = F.rms_norm(x.to(dtype).float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(dtype)


class ResidualScaling(nn.Module):
    """A learned per-channel merge of a sublayer output into the residual stream (spec section 6):

        h_new = (o + b_o) * s_o + (h + b_h) * s_h

    `o` is the branch (sublayer output), `h` the fp32 stream. At init (s = 1, b = 0) it is a plain residual add.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.branch_scale = nn.Parameter(torch.ones(dim))
        self.branch_bias = nn.Parameter(torch.zeros(dim))
        self.stream_scale = nn.Parameter(torch.ones(dim))
        self.stream_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, branch: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        # The branch may come out of an autocast matmul: lift it to the parameters' dtype before the affine.
        branch = branch.to(self.branch_scale.dtype)
        return (branch + self.branch_bias) * self.branch_scale + (stream + self.stream_bias) * self.stream_scale


class EmbeddingScaling(nn.Module):
    """The affine on the token embeddings, h_0 = (e + b_in) * s_in, after which the stream is fp32."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return ((e + self.bias) * self.scale).float()


class RotaryEmbedding(nn.Module):
    """Partial NeoX ("rotate-half") RoPE: the first `rotary_dim` dims of a head rotate, the rest pass through.

    Pairs are (i, i + rotary_dim/2) with angle pos * theta_i, theta_i = base^(-2i / rotary_dim).
    """

    def __init__(self, rotary_dim: int, base: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.register_buffer("inv_freq", self._inv_freq(rotary_dim, base), persistent=False)

    @staticmethod
    def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
        return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))

    def set_base(self, base: float) -> None:
        """Change the RoPE base in place (context extension phases raise it, e.g. 1e4 -> 1e6)."""
        self.inv_freq.copy_(self._inv_freq(self.rotary_dim, base).to(self.inv_freq.device))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables of shape [T, rotary_dim] (fp32) for integer positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :].float()
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x_BTHd: torch.Tensor, cos_Tr: torch.Tensor, sin_Tr: torch.Tensor) -> torch.Tensor:
    """Rotate the first r dims of every head of `x` [B, T, H, d]; dims r..d pass through unchanged."""
    r = cos_Tr.shape[-1]
    cos = cos_Tr[None, :, None, :].to(x_BTHd.dtype)
    sin = sin_Tr[None, :, None, :].to(x_BTHd.dtype)
    x_rot, x_pass = x_BTHd[..., :r], x_BTHd[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
