"""The package's structure, checked from its source: no import cycle and none back up the layers, one owner for the
cache mode, one for quantization and one for the host's facts, ONNX Runtime imported only by mla_deploy/ort/, the
TensorRT engine independent of the ONNX Runtime one, the engines independent of the exporter,
bench on public names only, the two benches independent of each other over their shared harness, no private name
imported across modules, every export target through the one export pipeline.

Every check reads the real source files with ``ast`` (imports inside functions included) and is shown to fail
on a planted violation first, so none of them passes vacuously.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mla_deploy"
MODE_NAMES = {"concat", "static"}
#: where the cache mode may be branched on (paths inside the package): the layouts themselves, and the CLI's module
#: that parses --cache-mode
MODE_OWNERS = {"cache_layout.py", "cli/groups.py"}


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """``{"mla_deploy.x.y": (path, is_package)}`` for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def imported_modules(name: str, is_package: bool, tree: ast.AST, known) -> set[str]:
    """The package modules ``name`` imports anywhere in ``tree`` (module level or inside functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in candidates:
            # importing a submodule also runs its package's __init__: count the package too
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in known and dep != name and not name.startswith(dep + "."):
                    found.add(dep)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imported_modules(name, pkg, ast.parse(path.read_text()), known) for name, (path, pkg) in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_detector_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "mla_deploy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")  # inside a function: still counted
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    (pkg / "c.py").write_text("import mla_deploy.a\n")
    assert cycles(import_graph(pkg)) == [["mla_deploy.a", "mla_deploy.sub.b"]]


def test_no_import_cycle_in_the_package():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def mode_branches(path: Path) -> list[str]:
    """Comparisons against a cache mode name (``== "static"``, ``in ("concat", "static")``, ...) in ``path``."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = set()
        for operand in operands:
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            names |= {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        if names & MODE_NAMES:
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_mode_branch_detector_finds_a_planted_branch(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("def f(mode):\n    if mode == 'static':\n        return 1\n    return mode in ('concat',)\n")
    assert len(mode_branches(planted)) == 2


def test_the_cache_mode_is_branched_on_only_by_the_layouts():
    hits = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).as_posix() not in MODE_OWNERS
            for hit in mode_branches(path)]
    assert not hits, f"branches on the cache mode outside cache_layout.py: {hits}"


def imports_from(path: Path, package: str, root: Path = PACKAGE) -> list[str]:
    """``module:name`` of every import in ``path`` (a module of the package at ``root``; relative imports resolved)
    that reaches into ``package``."""
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: -node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out += [f"{module}:{alias.name}" for alias in node.names if module.startswith(package)
                    or f"{module}.{alias.name}".startswith(package)]
        elif isinstance(node, ast.Import):
            out += [f"{alias.name}:" for alias in node.names if alias.name.startswith(package)]
    return out


def test_the_tensorrt_engine_imports_nothing_from_the_onnxruntime_engine():
    source = PACKAGE / "trt" / "engine.py"
    assert imports_from(source, "mla_deploy.ort") == []
    assert any(i.startswith("mla_deploy.engines.base:") for i in imports_from(source, "mla_deploy.engines"))


#: (package, whether bench must import from the package itself rather than its modules: the exporter's public
#: API is what its __init__ exports)
BENCH_DEPENDENCIES = [("mla_deploy.exporter", True), ("mla_deploy.trt", False), ("mla_deploy.model", False),
                      ("mla_deploy.engines", False), ("mla_deploy.ort", False)]


@pytest.mark.parametrize("package,root_only", BENCH_DEPENDENCIES, ids=[p for p, _ in BENCH_DEPENDENCIES])
def test_bench_uses_only_public_names(package, root_only):
    private = []
    for path in sorted((PACKAGE / "bench").rglob("*.py")):
        for item in imports_from(path, package):
            module, _, name = item.partition(":")
            if (any(part.startswith("_") for part in module.split(".")) or name.startswith("_")
                    or (root_only and module != package and not f"{module}.{name}" == package)):
                private.append(f"{path.name}: {item}")
    assert not private, f"bench imports private names of {package}: {private}"


