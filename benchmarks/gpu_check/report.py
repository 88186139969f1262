"""``gpu-verification.md`` from the step records and their logs: device, versions, figures, commands, pass/fail.

Each ``kind`` of step has a reader that turns its log into markdown lines; a log that does not hold what the
reader expects gives a line saying so rather than an error, so the report is written whatever happened.
"""

from __future__ import annotations

import json
import re
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

from .layout import DOC, Work
from .runner import Record
from .steps import TINY_BF16

HOW_TO_RUN = ("<!-- how-to-run -->", "<!-- /how-to-run -->")
TARGET = 0.80  # the bandwidth target at batch >= 32, context >= 4096
TENSORRT = ("TensorRT cannot be installed on the GPU machine: its builder's libraries come only from NVIDIA's own "
            "index, which is not reachable there; the PyPI `tensorrt-lean` libraries are a runtime without a builder, "
            "and TensorRT-RTX does not support the H100's SM 9.0. So `mla-deploy build`, `TrtEngine`, "
            "`validate --trt` and the MlaDecode plugin's registration are not checked (their tests skip).")


def log_text(work: Work, record: Record) -> str:
    path = work.root / record.log if record.log else None
    return path.read_text(errors="replace") if path and path.is_file() else ""


def result_json(text: str) -> dict | None:
    """The last ``RESULT <json>`` line of a probe's log."""
    found = [line[len("RESULT "):] for line in text.splitlines() if line.startswith("RESULT ")]
    return json.loads(found[-1]) if found else None


def first_json_object(text: str) -> dict | None:
    """The first JSON object printed on lines of its own (``--json`` output among log lines)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"^\{", text, re.MULTILINE):
        try:
            return decoder.raw_decode(text[match.start():])[0]
        except json.JSONDecodeError:
            continue
    return None


def bench_rows(text: str) -> list[dict]:
    """The rows of ``plugins/mla_decode/bench.py``'s table."""
    pattern = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)%\s+(\S+)\s*$")
    keys = ("batch", "heads", "length", "splits", "us", "gbps", "of_copy", "err")
    rows = []
    for line in text.splitlines():
        if match := pattern.match(line):
            values = match.groups()
            rows.append({k: (v if k == "err" else float(v)) for k, v in zip(keys, values)})
    return rows


def read_kernel_bench(text: str) -> list[str]:
    copy = re.search(r"device-to-device copy (\d+) GB/s", text)
    rows = bench_rows(text)
    if not rows:
        return ["no table in the log"]
    timing = re.search(r"^timing: (.*)$", text, re.M)
    lines = [f"Device-to-device copy measured in the same run: {copy.group(1)} GB/s (read + write)." if copy else "",
             f"Timing: {timing.group(1)}." if timing else "",
             "", "| batch | heads | length | splits | µs | GB/s | of copy | max rel err |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']:.0f} | {r['heads']:.0f} | {r['length']:.0f} | {r['splits']:.0f} | {r['us']:.1f} | "
              f"{r['gbps']:.0f} | {r['of_copy']:.1f}% | {r['err']} |" for r in rows]
    target = [r for r in rows if r["batch"] >= 32 and r["length"] >= 4096]
    if target:
        worst, best = min(r["of_copy"] for r in target), max(r["of_copy"] for r in target)
        verdict = "meets" if worst >= TARGET * 100 else "misses"
        lines += ["", f"At batch >= 32 and context >= 4096: {worst:.1f}% to {best:.1f}% of the copy bandwidth; the "
                      f"issue's target is {TARGET:.0%}: {verdict} it (bytes counted: the cache rows and the query)."]
    return lines


def read_versions(text: str) -> list[str]:
    facts = result_json(text)
    if not facts:
        return ["no versions in the log"]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in facts.items())]


def read_run(text: str) -> list[str]:
    out = first_json_object(text)
    if not out:
        return ["no JSON in the log"]
    timings = out.get("timings", {})
    first = out.get("sequences", [{}])[0].get("tokens", [])[:8]
    return [f"provider {out.get('provider')}, {out.get('precision')}, {out.get('cache_mode')} cache; sequence 0's first "
            f"tokens {first}; decode {timings.get('decode_tokens_per_second_batch', 0):.1f} tokens/s for the batch, "
            f"time to first token {timings.get('time_to_first_token_s', 0) * 1000:.1f} ms"]


