"""The one-client TTFT over deploy.yaml's app (`small`, as `make serve` launches it, spans
written to a file) split stage by stage (loadtests/ttft_stages.py): N streamed chats one at
a time over one kept-alive connection (one_client.py's prompts).

  .venv/bin/python reports/serving/cpu-host-2026-12-07-s65/stages_deploy_app.py 30
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cpu-host-2026-12-07-s64"))
from one_client import OneClient  # noqa: E402

from loadtests.closed_loop import RequestTiming  # noqa: E402
from loadtests.ttft_stages import ttft_stages  # noqa: E402

REPO = HERE.parents[2]
SPANS = Path("/tmp/stages65.jsonl")


def main(n: int) -> None:
    text = (REPO / "deploy.yaml").read_text()
    text = text.replace("model: models/tiny ", f"model: {REPO / 'models/small'} ")
    text = text.replace("served_model_name: tiny ", "served_model_name: small ")
    text = text.replace("exporter: none ", "exporter: file ")
    text = text.replace("file_path: null ", f"file_path: {SPANS} ")
    Path("/tmp/deploy_stages.yaml").write_text(text)
    SPANS.unlink(missing_ok=True)
    log = Path("/tmp/stages65.log")
    launch = [str(REPO / ".venv/bin/python"), "-m", "serve_app.deploy.launch"]
    proc = subprocess.Popen(
        [*launch, "/tmp/deploy_stages.yaml"],
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(300):
            found = re.search(r"dynabatch is serving .* at (\S+)", log.read_text())
            if found:
                break
            time.sleep(1)
        url = found.group(1)
        one = OneClient(url)
        for _ in range(3):
            one.chat()
        timings = []
        for _ in range(n):
            time.sleep(0.3)
            body = one.body()
            t = RequestTiming(time.perf_counter())
            with one.client.stream("POST", f"{url}/chat/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        if t.first_token is None:
                            t.first_token = time.perf_counter()
                            t.request_id = json.loads(line[6:])["id"]
                        t.tokens += 1
            t.end = time.perf_counter()
            timings.append(t)
        time.sleep(3)  # the spans' last flush
        ttft = sorted(1e3 * t.ttft for t in timings)[n // 2]
        print(f"TTFT {ttft:.1f} ms; stages:", json.dumps(ttft_stages(SPANS, timings)))
    finally:
        proc.terminate()
        proc.wait()
        httpx.Client().close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
