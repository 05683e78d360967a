"""The quantized-weights benchmark runs end to end on the tiny quantized checkpoints."""

from __future__ import annotations

import json

from loadtests import bench_quant
from tests.engine.test_quantized_checkpoints import quant_model


def test_bench_quant_reports_decode_against_the_roofline_and_prefill(capsys):
    float_model, _ = quant_model("online-fp8")  # the float tiny-quant checkpoint
    argv = ["--model", float_model, "--awq", quant_model("awq")[0], "--batches", "1,3"]
    result = bench_quant.main(
        [*argv, "--prompt-len", "16", "--steps", "3", "--prefill-tokens", "256", "--json"]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    variants = {v["variant"]: v for v in result["variants"]}
    assert set(variants) == {"float", "fp8 (online)", "awq int4"}
    weights = {name: v["weights_gib"] for name, v in variants.items()}
    assert weights["awq int4"] < weights["fp8 (online)"] < weights["float"]
    for v in variants.values():
        assert v["prefill_tok_s"] > 0 and v["self_check"] == []  # CPU: nothing to check
        for batch in ("1", "3"):
            d = v["decode"][batch]
            assert d["step_ms"] > 0 and d["roofline_ms"] > 0 and d["tok_s"] > 0
