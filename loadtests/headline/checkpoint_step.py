"""The headline's checkpoint: an 8B-shaped random one with a tokenizer (so that it also
serves over HTTP), written once per machine and reused; `--quick`: the tiny model.

    python -m loadtests.headline.checkpoint_step --model DIR --device cuda --out ckpt.json
"""

from __future__ import annotations

import time

import torch

from engine.model.random_checkpoint import make_random_checkpoint
from engine.model.tiny_model import make_model
from loadtests.headline.findings import Findings
from loadtests.headline.plan import step_parser


def main(argv: list[str] | None = None) -> None:
    args = step_parser(__doc__).parse_args(argv)  # --quick: the tiny model
    found = Findings(args.out)
    start = time.perf_counter()
    if args.quick:
        make_model(args.model, size="tiny")
    else:
        dtype = getattr(torch, args.dtype)
        make_random_checkpoint(args.model, "llama3-8b", dtype, args.device, tokenizer=True)
    found.record(write_s=time.perf_counter() - start)


if __name__ == "__main__":
    main()
