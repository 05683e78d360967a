"""The OpenAI API over real HTTP (openai client and httpx) against a real local Serve app."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from engine.core.sampling_params import SamplingParams
from loadtests.soak.watch import StackCapture
from serve_app.config import AppArgs

# The 64 streams take seconds; past this they hang (the watchdog then takes every stack).
STREAMS_DEADLINE_S = 120.0

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "Hello, world.",
    "The quick brown fox jumps over",
    "Café au lait, s'il vous plaît",
    "def step(self):\n    return",
    "In the beginning",
    "1 2 3 4 5 6 7 8",
]


@pytest.fixture(scope="module")
def reference_engine(serve_cluster):
    """The same engine settings, in process: the HTTP path must give the same greedy tokens."""
    from engine.llm_engine import LLMEngine

    args = AppArgs.model_validate(serve_cluster.args)
    return LLMEngine(args.engine.engine_config(serve_cluster.model))


@pytest.fixture(scope="module")
def client(serve_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)


def _greedy(engine, prompts, max_tokens: int, **kw) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return [r.text for r in engine.generate(prompts, params)]


def test_models_health_and_metrics(serve_cluster, client):
    models = client.models.list()
    assert models.data[0].id == "tiny"  # then the LoRA adapters (tests/serve/test_lora_http.py)
    assert httpx.get(f"{serve_cluster.base_url}/health").status_code == 200
    client.completions.create(model="tiny", prompt="metrics", max_tokens=2)
    metrics = httpx.get(f"{serve_cluster.base_url}/metrics")
    assert metrics.status_code == 200
    assert 'dynabatch_requests_total{endpoint="completions",model="tiny",status="200"}' in (
        metrics.text
    )
    assert "dynabatch_time_to_first_token_seconds_bucket" in metrics.text


def test_completions_equal_in_process_engine(client, reference_engine):
    expected = _greedy(reference_engine, PROMPTS, 24)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        res = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert res.choices[0].text == want
        assert res.choices[0].finish_reason == "length"
        n_prompt = len(reference_engine.tokenize(prompt))
        assert res.usage.prompt_tokens == n_prompt
        assert res.usage.completion_tokens == 24
        assert res.usage.total_tokens == n_prompt + 24


def test_an_app_serves_a_hub_id_downloaded_once_per_node(serve_cluster, reference_engine):
    """The `narrow` app's model is `acme/tiny` on tests/hub_server.py: its ingress (tokenizer,
    chat template) and its engine replica (weights) each resolved it on this node, and the
    node downloaded each file once; it answers as the same checkpoint does in process."""
    from tests.local_serve import HUB_MODEL, NARROW_AUTH

    base = serve_cluster.v1("narrow")
    card = httpx.get(f"{base}/models", headers=NARROW_AUTH).json()["data"][0]
    assert (card["id"], card["root"]) == ("tiny", HUB_MODEL)
    hub = serve_cluster.hub
    assert {repo for repo, _ in hub.downloads} == {HUB_MODEL}
    assert "model.safetensors" in {name for _, name in hub.downloads}
    assert set(hub.downloads.values()) == {1}
    narrow = openai.OpenAI(base_url=base, api_key="narrow-key", max_retries=0)
    res = narrow.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert res.choices[0].text == _greedy(reference_engine, [PROMPTS[1]], 16)[0]
    # What each replica did at start is in its own log (Serve's, under the session's logs).
    for deployment, line in [
        ("EngineServer", f"model: {HUB_MODEL}@main from {hub.endpoint}"),
        ("EngineServer", "attention backend "),
        ("OpenAIIngress", f"model: {HUB_MODEL}@main is "),
    ]:
        assert line in _replica_log("narrow", deployment), (deployment, line)


def _replica_log(app: str, deployment: str) -> str:
    from pathlib import Path

    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    files = sorted(logs.glob(f"replica_{app}_{deployment}_*.log"))
    assert files, sorted(p.name for p in logs.iterdir())
    return "".join(f.read_text() for f in files)


def test_streamed_completion_equals_whole(client, reference_engine):
    want = _greedy(reference_engine, [PROMPTS[1]], 40)[0]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


@pytest.mark.timeout(60)
def test_one_token_requests_end_after_their_first_delta(client, reference_engine):
    """The first delta is also the last: nothing follows on the delta channel."""
    want = _greedy(reference_engine, [PROMPTS[2]], 1)[0]
    for stream in (True, False):
        got = client.completions.create(
            model="tiny", prompt=PROMPTS[2], max_tokens=1, temperature=0, stream=stream
        )
        text = (
            "".join(c.choices[0].text for c in got if c.choices) if stream else got.choices[0].text
        )
        assert text == want


def test_chat_streaming_and_not(client, reference_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tok = reference_engine.tokenizer
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    want = _greedy(reference_engine, [ids], 16)[0]
    whole = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.content == want
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(ids) + 16


def test_chat_without_max_tokens_fills_the_context(client):
    res = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        temperature=0,
        max_tokens=None,
        extra_body={"ignore_eos": True},
    )
    assert res.usage.total_tokens == 512  # max_model_len of the test app


def test_stop_string_is_cut(client, reference_engine):
    full = _greedy(reference_engine, [PROMPTS[2]], 32)[0]
    stop = full[10:14]
    assert stop.strip(), full
    res = client.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=32,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert res.choices[0].finish_reason == "stop"
    assert res.choices[0].text == full[: full.index(stop)]


def test_seed_reproduces_sampled_output(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model="tiny",
                prompt="Once upon a time",
                max_tokens=24,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_priority_is_accepted(client, reference_engine):
    """`priority` (vLLM's extension) reaches the engine; fcfs ignores it, output unchanged."""
    body = client.completions.create(
        model="tiny", prompt="rank me", max_tokens=5, temperature=0, extra_body={"priority": -3}
    )
    plain = client.completions.create(model="tiny", prompt="rank me", max_tokens=5, temperature=0)
    assert body.choices[0].text == plain.choices[0].text


def test_64_concurrent_streams_complete_correctly(serve_cluster, reference_engine, tmp_path):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(64)]
    expected = _greedy(reference_engine, prompts, 16)
    chunks: dict[int, int] = {}  # stream -> chunks so far (a stream that hangs shows where)

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks[i] = 0
        text = []
        async for c in stream:
            chunks[i] += 1
            text += [c.choices[0].text] if c.choices else []
        del chunks[i]
        return "".join(text)

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=serve_cluster.v1(),
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=128)),
        ) as client:
            streams = asyncio.gather(*(one(client, i) for i in range(64)))
            try:
                return await asyncio.wait_for(streams, STREAMS_DEADLINE_S)
            except TimeoutError:
                # Once hung in a suite run: keep what every process was doing, and say it.
                folder = StackCapture(tmp_path / "stacks").capture("64 streams hung")
                pytest.fail(f"streams still open (chunks so far): {chunks}; stacks in {folder}")

    before = serve_cluster.replica_stats("llm", 2)
    assert asyncio.run(run_all()) == expected
    # Both engine replicas took part, and every block came back.
    stats = serve_cluster.replica_stats("llm", 2)
    assert all(s["num_finished_total"].get("length", 0) > 0 for s in stats.values()), stats
    for s in stats.values():
        assert s["num_used_blocks"] == 0 and s["num_streams"] == 0, s
    # Every delta after the first came through the delta channels, many to a message.
    deltas = sum(
        stats[r]["channel_deltas_total"] - before[r]["channel_deltas_total"] for r in stats
    )
    batches = sum(
        stats[r]["channel_batches_total"] - before[r]["channel_batches_total"] for r in stats
    )
    steps = sum(stats[r]["num_steps_total"] - before[r]["num_steps_total"] for r in stats)
    on_links = sum(
        stats[r]["channel_link_batches_total"] - before[r]["channel_link_batches_total"]
        for r in stats
    )
    assert on_links == batches, (on_links, batches)  # every one on a delta link, none on Ray
    # At most one message per engine step (one ingress replica here), and many deltas to a
    # message on the whole (how many depends on how fast requests arrive against how fast
    # the engine steps: 3.8 measured with the whole suite loading the machine, 4+ idle).
    assert batches <= steps, (batches, steps)
    assert deltas >= 64 and batches * 2 <= deltas, (deltas, batches)
    # Idle subscriptions end and their outboxes go.
    deadline = time.monotonic() + 20
    while any(s["num_channels"] for s in stats.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        stats = serve_cluster.replica_stats("llm", 2)
    assert not any(s["num_channels"] for s in stats.values()), stats
