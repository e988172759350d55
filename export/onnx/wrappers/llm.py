"""The `llm` and `llm_decode` graphs: one prefill-or-decode step of `CosyVoice3LM` with its KV cache as flat
tensors."""

from __future__ import annotations

from torch import Tensor, nn

from ...nets.llm import CosyVoice3LM


class LLMGraph(nn.Module):
    """`CosyVoice3LM.forward_step` with the per-layer caches flattened into the spec's I/O order.

    Inputs: `inputs_embeds` (1, new_len, C), then `past_key_i`, `past_value_i` (1, KV, past_len, D) for
    each layer i. Outputs: `logp` (1, V), then `present_key_i`, `present_value_i` (1, KV, total_len, D).
    `onnxruntime_only`: its export is written for a graph that only onnxruntime runs
    (`Qwen2Model.forward`).
    """

    def __init__(self, lm: CosyVoice3LM, *, onnxruntime_only: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.num_layers = lm.cfg.qwen.num_hidden_layers
        self.onnxruntime_only = onnxruntime_only

    def forward(self, inputs_embeds: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        """inputs_embeds, past_key_0, past_value_0, past_key_1, ... -> logp, present_key_0, ..."""
        if len(past) != 2 * self.num_layers:
            raise ValueError(f"expected {2 * self.num_layers} past tensors, got {len(past)}")
        logp, keys, values = self.lm.forward_step(inputs_embeds, list(past[0::2]), list(past[1::2]),
                                                  onnxruntime_only=self.onnxruntime_only)
        presents = [t for kv in zip(keys, values, strict=True) for t in kv]  # key_0, value_0, key_1, ...
        return (logp, *presents)


class LLMDecodeGraph(nn.Module):
    """`CosyVoice3LM.forward_step_buffered` in `llm_decode`'s I/O order: `inputs_embeds`, `seqlens_k`,
    `total_sequence_length`, then the per-layer buffers as `LLMGraph` takes its caches; outputs as
    `LLMGraph`'s. Its graph's metadata names the positions its RoPE table holds (`metadata`)."""

    def __init__(self, lm: CosyVoice3LM) -> None:
        super().__init__()
        self.lm = lm
        self.num_layers = lm.cfg.qwen.num_hidden_layers

    def metadata(self) -> dict[str, str]:
        """`max_positions`: the rows of the RoPE table in the graph; positions must stay below it."""
        return {"max_positions": str(self.lm.cfg.qwen.max_position_embeddings)}

    def forward(self, inputs_embeds: Tensor, seqlens_k: Tensor, total_sequence_length: Tensor, *past: Tensor
                ) -> tuple[Tensor, ...]:
        """inputs_embeds, seqlens_k, total_sequence_length, past_key_0, past_value_0, ... -> logp,
        present_key_0, ..."""
        if len(past) != 2 * self.num_layers:
            raise ValueError(f"expected {2 * self.num_layers} past tensors, got {len(past)}")
        logp, keys, values = self.lm.forward_step_buffered(inputs_embeds, seqlens_k, total_sequence_length,
                                                           list(past[0::2]), list(past[1::2]))
        presents = [t for kv in zip(keys, values, strict=True) for t in kv]
        return (logp, *presents)
