"""Model FLOPs per token, the numerator of MFU.

Convention (written out because every project picks its own):
- matrix FLOPs: 2 per multiply-add in the forward pass and twice that in the backward, so training costs
  6 x (parameters a token multiplies with): the active non-embedding parameters (attention projections,
  convolutions, router, the one expert it is routed to) plus the tied LM head (V x D); the embedding lookup
  and elementwise work (norms, scales, activations) are not counted.
- attention: causal, so on average a token attends to (T + 1) / 2 positions; QK^T and AV cost
  2 * 2 * H_q * d FLOPs per attended position in the forward pass, x3 for forward + backward.
"""

from __future__ import annotations

from zaya.model.config import ZayaConfig
from zaya.model.params import ParameterReport, parameter_report


def matmul_params_per_token(config: ZayaConfig, report: ParameterReport | None = None) -> int:
    """Parameters one token multiplies with: active non-embedding plus the LM head (`report`: the config's
    parameter report, if the caller has it: counting builds the model on the meta device)."""
    report = report or parameter_report(config)
    return report.active_non_embedding + config.vocab_size * config.hidden_size


def attention_flops_per_token(config: ZayaConfig, seq_len: int) -> float:
    """Forward FLOPs of QK^T and AV per token for causal attention over `seq_len` positions."""
    attended = (seq_len + 1) / 2
    return 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * attended


def training_flops_per_token(config: ZayaConfig, seq_len: int, report: ParameterReport | None = None) -> float:
    """Forward + backward FLOPs per token."""
    return 6 * matmul_params_per_token(config, report) + 3 * attention_flops_per_token(config, seq_len)


def forward_flops_per_token(config: ZayaConfig, seq_len: int) -> float:
    """Forward-only FLOPs per token (inference, prefill)."""
    return 2 * matmul_params_per_token(config) + attention_flops_per_token(config, seq_len)
