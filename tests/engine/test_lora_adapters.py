"""LoRA adapters' loading: a malformed directory or an adapter of another base is refused
with the file or field at fault; adapters are added, found on the search path and removed
while requests run, which finish with the adapter they started with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine.core.errors import InvalidParam, UnknownModel
from engine.core.sampling_params import SamplingParams
from engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter
from engine.model.loader import read_spec
from tests.conftest import build_engine
from tests.engine.oracle import HFOracle
from tests.lora_adapters import lora_adapters


@pytest.fixture(scope="module")
def adapters(tiny_model) -> dict[str, str]:
    return lora_adapters(tiny_model)


def broken_copy(src: str, dest: Path, config=None, weights=None) -> str:
    """A copy of adapter `src` whose config and weights the callables change."""
    shutil.copytree(src, dest)
    if config is not None:
        data = json.loads((dest / CONFIG_FILE).read_text())
        config(data)
        (dest / CONFIG_FILE).write_text(json.dumps(data))
    if weights is not None:
        tensors = load_file(dest / WEIGHTS_FILE)
        weights(tensors)
        save_file(tensors, dest / WEIGHTS_FILE)
    return str(dest)


def _widen_first_a(tensors):
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = tensors[key].repeat(1, 2)  # as an adapter of a base twice as wide


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"drop": CONFIG_FILE}, CONFIG_FILE),
        ({"drop": WEIGHTS_FILE}, WEIGHTS_FILE),
        ({"config": lambda c: c.update(r=64)}, "r"),
        ({"config": lambda c: c.update(use_dora=True)}, "use_dora"),
        ({"config": lambda c: c.update(bias="all")}, "bias"),
        ({"weights": _widen_first_a}, WEIGHTS_FILE),
        ({"weights": lambda t: t.update(bad=t.popitem()[1])}, "target_modules"),
        ({"weights": lambda t: [t.pop(k) for k in list(t) if "lora_B" in k]}, WEIGHTS_FILE),
    ],
)
def test_a_bad_adapter_is_refused_naming_its_fault(tiny_model, adapters, tmp_path, change, param):
    path = broken_copy(
        adapters["sql"], tmp_path / "bad", change.get("config"), change.get("weights")
    )
    if "drop" in change:
        (Path(path) / change["drop"]).unlink()
    with pytest.raises(InvalidParam) as err:
        read_adapter(path, read_spec(tiny_model), 16)
    assert err.value.param == param
    assert param in str(err.value)


def test_invalid_json_names_the_file(tiny_model, adapters, tmp_path):
    path = broken_copy(adapters["sql"], tmp_path / "bad")
    (Path(path) / CONFIG_FILE).write_text("{not json")
    with pytest.raises(InvalidParam, match=CONFIG_FILE):
        read_adapter(path, read_spec(tiny_model), 16)


def test_adapters_added_found_and_removed_while_requests_run(tiny_model, adapters, tmp_path):
    search = tmp_path / "search"
    shutil.copytree(adapters["code"], search / "found")
    engine = build_engine(
        tiny_model, lora={"adapters": {"sql": adapters["sql"]}, "search_path": str(search)}
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10]
    engine.add_request("sql-1", prompt, params, lora="sql")
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    step()
    copy = shutil.copytree(adapters["chat"], tmp_path / "chat")
    engine.loras.add("chat", str(copy))  # at run time, between steps
    shutil.rmtree(copy)  # read once, at registration: the slot loads from host memory
    engine.add_request("chat-1", prompt, params, lora="chat")
    engine.add_request("found-1", prompt, params, lora="found")  # from the search path
    step()
    engine.loras.remove("sql")  # sql-1 goes on with it; new requests cannot name it
    with pytest.raises(UnknownModel) as err:
        engine.add_request("sql-2", prompt, params, lora="sql")
    assert err.value.param == "model" and "sql" in str(err.value)
    with pytest.raises(UnknownModel):
        engine.add_request("nope", prompt, params, lora="no-such-adapter")
    while engine.has_unfinished_requests():
        step()
    engine.scheduler.check_integrity()
    for rid, path in (
        ("sql-1", adapters["sql"]),
        ("chat-1", adapters["chat"]),
        ("found-1", adapters["code"]),
    ):
        assert tokens[rid] == HFOracle(tiny_model, path).greedy(prompt, 12), rid
    assert sorted(engine.loras.names()) == ["chat", "found"]


def test_an_engine_without_lora_refuses_adapter_names(tiny_model):
    engine = build_engine(tiny_model)
    with pytest.raises(UnknownModel):
        engine.add_request("r", [1, 2, 3], lora="sql")
