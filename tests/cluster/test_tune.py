"""The tuner: trace files checked row by row, a reachable SLO met by the cheapest setting and
written as deploy.yaml args that AppArgs accepts, an impossible SLO answered with what
binds, and an interrupted search that keeps its trials."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from cluster.request_records import Slo
from cluster.trace_file import TraceError, load_trace, save_trace
from cluster.tune.cli import main as tune_main
from cluster.tune.problem import Problem
from cluster.tune.report import Target, binding, cheapest
from cluster.tune.search import RUNG_SHARES, pareto_front, plan, search
from cluster.tune.space import Setting, Space
from cluster.tune.trial_pool import LocalPool
from cluster.workload import make_workload
from engine.runner.cost_model import GPUS, MODELS, CostParams

TRACE = make_workload(300, 6.0, seed=2)
SPACE = {
    "max_num_seqs": [8, 64],
    "target_waiting": [2.0, 8.0],
    "max_replicas": [3],
    "startup_delay_s": [10.0],
}


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "row: not JSON"),
        ('["a list"]', "row: must be a JSON object"),
        ('{"prompt_len": 5, "output_len": 5}', "arrival_s: must be a number >= 0, got None"),
        ('{"arrival_s": -1, "prompt_len": 5, "output_len": 5}', "arrival_s"),
        ('{"arrival_s": 1, "prompt_len": 0, "output_len": 5}', "prompt_len: must be an integer"),
        ('{"arrival_s": 1, "prompt_len": 5, "output_len": "9"}', "output_len: must be an integer"),
        ('{"arrival_s": 1, "prompt_len": 5, "output_len": 2.5}', "output_len"),
        ('{"arrival_s": 1, "prompt_len": 5, "output_len": 5, "adapter": 3}', "adapter"),
        ('{"arrival_s": 1, "prompt_len": 5, "output_len": 5, "model": ["m"]}', "model"),
        (
            '{"arrival_s": 0.5, "prompt_len": 5, "output_len": 5, "request_id": "a"}',
            "request_id: 'a' appears twice",
        ),
    ],
)
def test_a_bad_row_names_its_line_and_field(tmp_path, line, field):
    path = tmp_path / "trace.jsonl"
    good = '{"arrival_s": 0.5, "prompt_len": 5, "output_len": 5, "request_id": "a"}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceError, match=f"line 3: {field}"):
        load_trace(path)


def test_trace_round_trip(tmp_path):
    save_trace(TRACE, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == TRACE


def problem(slo: Slo) -> Problem:
    return Problem(TRACE, MODELS["Llama-2-7B"], GPUS["A100-80GB"], CostParams(), slo)


def test_reachable_slo_cheapest_setting_meets_it_and_deploys(tmp_path):
    from serve_app.config import AppArgs

    target = Target(Slo(ttft_s=2.0, itl_s=0.1), attainment=0.9)
    trials, complete = search(problem(target.slo), Space.of(SPACE), 8, tmp_path / "t.jsonl")
    assert complete and len(trials) == 4  # the whole grid
    chosen = cheapest(trials, target)
    assert chosen is not None and chosen["sla_attainment"] >= 0.9
    assert all(t["replica_hours"] >= chosen["replica_hours"] for t in trials if target.met(t))
    # Eight sequences per replica cannot keep up at one replica: more replicas, or the SLO missed.
    small = [t for t in trials if t["setting"]["max_num_seqs"] == 8]
    assert all(t["replica_hours"] > chosen["replica_hours"] or not target.met(t) for t in small)
    assert chosen in pareto_front(trials)
    args = Setting(**chosen["setting"]).deploy_args()
    app = AppArgs(model="models/tiny", **args)
    assert app.engine.max_num_seqs == chosen["setting"]["max_num_seqs"]
    assert app.autoscaling.target_waiting == chosen["setting"]["target_waiting"]
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 4


def test_impossible_slo_reports_none_and_what_binds(tmp_path):
    target = Target(Slo(ttft_s=0.001, itl_s=0.1), attainment=0.9)
    trials, _ = search(problem(target.slo), Space.of(SPACE), 4, tmp_path / "t.jsonl")
    assert len(trials) == 4  # a budget of the grid's size covers all of it
    assert cheapest(trials, target) is None
    why = binding(trials, target)
    assert why[0].startswith("TTFT <= 0.001 s: at best 0.0%")


def test_successive_halving_promotes_the_best_within_the_budget(tmp_path):
    """24 settings, a budget of 6 whole-trace runs: 5 settings on the trace run 3x faster
    (a third of its requests), the best 2 by Pareto rank on the whole trace, then 2 more
    (the front's neighbours) with what is left."""
    space = Space.of(
        {
            "max_num_seqs": [4, 8, 16, 64],
            "target_waiting": [1.0, 2.0, 8.0],
            "max_replicas": [1, 3],
            "startup_delay_s": [10.0],
        }
    )
    third = RUNG_SHARES[0]
    assert plan(space.size, 6) == [(5, third), (2, 1.0), (2, 1.0)]
    runs: list[dict] = []
    trials, complete = search(
        problem(Slo(ttft_s=2.0, itl_s=0.1)), space, 6, tmp_path / "t.jsonl", progress=runs.append
    )
    screened = [r for r in runs if r.get("fraction") == third]
    assert len(screened) == 5 and len(trials) == 4 and complete
    assert trials == [r for r in runs if "fraction" not in r]
    assert sum(r.get("fraction", 1.0) for r in runs) <= 6
    assert all(t["requests"] > 2.9 * r["requests"] for t in trials for r in screened)

    def key(trial: dict) -> str:
        return json.dumps(trial["setting"], sort_keys=True)

    def dominates(a: dict, b: dict) -> bool:
        ours, theirs = (
            (a["replica_hours"], -a["sla_attainment"]),
            (
                b["replica_hours"],
                -b["sla_attainment"],
            ),
        )
        return ours != theirs and all(x <= y for x, y in zip(ours, theirs, strict=True))

    promoted = {key(t) for t in trials[:2]}
    kept = [r for r in screened if key(r) in promoted]
    assert len(kept) == 2
    assert not any(dominates(r, k) for r in screened if key(r) not in promoted for k in kept)


def test_worker_processes_find_what_one_process_finds(tmp_path):
    """Trials land in any order from two workers; the search takes each round in the order
    it asked, so it promotes and explores the same settings (the Ray pool likewise, on three
    nodes: tests/chaos/tune_nodes.py)."""
    space = Space.of(SPACE | {"max_replicas": [1, 3]})
    alone, _ = search(problem(Slo(ttft_s=2.0)), space, 5, tmp_path / "a.jsonl", seed=4)
    with LocalPool(2) as pool:
        shared, complete = search(
            problem(Slo(ttft_s=2.0)), space, 5, tmp_path / "b.jsonl", pool, seed=4
        )
    assert complete and len(shared) == len(alone) > 0

    def figures(trials):
        return [{k: v for k, v in t.items() if k != "wall_s"} for t in trials]

    assert figures(shared) == figures(alone)


def test_interrupted_search_keeps_finished_trials(tmp_path):
    seen = []

    def stop_after_two(trial):
        seen.append(trial)
        if len(seen) == 2:
            raise KeyboardInterrupt

    results = tmp_path / "t.jsonl"
    trials, complete = search(problem(Slo()), Space.of(SPACE), 4, results, progress=stop_after_two)
    assert not complete and len(trials) == 2
    assert [json.loads(line) for line in results.read_text().splitlines()] == trials


def test_cli_writes_report_fragment_and_pictures(tmp_path, capsys):
    save_trace(TRACE, tmp_path / "trace.jsonl")
    out = tmp_path / "out"
    argv = ["--trace", str(tmp_path / "trace.jsonl"), "--slo", "ttft=2", "--slo", "itl=0.1"]
    argv += ["--slo", "e2e_p99=120", "--trials", "4", "--workers", "2", "--out", str(out)]
    argv += [f"--set={k}={','.join(map(str, v))}" for k, v in SPACE.items()]
    result = tune_main(argv + ["--json"])
    # 72 settings (the default space's other knobs too): 4 on a third of the trace, the best
    # 2 on all of it.
    assert result["trials"] == 2 and result["complete"]
    assert result["chosen"] is not None and result["chosen"]["e2e_p99_s"] <= 120
    fragment = yaml.safe_load((out / "tuned.yaml").read_text())
    assert fragment == Setting(**result["chosen"]["setting"]).deploy_args()
    assert (out / "front.png").stat().st_size > 0 and (out / "replicas.png").stat().st_size > 0
    assert "Pareto front" in (out / "report.md").read_text()
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["trials"] == 2


def test_a_trace_of_two_models_tunes_each_and_writes_their_models_entries(tmp_path):
    """Each model's own requests on its own replicas (and its own cost model): two searches,
    one `models:` entry each in tuned.yaml, which AppArgs takes once the checkpoints are in."""
    from dataclasses import replace

    from serve_app.config import AppArgs

    light = make_workload(150, 3.0, seed=3)
    trace = [replace(r, model="chat") for r in TRACE]
    trace += [replace(r, request_id=f"b{r.request_id}", model="acme/batch") for r in light]
    save_trace(trace, tmp_path / "trace.jsonl")
    assert {r.model for r in load_trace(tmp_path / "trace.jsonl")} == {"chat", "acme/batch"}
    out = tmp_path / "out"
    argv = ["--trace", str(tmp_path / "trace.jsonl"), "--slo", "ttft=2", "--slo", "itl=0.1"]
    argv += ["--model", "Llama-2-7B", "--model", "acme/batch=Llama-2-13B"]
    argv += ["--trials", "4", "--workers", "1", "--out", str(out)]
    argv += [f"--set={k}={','.join(map(str, v))}" for k, v in SPACE.items()]
    result = tune_main(argv)["models"]
    assert set(result) == {"chat", "acme/batch"}
    assert "Llama-2-13B" in (out / "acme_batch" / "report.md").read_text()
    assert "Llama-2-7B" in (out / "chat" / "report.md").read_text()
    entries = yaml.safe_load((out / "tuned.yaml").read_text())["models"]
    assert [e["served_model_name"] for e in entries] == ["acme/batch", "chat"]
    for entry in entries:
        chosen = result[entry["served_model_name"]]["chosen"]["setting"]
        assert {k: v for k, v in entry.items() if "model" not in k} == Setting(
            **chosen
        ).deploy_args()
    models = [entry | {"model": "models/tiny"} for entry in entries]
    app = AppArgs(models=models)
    assert [a.model_name for a in app.per_model()] == ["acme/batch", "chat"]
    with pytest.raises(SystemExit):  # a cost model for a model the trace does not name
        tune_main(argv + ["--model", "nope=Llama-2-7B"])


def test_cli_names_a_bad_knob_or_slo(tmp_path, capsys):
    for bad in (["--set", "max_num_seqs=lots"], ["--slo", "latency=2"], ["--set", "warp=9"]):
        with pytest.raises(SystemExit):
            tune_main(["--workload", "chat", "--slo", "ttft=2", *bad])
        assert bad[1].split("=")[0] in capsys.readouterr().err


def test_target_describes_itself():
    text = Target(Slo(2.0, 0.1, math.inf), 0.95, {"ttft_p99_s": 3.0}).describe()
    assert text == ">= 95% of requests with TTFT <= 2 s and ITL <= 0.1 s, ttft p99 <= 3 s"