def test_the_engines_import_nothing_from_the_exporter():
    found = [f"{path.name}: {i}" for path in sorted((PACKAGE / "engines").rglob("*.py"))
             for i in imports_from(path, "mla_deploy.exporter")]
    assert not found, f"engines/ imports from exporter/: {found}"


def test_the_engine_import_check_finds_a_planted_import(tmp_path):
    pkg = tmp_path / "mla_deploy"
    (pkg / "engines").mkdir(parents=True)
    planted = pkg / "engines" / "x.py"
    planted.write_text("def f():\n    from ..exporter.quantize import EXACT_ACCURACY\n    import mla_deploy.exporter\n")
    assert imports_from(planted, "mla_deploy.exporter", pkg) == ["mla_deploy.exporter.quantize:EXACT_ACCURACY",
                                                                  "mla_deploy.exporter:"]


# --- quantization has one owner: mla_deploy/quant/ -------------------------------------------------------------------
#: the owner: every other module asks its objects (mla_deploy.quant.Quantization, WeightFormat) instead of branching
QUANT_OWNER = PACKAGE / "quant"
#: and the CPU engine's graph rewrites, which find the quantized operators the owner's formats write (``QMoE``,
#: ``MatMulNBits``) by their op type and dtype and put mla-deploy's own in their place, with the check that runs them
QUANT_CO_OWNERS = (PACKAGE / "ort" / "swaps.py", PACKAGE / "ort" / "probe.py")
#: a condition site outside the owner is one if it holds a name (variable, attribute) of these ...
QUANT_NAMES = re.compile(r"quant|scheme|block_size", re.IGNORECASE)
#: ... or one of the owner's constants ...
QUANT_IDS = {"FLOAT", "WEIGHTS", "FORMATS", "SCHEMES", "BLOCK_SIZES", "QDQ", "MATMULNBITS", "DEFAULT_FORMAT"}
#: ... or a string constant naming a scheme or a format. The bare name ``weights`` is a WeightsSource, MoE routing
#: weights or a byte count as often as a scheme: it counts beside one of these constants (``weights == "float"``)
QUANT_CONSTANTS = {"float", "int8", "int4", "matmulnbits", "qdq"}
FORMAT_NAMES = {"matmulnbits", "qdq"}
#: the issue's bound (main at 2c7fb74 had 58 such sites in 15 files by this count)
MAX_QUANT_CONDITIONS = 12


def _quant_related(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and (QUANT_NAMES.search(sub.id) or sub.id in QUANT_IDS):
            return True
        if isinstance(sub, ast.Attribute) and (QUANT_NAMES.search(sub.attr) or sub.attr in QUANT_IDS):
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.lower() in QUANT_CONSTANTS:
            return True
    return False


def _conditions(tree: ast.AST) -> list[ast.AST]:
    """Every condition of ``tree``: the tests of ``if``/``elif``, ternaries, ``while``, ``assert``, comprehension
    ``if`` s and ``match`` subjects, then every boolean expression used as a value (``and``/``or``, ``not``, a
    comparison) outside those tests."""
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
    inside = {id(sub) for test in tests for sub in ast.walk(test)}
    for node in ast.walk(tree):
        boolean = isinstance(node, (ast.BoolOp, ast.Compare)) or (isinstance(node, ast.UnaryOp)
                                                                   and isinstance(node.op, ast.Not))
        if boolean and id(node) not in inside:
            tests.append(node)
            inside |= {id(sub) for sub in ast.walk(node)}
    return tests


def quant_conditions(path: Path) -> list[str]:
    """``file:line: source`` of each condition on quantization in ``path`` (one per line)."""
    lines = path.read_text().splitlines()
    found = sorted({test.lineno for test in _conditions(ast.parse(path.read_text())) if _quant_related(test)})
    name = path.relative_to(PACKAGE.parent) if PACKAGE in path.parents else path.name
    return [f"{name}:{n}: {lines[n - 1].strip()}" for n in found]


def format_literals(path: Path) -> list[str]:
    """``file:line`` of each string constant that is a weight format's name (any case) in ``path``."""
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in FORMAT_NAMES]