def read_static(text: str) -> list[str]:
    found = result_json(text)
    if not found:
        return ["no result in the log"]
    return [f"{found['provider']} ({found['device']} memory), {found['layers']} layers: same address after a decode "
            f"step {found['same_address']}, only the new rows changed {found['only_new_rows']}, ONNX Runtime logged a "
            f"copy fallback {found['copy_fallback_logged']}"]


def read_cuda_load(text: str) -> list[str]:
    found = result_json(text)
    if not found:
        return ["no result in the log"]
    lines = ["| how | CUDA provider |", "|---|---|"]
    lines += [f"| {way} | {'loads' if r['ok'] else 'does not load: ' + str(r['reason'])} |"
              for way, r in found["ways"].items()]
    if found.get("env"):
        lines += ["", f"The later steps ran with `LD_LIBRARY_PATH={found['env']['LD_LIBRARY_PATH']}`."]
    return lines


def read_decode(text: str) -> list[str]:
    found = result_json(text)
    if not found:
        return ["no result in the log"]
    lines = [f"`{found['artifact']}`, {found['new_tokens']} new tokens per sequence, greedy:", "",
             "| context | batch | ms/token (per sequence) | tokens/s (batch) | time to first token | note |",
             "|---|---|---|---|---|---|"]
    for row in found["rows"]:
        if "error" in row:
            lines.append(f"| {row['context']} | {row['batch']} | | | | {row['error']} |")
        else:
            lines.append(f"| {row['context']} | {row['batch']} | {row['ms_per_token']:.2f} | "
                         f"{row['tokens_per_second_batch']:.0f} | {row['time_to_first_token_s'] * 1000:.0f} ms | |")
    return lines


def read_doctor(text: str) -> list[str]:
    out = first_json_object(text)
    if not out:
        return ["no JSON in the log"]
    loaded = out.get("onnxruntime", {}).get("loaded", {})
    lines = [f"GPU {out.get('gpu')}; torch {out.get('torch')} (CUDA {out.get('torch_cuda')}); onnxruntime "
             f"{out.get('onnxruntime', {}).get('version')}; polygraphy {out.get('polygraphy')}; TensorRT "
             f"{out.get('tensorrt')}", ""]
    lines += [f"- {name}: {'loads' if v.get('ok') else 'does not load: ' + str(v.get('reason'))}"
              for name, v in loaded.items()]
    lines += [f"- `{cmd}`: {verdict}" for cmd, verdict in out.get("commands", {}).items()]
    return lines


def read_lines(pattern: str):
    def read(text: str) -> list[str]:
        found = [line.strip() for line in text.splitlines() if re.match(pattern, line.strip())]
        return [f"`{line[:400]}`" for line in found[-3:]] or ["nothing matching in the log"]
    return read


READERS = {"kernel-bench": read_kernel_bench, "versions": read_versions, "run": read_run, "static": read_static,
           "cuda-load": read_cuda_load, "decode": read_decode, "doctor": read_doctor,
           "pytest": read_lines(r"^(=+ )?\d+ (passed|failed|skipped|error|deselected)"),
           "export": read_lines(r"^exported "), "gpu-bench": read_lines(r"^(plan: |variant |wrote )"), "validate": read_lines(r"^(mla-deploy: (error: )?)?(validation|quantization) "),
           "nvidia-smi": read_lines(r"^(NVIDIA|name,)|.*\d+ MiB, \d+ MHz$")}


SECTIONS = (
    ("Device and versions", ("nvidia-smi", "versions")),
    ("The Triton decode kernel on the GPU", ("kernel-tests", "plugin-tests", "kernel-bench")),
    ("Exports", ("export",)),
    ("ONNX Runtime's CUDA provider", ("ort-cuda-load", "doctor")),
    ("The pipeline: run, the in-place static cache, validate", ("run", "static", "validate")),
    ("Whole-model decode", ("bench-whole", "decode")),
    ("GPU decode (issue 48): branches against the fused experts, CUDA graphs, fpA_intB, the torch.compile peer",
     ("gpu",)),
)


def _section_records(records: list[Record], prefixes: tuple[str, ...]) -> list[Record]:
    return [r for r in records if any(r.name == p or r.name.startswith(p + "-") for p in prefixes)]


