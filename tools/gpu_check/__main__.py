"""``python -m tools.gpu_check [--dry] [--out DIR]``: every step of the GPU check, then a summary.

Files under DIR: ``tests.json``, ``gpt_bf16.json``, ``fp16_loss_scale.json``, ``sdpa.json``,
``ring_attention.json``, ``summary.json`` and ``gpu_check.log`` (every subprocess's output):
seven, under the device tool's eight-file limit. Scratch data and runs go to a temporary
directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tools.gpu_check import pretrain
from tools.gpu_check.data import write_null_dataset
from tools.gpu_check.environment import ROOT, describe
from tools.gpu_check.plan import DRY, GPU, Plan
from tools.gpu_check.runner import Deadline, Step, run_command, run_steps
from tools.gpu_check.unit_tests import run_tests

# The whole check must end within 8 minutes on one GPU; each step's share leaves ~30 s for
# start-up and the synthetic data. The shares add up to 460: ring_attention, last, gets what
# the deadline leaves of its 30 s if every step before it uses all of its own.
TOTAL_SECONDS = 450
STEP_SECONDS = {
    "tests": 100,
    "gpt_bf16": 170,
    "fp16_loss_scale": 100,
    "sdpa": 60,
    "ring_attention": 30,
}


def build_steps(plan: Plan, scratch: Path, log: Path) -> list[Step]:
    """The five steps (the first three over one synthetic dataset in ``scratch``)."""
    data = write_null_dataset(str(scratch / "ids"), plan.vocab_size, plan.data_tokens, seed=0)

    def gpt_bf16(timeout: float) -> dict:
        run = scratch / "gpt_bf16"
        args = pretrain.overrides(data, run, plan.vocab_size, plan.gpt_overrides)
        warmup = plan.warmup_iters
        return pretrain.throughput(plan.gpt_config, args, run, warmup, timeout, log, plan.dry)

    def fp16(timeout: float) -> dict:
        run = scratch / "fp16"
        args = pretrain.overrides(data, run, plan.vocab_size, plan.fp16_overrides)
        return pretrain.loss_scaling(plan.fp16_config, args, run, timeout, log)

    def sdpa(timeout: float) -> dict:
        shape = [f"--{k.replace('_', '-')}={v}" for k, v in plan.sdpa_shape.items()]
        cmd = [sys.executable, "-m", "tools.gpu_check.sdpa", *shape]
        return json.loads(run_command(cmd, timeout, log, cwd=ROOT).splitlines()[-1])

    def ring_attention(timeout: float) -> dict:
        shape = [f"--{k.replace('_', '-')}={v}" for k, v in plan.ring_shape.items()]
        cmd = [sys.executable, "-m", "tools.gpu_check.ring_attention", *shape]
        return json.loads(run_command(cmd, timeout, log, cwd=ROOT).splitlines()[-1])

    def tests(timeout: float) -> dict:
        return run_tests(plan.test_device, scratch, timeout, log)

    named = {
        "tests": tests,
        "gpt_bf16": gpt_bf16,
        "fp16_loss_scale": fp16,
        "sdpa": sdpa,
        "ring_attention": ring_attention,
    }
    return [Step(name, STEP_SECONDS[name], fn) for name, fn in named.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description="The GPU check (docs/gpu_check.md).")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU, no MFU")
    parser.add_argument("--out", default="gpu_check", help="where the JSON files go")
    parser.add_argument(
        "--steps",
        default=",".join(STEP_SECONDS),
        help="comma-separated steps to run, to rerun some on a short lease (default: all)",
    )
    args = parser.parse_args()
    wanted = args.steps.split(",")
    unknown = sorted(set(wanted) - set(STEP_SECONDS))
    if unknown:
        names = ", ".join(STEP_SECONDS)
        parser.error(f"--steps: no step named {', '.join(unknown)}; the steps are {names}")
    plan = DRY if args.dry else GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    log.write_text("")
    start = time.monotonic()
    context = {"dry": plan.dry, "environment": describe()}
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        steps = [s for s in build_steps(plan, Path(tmp), log) if s.name in wanted]
        records = run_steps(
            steps, out, Deadline(TOTAL_SECONDS - (time.monotonic() - start)), context
        )
    summary = {
        "ok": all(r["status"] == "ok" for r in records),
        "seconds": round(time.monotonic() - start, 2),
        "steps": [{k: r.get(k) for k in ("step", "status", "seconds", "error")} for r in records],
        "figures": {r["step"]: r["figures"] for r in records},
        **context,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"== gpu check {'ok' if summary['ok'] else 'FAILED'} in {summary['seconds']} s: {out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
