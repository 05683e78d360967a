"""When an engine replica counts as unhealthy, so that Serve replaces it (and the ingress
resumes its requests elsewhere): its step loop died, a process of its runner ended (a
tensor-parallel rank), its steps keep failing (a sticky device error: failing fast, such a
replica would otherwise attract traffic), or one step has run past a timeout (a hung device,
a stopped process or rank). Serve asks every `check_period_s` and gives up on an answer after
`check_timeout_s`; a stopped process never answers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # the ingress imports this module's settings without the engine
    from engine.async_engine import AsyncLLMEngine


class HealthArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    check_period_s: float = Field(
        2.0,
        gt=0.0,
        description="How often Serve checks each engine replica's health, and the control "
        "plane's actors' (the cluster controller, the LoRA board, the app's tables).",
    )
    check_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="A health check unanswered this long counts as failed (a stopped process, "
        "a hung event loop, an actor cut off from the network); after three failed checks in a "
        "row Serve replaces the replica.",
    )
    max_failed_steps: int = Field(
        3, ge=1, description="Consecutive failed engine steps that make a replica unhealthy."
    )
    step_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="One engine step running longer than this makes a replica unhealthy.",
    )
    graceful_shutdown_timeout_s: float = Field(
        60.0,
        ge=0.0,
        description="How long an engine replica being removed (downscale, redeploy) may "
        "finish its streams; those still running then resume at another replica.",
    )
    ingress_graceful_shutdown_timeout_s: float = Field(
        600.0,
        ge=0.0,
        description="How long an ingress replica being removed keeps serving the responses it "
        "has open: the clients' connections end there and cannot move, so this bounds the "
        "longest response a redeploy leaves whole (new requests go to the new replicas).",
    )
    move_on_stop: bool = Field(
        True,
        description="An engine replica being removed moves its sequences, with their KV, to "
        "other replicas at once and is gone in seconds, instead of finishing them within "
        "graceful_shutdown_timeout_s (the clients' streams go on unbroken either way).",
    )


def health_problem(engine: AsyncLLMEngine, args: HealthArgs) -> str | None:
    """Why the replica is unhealthy, or None."""
    if engine.loop_error is not None:
        return f"engine loop died: {engine.loop_error!r}"
    runner_problem = getattr(engine.engine.runner, "health_problem", None)
    problem = runner_problem() if runner_problem is not None else None
    if problem is not None:  # e.g. a tensor-parallel rank's process ended
        return problem
    failed = engine.engine.num_failed_steps_in_a_row
    if failed >= args.max_failed_steps:
        return f"{failed} engine steps in a row failed"
    running = engine.step_running_s
    if running > args.step_timeout_s:
        return f"an engine step has run {running:.0f} s (step_timeout_s {args.step_timeout_s:g})"
    return None
