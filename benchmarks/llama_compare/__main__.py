"""benchmarks/compare_llama_cpp.sh CHECKPOINT [options]: this project's whole-model bench beside llama.cpp's
llama-bench on the same Hugging Face DeepSeek checkpoint, at equal weight precision (float/F32, int8/Q8_0,
int4/Q4_0, blocks of 32), batch 1, in one run; prints one table and writes compare.json and compare.md (and
each round's llama-bench JSON and bench.json under rounds/, the logs) into --out.

Both engines are measured --rounds times, alternating per precision (ours first in odd rounds, llama.cpp first in
even ones): this machine's read bandwidth moves between states minutes apart, so each ratio is taken within one
round and the table gives the median of the rounds' ratios with their range. --pairs N adds, after the rounds, N
paired decode measurements per precision and context (:mod:`.paired`): both engines back to back within seconds, a
read probe before, between and after, and a second table from the pairs whose probes agree (both engines at one
bandwidth), with each engine's step against the bandwidth probed beside it. --interleave N adds N neighbouring
bursts per precision and context (:mod:`.interleaved`): both engines held open side by side (llama.cpp's as
``llama-stepper``, compiled against the build), each timing ``-n`` decode steps in turn, the ratio taken between
neighbours, so that nearly every ratio compares the two at one bandwidth.

llama.cpp comes from the llama-cpp-python source distribution on the package index (its vendored llama.cpp,
built natively with cmake: llama-bench, llama-quantize and llama-server, Release), kept under the cache with the GGUF
files of each checkpoint, so a second run neither rebuilds nor converts. --dry-run prints the command lines.

--ik-llama SRC adds ik_llama.cpp (a source folder: its llama-bench built natively under the cache, keyed by the
source's commit, from a copy whose V2-Lite condition is widened to checkpoints cut to fewer layers; :mod:`.ik`): in
every round its llama-bench on the same GGUF files with its defaults (-mla 3 -fa 1 -fmoe 1) and with -rtr 1 (the
weights repacked at load), each a row of the same table beside ours.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import gguf, ik, interleaved, paired, steps, table
from .checks import check_checkpoint, fingerprint, missing_build_tools, pip_command, require_build_tools
from .settings import DEFAULT_VERSION, PRECISIONS, QUANTIZE_SOURCES, CompareError, Settings, default_cache


def _ints(minimum: int):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
        return values
    return parse


def _precisions(text: str) -> tuple[str, ...]:
    values = tuple(v for v in text.split(",") if v)
    unknown = [v for v in values if v not in PRECISIONS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(PRECISIONS)}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/compare_llama_cpp.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a Hugging Face DeepSeek-V2/V3 checkpoint folder")
    p.add_argument("--out", type=Path, default=Path("compare-llama-cpp"), help="where the table and logs go")
    p.add_argument("--cache", type=Path, default=None, help="llama.cpp build and GGUF files (default "
                   "$MLA_DEPLOY_CACHE, else ~/.cache/mla-deploy)")
    p.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python release (default %(default)s)")
    p.add_argument("--weights", type=_precisions, default=tuple(PRECISIONS), help="comma list of float, int8, int4")
    p.add_argument("--context", type=_ints(0), default=(0, 1024), help="comma list (default 0,1024)")
    p.add_argument("--threads", type=_ints(1), default=(2,), help="threads of both engines (default 2)")
    p.add_argument("-r", "--repetitions", type=_ints(1), default=(3,), help="llama-bench -r (default 3)")
    p.add_argument("-p", "--prompt", type=_ints(1), default=(512,), help="prefill tokens (default 512)")
    p.add_argument("-n", "--generate", type=_ints(1), default=(128,), help="llama-bench -n (default 128)")
    p.add_argument("--our-repeat", type=_ints(1), default=(10,), help="mla-deploy bench --repeat (default 10)")
    p.add_argument("--rounds", type=_ints(1), default=(3,), help="times both engines are measured, alternating "
                   "(default 3)")
    p.add_argument("--pairs", type=_ints(0), default=(0,), help="after the rounds, this many paired decode "
                   "measurements per precision and context: both engines back to back with a read probe before, "
                   "between and after, so that a ratio compares them at one bandwidth (default 0: none)")
    p.add_argument("--interleave", type=_ints(0), default=(0,), help="after the rounds (and pairs), this many "
                   "neighbouring decode bursts of -n steps per precision and context, both engines held open side by "
                   "side and taking turns, the ratio taken between neighbours (default 0: none)")
    p.add_argument("--quantize-from", type=str.upper, choices=QUANTIZE_SOURCES, default="F32",
                   help="the GGUF llama-quantize makes Q4_0 from, removed afterwards unless requested (default F32; "
                   "BF16: the same Q4_0 from a bf16 checkpoint at half the disk; Q8_0: requantized, a different Q4_0, "
                   "where a full-size F32 or BF16 file does not fit)")
    p.add_argument("--pure", action="store_true", help="llama-quantize --pure: every matrix of the Q4_0 file in "
                   "Q4_0, output.weight too, as our int4 export holds its lm_head (default: llama-quantize's own "
                   "choice, output.weight in Q6_K); kept as a file of its own")
    p.add_argument("--ik-llama", type=Path, default=None, metavar="SRC", help="an ik_llama.cpp source folder: "
                   "its llama-bench built under the cache and run beside llama.cpp's on the same GGUF files, with "
                   "its defaults (-mla 3 -fa 1 -fmoe 1) and with -rtr 1, each a row of the table")
    p.add_argument("--dry-run", action="store_true", help="print the plan (command lines, what is cached); run nothing")
    return p


def settings(args) -> Settings:
    return Settings(checkpoint=args.checkpoint.resolve(), out=args.out.resolve(),
                    cache=(args.cache or default_cache()).resolve(), version=args.version, precisions=args.weights,
                    contexts=args.context, threads=args.threads[0], repetitions=args.repetitions[0],
                    prompt=args.prompt[0], generate=args.generate[0], our_repeat=args.our_repeat[0],
                    quantize_from=args.quantize_from, rounds=args.rounds[0], pairs=args.pairs[0],
                    interleave=args.interleave[0], pure=args.pure,
                    ik_source=args.ik_llama.resolve() if args.ik_llama else None)


def dry_run(s: Settings, key: str, planned: list[steps.Step]) -> int:
    print("\n".join(step.line() for step in planned))
    if s.pairs:
        print(f"paired: {s.pairs} pairs per precision and context, each a read probe, then (order alternating) our "
              f"decode of {s.generate} steps in a fresh worker process on the rounds' export and one llama-bench, a "
              f"probe after each:")
        for weights in s.precisions:
            for context in s.contexts:
                print(f"paired-{weights}-{context}: {s.ours_artifact(weights)} beside "
                      f"{shlex.join(paired.llama_argv(s, s.gguf(key, PRECISIONS[weights]), context))}")
    if s.interleave:
        print(f"interleaved: {s.interleave} neighbouring bursts of {s.generate} decode steps per precision and context, "
              f"our burst worker on the rounds' export and {interleaved.stepper_path(s)} on the GGUF file, both held "
              f"open, taking turns; a read probe before and after each series")
    missing = missing_build_tools()
    if missing and not (s.built and (s.ik_source is None or s.ik_built)):
        print(f"missing to build llama.cpp: {', '.join(missing)}")
    return 0


def probe(s: Settings) -> dict:
    """The read bandwidth beside llama-bench (mla-deploy's probe, in this process)."""
    from mla_deploy.bench.machine import read_bandwidth

    return read_bandwidth(s.threads)


def execute(s: Settings, planned: list[steps.Step], echo) -> list[dict]:
    """Run the steps not cached; returns the bandwidth probes taken before each llama-bench run."""
    probes = []
    for step in planned:
        if step.done:
            echo(f"[compare] {step.name}: cached")
            continue
        if step.stdout is not None:  # llama-bench: a bandwidth probe beside it
            probes.append(probe(s))
        steps.run(step, s.logs, echo)
        if step.name == "build":
            record_build(s)
        elif step.name == "ik-build":
            record_ik_build(s)
    return probes


def record_build(s: Settings) -> None:
    missing = [name for name in steps.TARGETS if not s.tool(name).is_file()]
    if missing:
        raise CompareError(f"the llama.cpp build made no {', '.join(missing)} under {s.build / 'bin'}")
    s.build_record.write_text(json.dumps({"version": s.version, "targets": list(steps.TARGETS),
                                          "built": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n")


def record_ik_build(s: Settings) -> None:
    if not s.ik_tool.is_file():
        raise CompareError(f"the ik_llama.cpp build made no llama-bench under {s.ik_build / 'bin'}")
    patch = {name: change for name, (change, _) in ik.PATCH.items()}
    s.ik_record.write_text(json.dumps({"source": str(s.ik_source), "key": s.ik_key, "patch": patch,
                                       "built": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=2) + "\n")


def collect(s: Settings, key: str, probes: list[dict], commands: list[str]) -> tuple[dict, str, str]:
    """The table from each round's bench.json and llama-bench JSON files and the GGUF files: (data, text,
    markdown)."""
    kinds = [PRECISIONS[w] for w in s.precisions]
    models = {k: gguf.read_gguf(s.gguf(key, k)) for k in kinds}
    read = {k: {c: gguf.decode_bytes(models[k], c + s.generate / 2)["bytes"] for c in s.contexts} for k in kinds}
    reports, rounds, llama_runs, ik_runs = [], [], [], []
    for round_ in range(1, s.rounds + 1):
        parts = [json.loads(s.ours_json(w, round_).read_text()) for w in s.precisions]
        report = dict(parts[0], rows=[row for part in parts for row in part["rows"]])
        llama = {k: table.parse_llama_bench(s.llama_json(k, round_).read_text(), str(s.llama_json(k, round_)))
                 for k in kinds}
        reports += parts
        llama_runs.append(llama)
        rounds.append(table.rows(report, llama, read))
        for variant in ik.VARIANTS if s.ik_source is not None else ():
            theirs = {k: table.parse_llama_bench(s.ik_json(variant, k, round_).read_text(),
                                                 str(s.ik_json(variant, k, round_))) for k in kinds}
            ik_runs.append({"variant": variant, "round": round_, "llama_bench": theirs})
            rounds[-1] += table.rows(report, theirs, read, engine=ik.LABELS[variant])
    rows = table.combine(rounds)
    bound = table.bound(reports, probes, [r for each in rounds for r in each])
    model = reports[0]["model"]
    commit = next(iter(llama_runs[0].values()))[0]["build_commit"]
    title = (f"{model['name']} ({model['num_hidden_layers']} layers), batch 1, {s.threads} threads: mla-deploy "
             f"{reports[0]['versions'].get('mla_deploy')} (ONNX Runtime {reports[0]['versions'].get('onnxruntime')}) "
             f"beside llama.cpp {commit} (llama-cpp-python {s.version}); decode tokens/s after each context; "
             f"{s.rounds} round{'s' if s.rounds > 1 else ''}{gguf.held_apart(models)}")
    if s.ik_source is not None:
        title += f"; ik_llama.cpp {s.ik_key} ({s.ik_source}, {ik.PATCH_NOTE})"
    data = {"title": title, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(s).items()},
            "rows": rows, "rounds": rounds, "bound": bound, "gguf": {k: gguf.summary(m) for k, m in models.items()},
            "llama_bench": llama_runs, "machine": reports[0].get("machine"), "probes_beside_llama_bench": probes,
            "commands": commands}
    if s.ik_source is not None:
        data["ik_llama_bench"] = ik_runs
    return data, table.text(rows, bound, title), table.markdown(rows, bound, title, commands)


def mainline(rows: list[dict]) -> list[dict]:
    """The table's rows of mainline llama.cpp (the paired and interleaved decode run mainline's engine only)."""
    return [r for r in rows if r["engine"] == "llama.cpp"]


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    s = settings(args)
    try:
        check_checkpoint(s.checkpoint)
        key = fingerprint(s.checkpoint, s.version)
        if s.ik_source is not None:
            s = replace(s, ik_key=ik.source_key(ik.check_source(s.ik_source)))
        planned = steps.plan(s, key, pip_command())
        if args.dry_run:
            return dry_run(s, key, planned)
        if not s.built or (s.ik_source is not None and not s.ik_built):
            require_build_tools()
        s.out.mkdir(parents=True, exist_ok=True)
        s.gguf_dir(key).mkdir(parents=True, exist_ok=True)
        probes = execute(s, planned, lambda line: print(line, flush=True))
        data, text, md = collect(s, key, probes, [step.line() for step in planned])
        if s.pairs:
            data["paired"] = paired.run(s, key, mainline(data["rows"]), lambda: probe(s),
                                        lambda line: print(line, flush=True))
            text += "\n\n" + paired.text(data["paired"])
            md += "\n" + paired.markdown(data["paired"])
        if s.interleave:
            data["interleaved"] = interleaved.run(s, key, mainline(data["rows"]), lambda: probe(s),
                                                  lambda line: print(line, flush=True))
            text += "\n\n" + interleaved.text(data["interleaved"])
            md += "\n" + interleaved.markdown(data["interleaved"])
        table.write(s.out, data, md)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(text)
    print(f"\nwrote {s.out / 'compare.json'} and {s.out / 'compare.md'}; llama.cpp's tools (llama-server among them) "
          f"are in {s.build / 'bin'}, the GGUF files in {s.gguf_dir(key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
