"""Train several runs one after another in one process (one interpreter start-up for all of them) and write each
run's logged loss and gradient norm per step as JSON. Started by test_lora_moe_resume.py, once for the straight runs
and once for the resumed ones, so that every resume reads its checkpoint in another process than the one that
saved it:

    python runs_worker.py OUT.json '{"name": [overrides...], ...}' BASE_OVERRIDES...

Each case trains the debug recipe with BASE_OVERRIDES, then its own, into OUT.json.runs/NAME.
"""

import json
import sys
from pathlib import Path

from ember.train import run as run_lib
from ember.train.trainer import Trainer


def main() -> None:
    out, cases, base = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    results = {}
    for name, overrides in cases.items():
        run_dir = Path(f"{out}.runs") / name
        Trainer(run_lib.load_config("debug", [*base, *overrides, f"output_dir={run_dir}"])).train()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results[name] = {r["step"]: [r["loss"], r["grad_norm"]] for r in records if "loss" in r}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
