"""Chaos: stored responses outlive the ingress replica that made them. A conversation goes
on through previous_response_id for three turns, then the ingress replica is killed and,
once Serve has started another, the conversation continues where it was (the store is its
own deployment), its texts those of the chat route for the same messages."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.chaos.conftest import APP

pytestmark = pytest.mark.timeout(300)

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 8}


def _chat_text(client: openai.OpenAI, messages: list[dict]) -> str:
    chat = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_completion_tokens=8
    )
    return chat.choices[0].message.content or ""


def _kill_the_ingress_replica() -> None:
    found = subprocess.run(
        ["pgrep", "-f", f"ServeReplica:{APP}:OpenAIIngress"], capture_output=True, text=True
    )
    pids = found.stdout.split()
    assert len(pids) == 1, found.stdout
    os.kill(int(pids[0]), signal.SIGKILL)


def test_a_conversation_goes_on_after_its_ingress_replica_died(serve_cluster, chaos_app):
    client = openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused", max_retries=0)
    messages: list[dict] = []
    previous = None
    for turn in range(3):
        said = f"Turn {turn}: go on."
        response = client.responses.create(input=said, previous_response_id=previous, **GREEDY)
        messages += [{"role": "user", "content": said}]
        assert response.output_text == _chat_text(client, messages)
        messages += [{"role": "assistant", "content": response.output_text}]
        previous = response.id
    _kill_the_ingress_replica()
    deadline = time.monotonic() + 120  # Serve starts another ingress replica
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{serve_cluster.v1(APP)}/models", timeout=5).status_code == 200:
                break
        assert time.monotonic() < deadline
        time.sleep(1)
    assert client.responses.retrieve(previous).output_text == messages[-1]["content"]
    after = client.responses.create(input="And now?", previous_response_id=previous, **GREEDY)
    messages += [{"role": "user", "content": "And now?"}]
    assert after.output_text == _chat_text(client, messages)
