"""Model FLOPs per token, the numerator of MFU.

Convention (written out because every project picks its own):
- matrix FLOPs: 2 per multiply-add in the forward pass and twice that in the backward, so training costs
  6 x (parameters a token multiplies with): the active non-embedding parameters (attention projections,
  convolutions, router, the one expert it is routed to) plus the tied LM head (V x D); the embedding lookup
  and elementwise work (norms, scales, activations) are not counted.
- attention: causal, so on average a token of a `hybrid` block attends to (T + 1) / 2 positions, and one of a
  `hybrid_sliding` block of window W to the mean over t of min(t + 1, W): the pairs of a causal square of side
  T under the window, over T (W (W + 1) / 2 + (T - W) W for T > W); summed over the blocks. QK^T and AV cost
  2 * 2 * H_q * d FLOPs per attended position in the forward pass, x3 for forward + backward. Only the pairs
  the mask allows count: a kernel that computes a masked tile whole does more work, not more model FLOPs.
"""

from __future__ import annotations

from zaya.model.config import ZayaConfig
from zaya.model.masks import band_pairs
from zaya.model.params import ParameterReport, parameter_report


def matmul_params_per_token(config: ZayaConfig, report: ParameterReport | None = None) -> int:
    """Parameters one token multiplies with: active non-embedding plus the LM head (`report`: the config's
    parameter report, if the caller has it: counting builds the model on the meta device)."""
    report = report or parameter_report(config)
    return report.active_non_embedding + config.vocab_size * config.hidden_size


def block_windows(config: ZayaConfig) -> dict[int | None, int]:
    """How many blocks attend through each window: {None: the `hybrid` blocks, W: the sliding ones}, the
    blocks that attend alike counted together (their attention costs the same)."""
    # counted, not walked block by block: the planner asks this for every layout it weighs
    sliding = config.sliding_blocks
    counts: dict[int | None, int] = {}
    if sliding < config.num_hidden_layers:
        counts[None] = config.num_hidden_layers - sliding
    if sliding:
        counts[config.sliding_window] = sliding
    return counts


def attended_positions(seq_len: int, window: int | None = None) -> float:
    """The keys a query sees on average in a causal row of `seq_len` tokens, within `window` (None: all)."""
    return band_pairs(seq_len, window) / seq_len


def attention_flops_per_token(config: ZayaConfig, seq_len: int) -> float:
    """Forward FLOPs of QK^T and AV per token for causal attention over `seq_len` positions, every block's
    within its window."""
    attended = sum(blocks * attended_positions(seq_len, window) for window, blocks in block_windows(config).items())
    return 4 * config.num_attention_heads * config.head_dim * attended


def training_flops_per_token(config: ZayaConfig, seq_len: int, report: ParameterReport | None = None) -> float:
    """Forward + backward FLOPs per token."""
    return 6 * matmul_params_per_token(config, report) + 3 * attention_flops_per_token(config, seq_len)


def forward_flops_per_token(config: ZayaConfig, seq_len: int) -> float:
    """Forward-only FLOPs per token (inference, prefill)."""
    return 2 * matmul_params_per_token(config) + attention_flops_per_token(config, seq_len)
