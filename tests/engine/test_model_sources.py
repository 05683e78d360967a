"""Models as users name them: a Hub id through huggingface_hub's real download path (against
tests/hub_server.py on loopback, `HF_ENDPOINT` pointed at it), an s3:// URI through s3fs
(against moto's S3 server on loopback), each fetched once per node into its cache; every
failure at start one error naming the field."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

from engine.core.errors import InvalidParam
from engine.core.sampling_params import SamplingParams
from engine.model.model_source import check_source, local_checkpoint, served_name, source_kind
from tests.hub_server import HubRepo, HubServer
from tests.lora_adapters import lora_adapters


@pytest.fixture
def hub(tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """acme/tiny (main: the tiny checkpoint; v2: the same with another generation config),
    acme/tiny-sql (a LoRA adapter of it), acme/private (a token's only), acme/gated,
    acme/pickled (no safetensors); an empty cache."""
    v2 = tmp_path / "v2"
    shutil.copytree(tiny_model, v2)
    (v2 / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    main = Path(tiny_model)
    server = HubServer(
        {
            "acme/tiny": HubRepo({"main": main, "v2": v2}),
            "acme/tiny-sql": HubRepo({"main": Path(lora_adapters(tiny_model)["sql"])}),
            "acme/private": HubRepo({"main": main}, token="hf_secret"),
            "acme/gated": HubRepo({"main": main}, gated=True),
            "acme/pickled": HubRepo({"main": pickled}),
        }
    ).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield server
    server.stop()


def test_sources_are_told_apart(tiny_model: str) -> None:
    assert source_kind(tiny_model) == "local"
    assert source_kind("Qwen/Qwen3-8B") == "hub"
    assert source_kind("s3://bucket/llama/") == "bucket"
    assert source_kind("./not-here") == "local"  # a path, found missing by the loader
    with pytest.raises(InvalidParam, match="unknown scheme 'ftp'") as err:
        source_kind("ftp://host/model")
    assert err.value.param == "model"
    assert served_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # as vLLM names it
    assert served_name(tiny_model) == "tiny"
    assert served_name("s3://bucket/llama-8b/") == "llama-8b"


def test_a_hub_id_serves_after_one_download_per_node(hub: HubServer, tiny_model: str) -> None:
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.oracle import HFOracle

    engine = LLMEngine(EngineConfig(model="acme/tiny"))
    files = {name for _, name in hub.downloads}
    # Config, tokenizer, chat template, generation config, weights: each fetched once.
    assert files == {p.name for p in Path(tiny_model).iterdir()}
    assert hub.num_downloads() == len(files)
    prompt = [5, 17, 42, 99, 3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    assert out.token_ids == HFOracle(tiny_model).greedy(prompt, 8)

    # A second start on this node fetches nothing.
    again = local_checkpoint("acme/tiny")
    assert Path(again) == Path(engine.config.model)
    assert hub.num_downloads() == len(files)


def test_a_draft_model_and_a_lora_adapter_by_hub_id(hub: HubServer, tiny_model: str) -> None:
    from engine.core.config import EngineConfig, SpeculativeConfig
    from engine.core.lora_config import LoRAConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.oracle import HFOracle

    engine = LLMEngine(
        EngineConfig(
            model=tiny_model,
            speculative=SpeculativeConfig(
                enabled=True, method="draft_model", model="acme/tiny", adaptive=False
            ),
            lora=LoRAConfig(enabled=True, adapters={"sql": "acme/tiny-sql"}),
        )
    )
    assert {repo for repo, _ in hub.downloads} == {"acme/tiny", "acme/tiny-sql"}
    prompt = [5, 17, 42, 99, 3, 5, 17, 42]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (base,) = engine.generate([prompt], params)
    assert base.token_ids == HFOracle(tiny_model).greedy(prompt, 8)
    (sql,) = engine.generate([prompt], params, loras=["sql"])
    adapter = lora_adapters(tiny_model)["sql"]
    assert sql.token_ids == HFOracle(tiny_model, adapter).greedy(prompt, 8)
    assert sql.token_ids != base.token_ids  # the adapter was applied
    # The ingress names the adapter by its source: the same source is the same adapter.
    assert engine.loras.holds("sql", "acme/tiny-sql")


def test_an_ingress_fetches_all_but_the_weights(hub: HubServer, s3, tiny_model: str) -> None:
    """What an ingress reads (config, tokenizer, chat template), then, on the same node, an
    engine replica: only the weights are fetched then."""
    _, endpoint = s3
    local = Path(local_checkpoint("acme/tiny", weights=False))
    assert not (local / "model.safetensors").exists()
    assert (local / "tokenizer.json").is_file() and (local / "config.json").is_file()
    assert ("acme/tiny", "model.safetensors") not in hub.downloads
    before = hub.num_downloads()
    assert Path(local_checkpoint("acme/tiny")) == local
    assert (local / "model.safetensors").is_file()
    assert hub.downloads[("acme/tiny", "model.safetensors")] == 1
    assert hub.num_downloads() == before + 1

    light = Path(local_checkpoint("s3://ckpt/tiny/", endpoint_url=endpoint, weights=False))
    assert (light / "tokenizer.json").is_file() and not (light / "model.safetensors").exists()


def _resolve_in_a_process(source: str) -> None:
    local_checkpoint(source)


def test_replicas_starting_together_on_a_node_download_once(hub: HubServer) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_resolve_in_a_process, args=("acme/tiny",)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert hub.downloads and set(hub.downloads.values()) == {1}


def test_a_revision_is_served(hub: HubServer) -> None:
    v2 = Path(local_checkpoint("acme/tiny", revision="v2"))
    main = Path(local_checkpoint("acme/tiny"))
    assert v2 != main
    assert json.loads((v2 / "generation_config.json").read_text()) == {"temperature": 0.25}
    assert json.loads((main / "generation_config.json").read_text()) != {"temperature": 0.25}
    with pytest.raises(InvalidParam, match="has no revision 'v3'") as err:
        local_checkpoint("acme/tiny", revision="v3")
    assert err.value.param == "model"


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        ("acme/missing", "not a local directory, nor a repo at http://127.0.0.1"),
        ("acme/private", "unauthorized .HF_TOKEN unset."),
        ("acme/gated", "is gated"),
        ("acme/pickled", "no safetensors weights"),
    ],
)
def test_a_hub_failure_is_one_error_naming_the_field(hub: HubServer, source: str, cause: str):
    with pytest.raises(InvalidParam, match=cause) as err:
        local_checkpoint(source, "speculative.model")
    assert err.value.param == "speculative.model"
    assert str(err.value).startswith(f"speculative.model: {source}")


def test_a_source_is_checked_without_fetching_it(hub: HubServer, s3) -> None:
    """What a deploy checks before its replicas start: the same causes, nothing fetched."""
    _, endpoint = s3
    check_source("acme/tiny")
    check_source("acme/tiny", revision="v2")
    check_source("s3://ckpt/tiny/", endpoint_url=endpoint)
    for source, revision, cause in [
        ("acme/missing", None, "nor a repo at"),
        ("acme/tiny", "v3", "has no revision 'v3'"),
        ("acme/private", None, "unauthorized"),
        ("acme/pickled", None, "no safetensors weights"),
        ("s3://ckpt/elsewhere/", None, "nothing under this prefix"),
    ]:
        with pytest.raises(InvalidParam, match=cause) as err:
            check_source(source, "model", revision, endpoint)
        assert err.value.param == "model"
    assert hub.num_downloads() == 0
    assert not list((Path(os.environ["DYNABATCH_CACHE"]) / "buckets").glob("*/*/config.json"))


def test_a_token_opens_a_private_repo(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(InvalidParam, match="unauthorized .HF_TOKEN refused."):
        local_checkpoint("acme/private")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert (Path(local_checkpoint("acme/private")) / "model.safetensors").is_file()


def test_offline_serves_from_a_warm_cache_only(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm = local_checkpoint("acme/tiny")
    hub.stop()  # nothing answers now
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert local_checkpoint("acme/tiny") == warm
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cold"))
    with pytest.raises(InvalidParam, match="not in the cache at .*HF_HUB_OFFLINE is set") as err:
        local_checkpoint("acme/tiny")
    assert err.value.param == "model"


@pytest.fixture
def s3(tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """moto's S3 server on loopback with bucket `ckpt` holding the tiny checkpoint under
    `tiny/`; (boto3 client, endpoint URL)."""
    import boto3
    from moto.server import ThreadedMotoServer

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("DYNABATCH_CACHE", str(tmp_path / "cache"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="ckpt")
    for f in Path(tiny_model).iterdir():
        client.upload_file(str(f), "ckpt", f"tiny/{f.name}")
    _fresh_s3fs()
    yield client, endpoint
    server.stop()
    _fresh_s3fs()


def _fresh_s3fs() -> None:
    """s3fs keeps one filesystem per set of options: the next one reads the credentials anew."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def test_an_s3_checkpoint_is_copied_once_and_again_where_it_changed(s3, tiny_model: str):
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    client, endpoint = s3
    uri = "s3://ckpt/tiny/"
    engine = LLMEngine(EngineConfig(model=uri, object_store_endpoint_url=endpoint))
    first = Path(engine.config.model)
    weights = first / "model.safetensors"
    assert weights.read_bytes() == (Path(tiny_model) / "model.safetensors").read_bytes()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[5, 6, 7]], params)[0].token_ids) == 4

    # Unchanged: the same copy, nothing fetched (the files are the ones made the first time).
    inode = weights.stat().st_ino
    assert Path(local_checkpoint(uri, endpoint_url=endpoint)) == first
    assert weights.stat().st_ino == inode

    # One object changed: a new copy with it fetched again, the others linked from the first.
    client.put_object(Bucket="ckpt", Key="tiny/generation_config.json", Body=b'{"top_k": 3}')
    second = Path(local_checkpoint(uri, endpoint_url=endpoint))
    assert second != first
    assert json.loads((second / "generation_config.json").read_text()) == {"top_k": 3}
    assert (second / "model.safetensors").stat().st_ino == inode


def test_an_s3_failure_is_one_error_naming_the_field(s3, monkeypatch: pytest.MonkeyPatch) -> None:
    _, endpoint = s3
    for uri, cause in [
        ("s3://nobucket/tiny/", "no such bucket"),
        ("s3://ckpt/elsewhere/", "nothing under this prefix"),
    ]:
        with pytest.raises(InvalidParam, match=cause) as err:
            local_checkpoint(uri, endpoint_url=endpoint)
        assert err.value.param == "model"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    _fresh_s3fs()
    with pytest.raises(InvalidParam, match="no credentials found") as err:
        local_checkpoint("s3://ckpt/tiny/", endpoint_url=endpoint)
    assert err.value.param == "model"