def _outside_the_owner() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if QUANT_OWNER not in p.parents and p not in QUANT_CO_OWNERS]


def test_quant_condition_detector_finds_planted_conditions(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text(
        "def f(weights, scheme, manifest, source, keys, fmt, block_size):\n"
        "    if weights == 'float':\n"  # 1
        "        return 1\n"
        "    elif manifest.quantization.quantized:\n"  # 2
        "        pass\n"
        "    x = 2 if scheme else 3\n"  # 3
        "    y = [k for k in keys if manifest.quantization is not FLOAT]\n"  # 4
        "    while block_size > 1:\n"  # 5
        "        block_size //= 2\n"
        "    assert fmt != 'qdq'\n"  # 6
        "    whole = fmt == 'MatMulNBits'\n"  # 7: a boolean value, not in an if
        "    if source.kind == 'hf' and weights.path:\n"  # not counted: a WeightsSource
        "        pass\n"
        "    return [w for w in weights if w.dtype != 'int64']\n")  # not counted
    assert [hit.split(":")[1] for hit in quant_conditions(planted)] == ["2", "4", "6", "7", "8", "10", "11"]
    assert format_literals(planted) == ["x.py:10", "x.py:11"]


def test_quantization_is_branched_on_only_by_its_owner():
    sites = [hit for path in _outside_the_owner() for hit in quant_conditions(path)]
    print(f"{len(sites)} condition sites on quantization outside mla_deploy/quant/:", *sites, sep="\n  ")
    assert len(sites) <= MAX_QUANT_CONDITIONS, "\n".join(sites)


def test_format_names_are_spelled_only_by_their_owner():
    found = [hit for path in _outside_the_owner() for hit in format_literals(path)]
    assert not found, f"weight format names spelled outside mla_deploy/quant/: {found}"


def private_imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """``module:name`` of every name with a leading underscore that ``path`` imports from the package."""
    return [item for item in imports_from(path, "mla_deploy", root)
            if item.partition(":")[2].startswith("_") and item.partition(":")[2] != "__version__"]


def test_private_import_detector_finds_a_planted_import(tmp_path):
    planted = tmp_path / "mla_deploy" / "exporter" / "genai.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from .export import _save, run_export\ndef f():\n    from ..quant import _layout\n")
    assert private_imports(planted, tmp_path / "mla_deploy") == ["mla_deploy.exporter.export:_save",
                                                                 "mla_deploy.quant:_layout"]


def test_no_module_imports_another_modules_private_names():
    found = [f"{path.relative_to(PACKAGE)}: {item}" for path in sorted(PACKAGE.rglob("*.py"))
             for item in private_imports(path)]
    assert not found, f"private names imported across modules: {found}"


#: the steps only the one export pipeline (exporter/export.py) runs: every target goes through run_export
PIPELINE_STEPS = {"atomic_dir", "make_weights", "save_graph", "quantize_graph_weights", "trace_meta_graph"}
#: where they may be called: the pipeline, and the tracing pieces it is built from (trace_to_onnx saves an
#: in-memory module's graph for the bench)
PIPELINE_OWNERS = {"export.py", "onnx_export.py"}