def step_lines(work: Work, record: Record) -> list[str]:
    """A step's heading line, its figures (when it ran) and its note."""
    head = f"**{record.name}**: {record.status}" + (f" in {record.seconds:.0f} s" if record.rc is not None or
                                                     record.status == "TIMEOUT" else "")
    lines = [head + (f". {record.note}" if record.note else ""), ""]
    reader = READERS.get(record.kind)
    if reader and record.log and record.status not in ("SKIPPED",):
        text = log_text(work, record)
        try:
            lines += [*reader(text), ""]
        except (KeyError, TypeError, ValueError) as exc:  # an unexpected log is reported, never fatal
            lines += [f"(the log could not be read: {type(exc).__name__}: {exc})", ""]
    if record.name == "bench-whole" and (work.root / "bench-whole" / "bench.md").is_file():
        lines += [(work.root / "bench-whole" / "bench.md").read_text(), ""]
    if record.kind == "gpu-bench" and (work.root / "gpu-bench" / record.name / "gpu-bench.md").is_file():
        lines += [(work.root / "gpu-bench" / record.name / "gpu-bench.md").read_text(), ""]
    return lines


def status_line(records: list[Record], dry_run: bool, device: str | None) -> str:
    counts = {s: sum(r.status == s for r in records) for s in ("PASS", "FAIL", "TIMEOUT", "XFAIL", "XPASS",
                                                               "SKIPPED", "PENDING")}
    tally = ", ".join(f"{n} {s.lower()}" for s, n in counts.items() if n)
    when = time.strftime("%Y-%m-%d")
    if dry_run:
        return (f"**Status: dry run on the CPU ({when}), not a GPU verification.** The GPU steps were skipped; the "
                f"pipeline ran on ONNX Runtime's CPU provider. Steps: {tally}.")
    return f"**Status: run on {device or 'a machine whose GPU was not identified'} ({when}).** Steps: {tally}."


def summary_table(records: list[Record]) -> list[str]:
    lines = ["| step | status | seconds | note |", "|---|---|---|---|"]
    for r in records:
        note = r.note.replace("|", "\\|")[:160]
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.0f} | {note} |")
    return lines


def how_to_run(doc: Path = DOC) -> str:
    """The "how to run" section of the committed doc (between its markers), carried into every generated one."""
    text = doc.read_text() if doc.is_file() else ""
    start, end = text.find(HOW_TO_RUN[0]), text.find(HOW_TO_RUN[1])
    if start < 0 or end < 0:
        return "## How to run\n\nSee `benchmarks/gpu_check.sh --help`.\n"
    return text[start:end + len(HOW_TO_RUN[1])] + "\n"


def device_name(work: Work, records: list[Record]) -> str | None:
    for record in records:
        if record.name == "versions" and record.status == "PASS":
            facts = result_json(log_text(work, record)) or {}
            return facts.get("gpu")
    return None


def render(work: Work, records: list[Record], dry_run: bool, notes: list[str]) -> str:
    """The whole markdown document."""
    lines = ["# GPU verification", "", status_line(records, dry_run, device_name(work, records)), ""]
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    lines += ["Generated by `benchmarks/gpu_check.sh run` (see **How to run** below). Statuses: PASS, FAIL, TIMEOUT, "
              f"XFAIL/XPASS (a failure expected, e.g. tiny bf16: {TINY_BF16}), SKIPPED (with the reason), PENDING "
              "(not run yet: a later call runs it).", "", *summary_table(records), ""]
    for title, prefixes in SECTIONS:
        chosen = _section_records(records, prefixes)
        if chosen:
            lines += [f"## {title}", ""]
            for record in chosen:
                lines += step_lines(work, record)
    lines += ["## Not covered", "", TENSORRT, "", "onnxruntime-genai (`export --target genai`) is not run on the GPU.",
              "", "## Commands", "", "Each step's command, run in the repository root (`python3` is the GPU "
              "machine's interpreter; the carried packages and the repository are on `PYTHONPATH`):", ""]
    lines += [f"- {r.name}: `{r.command}`" for r in records]
    return "\n".join(lines) + "\n\n" + how_to_run()


def write_outputs(work: Work, records: list[Record], out: Path, dry_run: bool, notes: list[str]) -> Path:
    """``gpu-verification.md``, ``steps.json`` and ``logs.tar.gz`` (logs, records, validation and bench reports) in
    ``out``; the document's path."""
    out.mkdir(parents=True, exist_ok=True)
    doc = out / "gpu-verification.md"
    doc.write_text(render(work, records, dry_run, notes))
    (out / "steps.json").write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for folder in ("logs", "records"):
            if (work.root / folder).is_dir():
                tar.add(work.root / folder, arcname=folder)
        for pattern in ("validate/*/report.md", "validate/*/report.json", "bench-whole/bench.*",
                        "gpu-bench/*/gpu-bench.*", "env.json", "install.json"):
            for path in sorted(work.root.glob(pattern)):
                tar.add(path, arcname=str(path.relative_to(work.root)))
    return doc
