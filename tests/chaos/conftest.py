"""The chaos suite's own app (`chaos`, 2 engine replicas, 1 ingress, fast health checks) on
the session's local Serve, so the replicas it kills and stops serve nobody else's tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.local_serve import ServeCluster, app_args, metric_total

APP = "chaos"


def chaos_args(model: str, **overrides: Any) -> dict[str, Any]:
    """The chaos app's args: the tests' sizes, fast health checks, a long request timeout, a
    small bound on the tokens waiting for a client that does not read."""
    health = {"check_period_s": 1, "check_timeout_s": 2}
    api = {"max_unsent_tokens": 64}
    return app_args(model, request_timeout_s=60, health=health, api=api, **overrides)


# The chaos app's second model: a mixture of experts (gpt-oss: other weights, other tokens,
# the expert path, attention sinks and windowed layers over HTTP), one engine replica of its
# own beside `tiny`'s two; its streams must not notice a fault of `tiny`'s replicas. Its
# deltas come on each request's own call (delta_channels false), so every fault here meets
# both of the ingress's ways of streaming.
OTHER_ARCH = "gpt-oss"
OTHER = f"tiny-{OTHER_ARCH}"


def deploy(serve_cluster: ServeCluster, **overrides: Any) -> None:
    """(Re)deploy the chaos app, `tiny` and OTHER; returns once it runs."""
    from ray import serve

    from serve_app import build_app
    from tests.conftest import tiny_model_dir

    args = chaos_args(serve_cluster.model, **overrides)
    tiny = {"model": args.pop("model"), "served_model_name": args.pop("served_model_name")}
    other = {
        "model": tiny_model_dir(OTHER_ARCH),
        "served_model_name": OTHER,
        "engine": {"lora": {"enabled": False, "adapters": {}, "search_path": None}},
        "engine_replicas": {"num_replicas": 1},
        "delta_channels": False,
    }
    serve.run(build_app(args | {"models": [tiny, other]}), name=APP, route_prefix=f"/{APP}")


@pytest.fixture(scope="package")  # gone after tests/chaos: idle replicas still cost CPU
def chaos_app(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    deploy(serve_cluster)
    yield APP
    serve.delete(APP)


PROMPTS = [f"Story {i}: once upon a time" for i in range(16)]
MAX_TOKENS = 400
READ_TIMEOUT_S = 180.0


async def run_all(
    base_url: str,
    kill: asyncio.Event | None = None,
    gaps: list[float] | None = None,
    until: Callable[[], bool] | None = None,
) -> list[str]:
    """PROMPTS[:12] streamed and PROMPTS[12:] whole, greedy; returns their texts. With `kill`,
    set it once every stream has its first two chunks; with `gaps`, each stream's longest
    wait between two chunks goes there; with `until`, each request is sent again as soon as
    it ends, until until() holds, and must answer as the first time."""
    # A stream that stops for READ_TIMEOUT_S fails (its error shows) rather than hang its test.
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=READ_TIMEOUT_S
    )
    kwargs = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    started = 0

    async def streamed(prompt: str) -> str:
        nonlocal started
        text, counted, request_id, longest = [], False, None, 0.0
        try:
            stream = await client.completions.create(prompt=prompt, stream=True, **kwargs)
            last = time.monotonic()
            async for chunk in stream:
                now = time.monotonic()
                longest, last = max(longest, now - last), now
                text.append(chunk.choices[0].text)
                request_id = chunk.id
                if not counted and len(text) >= 2:  # the rest comes through its delta channel
                    counted, started = True, started + 1
                    if kill is not None and started == 12:
                        kill.set()
        except openai.APIError as exc:  # which request, for the server's logs
            raise AssertionError(f"{request_id} failed after {len(text)} chunks: {exc!r}") from exc
        if gaps is not None:
            gaps.append(longest)
        return "".join(text)

    async def whole(prompt: str) -> str:
        return (await client.completions.create(prompt=prompt, **kwargs)).choices[0].text

    async def repeated(send: Callable[[str], Awaitable[str]], prompt: str) -> str:
        text = await send(prompt)
        while until is not None and not until():
            again = await send(prompt)
            assert again == text, differences([again], [text])
        return text

    tasks = [repeated(streamed, p) for p in PROMPTS[:12]]
    tasks += [repeated(whole, p) for p in PROMPTS[12:]]
    return list(await asyncio.gather(*tasks))


async def run_other(base_url: str) -> list[str]:
    """OTHER's streams beside run_all's: 4 streamed, greedy (long enough to outlast the
    fault, which comes once run_all's streams have begun); returns their texts."""
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=READ_TIMEOUT_S
    )

    async def streamed(prompt: str) -> str:
        stream = await client.completions.create(
            model=OTHER,
            prompt=prompt,
            max_tokens=160,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    return list(await asyncio.gather(*(streamed(f"Other {i}: far away") for i in range(4))))


def engine_replica_stats(
    serve_cluster: ServeCluster, timeout: float = 60.0, model: str = "tiny"
) -> dict[str, dict]:
    """Stats of every live engine replica of the chaos app's `model`, each asked by its id."""
    from loadtests.soak.cli import engine_stats

    seen = engine_stats(serve_cluster.engine_handle(APP, model), APP, timeout=timeout)
    assert seen, f"the {APP} app's {model} replicas did not all answer within {timeout:g} s"
    return seen


async def run_with_fault(base_url: str, fault: Callable[[], None]) -> list[str]:
    """run_all, with `fault` done once every stream has its first tokens. A request that
    fails before that ends the run (its error shows) rather than leave it waiting."""
    started = asyncio.Event()
    task = asyncio.create_task(run_all(base_url, started))
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        fault()
    return await task


def sequences_resumed(app_url: str, model: str = "tiny") -> float:
    """The app's count of `model`'s sequences resumed at another replica (its /metrics)."""
    return metric_total(app_url, f'dynabatch_sequences_resumed_total{{model="{model}"}} ')


def differences(texts: list[str], expected: list[str]) -> list[dict[str, int]]:
    """Where each text that differs from its expected one first does (for a failure's message)."""
    found = []
    for i, (text, want) in enumerate(zip(texts, expected, strict=True)):
        if text != want:
            at = len(os.path.commonprefix([text, want]))
            found.append({"request": i, "at": at, "len": len(text), "expected_len": len(want)})
    return found


STAGE = "[stage] "
# How long an interrupted harness has to take its cluster down before it is killed.
HARNESS_STOP_S = 60


def stage(text: str) -> None:
    """A harness's progress on its stderr (what a timeout's message shows)."""
    print(f"{STAGE}{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_json(command: list[str], cwd: Path, timeout: float) -> dict[str, Any]:
    """Run a harness that prints one JSON object last (a Ray cluster of its own in its own
    process); its result, once it exited 0. One that runs past `timeout` is interrupted
    first, so that its `finally` takes its cluster down (a killed one leaves the cluster
    running, and /tmp/ray/ray_current_cluster naming it for every later bare ray.init)."""
    harness = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # SIGINT as Python expects it: a shell's background job (`make test &`) starts with
        # it ignored, and a child that inherits that never raises KeyboardInterrupt.
        preexec_fn=_default_sigint,
    )
    try:
        stdout, stderr = harness.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        harness.send_signal(signal.SIGINT)
        try:
            stdout, stderr = harness.communicate(timeout=HARNESS_STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(harness.pid, signal.SIGKILL)
            stdout, stderr = harness.communicate()
        stages = "\n".join(line for line in stderr.splitlines() if line.startswith(STAGE))
        raise AssertionError(
            f"timed out after {timeout:g} s:\n{stages}\n{stderr[-2000:]}"
        ) from None
    assert harness.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])