def pipeline_bypasses(path: Path) -> list[str]:
    """Calls in ``path`` of a step of the export pipeline (``name:line``)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in PIPELINE_STEPS:
                hits.append(f"{path.name}:{name}:{node.lineno}")
    return hits


def test_pipeline_bypass_detector_finds_a_planted_call(tmp_path):
    planted = tmp_path / "genai.py"
    planted.write_text("def export(out):\n    with atomic_dir(out) as tmp:\n        files.save_graph(tmp)\n")
    assert pipeline_bypasses(planted) == ["genai.py:atomic_dir:2", "genai.py:save_graph:3"]


def test_every_export_target_goes_through_the_one_pipeline():
    found = [hit for path in sorted((PACKAGE / "exporter").glob("*.py")) if path.name not in PIPELINE_OWNERS
             for hit in pipeline_bypasses(path)]
    assert not found, f"export steps called outside exporter/export.py's run_export: {found}"


#: the bench's two benches: each imports the shared modules of ``mla_deploy.bench`` (the process harness, the
#: machine probes, the bound, the report helpers), never the other bench
BENCHES = ("mla_deploy.bench.attention", "mla_deploy.bench.whole_model")


def _bench_of(module: str) -> str | None:
    return next((b for b in BENCHES if module == b or module.startswith(b + ".")), None)


def bench_crossings(graph: dict[str, set[str]]) -> list[str]:
    """``module -> dependency`` for each import from one bench into the other, or from a shared bench module
    into either bench."""
    out = []
    for module, deps in graph.items():
        shared = module.startswith("mla_deploy.bench.") and module.count(".") == 2  # imports neither bench
        own = _bench_of(module)
        if own is None and not shared:
            continue
        out += [f"{module} -> {dep}" for dep in deps if _bench_of(dep) not in (None, own)]
    return sorted(out)


def test_bench_crossing_detector_finds_planted_imports(tmp_path):
    bench = tmp_path / "mla_deploy" / "bench"
    for sub in ("attention", "whole_model"):
        (bench / sub).mkdir(parents=True)
        (bench / sub / "__init__.py").write_text("")
    (tmp_path / "mla_deploy" / "__init__.py").write_text("")
    (bench / "__init__.py").write_text("")
    (bench / "harness.py").write_text("def f():\n    from .whole_model import spec\n")  # shared -> a bench
    (bench / "attention" / "spec.py").write_text("from ..harness import f\n")  # a bench -> shared: allowed
    (bench / "whole_model" / "spec.py").write_text("def g():\n    from ..attention.spec import f\n")
    (bench / "whole_model" / "report.py").write_text("from . import spec\nfrom .. import harness\n")
    assert bench_crossings(import_graph(tmp_path / "mla_deploy")) == [
        "mla_deploy.bench.harness -> mla_deploy.bench.whole_model",
        "mla_deploy.bench.harness -> mla_deploy.bench.whole_model.spec",
        "mla_deploy.bench.whole_model.spec -> mla_deploy.bench.attention",
        "mla_deploy.bench.whole_model.spec -> mla_deploy.bench.attention.spec",
    ]


def test_the_two_benches_share_the_harness_and_import_nothing_from_each_other():
    graph = import_graph()
    crossings = bench_crossings(graph)
    assert not crossings, f"imports between the benches (or from a shared module into one): {crossings}"
    for bench in BENCHES:  # both run their workers through the shared harness
        assert any("mla_deploy.bench.harness" in deps for module, deps in graph.items() if _bench_of(module) == bench)


def private_reaches(path: Path) -> list[str]:
    """``file:line name`` of every private name ``path`` reads from another object or module: ``x._name`` where
    ``x`` is not ``self``/``cls`` or a class of ``path``, and ``from m import _name``."""
    hits, tree = [], ast.parse(path.read_text())
    own = {"self", "cls"} | {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            name = node.attr
        elif isinstance(node, ast.ImportFrom):
            owner, name = None, next((a.name for a in node.names if a.name.startswith("_")), "")
        else:
            continue
        if name.startswith("_") and not name.startswith("__") and owner not in own:
            hits.append(f"{path.name}:{node.lineno} {name}")
    return hits


def test_private_reach_detector_finds_planted_reaches(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("from .m import _helper, ok\n\nclass A:\n    @staticmethod\n    def _check(): ...\n\n"
                       "def f(engine):\n    return engine._run(), engine.step(), self._own, A._check(),"
                       " type(engine).__name__\n")
    assert private_reaches(planted) == ["x.py:1 _helper", "x.py:8 _run"]


def test_the_generation_package_drives_engines_through_their_public_interface():
    """The loop, sampling and text read no private name of an engine (or of any other module), and import
    nothing from mla_deploy.engines: they drive mla_deploy.generate.engine.GenerationEngine."""
    files = sorted((PACKAGE / "generate").rglob("*.py"))
    assert {p.name for p in files} >= {"loop.py", "engine.py", "text.py"}
    hits = [hit for path in files for hit in private_reaches(path)]
    assert not hits, f"mla_deploy/generate reaches private names: {hits}"
    engines = [f"{path.name}: {i}" for path in files for i in imports_from(path, "mla_deploy.engines")]
    assert not engines, f"mla_deploy/generate imports from mla_deploy.engines: {engines}"


#: function size limits (issue 20): at most MAX_LONG functions over LONG_LINES lines, none over MAX_PARAMS
#: parameters (``self``/``cls`` not counted). plugins/ (the decode kernel's Triton signatures) is not measured.
LONG_LINES, MAX_LONG, MAX_PARAMS = 50, 8, 10


def function_sizes(root: Path = PACKAGE) -> list[tuple[str, int, int]]:
    """``(module:line name, lines, parameters)`` of every function and method under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            if a.args and a.args[0].arg in ("self", "cls"):
                params = params[1:]
            where = f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"
            out.append((where, node.end_lineno - node.lineno + 1, len(params)))
    return out


