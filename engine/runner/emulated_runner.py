"""EmulatedRunner (`engine.device: emulated`): a GPU's step times on any machine, no model.

Each step takes the wall-clock time the cost model (engine/runner/cost_model.py) prices it at
for the emulated model on the emulated GPU, queued behind the step before as a device's
stream would be: a step launched while another runs starts when that one ends, so the
engine's overlapped steps overlap here as they do on the GPU. The tokens are real ids of the
served checkpoint's tokenizer: a fixed text, the token at each sequence position the text's
token there (cycling), so detokenization, stop strings and SSE cost what they do for real and
a request's output is the same wherever it runs. Speculative drafts are verified against that
text. Serving the deploy.yaml of a GPU cluster on a laptop at the GPU's token rate is what it
is for (load tests, autoscaling, chaos, calibrating the tuner), never answers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.errors import InvalidParam
from engine.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from engine.core.sequence_kv import SequenceKV
from engine.model.loader import read_spec, resolve_max_model_len
from engine.runner.cost_model import GPUS, MODELS, CostParams, Pricer, kv_blocks_for
from engine.runner.gpu_specs import GpuSpec
from engine.runner.model_specs import ModelSpec

# What an emulated replica says: plain prose in the served tokenizer's ids.
TEXT = (
    " The river runs past the mill and under the old stone bridge, where the children of"
    " the village stop on their way to school to count the boats. In spring the water"
    " rises and the miller opens the gates; in autumn it falls, and the reeds turn the"
    " colour of bread. Nobody remembers who built the bridge, but everyone has a story"
    " about it, and every story ends with someone crossing it at night."
)
LOGPROB_OTHERS = -20.0  # the log-probability an emulated replica gives a token it did not say


@dataclass(frozen=True)
class Emulated:
    """The model and GPU an emulated replica prices its steps for."""

    model: ModelSpec
    gpu: GpuSpec
    params: CostParams
    label: str  # "Llama-3.1-8B on H100-80GB"


def emulated(model: str, gpu: str, calibration: str | None = None) -> Emulated:
    """The model, GPU and cost constants named by the simulator's tables, or by a
    `python -m loadtests.calibrate` JSON (its fitted model, device and constants)."""
    if calibration:
        try:
            found = json.loads(Path(calibration).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidParam("emulate.calibration", f"emulate.calibration: {exc}") from exc
        spec = ModelSpec.from_hf_config(found["model"], dtype_bytes=4)
        device = GpuSpec(**found["device"])
        label = f"{found['model']} on {device.name} (calibrated)"
        return Emulated(spec, device, CostParams(**found["params"]), label)
    if model not in MODELS:
        raise InvalidParam("emulate.model", f"emulate.model: one of {', '.join(MODELS)}")
    if gpu not in GPUS:
        raise InvalidParam("emulate.gpu", f"emulate.gpu: one of {', '.join(GPUS)}")
    return Emulated(MODELS[model], GPUS[gpu], CostParams(), f"{model} on {gpu}")


def said_ids(tokenizer) -> list[int]:
    """TEXT in `tokenizer`'s ids, without special tokens: what an emulated replica says, the
    token at sequence position p being the one at p modulo its length."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [t for t in tokenizer.encode(TEXT, add_special_tokens=False) if t not in special]


def _refuse_what_needs_a_model(config: EngineConfig) -> None:
    """Knobs whose work an emulated replica cannot price or say: InvalidParam naming each."""
    if config.lora.enabled:
        raise InvalidParam("lora.enabled", "lora.enabled: an emulated replica runs no adapters")
    if config.speculative.enabled and config.speculative.method == "draft_model":
        raise InvalidParam(
            "speculative.method", "speculative.method: an emulated replica has no draft model"
        )
    if config.scheduler.preemption_mode == "swap":
        raise InvalidParam(
            "preemption_mode", "preemption_mode: an emulated replica has no host pool to swap to"
        )


class EmulatedKernels:
    name = "emulated"


