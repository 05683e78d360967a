"""The correctness oracle: greedy tokens must equal transformers' generate on each prompt alone."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# A float32 near-tie may flip an argmax between two correct implementations; a divergence is
# accepted only where HF's own top-2 logits differ by less than this at the first differing
# position, and such cases are counted.
NEAR_TIE_TOLERANCE = 1e-4


class HFOracle:
    def __init__(self, model_dir: str, adapter: str | None = None) -> None:
        """`adapter`: a PEFT LoRA adapter directory, merged into the model by PEFT."""
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, **_dequantized(model_dir)
        ).eval()
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter).merge_and_unload().eval()
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    # Explicit mask: HF would otherwise mask prompt tokens equal to pad_token_id.
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            self._cache[key] = out[0, len(prompt) :].tolist()
        return self._cache[key]

    def top2_gap(self, tokens: list[int]) -> float:
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens])).logits[0, -1]
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])

    def compare(self, prompt: list[int], ours: list[int], max_new_tokens: int) -> str:
        """'equal', or 'near-tie' (accepted), or raise AssertionError describing the miss."""
        ref = self.greedy(prompt, max_new_tokens)
        if ours == ref:
            return "equal"
        assert len(ours) == len(ref), f"length {len(ours)} != {len(ref)}"
        j = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
        gap = self.top2_gap(prompt + ref[:j])
        assert gap < NEAR_TIE_TOLERANCE, (
            f"tokens differ at output position {j} (ours {ours[j]}, HF {ref[j]}) where HF's "
            f"top-2 logit gap is {gap:.3g}, not a near-tie\nours {ours}\nhf   {ref}"
        )
        return "near-tie"


def _dequantized(model_dir: str) -> dict:
    """from_pretrained's arguments that dequantize an MXFP4 checkpoint at load. Where the
    `kernels` package is installed (recent transformers require it) transformers
    runs MXFP4 experts through kernels fetched from the Hub, which these hosts cannot reach;
    without it, it dequantized them, as it does here."""
    quant = getattr(AutoConfig.from_pretrained(model_dir), "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}
