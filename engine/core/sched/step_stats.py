"""The shape and timing of a scheduler's steps, as the batching policies and /metrics read
them (pure Python)."""

from __future__ import annotations

from engine.core.histogram import CumulativeHistogram

# Requests per step (Prometheus buckets of the iteration batch size histogram).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class StepStats:
    """The last step's batch, and decode-only steps as running totals: a reader that keeps
    the previous totals gets the mean decode-step latency and batch over any period (the
    controller's window)."""

    def __init__(self) -> None:
        self.last_num_seqs = 0
        self.last_num_decodes = 0
        self.last_decode_only = False
        self.last_duration_s: float | None = None
        self.decode_steps_total = 0
        self.decode_step_seconds_total = 0.0
        self.decode_step_seqs_total = 0
        self.batch_size_histogram = CumulativeHistogram(BATCH_SIZE_BUCKETS)

    def scheduled(self, num_seqs: int, num_decodes: int) -> None:
        """A step was scheduled with `num_seqs` requests, `num_decodes` of them decodes."""
        self.last_num_seqs = num_seqs
        if num_seqs:
            self.batch_size_histogram.observe(num_seqs)
        self.last_num_decodes = num_decodes
        self.last_decode_only = bool(num_seqs) and num_decodes == num_seqs
        self.last_duration_s = None

    def executed(self, seconds: float) -> None:
        """The engine's measure of the step just scheduled (policies read it from stats)."""
        self.last_duration_s = seconds
        if self.last_decode_only:
            self.decode_steps_total += 1
            self.decode_step_seconds_total += seconds
            self.decode_step_seqs_total += self.last_num_seqs
