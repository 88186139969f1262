"""python benchmarks/tile_probe [--against REV] [--isa NAME] [--shapes v2-lite|v3] [--tokens 64] [--bits 4|8]
[--rounds 5] [--threads 2] [--only linear|experts] [--engine ART] [--profile]: mla-deploy's CPU operators over many
tokens (a prefill's products) from this checkout's source beside the same operators from another revision
(``--against``, default ``main``), on the shapes of DeepSeek-V2-Lite (int4 or int8, the engine's layout: rows over 512
values interleaved, float16 scales): ``BlockwiseMatMul`` 2048 -> 2048 (o_proj), 2048 -> 10944 (the dense MLP's gate)
and 10944 -> 2048 (its down), and ``RoutedExperts`` (64 experts, 6 per token, intermediate 1408, routed by random
scores). Both libraries are compiled for one instruction set (``--isa``, by default the best this CPU has), their
sessions opened in this process, and each product's CPU time (the process's, threads not spinning: less moved by
other jobs than wall time) taken in alternating rounds (old, new, old, new, ...), so that both see the same machine;
the outputs are checked bit for bit equal. Prints each product's median milliseconds and new / old.

``--shapes v3``: DeepSeek-V3's shapes instead (7168 -> 7168, 7168 -> 18432, 18432 -> 7168, experts of 2048 of
which 8 per token; ``--experts 16`` keeps their weights in memory). ``--engine ART`` times a prefill of ``--tokens``
tokens through the artifact's CPU engine graph (``mla-deploy build ART --target cpu``) instead, its logits and caches
checked bit for bit equal; ``--profile`` adds the new operators' time by operator type. ``--once --library PATH``
runs each product once with the library at ``PATH`` (for an instruction counter; valgrind runs no AVX-512, so an
``--isa avx2`` library). ``kernel.c`` beside this file times the kernel alone, without ONNX Runtime."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

#: hidden size, dense MLP width, routed experts, experts per token, expert width
SHAPES = {"v2-lite": (2048, 10944, 64, 6, 1408), "v3": (7168, 18432, 256, 8, 2048)}


def _library(into: Path, isa: str | None, source: Path | None):
    from mla_deploy.ort import operators as cpu_ops

    built = cpu_ops.compile_library(into, cpu_ops.isa_named(isa) if isa else None, source=source)
    if built.path is None:
        sys.exit(f"tile_probe: no library: {built.why_not}")
    return built.path


def _models(bits: int, only: str | None, shapes: str, experts: int | None = None):
    """(name, model, feeds maker) for each product."""
    from onnx import TensorProto, helper, numpy_helper

    from mla_deploy.ort import swaps as own_ops

    HIDDEN, DENSE, EXPERTS, CHOSEN, EXPERT_WIDTH = SHAPES[shapes]
    experts = experts or EXPERTS
    rng = np.random.default_rng(0)

    def rows(n: int, k: int):
        w = rng.integers(0, 256, size=(n, k * bits // 8), dtype=np.uint8)
        if k > 512:
            w = own_ops.interleave_rows(w, bits)
        return w, (rng.random(n * k // 32, dtype=np.float32) * 0.02 + 0.005).astype(np.float16)

    def model(nodes, inputs, outputs, inits):
        graph = helper.make_graph(nodes, "probe", inputs, outputs, inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(own_ops.DOMAIN, 1)])
        m.ir_version = 10
        return m

    out = []
    if only in (None, "linear"):
        for k, n in ((HIDDEN, HIDDEN), (HIDDEN, DENSE), (DENSE, HIDDEN)):
            w, s = rows(n, k)
            node = helper.make_node(own_ops.LINEAR_OP_TYPE, ["a", "b", "s"], ["y"], domain=own_ops.DOMAIN, K=k, N=n,
                                    bits=bits, block_size=32, interleaved=int(k > 512))
            m = model([node], [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["T", k])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])],
                      [numpy_helper.from_array(w.reshape(n, k // 32, -1), "b"), numpy_helper.from_array(s, "s")])
            out.append((f"BlockwiseMatMul {k} -> {n}", m, lambda t, k=k: {"a": rng.standard_normal((t, k), np.float32)}))
    if only in (None, "experts"):
        w1, s1 = rows(experts * 2 * EXPERT_WIDTH, HIDDEN)
        w2, s2 = rows(experts * HIDDEN, EXPERT_WIDTH)
        inits = [numpy_helper.from_array(w1.reshape(experts, 2 * EXPERT_WIDTH, -1), "w1"),
                 numpy_helper.from_array(s1.reshape(experts, 2 * EXPERT_WIDTH, -1), "s1"),
                 numpy_helper.from_array(w2.reshape(experts, HIDDEN, -1), "w2"),
                 numpy_helper.from_array(s2.reshape(experts, HIDDEN, -1), "s2")]
        node = helper.make_node(own_ops.OP_TYPE, ["x", "r", "w1", "s1", "w2", "s2"], ["y"], domain=own_ops.DOMAIN,
                                k=CHOSEN, expert_weight_bits=bits, block_size=32, normalize_routing_weights=1,
                                interleaved=1)
        m = model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", HIDDEN]),
                           helper.make_tensor_value_info("r", TensorProto.FLOAT, ["T", experts])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", HIDDEN])], inits)
        out.append((f"RoutedExperts {experts} x ({HIDDEN} -> 2x{EXPERT_WIDTH} -> {HIDDEN}), {CHOSEN} per token", m,
                    lambda t: {"x": rng.standard_normal((t, HIDDEN), np.float32),
                               "r": rng.standard_normal((t, experts), np.float32)}))
    return out


def _session(model, library: Path, threads: int, entries: dict | None = None, profile: Path | None = None):
    import onnxruntime as ort

    from mla_deploy.ort import operators as cpu_ops

    options = ort.SessionOptions()
    if profile is not None:
        options.enable_profiling, options.profile_file_prefix = True, str(profile)
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # an engine graph: built already
    for key, value in (entries or {}).items():
        options.add_session_config_entry(key, value)
    # threads that spin between calls would count their waiting as CPU time
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    cpu_ops.register(options, library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _engine_product(art: Path, tokens: int):
    """(name, model, feeds maker, session options entries) for a prefill of ``tokens`` tokens through ``art``'s CPU
    engine graph (``mla-deploy build ART --target cpu``), its operators from the library each session is given."""
    import onnx

    from mla_deploy.quant.formats import EXTERNAL_FOLDER_ENTRY

    model = onnx.load(str(art / "cpu" / "model.onnx"), load_external_data=False)
    names = {i.name: i for i in model.graph.input}
    width = next(i for i in model.graph.input if i.name.startswith("past_latent.")).type.tensor_type.shape.dim[-1]
    rng = np.random.default_rng(1)

    def feeds(t: int):
        feed = {"input_ids": rng.integers(0, 1000, size=(1, t), dtype=np.int64),
                "position_ids": np.arange(t, dtype=np.int64)[None], "logits_index": np.full((1, 1), t - 1, np.int64),
                "attention_mask": np.ones((1, t), np.int64)}
        static = "write_indices" in names  # a static cache of t slots, written from slot 0; else a concatenated one
        feed["write_indices"] = np.zeros(1, np.int64)
        shape = (1, 1, t, width.dim_value) if static else (1, 0, width.dim_value)
        feed.update({n: np.zeros(shape, np.float32) for n in names if n.startswith("past_latent.")})
        return {n: v for n, v in feed.items() if n in names}

    return (f"engine prefill of {tokens} tokens ({art})", model, feeds, {EXTERNAL_FOLDER_ENTRY: str(art / "cpu")})


def _profile(model, library: Path, threads: int, entries: dict | None, feed: dict, into: Path) -> None:
    """One more run with ONNX Runtime's profiler on ``library``: each operator type's wall milliseconds, largest first."""
    import json
    from collections import Counter

    profiled = _session(model, library, threads, entries, profile=into / "profile")
    profiled.run(None, feed)  # the first run: its operators' one-time work (LatentAttention's panels) counts too
    profiled.run(None, feed)
    events = json.loads(Path(profiled.end_profiling()).read_text())
    totals = Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"] / 1e3
    print("  new, by operator (ms, wall, one run): " + ", ".join(f"{op} {ms:.1f}" for op, ms in totals.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(prog="tile_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", help="git revision of the other operators (default main)")
    parser.add_argument("--isa", default=None, help="avx512-vnni, avx-vnni or avx2 (default: this CPU's best)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("linear", "experts"), default=None)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="v2-lite", help="whose products (default v2-lite)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (fewer than the model's: less memory)")
    parser.add_argument("--once", action="store_true", help="run each product once with --library (for valgrind)")
    parser.add_argument("--library", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="also print the new operators' time by operator type")
    parser.add_argument("--engine", type=Path, default=None,
                        help="an artifact with a CPU engine: time its prefill of --tokens tokens instead")
    args = parser.parse_args()
    products = ([(*_engine_product(args.engine, args.tokens),)] if args.engine
                else [(*p, None) for p in _models(args.bits, args.only, args.shapes, args.experts)])
    if args.once:
        if args.library is None:
            sys.exit("tile_probe: --once needs --library")
        for _, model, feeds, entries in products:
            _session(model, args.library, args.threads, entries).run(None, feeds(args.tokens))
        return
    from mla_deploy.ort import operators as cpu_ops

    with tempfile.TemporaryDirectory() as tmp:
        old_source = Path(tmp) / "old.c"
        done = subprocess.run(["git", "-C", str(cpu_ops.source_path().parent), "show",
                               f"{args.against}:mla_deploy/ort/csrc/cpu_ops.c"], capture_output=True)
        if done.returncode:
            sys.exit(f"tile_probe: git show {args.against}: {done.stderr.decode().strip()}")
        old_source.write_bytes(done.stdout)
        (Path(tmp) / "old").mkdir(), (Path(tmp) / "new").mkdir()
        libraries = {"old": _library(Path(tmp) / "old", args.isa, old_source),
                     "new": _library(Path(tmp) / "new", args.isa, None)}
        print(f"{args.tokens} tokens, int{args.bits}, {args.threads} threads, {cpu_ops.library_isa(libraries['new'])}; "
              f"old: {args.against}, new: this checkout")
        for name, model, feeds, entries in products:
            sessions = {k: _session(model, lib, args.threads, entries) for k, lib in libraries.items()}
            feed = feeds(args.tokens)
            outs = {k: s.run(None, feed) for k, s in sessions.items()}  # also the first, untimed, run
            equal = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(outs["old"], outs["new"]))
            times = {"old": [], "new": []}
            for _ in range(args.rounds):
                for k, s in sessions.items():
                    start = time.process_time()
                    s.run(None, feed)
                    times[k].append(time.process_time() - start)
            old, new = (float(np.median(times[k])) * 1e3 for k in ("old", "new"))
            if args.profile:
                _profile(model, libraries["new"], args.threads, entries, feed, Path(tmp))
            print(f"{name}: CPU time old {old:.1f} ms, new {new:.1f} ms, new/old {new / old:.2f}, "
                  f"bit-equal {'yes' if equal else 'NO'}")


if __name__ == "__main__":
    main()