def size_violations(root: Path = PACKAGE) -> list[str]:
    sizes = function_sizes(root)
    long = sorted(f"{w} ({n} lines)" for w, n, _ in sizes if n > LONG_LINES)
    wide = sorted(f"{w} ({p} parameters)" for w, _, p in sizes if p > MAX_PARAMS)
    found = [f"{len(long)} functions over {LONG_LINES} lines (at most {MAX_LONG}): {long}"] if len(long) > MAX_LONG else []
    return found + [f"over {MAX_PARAMS} parameters: {w}" for w in wide]


def test_size_detector_finds_planted_violations(tmp_path):
    pkg = tmp_path / "mla_deploy"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(LONG_LINES))
    (pkg / "a.py").write_text("".join(f"def long{i}():\n{body}" for i in range(MAX_LONG)))
    assert size_violations(pkg) == []  # MAX_LONG long functions are allowed
    (pkg / "b.py").write_text(f"def one_more():\n{body}\n"
                              "class C:\n    def m(self, a, b, c, d, e, f, g, h, i, j, *, k=1):\n        pass\n"
                              "    def ok(self, a, b, c, d, e, f, g, h, i, j):\n        pass\n")
    found = size_violations(pkg)
    assert len(found) == 2 and f"{MAX_LONG + 1} functions over" in found[0]
    assert found[1].startswith("over 10 parameters: mla_deploy/b.py:") and found[1].endswith(" m (11 parameters)")


def test_functions_are_short_and_take_few_parameters():
    assert size_violations() == []


# --- no import runs back up the house ---------------------------------------------------------------------------------
#: each part of the package and its layer: a module imports only from its own layer or a lower one. The root package
#: and the deprecated import paths (kept for one release) sit on top: they name what lies below them.
LAYERS = {
    0: ("errors", "lazy", "host", "memory", "values", "io_spec", "config", "expert_forms"),
    1: ("model", "quant", "cache_table"),
    2: ("cache_layout", "recipe", "weight_bytes"),
    3: ("artifact",),
    4: ("checkpoint", "random_checkpoint", "generate"),
    5: ("engines", "exporter"),
    6: ("ort", "trt"),
    7: ("validate", "serve"),
    8: ("bench", "doctor"),
    9: ("cli", "__main__", "text", "tokenizer", "sampling"),
}
#: modules whose layer is not their part's: the deprecated import paths of the engines, which name their new homes
LAYER_OF_MODULE = {"mla_deploy.engines.ort_engine": 9, "mla_deploy.engines.trt_engine": 9, "mla_deploy": 10}


