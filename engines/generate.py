"""Hugging Face ``generate``: greedy, eager, Transformers' dynamic cache (the articles' baseline)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from decodebench.checkpoint import load_model
from engines.base import Engine, Generation


class GenerateEngine(Engine):
    name = "generate"

    def load(self) -> None:
        assert self.checkpoint is not None
        self.model, _ = load_model(self.checkpoint, self.ctx.dtype, self.ctx.device.torch_device)

    def generation_config(self, max_new_tokens: int, return_logits: bool) -> GenerationConfig:
        """Greedy, exactly ``max_new_tokens``: no EOS stop, so every call does the same work."""
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=None,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=self.checkpoint.config.pad_token_id,
            bos_token_id=self.checkpoint.config.bos_token_id,
            output_logits=return_logits,
            return_dict_in_generate=True,
        )

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, *, return_logits: bool = False
    ) -> Generation:
        ids = torch.tensor([prompt_ids], device=self.ctx.device.torch_device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=self.generation_config(max_new_tokens, return_logits),
        )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        logits = torch.cat([step.float().cpu() for step in out.logits]) if return_logits else None
        return Generation(tokens, logits)
