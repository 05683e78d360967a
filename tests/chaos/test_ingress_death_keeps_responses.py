"""Chaos: stored responses outlive the ingress replicas that made them. With two ingress
replicas, a conversation goes on through previous_response_id turn after turn (through
either replica), then every ingress replica is killed and, once Serve has started others,
the conversation continues where it was: the store is its own deployment. (Runs before
test_redeploy.py by name: that test leaves the app with one engine replica, for the rest of
the suite's CPU.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.chaos.conftest import APP, deploy

pytestmark = pytest.mark.timeout(300)

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 8}


def _chat_text(client: openai.OpenAI, messages: list[dict]) -> str:
    chat = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_completion_tokens=8
    )
    return chat.choices[0].message.content or ""


def _kill_every_ingress_replica() -> None:
    found = subprocess.run(
        ["pgrep", "-f", f"ServeReplica:{APP}:OpenAIIngress"], capture_output=True, text=True
    )
    pids = found.stdout.split()
    assert len(pids) == 2, found.stdout
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)


def test_a_conversation_goes_on_after_every_ingress_replica_died(serve_cluster, chaos_app):
    deploy(serve_cluster, ingress_replicas={"num_replicas": 2, "num_cpus": 0.25})
    try:
        client = openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused", max_retries=0)
        messages: list[dict] = []
        previous = None
        for turn in range(4):
            said = f"Turn {turn}: go on."
            response = client.responses.create(input=said, previous_response_id=previous, **GREEDY)
            messages += [{"role": "user", "content": said}]
            assert response.output_text == _chat_text(client, messages)
            messages += [{"role": "assistant", "content": response.output_text}]
            previous = response.id
        _kill_every_ingress_replica()
        deadline = time.monotonic() + 120  # Serve starts other ingress replicas
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
    finally:
        deploy(serve_cluster)