def layer_of(module: str) -> int:
    if module in LAYER_OF_MODULE:
        return LAYER_OF_MODULE[module]
    part = module.split(".")[1]
    found = [layer for layer, parts in LAYERS.items() if part in parts]
    assert found, f"{module}: its part {part!r} has no layer in tests/test_structure.py's LAYERS"
    return found[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module (layer) -> dependency (layer)`` for each import from a lower layer into a higher one."""
    return sorted(f"{m} ({layer_of(m)}) -> {d} ({layer_of(d)})" for m, deps in graph.items() for d in deps
                  if layer_of(d) > layer_of(m))


def test_upward_import_detector_finds_a_planted_import(tmp_path):
    pkg = tmp_path / "mla_deploy"
    for sub in ("artifact", "ort"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "ort" / "record.py").write_text("from ..artifact import files\n")  # down: allowed
    (pkg / "artifact" / "files.py").write_text("def f():\n    from ..ort.record import x\n")  # up, inside a function
    assert upward_imports(import_graph(pkg)) == ["mla_deploy.artifact.files (3) -> mla_deploy.ort (6)",
                                                 "mla_deploy.artifact.files (3) -> mla_deploy.ort.record (6)"]


def test_no_import_runs_back_up_the_layers():
    found = upward_imports(import_graph())
    assert not found, "imports from a lower layer into a higher one:\n" + "\n".join(found)


# --- one owner of the host's facts: mla_deploy/host.py ----------------------------------------------------------------
#: how a fact about the machine is read; only mla_deploy/host.py reads them
HOST_FACTS = re.compile(r"/proc/cpuinfo|/proc/meminfo|sched_getaffinity|cpu_count\(|transparent_hugepage|"
                        r"platform\.(machine|processor)\(|libc_ver\(|SC_PHYS_PAGES|memory\.max")


def host_fact_reads(path: Path) -> list[str]:
    return [f"{path.name}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if HOST_FACTS.search(line) and not line.lstrip().startswith("#")]


def test_host_fact_detector_finds_planted_reads(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("import os, platform\nn = os.cpu_count()\nm = platform.machine()\n"
                       "# /proc/cpuinfo in a comment is no read\nflags = open('/proc/cpuinfo').read()\n")
    assert host_fact_reads(planted) == ["x.py:2", "x.py:3", "x.py:5"]


def test_facts_about_the_host_have_one_owner():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "host.py"
             for hit in host_fact_reads(path)]
    assert not found, f"host facts read outside mla_deploy/host.py: {found}"


# --- ONNX Runtime is imported only by its backend folder, mla_deploy/ort/ ---------------------------------------------
def onnxruntime_imports(path: Path) -> list[str]:
    """``file:line`` of each import of ``onnxruntime`` in ``path`` (module level or inside a function)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "onnxruntime" or n.startswith("onnxruntime.") for n in names):
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_onnxruntime_import_detector_finds_planted_imports(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("import onnxruntime_genai\ndef f():\n    import onnxruntime as ort\n"
                       "    from onnxruntime.capi import _pybind_state\n")
    assert onnxruntime_imports(planted) == ["x.py:3", "x.py:4"]


def test_onnxruntime_is_imported_only_under_ort():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if (PACKAGE / "ort") not in path.parents
             for hit in onnxruntime_imports(path)]
    assert not found, f"onnxruntime imported outside mla_deploy/ort/ (go through mla_deploy.ort): {found}"
