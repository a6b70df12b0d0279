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
        dtype = self.weight.dtype
        if x.dtype == dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Round the input to the weight dtype first, then normalise in fp32: the public checkpoints' numerics.
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
        # Expanded as o*s_o + h*s_h + (b_o*s_o + b_h*s_h): two fused passes over the stream instead of five.
        shift = self.branch_bias * self.branch_scale + self.stream_bias * self.stream_scale
        return torch.addcmul(torch.addcmul(shift, stream, self.stream_scale), branch, self.branch_scale)


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

    Pairs are (i, i + r/2) with angle pos * theta_i, theta_i = base^(-2i / r), r = rotary_dim:

        x'_i       = x_i cos - x_{i+r/2} sin,     x'_{i+r/2} = x_{i+r/2} cos + x_i sin

    Written for a whole head as x' = x * cos + x[partner] * sin, with cos = 1 and sin = 0 on the
    dims that pass through and the sign folded into sin.
    """

    def __init__(self, head_dim: int, rotary_dim: int, base: float):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.register_buffer("inv_freq", self._inv_freq(rotary_dim, base), persistent=False)
        self.register_buffer("partner", self._partner(head_dim, rotary_dim), persistent=False)

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` would round the frequencies, which the forward uses in fp32: computed anew in
        # fp32 wherever the buffer goes (a meta tensor has nothing to compute)
        super()._apply(fn, recurse)
        if self.inv_freq.is_meta:
            self.inv_freq.data = self.inv_freq.data.float()
        else:
            self.inv_freq.data = self._inv_freq(self.rotary_dim, self.base).to(self.inv_freq.device)
        return self

    def initializers(self):
        """The tables, with what sets them (for a model built on the meta device: `Zaya.initializers`)."""
        inv_freq, partner = self._inv_freq(self.rotary_dim, self.base), self._partner(self.head_dim, self.rotary_dim)
        yield self.inv_freq, lambda tensor: tensor.copy_(inv_freq)
        yield self.partner, lambda tensor: tensor.copy_(partner)

    @staticmethod
    def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
        # computed on the CPU and moved: under the meta device, `pow` would load the compiler's decompositions,
        # over a second of a process's start
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        return (1.0 / (base ** exponents)).to(torch.get_default_device())

    @staticmethod
    def _partner(head_dim: int, rotary_dim: int) -> torch.Tensor:
        """Index of each dim's rotation partner: i <-> i + r/2 inside the rotary dims, itself outside."""
        half = rotary_dim // 2
        partner = torch.arange(head_dim)
        partner[:half] += half
        partner[half:rotary_dim] -= half
        return partner

    def set_base(self, base: float) -> None:
        """Change the RoPE base in place (context extension phases raise it, e.g. 1e4 -> 1e6). Also restores
        the partner index: both buffers are non-persistent, so a model materialised from meta needs them."""
        self.base = base
        self.inv_freq.copy_(self._inv_freq(self.rotary_dim, base).to(self.inv_freq.device))
        self.partner.copy_(self._partner(self.head_dim, self.rotary_dim).to(self.partner.device))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin tables [T, head_dim] (fp32) for integer positions [T], or [B, T, head_dim] for
        positions per row [B, T] (packed documents)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        cos, sin = freqs.cos(), freqs.sin()
        keep = cos.new_ones(*cos.shape[:-1], self.head_dim - self.rotary_dim)
        return torch.cat([cos, cos, keep], dim=-1), torch.cat([-sin, sin, keep * 0], dim=-1)


def apply_rotary(x_BTHd: torch.Tensor, cos_Td: torch.Tensor, sin_Td: torch.Tensor, partner_d: torch.Tensor):
    """Rotate every head of `x` [B, T, H, d] by the tables of `RotaryEmbedding.forward` ([T, d] or [B, T, d])."""
    cos = cos_Td.unsqueeze(-2).to(x_BTHd.dtype)  # broadcast over the heads (and the rows, for [T, d])
    sin = sin_Td.unsqueeze(-2).to(x_BTHd.dtype)
    return torch.addcmul(x_BTHd * cos, x_BTHd.index_select(-1, partner_d), sin)
