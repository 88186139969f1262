"""benchmarks/gpu_check.sh: run the GPU paths on a GPU machine reached only through the `run` tool; see
docs/gpu-verification.md.

  prepare [--update-doc]   here: download the wheels the GPU machine lacks into .whl/downloads/, pack them into
                           .whl/gpu-check/part-K/ (each under 64 MiB with the tree) and print the plan of calls
  plan [--update-doc]      print the plan for the parts prepared (--update-doc: also into the doc)
  install                  there: join the parts, pip install them into build/gpu-check/site, check the imports
                           (exit 3 while parts are still to come)
  run [--dry-run] ...      the checks, with logs; writes gpu-verification.md, steps.json and logs.tar.gz into
                           --out (default $OUT, else build/gpu-check/out). Exit 2: steps still pending
                           (run it again); else 1: a step failed; 0: every step passed or was skipped
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import plan as call_plan
from . import steps as steps_mod
from . import wheels
from .layout import DEFAULT_WORK, PACK, Work
from .report import write_outputs
from .runner import Runner, exit_status, prepare_work


def _csv(choices):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v for v in text.split(",") if v)
        unknown = [v for v in values if v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return values
    return parse


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="benchmarks/gpu_check.sh", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    for name in ("prepare", "plan"):
        sub.add_parser(name).add_argument("--update-doc", action="store_true",
                                          help="write the plan into docs/gpu-verification.md's how-to-run section")
    sub.add_parser("install").add_argument("--work", type=Path, default=DEFAULT_WORK.root)
    run = sub.add_parser("run")
    run.add_argument("--dry-run", action="store_true", help="skip the GPU steps; the pipeline on the CPU provider")
    run.add_argument("--out", type=Path, default=None, help="where the doc goes (default $OUT, else WORK/out)")
    run.add_argument("--work", type=Path, default=DEFAULT_WORK.root, help="records, logs, exports, installed wheels")
    run.add_argument("--steps", default=None, help=f"comma list of step names or groups ({', '.join(steps_mod.GROUPS)})")
    run.add_argument("--models", type=_csv(tuple(steps_mod.MODELS)), default=tuple(steps_mod.MODELS))
    run.add_argument("--precisions", type=_csv(steps_mod.PRECISIONS), default=steps_mod.PRECISIONS)
    run.add_argument("--budget", type=float, default=None, help="seconds this call may spend on steps")
    run.add_argument("--fresh", action="store_true", help="forget the records of earlier calls")
    run.add_argument("--list", action="store_true", help="print the steps and exit")
    return top


def notes_for(work: Work, cleared: str | None) -> list[str]:
    notes = [cleared] if cleared else []
    if work.install_file.is_file():
        imports = json.loads(work.install_file.read_text())["imports"]
        notes.append(f"Carried and installed there: {imports['package']} {imports['onnxruntime']} (built for CUDA "
                     f"{imports['cuda_version']}), polygraphy {imports['polygraphy']}.")
    return notes


def run(args) -> int:
    work = Work(args.work.resolve())
    options = steps_mod.Options(work, args.dry_run, args.models, args.precisions)
    planned = steps_mod.plan(options)
    if args.list:
        print("\n".join(f"{s.group:7} {s.name}{'  (GPU)' if s.gpu else ''}" for s in planned))
        return 0
    cleared = prepare_work(work, args.dry_run, args.fresh)
    selected = set(args.steps.split(",")) if args.steps else None
    records = Runner(options, selected, args.budget).run(planned)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else work.root / "out")
    doc = write_outputs(work, records, out, args.dry_run, notes_for(work, cleared))
    status = exit_status(records)
    print(f"[gpu-check] wrote {doc}; exit {status} (2 steps pending, 1 a step failed, 0 all passed)", flush=True)
    return status


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command == "prepare":
        try:
            manifest = wheels.prepare()
        except wheels.PackError as exc:
            print(f"prepare: {exc}", file=sys.stderr)
            return 1
        return call_plan.show(manifest, args.update_doc)
    if args.command == "plan":
        manifest = wheels.read_manifest(PACK) if PACK.is_dir() else None
        if manifest is None:
            print("plan: nothing prepared: run benchmarks/gpu_check.sh prepare", file=sys.stderr)
            return 1
        return call_plan.show(manifest, args.update_doc)
    if args.command == "install":
        return wheels.install(Work(args.work.resolve()))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
