"""Real acceptance length during training: the training drafter drives greedy speculative
decoding of the whole target on a few fixed prompts (consumers/evaluation/speculative.py, the code
dflash-eval runs), checked token for token against the target's own greedy output, which is
decoded once when the prompts load (it does not depend on the drafter)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from dflash.consumers.export.export import Drafter
from dflash.decoding.ties import divergence, TIE_TOLERANCE

from .evaluate import Prompt, prompt_report, read_prompts, stop_ids, summarise
from .speculative import Generation, Speculative, TargetGreedy


@dataclass
class RealTauSet:
    """A loaded target, the prompts and their target-only greedy outputs."""

    model: nn.Module
    prompts: list[Prompt]
    baselines: list[Generation]
    stops: set[int]
    max_new_tokens: int
    load_s: float = 0.0  # loading the target and decoding the baselines, once

    @classmethod
    def load(cls, target: str, prompts_file: str, *, device: torch.device, dtype: torch.dtype,
             max_new_tokens: int, limit: int | None = None) -> "RealTauSet":
        """Load the target and tokenizer from `target`, read and decode the prompts."""
        from transformers.utils import logging as hf_logging

        from dflash.runtime import targets

        t0 = time.monotonic()
        hf_logging.disable_progress_bar()
        model = targets.load_causal_lm(target, dtype=dtype).to(device).eval().requires_grad_(False)
        tokenizer = targets.load_tokenizer(target)
        if len(tokenizer) < 2:  # transformers makes an empty one for a folder without tokenizer files
            raise ValueError(f"--target {target} has no tokenizer (tokenizer.json etc.): --eval-prompts needs it")
        prompts = read_prompts(prompts_file, tokenizer, limit)
        if not prompts:
            raise ValueError(f"{prompts_file}: no prompts (JSON Lines of messages/prompt/text rows)")
        stops = stop_ids(model, tokenizer)
        base = TargetGreedy(model, max_prompt=max(len(p.ids) for p in prompts), max_new_tokens=max_new_tokens,
                            stop_ids=stops)
        base(prompts[0].ids)  # warm-up: the timed baselines should not carry one-off costs
        baselines = [base(p.ids) for p in prompts]
        return cls(model, prompts, baselines, stops, max_new_tokens, round(time.monotonic() - t0, 3))

    @property
    def tolerance(self) -> float | None:
        """Tie tolerance of this target's dtype (None: float32, any difference is a mismatch)."""
        dtype = self.model.get_input_embeddings().weight.dtype
        return None if dtype in (torch.float32, torch.float64) else TIE_TOLERANCE[dtype]

    def check_drafter(self, target_layers: list[int], hidden_size: int) -> None:
        """Raise ValueError if the drafter's target layers or width do not fit this target."""
        cfg = self.model.config.get_text_config()
        if max(target_layers) > cfg.num_hidden_layers - 2 or cfg.hidden_size != hidden_size:
            raise ValueError(f"--target {cfg.num_hidden_layers} layers of width {cfg.hidden_size} does not fit "
                             f"the drafter's target layers {target_layers} and width {hidden_size}")

    def evaluate(self, model: nn.Module, block_size: int, mask_token_id: int, target_layers: list[int]) -> dict:
        """dflash-eval's report for `model` as the drafter, target-only timings from the cached baselines."""
        num_layers = self.model.config.get_text_config().num_hidden_layers
        drafter = Drafter(model, block_size, mask_token_id, list(target_layers), num_layers, {})
        was_training = model.training
        model.eval()
        try:
            # per evaluation: its CUDA graph captures this step's weights
            spec_dec = Speculative(self.model, drafter, max_prompt=max(len(p.ids) for p in self.prompts),
                                   max_new_tokens=self.max_new_tokens, stop_ids=self.stops)
            spec_dec(self.prompts[0].ids)
            rows = []
            for p, base in zip(self.prompts, self.baselines):
                spec = spec_dec(p.ids)
                div = divergence(self.model, p.ids, base.tokens, spec.tokens) if spec.tokens != base.tokens else None
                rows.append(prompt_report(p, base, spec, block_size, div, self.tolerance))
        finally:
            model.train(was_training)
        return summarise(rows, block_size, self.tolerance)