class EmulatedStep:
    """A step on the emulated device: its tokens are known at launch, readable when due."""

    def __init__(self, due: float, output: ModelRunnerOutput) -> None:
        self.due = due
        self._output = output

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self.due

    def result(self) -> ModelRunnerOutput:
        wait = self.due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return self._output


class EmulatedRunner:
    backend = EmulatedKernels()
    self_check = ()

    def __init__(self, config: EngineConfig, tokenizer) -> None:
        _refuse_what_needs_a_model(config)
        emulate = config.emulate
        self.emulated = emulated(emulate.model, emulate.gpu, emulate.calibration)
        cache = config.cache
        self.block_size = cache.block_size
        model = self.emulated.model.quantized(kv_cache_dtype=cache.kv_cache_dtype)
        self.pricer = Pricer(model, self.emulated.gpu, self.emulated.params, lora_rank=0)
        self._num_blocks = cache.num_blocks or kv_blocks_for(
            model, self.emulated.gpu, cache.block_size, cache.gpu_memory_fraction
        )
        # The served checkpoint's context, as the ingress reads it from the same config.json.
        spec = read_spec(config.model)
        self._max_model_len = resolve_max_model_len(config.scheduler.max_model_len, spec)
        self.backend_reason = f"engine.device: emulated ({self.emulated.label}), no model"
        self.text = said_ids(tokenizer)
        self._free_at = 0.0  # when the emulated device finishes the steps queued on it
        self.busy_seconds = 0.0

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def max_model_len(self) -> int:
        return self._max_model_len

    def num_host_blocks(self) -> int:
        return 0

    def export_kv(
        self, block_ids: list[int], token_ids: list[int], swapped: bool = False
    ) -> SequenceKV:
        """A sequence's progress without tensors (there are none): the count moves."""
        return SequenceKV(list(token_ids), self.block_size, "emulated")

    def kv_refusal(self, kv: SequenceKV) -> str | None:
        if kv.data is not None:
            return "an emulated replica keeps no KV tensors"
        return None if kv.block_size == self.block_size else "another block size"

    def token_at(self, position: int) -> int:
        """The token an emulated replica says at a sequence position."""
        return self.text[position % len(self.text)]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).result()

    def launch(self, scheduler_output: SchedulerOutput) -> EmulatedStep:
        seconds = self.pricer.step(scheduler_output).seconds
        start = max(time.monotonic(), self._free_at)
        self._free_at = start + seconds
        self.busy_seconds += seconds
        return EmulatedStep(self._free_at, self._output(scheduler_output))

    def _output(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput({})
        for s in out.scheduled:
            end = s.num_computed_tokens + len(s.token_ids)  # the position sampled first
            if s.prompt_targets:
                start = s.num_computed_tokens + 1
                result.prompt_logprobs[s.request_id] = (
                    start,
                    [TokenLogprob(0.0, [(t, 0.0)]) for t in s.prompt_targets],
                )
            if s.pooled:
                result.pooled[s.request_id] = [1.0] + [0.0] * (self.pricer.model.hidden_size - 1)
            if s.num_drafts:
                first = end - s.num_drafts
                drafts = s.token_ids[-s.num_drafts :]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == self.token_at(
                    first + accepted
                ):
                    accepted += 1
                said = drafts[:accepted] + [self.token_at(first + accepted)]
                result.spec_token_ids[s.request_id] = said
                self._logprob(result, s, said[-1], first + accepted)
            elif s.sample:
                token = self.token_at(end)
                result.sampled_token_ids[s.request_id] = token
                self._logprob(result, s, token, end)
        return result

    def _logprob(self, result: ModelRunnerOutput, s, token: int, position: int) -> None:
        asked = s.sampling_params.logprobs
        if asked is None:
            return
        others = [self.token_at(position + j) for j in range(1, asked + 1)]
        top = [(token, 0.0)] + [(t, LOGPROB_OTHERS) for t in dict.fromkeys(others) if t != token]
        result.logprobs[s.request_id] = TokenLogprob(0.0, top[:asked])
