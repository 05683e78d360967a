"""Self-tuning's figures for /metrics (deploy.yaml `tuning.auto`), from each model's cluster
controller (cluster/tuning_loop.py's view): the changes it applied and the setting it holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# The setting's knobs shown as the info metric's labels.
_SHOWN = (
    "policy",
    "max_num_seqs",
    "max_num_batched_tokens",
    "min_replicas",
    "max_replicas",
    "target_waiting",
    "upscale_delay_s",
    "downscale_delay_s",
)


class _Views:
    def __init__(self, views: dict[str, dict[str, Any]]) -> None:
        self.views = views

    def collect(self) -> Iterator[Metric]:
        applied = CounterMetricFamily(
            "dynabatch:tuning_applied",
            "Settings self-tuning applied (kind: apply, or revert after measured attainment "
            "fell below the predicted).",
            labels=["model_name", "kind"],
        )
        steps = CounterMetricFamily(
            "dynabatch:tuning_steps", "Self-tuning periods run.", labels=["model_name"]
        )
        info = GaugeMetricFamily(
            "dynabatch:tuning_setting_info",
            "The setting self-tuning holds in force (its knobs as labels).",
            labels=["model_name", "version", *_SHOWN],
        )
        for model, view in sorted(self.views.items()):
            for kind, count in sorted(view["applied_total"].items()):
                applied.add_metric([model, kind], float(count))
            steps.add_metric([model], float(view["steps_total"]))
            setting = view["setting"]
            info.add_metric([model, str(view["version"])] + [str(setting[k]) for k in _SHOWN], 1.0)
        yield from (applied, steps, info)


def render(views: dict[str, dict[str, Any]]) -> bytes:
    """`views`: each self-tuned model's TuningLoop.view(), by served name."""
    if not views:
        return b""
    registry = CollectorRegistry()
    registry.register(_Views(views))
    return generate_latest(registry)
