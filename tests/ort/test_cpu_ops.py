"""mla-deploy's own CPU operators (``mla_deploy/ort/csrc/cpu_ops.c``, :mod:`mla_deploy.ort.operators`): compiled
here, run in real ONNX Runtime sessions beside ONNX Runtime's own ``QMoE`` and ``MatMulNBits`` on the same weights
(int4 and int8, one token and several), its portable C path beside its fast path for this CPU, its AVX2 build
(compiled and run here, whatever else the CPU has) bit for bit beside its AVX-512 VNNI one, the
swap that puts it in a CPU engine (only where it computes exactly what QMoE does), and the engine that holds it:
the same tokens as the source graphs, its library refused in one line when missing or modified, QMoE kept (and
why said) without a C compiler."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from artifacts import tiny_recipe
from cli_run import cli, ok
from mla_deploy.ort import operators as cpu_ops
from mla_deploy.ort import swaps as own_ops
from mla_deploy.ort.engine import OrtEngine
from mla_deploy.errors import ArtifactError

pytestmark = pytest.mark.skipif(cpu_ops.compiler() is None, reason="no C compiler (cc, gcc, clang or $CC)")

# 20 blocks of 32 (one group of 16, one of 4) and 5 (one group of 4, one block alone): every path of the kernel
D, I, E, K = 640, 160, 8, 3


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, cpu_ops.Library]:
    """The operator compiled for this CPU (``native``: its best fast path, where it has one) and in portable C."""
    built = {}
    for name, isa in (("native", None), ("portable", cpu_ops.PORTABLE)):
        folder = tmp_path_factory.mktemp(name)
        built[name] = cpu_ops.compile_library(folder, isa)
    assert built["portable"].path is not None and built["portable"].isa == "portable", built["portable"].why_not
    return built


def _weights(bits: int, seed: int = 0):
    """fc1, its scales, fc2, its scales: random bytes, scales float32 holding float16 values (as the export's)."""
    rng = np.random.default_rng(seed)
    def stacked(rows: int, cols: int):
        return (rng.integers(0, 256, size=(E, rows, cols * bits // 8), dtype=np.uint8),
                _half_values(rng.random((E, rows, cols // 32), dtype=np.float32) * 0.02 + 0.005))
    return (*stacked(2 * I, D), *stacked(D, I))


def _half_values(scales):
    return scales.astype(np.float16).astype(np.float32)


def _as_half(weights):
    """``weights`` (integers, scales, ...) with every scale array float16 (the same values)."""
    return tuple(w.astype(np.float16) if w.dtype == np.float32 else w for w in weights)


def _model(graph, *domains: str, opset: int = 18):
    """``graph`` as a model of IR version 10 (what ONNX Runtime 1.31 reads) importing ONNX's ``opset`` and version 1
    of each of ``domains``."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    *(helper.make_opsetid(d, 1) for d in domains)])
    model.ir_version = 10
    return model


def _session(node, weights, library: Path | None):
    names = ("w1", "s1", "w2", "s2")
    graph = helper.make_graph(
        [node], "experts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D]),
                            helper.make_tensor_value_info("r", TensorProto.FLOAT, ["T", E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", D])],
        [numpy_helper.from_array(w, n) for w, n in zip(weights, names)])
    return _open(graph, library)


def _open(graph, library: Path | None):
    """A 2-thread CPU session on ``graph`` (ONNX Runtime's contrib and our operators' domains), ``library``
    registered when given."""
    model = _model(graph, "com.microsoft", own_ops.DOMAIN)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if library is not None:
        cpu_ops.register(options, library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _qmoe(bits: int, normalize: int, block: int = 32, level: int = 4):
    return helper.make_node("QMoE", ["x", "r", "w1", "s1", "", "w2", "s2"], ["y"], domain="com.microsoft", k=K,
                            activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=normalize,
                            activation_alpha=1.0, activation_beta=0.0, expert_weight_bits=bits, block_size=block,
                            accuracy_level=level)


def _ours(bits: int, normalize: int, block: int = 32, **extra):
    return helper.make_node(own_ops.OP_TYPE, ["x", "r", "w1", "s1", "w2", "s2"], ["y"], domain=own_ops.DOMAIN, k=K,
                            expert_weight_bits=bits, block_size=block, normalize_routing_weights=normalize, **extra)


def _interleaved(weights, bits: int):
    """fc1, its scales, fc2, its scales with both weights in the interleaved layout (``own_ops.interleave_rows``)."""
    w1, s1, w2, s2 = weights
    return (own_ops.interleave_rows(w1.reshape(-1, w1.shape[-1]), bits).reshape(w1.shape), s1,
            own_ops.interleave_rows(w2.reshape(-1, w2.shape[-1]), bits).reshape(w2.shape), s2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("scales", ["float", "float16"])
@pytest.mark.parametrize("layout", ["source", "interleaved"])
def test_operator_equals_qmoe(libraries, bits, tokens, build, scales, layout):
    """The same weights, tokens and routing scores through QMoE and through ours: equal to float32 rounding (both
    quantize each token to int8 per block and sum integer products; only the order of float sums differs). Six
    tokens over 8 experts with 3 each: experts with one token, several, and none. Ours reads the scales as float or
    as float16 (the CPU engine's storage), the same values, and the weights as QMoE holds them or, given
    ``interleaved=1``, in the interleaved layout the CPU engine stores (fc1's rows: a group of 16 blocks and 4 left
    over; fc2's: 5 left over)."""
    library = libraries[build]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    rng = np.random.default_rng(tokens + 10 * bits)
    x = rng.standard_normal((tokens, D), dtype=np.float32)
    r = rng.standard_normal((tokens, E), dtype=np.float32)
    weights = _weights(bits)
    want = _session(_qmoe(bits, 1), weights, None).run(None, {"x": x, "r": r})[0]
    mine = _as_half(weights) if scales == "float16" else weights
    extra = {}
    if layout == "interleaved":
        mine, extra = _interleaved(mine, bits), {"interleaved": 1}
    got = _session(_ours(bits, 1, **extra), mine, library.path).run(None, {"x": x, "r": r})[0]
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(got - want).max() <= 2e-5 * scale, np.abs(got - want).max() / scale
    # routing matters: other scores give other outputs (the test could not pass by ignoring r)
    other = _session(_ours(bits, 1, **extra), mine, library.path).run(None, {"x": x, "r": -r})[0]
    assert np.abs(other - want).max() > 0.1 * scale


def test_no_token_gives_an_empty_output(libraries):
    library = libraries["portable"]
    y = _session(_ours(4, 1), _weights(4), library.path).run(
        None, {"x": np.zeros((0, D), np.float32), "r": np.zeros((0, E), np.float32)})[0]
    assert y.shape == (0, D)


def test_bad_attributes_are_refused_by_the_operator(libraries):
    """An attribute the kernel does not compute (blocks of 64) fails the session in one ONNX Runtime error."""
    node = _ours(4, 1, block=64)
    with pytest.raises(Exception, match="block_size 32"):
        _session(node, _weights(4), libraries["portable"].path).run(
            None, {"x": np.zeros((1, D), np.float32), "r": np.zeros((1, E), np.float32)})


@pytest.mark.parametrize("change, swapped", [({}, 1), ({"block": 64}, 0), ({"level": 1}, 0), ({"normalize": 0}, 0)])
def test_swap_only_where_the_operator_computes_exactly_qmoe(change, swapped):
    """Blocks of 32 at accuracy_level 4, weights normalised over the chosen experts, are swapped; another block
    size, the exact (fp32) compute, or another normalisation keep QMoE."""
    graph = helper.make_graph([_qmoe(**{"bits": 4, "normalize": 1, **change})], "g", [], [])
    model = helper.make_model(graph)
    assert own_ops.swap_experts(model) == swapped
    assert [n.op_type for n in model.graph.node] == [own_ops.OP_TYPE if swapped else "QMoE"]
    assert any(o.domain == own_ops.DOMAIN for o in model.opset_import) == bool(swapped)


def _routing_round_trip(bits: int, also_read: bool = False):
    """The export's fused routing around QMoE (:func:`mla_deploy.exporter.moe_onnx.moe_experts_fused_onnx`): the
    chosen experts' weights ``w [T, K]`` scattered as log-probabilities over ``-1e30``, QMoE's output multiplied back
    by their sum. ``also_read``: QMoE's output is a graph output too (then the rewrite must leave it alone)."""
    qmoe = _qmoe(bits, 1)
    qmoe.output[0] = "moe"
    nodes = [helper.make_node("Shape", ["x"], ["t"], start=0, end=1),
             helper.make_node("Constant", [], ["e"], value_ints=[E]),
             helper.make_node("Concat", ["t", "e"], ["te"], axis=0),
             helper.make_node("ConstantOfShape", ["te"], ["floor"],
                              value=numpy_helper.from_array(np.array([-1e30], np.float32))),
             helper.make_node("Constant", [], ["tiny"], value_float=1e-30),
             helper.make_node("Max", ["w", "tiny"], ["floored"]),
             helper.make_node("Log", ["floored"], ["log_w"]),
             helper.make_node("ScatterElements", ["floor", "idx", "log_w"], ["r"], axis=1), qmoe,
             helper.make_node("Constant", [], ["axes"], value_ints=[1]),
             helper.make_node("ReduceSum", ["w", "axes"], ["total"], keepdims=1),
             helper.make_node("Mul", ["moe", "total"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", D])]
    if also_read:
        outputs.append(helper.make_tensor_value_info("moe", TensorProto.FLOAT, ["T", D]))
    graph = helper.make_graph(
        nodes, "routing", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, ["T", K]),
                           helper.make_tensor_value_info("idx", TensorProto.INT64, ["T", K])], outputs,
        [numpy_helper.from_array(w, n) for w, n in zip(_weights(bits), ("w1", "s1", "w2", "s2"))])
    return _model(graph, "com.microsoft")


def _routing(tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, D), dtype=np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int64)
    w = (rng.random((tokens, K), dtype=np.float32) * 2 + 0.1).astype(np.float32)  # not normalised (V3 scales them)
    return {"x": x, "w": w, "idx": idx}


def _run(model, feeds, library: Path | None, folder: Path | None = None):
    """``model`` run by ONNX Runtime on ``feeds``, our operators registered from ``library`` (or not), its external
    weights read from ``folder``."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    if library is not None:
        cpu_ops.register(options, library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 6])
def test_swap_gives_the_operator_the_routing_itself(libraries, bits, tokens):
    """The export's routing round trip (weights scattered as log-probabilities into QMoE, the output multiplied back
    by their sum) becomes one RoutedExperts given the weights and the experts (normalize_routing_weights 0): every
    node of the round trip is gone, and the output equals QMoE's through the round trip to float32 rounding, for
    weights that do not sum to 1. Other experts give another output (the operator reads idx)."""
    library = libraries["native"] if libraries["native"].path else libraries["portable"]
    model = _routing_round_trip(bits)
    feeds = _routing(tokens, seed=tokens + bits)
    want = _run(model, feeds, None)[0]
    assert own_ops.swap_experts(model) == 1
    assert [n.op_type for n in model.graph.node] == [own_ops.OP_TYPE]
    node = model.graph.node[0]
    assert list(node.input) == ["x", "w", "w1", "s1", "w2", "s2", "idx"] and list(node.output) == ["y"]
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "normalize_routing_weights")) == 0
    got = _run(model, feeds, library.path)[0]
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(got - want).max() <= 2e-5 * scale, np.abs(got - want).max() / scale
    other = _run(model, {**feeds, "idx": (feeds["idx"] + 1) % E}, library.path)[0]
    assert np.abs(other - want).max() > 0.1 * scale


def test_routing_read_elsewhere_stays_a_round_trip():
    """QMoE's own output read by something else (here a graph output): swapped, but its router input kept."""
    model = _routing_round_trip(4, also_read=True)
    assert own_ops.swap_experts(model) == 1
    node = next(n for n in model.graph.node if n.op_type == own_ops.OP_TYPE)
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "normalize_routing_weights")) == 1
    assert {"ScatterElements", "Mul", "ReduceSum"} <= {n.op_type for n in model.graph.node}


def test_given_routing_outside_the_experts_is_refused(libraries):
    """An expert index outside [0, E) fails the run in one ONNX Runtime error, read nowhere."""
    model = _routing_round_trip(4)
    own_ops.swap_experts(model)
    feeds = _routing(2, seed=3)
    feeds["idx"][1, 0] = E
    with pytest.raises(Exception, match=r"outside \[0, E\)"):
        _run(model, feeds, libraries["portable"].path)


SHARED = 96  # the shared experts' intermediate size: 3 blocks of 32


def _shared_experts_model(bits: int, reader: str | None = None):
    """A MoE layer as the export writes it for ONNX Runtime: ``QMoE`` over ``h`` reshaped to ``[T, D]``, its output
    reshaped back and added to the shared experts' ``down(silu(gate(h)) * up(h))`` (three ``MatMulNBits`` products,
    ``silu`` as ``Mul(g, Sigmoid(g))``). ``reader``: a tensor of the shared experts also made a graph output (the
    fold must then leave the layer alone)."""
    rng = np.random.default_rng(bits + 7)

    def product(name, n, k):
        return [numpy_helper.from_array(rng.integers(0, 256, size=(n, k // 32, 32 * bits // 8), dtype=np.uint8),
                                        f"{name}.q"),
                numpy_helper.from_array(_half_values(rng.random(n * k // 32, dtype=np.float32) * 0.02 + 0.005),
                                        f"{name}.s")]

    def nbits(name, a, out, n, k):
        return helper.make_node("MatMulNBits", [a, f"{name}.q", f"{name}.s"], [out], domain="com.microsoft", K=k, N=n,
                                bits=bits, block_size=32, accuracy_level=4)

    qmoe = _qmoe(bits, 1)
    qmoe.input[0], qmoe.output[0] = "x", "moe"
    nodes = [helper.make_node("Constant", [], ["flat"], value_ints=[-1, D]),
             helper.make_node("Reshape", ["h", "flat"], ["x"]), qmoe,
             helper.make_node("Shape", ["h"], ["h_shape"]),
             helper.make_node("Reshape", ["moe", "h_shape"], ["routed"]),
             nbits("gate", "h", "g", SHARED, D), helper.make_node("Sigmoid", ["g"], ["sig"]),
             helper.make_node("Mul", ["g", "sig"], ["silu"]), nbits("up", "h", "u", SHARED, D),
             helper.make_node("Mul", ["silu", "u"], ["act"]), nbits("down", "act", "shared", D, SHARED),
             helper.make_node("Add", ["routed", "shared"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", D])]
    if reader:
        outputs.append(helper.make_tensor_value_info(reader, TensorProto.FLOAT, None))
    weights = [numpy_helper.from_array(w, n) for w, n in zip(_weights(bits), ("w1", "s1", "w2", "s2"))]
    graph = helper.make_graph(
        nodes, "layer", [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "T", D]),
                         helper.make_tensor_value_info("r", TensorProto.FLOAT, ["T", E])], outputs,
        weights + product("gate", SHARED, D) + product("up", SHARED, D) + product("down", D, SHARED))
    return _model(graph, "com.microsoft")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("layout", ["source", "interleaved"])
def test_shared_experts_fold_into_the_operator(libraries, bits, tokens, build, layout):
    """The build's fold (``fold_shared_experts``): the layer's shared experts become inputs 7 to 12 of its
    RoutedExperts, and the gate, sigmoid, silu, up, product, down and add nodes go; the output equals ONNX Runtime's
    QMoE plus its three MatMulNBits products to float32 rounding (the same int8 quantization of each token and of
    the activation), but for one thing: ONNX Runtime's Sigmoid and the operator's expf differ in the last bits, so an
    activation value on a rounding boundary may quantize one int8 step apart. One token of a batch may then differ by
    at most that step times the largest down weight (measured: one of the 140 tokens below). Other shared weights
    give another output (the operator reads them). The same with every weight of the node interleaved by the build's
    ``interleave_weights`` (the weights in the graph: rewritten in place)."""
    library = libraries[build]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    model = _shared_experts_model(bits, reader="act")
    rng = np.random.default_rng(tokens)
    feeds = {"h": rng.standard_normal((1, tokens, D), dtype=np.float32),
             "r": rng.standard_normal((tokens, E), dtype=np.float32)}
    want, act = _run(model, feeds, None)
    del model.graph.output[1]
    scales = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    step = np.abs(act).reshape(tokens, -1, 32).max(axis=-1) / 127  # one int8 step of each activation block
    flip = step.max(axis=-1) * scales["down.s"].max() * 2 ** (bits - 1)  # its largest effect on an output, per token
    assert own_ops.swap_experts(model) == 1 and own_ops.swap_linear(model) == 3
    assert own_ops.fold_shared_experts(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Constant", "Reshape", own_ops.OP_TYPE, "Shape", "Reshape"]
    node = model.graph.node[2]
    assert list(node.input[6:]) == ["", "gate.q", "gate.s", "up.q", "up.s", "down.q", "down.s"]
    assert model.graph.node[-1].output[0] == "y"
    if layout == "interleaved":
        before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        assert own_ops.interleave_weights(model) == 1
        assert own_ops.interleave_weights(model) == 0  # once only
        after = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        moved = {n for n in before if not np.array_equal(before[n], after[n])}
        assert moved == {"w1", "gate.q", "up.q"}  # rows of 20 blocks; fc2's and down's (5 and 3 blocks) stay
        assert [a.i for a in node.attribute if a.name == "interleaved"] == [1]
    got = _run(model, feeds, library.path)[0]
    scale = np.abs(want).max()
    assert got.shape == want.shape == (1, tokens, D) and scale > 0
    error = np.abs(got - want).max(axis=-1)[0]  # per token
    apart = error > 2e-5 * scale
    assert apart.sum() <= 1 and (error <= 2e-5 * scale + flip).all(), (error / scale, flip / scale)
    down = next(t for t in model.graph.initializer if t.name == "down.q")
    down.CopyFrom(numpy_helper.from_array(255 - numpy_helper.to_array(down), "down.q"))
    other = _run(model, feeds, library.path)[0]
    assert np.abs(other - want).max() > 0.1 * scale


@pytest.mark.parametrize("reader", ["g", "sig", "act", "shared", "moe"])
def test_shared_experts_read_elsewhere_stay_apart(reader):
    """A tensor between the experts and the sum read by something else too: nothing is folded."""
    model = _shared_experts_model(4, reader=reader)
    own_ops.swap_experts(model), own_ops.swap_linear(model)
    before = [n.op_type for n in model.graph.node]
    assert own_ops.fold_shared_experts(model) == 0
    assert [n.op_type for n in model.graph.node] == before


def test_shared_experts_refuse_inputs_that_do_not_agree(libraries):
    """Inputs 7 to 12 given in part, or of another size than the layer's, fail the run in one ONNX Runtime error."""
    model = _shared_experts_model(4)
    own_ops.swap_experts(model), own_ops.swap_linear(model), own_ops.fold_shared_experts(model)
    feeds = {"h": np.ones((1, 2, D), np.float32), "r": np.ones((2, E), np.float32)}
    partial = model.__class__.FromString(model.SerializeToString())
    partial.graph.node[2].input[12] = ""
    with pytest.raises(Exception, match="all of inputs 7 to 12 or none"):
        _run(partial, feeds, libraries["portable"].path)
    wrong = model.__class__.FromString(model.SerializeToString())
    wrong.graph.node[2].input[11] = "gate.q"  # [SHARED, D/32, 16] where down's [D, SHARED/32, 16] belongs
    with pytest.raises(Exception, match="shared gate and up weights must be"):
        _run(wrong, feeds, libraries["portable"].path)


def _float_round_trip():
    """The export's routing round trip around a float ``MoE`` (:func:`_routing_round_trip`'s, float weights)."""
    model = _routing_round_trip(4)
    graph = model.graph
    rng = np.random.default_rng(7)
    fc1 = rng.standard_normal((E, 2 * I, D), dtype=np.float32) * 0.05
    fc2 = rng.standard_normal((E, D, I), dtype=np.float32) * 0.05
    del graph.initializer[:]
    graph.initializer.extend([numpy_helper.from_array(fc1, "w1"), numpy_helper.from_array(fc2, "w2")])
    at = next(i for i, n in enumerate(graph.node) if n.op_type == "QMoE")
    moe = helper.make_node("MoE", ["x", "r", "w1", "", "w2"], ["moe"], domain="com.microsoft", k=K,
                           activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1,
                           activation_alpha=1.0, activation_beta=0.0)
    graph.node.remove(graph.node[at])
    graph.node.insert(at, moe)
    return model


@pytest.mark.parametrize("tokens", [1, 6, 24])
@pytest.mark.parametrize("build", ["native", "portable"])
def test_float_experts_equal_moe(libraries, tokens, build):
    """A float MoE behind the export's routing round trip becomes one FloatExperts given the routing: every node of
    the round trip is gone, and the output equals ONNX Runtime's MoE to float32 rounding. 24 tokens give each
    expert about 9 pairs: groups of 4 (a prefill's path, 4 rows by 4 tokens) and some left over."""
    library = libraries[build]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    model = _float_round_trip()
    feeds = _routing(tokens, seed=tokens)
    want = _run(model, feeds, None)[0]
    assert own_ops.swap_float_experts(model) == 1
    assert [n.op_type for n in model.graph.node] == [own_ops.FLOAT_EXPERTS_OP_TYPE]
    assert list(model.graph.node[0].input) == ["x", "w", "w1", "w2", "idx"]
    got = _run(model, feeds, library.path)[0]
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(got - want).max() <= 1e-5 * scale, np.abs(got - want).max() / scale
    other = _run(model, {**feeds, "idx": (feeds["idx"] + 1) % E}, library.path)[0]
    assert np.abs(other - want).max() > 0.1 * scale


def _float_linear_model(K: int, N: int, seed: int = 0):
    """``y = MatMul(a [B, T, K], w)`` with ``w`` a float32 initializer ``[K, N]``, beside ``MatMul(a, a2)`` of a
    second input (no weight: never swapped)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((K, N), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"]), helper.make_node("MatMul", ["a", "b"], ["z"])], "float",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["B", "T", K]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [K, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", N]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["B", "T", 3])],
        [numpy_helper.from_array(w, "w")])
    return _model(graph), w


@pytest.mark.parametrize("rows", [(1, 1), (2, 3), (1, 8), (1, 9), (4, 16)])
@pytest.mark.parametrize("shape", [(640, 320), (2048, 576), (130, 50)])
@pytest.mark.parametrize("build", ["native", "portable"])
def test_float_matmul_equals_matmul(libraries, rows, shape, build):
    """A float32 weight's ``MatMul`` becomes ``FloatMatMul`` of the weight transposed (the one of a second input
    stays): equal to ONNX Runtime's ``MatMul`` to float32 rounding for a decode step's rows (up to 8: ours, dot
    products over the transposed weight's rows, 4 rows of A at a time) and for more (9, 64: handed to ONNX Runtime's
    own ``FusedMatMul`` with ``transB``), K and N not multiples of the vector (130 x 50)."""
    library = libraries[build]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    K, N = shape
    model, w = _float_linear_model(K, N)
    rng = np.random.default_rng(K + sum(rows))
    feeds = {"a": rng.standard_normal((*rows, K), dtype=np.float32), "b": rng.standard_normal((K, 3),
                                                                                          dtype=np.float32)}
    want = _run(model, feeds, None)
    assert own_ops.swap_float_linear(model) == 1
    assert [(n.domain, n.op_type) for n in model.graph.node] == [(own_ops.DOMAIN, own_ops.FLOAT_LINEAR_OP_TYPE),
                                                                 ("", "MatMul")]
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), w.T)
    got = _run(model, feeds, library.path)
    exact = feeds["a"].astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(exact).max()
    assert got[0].shape == want[0].shape == (*rows, N)
    assert np.abs(got[0] - exact).max() <= 1e-6 * scale and np.abs(got[0] - want[0]).max() <= 1e-6 * scale
    assert np.array_equal(got[1], want[1])
    empty = _run(model, {"a": np.zeros((0, 1, K), np.float32), "b": feeds["b"]}, library.path)[0]
    assert empty.shape == (0, 1, N)


@pytest.mark.parametrize("a_shape", [(1, 4, 1, 48), (2, 4, 3, 48), (1, 4, 9, 48), (1, 1, 2, 48), (3, 48),
                                     (2, 1, 4, 2, 48)])
@pytest.mark.parametrize("build", ["native", "portable"])
def test_float_matmul_per_head_weights(libraries, a_shape, build):
    """A ``MatMul`` of a per-head float32 weight ``[H, K, N]`` (the absorbed attention's ``W_UK``, ``W_UV``) becomes
    ``FloatMatMul`` of it transposed, ``[H, N, K]``: equal to ``MatMul`` to float32 rounding for a decode step's rows
    per head (ours: up to 8), for more (handed to ``FusedMatMul``), and where ``MatMul`` broadcasts A over the heads
    (A's heads axis 1, or A of two dimensions)."""
    library = libraries[build]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    rng = np.random.default_rng(sum(a_shape))
    H, K, N = 4, 48, 40
    w = rng.standard_normal((H, K, N), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])], "heads",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None] * len(a_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")])
    model = _model(graph)
    feeds = {"a": rng.standard_normal(a_shape, dtype=np.float32)}
    want = _run(model, feeds, None)[0]
    assert own_ops.swap_float_linear(model) == 1
    assert model.graph.node[0].op_type == own_ops.FLOAT_LINEAR_OP_TYPE
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), np.swapaxes(w, 1, 2))
    got = _run(model, feeds, library.path)[0]
    exact = np.matmul(feeds["a"].astype(np.float64), w.astype(np.float64))
    scale = np.abs(exact).max()
    assert got.shape == want.shape == exact.shape
    assert np.abs(got - exact).max() <= 1e-6 * scale and np.abs(got - want).max() <= 1e-6 * scale
    other = _run(model, {"a": feeds["a"][..., ::-1].copy()}, library.path)[0]
    assert np.abs(other - got).max() > 0.1 * scale


def test_float_matmul_transposes_external_weights_into_the_side_file(libraries, tmp_path):
    """The build's transposed float weights (``swap_float_linear`` with a folder and a side file): an external weight
    read by two ``MatMul`` nodes is transposed once into the side file, at a 4 KiB-aligned offset, its source file
    untouched, and both nodes compute what ``MatMul`` did; a weight something else reads too (here a ``Gather``, as a
    tied embedding would) keeps its ``MatMul`` and its form, so the model never holds both forms of a weight."""
    import onnx

    library = libraries["native"] if libraries["native"].path else libraries["portable"]
    rng = np.random.default_rng(11)
    K, N = 96, 200
    w, v = rng.standard_normal((K, N), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)
    u = rng.standard_normal((3, K, 30), dtype=np.float32)  # per head
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"]), helper.make_node("MatMul", ["a2", "w"], ["y2"]),
         helper.make_node("MatMul", ["a", "v"], ["z"]), helper.make_node("Gather", ["v", "i"], ["g"]),
         helper.make_node("MatMul", ["a3", "u"], ["h"])], "float",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["T", K]),
         helper.make_tensor_value_info("a2", TensorProto.FLOAT, ["T", K]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("a3", TensorProto.FLOAT, [1, 3, 1, K])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "y2", "z", "g", "h")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v"), numpy_helper.from_array(u, "u")])
    path = tmp_path / "model.onnx"
    onnx.save_model(_model(graph), str(path), save_as_external_data=True, location="model.data", size_threshold=0)
    source = (tmp_path / "model.data").read_bytes()
    feeds = {"a": rng.standard_normal((3, K), dtype=np.float32), "a2": rng.standard_normal((1, K), dtype=np.float32),
             "i": np.array([5], np.int64), "a3": rng.standard_normal((1, 3, 1, K), dtype=np.float32)}

    model = onnx.load(str(path), load_external_data=False)
    want = _run(model, feeds, None, tmp_path)
    side = tmp_path / "side.transposed"
    assert own_ops.swap_float_linear(model, tmp_path, side) == 3
    assert [n.op_type for n in model.graph.node] == [own_ops.FLOAT_LINEAR_OP_TYPE] * 2 + ["MatMul", "Gather",
                                                                                        own_ops.FLOAT_LINEAR_OP_TYPE]
    tensors = {t.name: t for t in model.graph.initializer}
    assert list(tensors["w"].dims) == [N, K] and list(tensors["v"].dims) == [K, N]
    assert list(tensors["u"].dims) == [3, 30, K]
    ends = []
    for name, size in (("w", K * N * 4), ("u", 3 * K * 30 * 4)):
        entries = {e.key: e.value for e in tensors[name].external_data}
        assert entries["location"] == "side.transposed" and int(entries["offset"]) % 4096 == 0
        assert int(entries["length"]) == size
        ends.append(int(entries["offset"]) + size)
    assert side.stat().st_size == max(ends)
    assert (tmp_path / "model.data").read_bytes() == source
    got = _run(model, feeds, library.path, tmp_path)
    for mine, theirs in zip(got, want):
        scale = np.abs(theirs).max()
        assert mine.shape == theirs.shape and np.abs(mine - theirs).max() <= 1e-6 * scale
    with pytest.raises(ValueError, match="side file"):  # a build that forgot to say where
        own_ops.swap_float_linear(onnx.load(str(path), load_external_data=False))


def test_weights_interleave_into_the_side_file(libraries, tmp_path):
    """The build's interleaving of external weights (``interleave_weights`` with a folder and a side file): a
    RoutedExperts' fc1 and fc2 and a BlockwiseMatMul's B of rows of 640 values are written to the side file at 4
    KiB-aligned offsets, their source file untouched, the nodes given ``interleaved=1``, and the outputs equal the
    source layout's to float32 rounding; a BlockwiseMatMul of rows of 128 values (computed 4 rows at a time) stays,
    and so do weights something else reads too, with their node."""
    import onnx

    library = libraries["native"] if libraries["native"].path else libraries["portable"]
    rng = np.random.default_rng(5)
    bits, dims = 4, {"w1": (E, 2 * 2 * D, D // 2), "w2": (E, D, 2 * D // 2)}  # fc2 rows of 40 blocks
    weights = {n: rng.integers(0, 256, size=shape, dtype=np.uint8) for n, shape in dims.items()}
    scales = {"s1": _half_values(rng.random((E, 4 * D, D // 32), dtype=np.float32) * 0.02 + 0.005),
              "s2": _half_values(rng.random((E, D, 2 * D // 32), dtype=np.float32) * 0.02 + 0.005)}
    products = {"long": (D, 200), "short": (128, 64)}  # K, N
    for name, (k, n) in products.items():
        weights[f"{name}.q"] = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
        scales[f"{name}.s"] = _half_values(rng.random(n * k // 32, dtype=np.float32) * 0.02 + 0.005)
    linear = [helper.make_node(own_ops.LINEAR_OP_TYPE, [f"a.{name}", f"{name}.q", f"{name}.s"], [f"y.{name}"],
                               domain=own_ops.DOMAIN, K=k, N=n, bits=bits, block_size=32)
              for name, (k, n) in products.items()]
    graph = helper.make_graph(
        [_ours(bits, 1), *linear], "experts",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, ["T", E]),
         *(helper.make_tensor_value_info(f"a.{name}", TensorProto.FLOAT, ["T", k]) for name, (k, _) in products.items())],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "y.long", "y.short")],
        [numpy_helper.from_array(v, n) for n, v in {**weights, **scales}.items()])
    path = tmp_path / "model.onnx"
    onnx.save_model(_model(graph, own_ops.DOMAIN), str(path), save_as_external_data=True, location="model.data",
                    size_threshold=0)
    source = (tmp_path / "model.data").read_bytes()
    feeds = {"x": rng.standard_normal((3, D), dtype=np.float32), "r": rng.standard_normal((3, E), dtype=np.float32),
             **{f"a.{name}": rng.standard_normal((1, k), dtype=np.float32) for name, (k, _) in products.items()}}
    model = onnx.load(str(path), load_external_data=False)
    want = _run(model, feeds, library.path, tmp_path)
    side = tmp_path / "side.weights"
    assert own_ops.interleave_weights(model, tmp_path, side) == 2
    tensors = {t.name: t for t in model.graph.initializer}
    assert {e.key: e.value for e in tensors["short.q"].external_data}["location"] == "model.data"
    ends = []
    for name, value in weights.items():
        if name == "short.q":
            continue
        entries = {e.key: e.value for e in tensors[name].external_data}
        assert entries["location"] == "side.weights" and int(entries["offset"]) % 4096 == 0
        assert int(entries["length"]) == value.size
        ends.append(int(entries["offset"]) + value.size)
        stored = np.fromfile(side, np.uint8, value.size, offset=int(entries["offset"])).reshape(value.shape)
        rows = value.reshape(value.shape[0], -1) if name.endswith(".q") else value.reshape(-1, value.shape[-1])
        assert np.array_equal(stored, own_ops.interleave_rows(rows, bits).reshape(value.shape))
    assert side.stat().st_size == max(ends)
    assert (tmp_path / "model.data").read_bytes() == source
    assert [[a.i for a in n.attribute if a.name == "interleaved"] for n in model.graph.node] == [[1], [1], []]
    got = _run(model, feeds, library.path, tmp_path)
    for mine, theirs in zip(got, want):
        assert np.abs(mine - theirs).max() <= 2e-5 * np.abs(theirs).max()
    with pytest.raises(ValueError, match="side file"):  # a build that forgot to say where
        own_ops.interleave_weights(onnx.load(str(path), load_external_data=False))
    shared = onnx.load(str(path), load_external_data=False)  # fc2 also read by another node: the node stays
    shared.graph.node.append(helper.make_node("Identity", ["w2"], ["w2_copy"]))
    shared.graph.node.append(helper.make_node("Identity", ["long.q"], ["long_copy"]))
    assert own_ops.interleave_weights(shared, tmp_path, tmp_path / "other.weights") == 0
    assert not (tmp_path / "other.weights").exists()


def _linear_session(node, weights, library: Path | None):
    b, scales = weights
    graph = helper.make_graph(
        [node], "linear", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["B", "T", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 2 * I])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "s")])
    return _open(graph, library)


def _matmulnbits(bits: int, **extra):
    return helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=D, N=2 * I, bits=bits,
                            block_size=32, accuracy_level=4, **extra)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [(1, 1), (2, 5)])
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("stored", ["float", "float16"])
@pytest.mark.parametrize("layout", ["source", "interleaved"])
def test_blockwise_matmul_equals_matmulnbits(libraries, bits, rows, build, stored, layout):
    """``A [B, T, K]`` through MatMulNBits and through ours: equal to float32 rounding, for one row (decode) and ten
    (two groups of four and two left: the prefill path), ours reading the scales as float or as float16, and B as
    MatMulNBits holds it or, given ``interleaved=1``, in the interleaved layout (a group of 16 blocks, 4 left)."""
    library = libraries[build]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    rng = np.random.default_rng(bits)
    b = rng.integers(0, 256, size=(2 * I, D // 32, 32 * bits // 8), dtype=np.uint8)
    scales = _half_values(rng.random(2 * I * D // 32, dtype=np.float32) * 0.02 + 0.005)
    a = rng.standard_normal((*rows, D), dtype=np.float32)
    want = _linear_session(_matmulnbits(bits), (b, scales), None).run(None, {"a": a})[0]
    extra = {"interleaved": 1} if layout == "interleaved" else {}
    ours = helper.make_node(own_ops.LINEAR_OP_TYPE, ["a", "b", "s"], ["y"], domain=own_ops.DOMAIN, K=D, N=2 * I,
                            bits=bits, block_size=32, **extra)
    mine = scales.astype(np.float16) if stored == "float16" else scales
    if extra:
        b = own_ops.interleave_rows(b.reshape(2 * I, -1), bits).reshape(b.shape)
    got = _linear_session(ours, (b, mine), library.path).run(None, {"a": a})[0]
    scale = np.abs(want).max()
    assert got.shape == want.shape == (*rows, 2 * I)
    assert scale > 0 and np.abs(got - want).max() <= 2e-5 * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("bits, k", [(4, 128), (4, 512), (8, 512), (4, 384)])
@pytest.mark.parametrize("stored", ["float", "float16"])
@pytest.mark.parametrize("layout", ["source", "interleaved"])
def test_short_rows_of_one_token_equal_matmulnbits(libraries, bits, k, stored, layout):
    """One token against rows of at most 512 values (the absorbed attention's W_UK, K 128, and W_UV, K 512): the
    native build takes them 4 rows at a time; 43 rows leave 3 over. Equal to MatMulNBits to float32 rounding. The
    build leaves such rows as they are, but interleaved ones are computed too (one row at a time)."""
    library = libraries["native"]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    n, rng = 43, np.random.default_rng(k + bits)
    b = rng.integers(0, 256, size=(n, k // 32, 32 * bits // 8), dtype=np.uint8)
    scales = _half_values(rng.random(n * k // 32, dtype=np.float32) * 0.02 + 0.005)
    a = rng.standard_normal((1, 1, k), dtype=np.float32)
    outputs = []
    for node, mine in ((helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n,
                                         bits=bits, block_size=32, accuracy_level=4), scales),
                       (helper.make_node(own_ops.LINEAR_OP_TYPE, ["a", "b", "s"], ["y"], domain=own_ops.DOMAIN, K=k,
                                         N=n, bits=bits, block_size=32, interleaved=int(layout == "interleaved")),
                        scales.astype(np.float16) if stored == "float16" else scales)):
        weight = b
        if node.op_type != "MatMulNBits" and layout == "interleaved":
            weight = own_ops.interleave_rows(b.reshape(n, -1), bits).reshape(b.shape)
        graph = helper.make_graph(
            [node], "linear", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 1, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n])],
            [numpy_helper.from_array(weight, "b"), numpy_helper.from_array(mine, "s")])
        outputs.append(_open(graph, None if node.op_type == "MatMulNBits" else library.path).run(None, {"a": a})[0])
    want, got = outputs
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(got - want).max() <= 2e-5 * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("change, swapped", [({}, 1), ({"N": 1 << 17}, 1), ({"block_size": 64}, 0),
                                             ({"accuracy_level": 1}, 0)])
def test_linear_swap_only_where_it_computes_exactly_matmulnbits(change, swapped):
    """Blocks of 32 at accuracy_level 4 with the weight's layout are swapped, at any size (an lm_head of 128k rows
    too); another block size or the exact (fp32) compute keep MatMulNBits."""
    n, block = change.get("N", 2 * I), change.get("block_size", 32)
    node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=D, N=n, bits=4,
                            block_size=block, accuracy_level=change.get("accuracy_level", 4))
    b, s = TensorProto(name="b", data_type=TensorProto.UINT8), TensorProto(name="s", data_type=TensorProto.FLOAT)
    b.dims.extend([n, D // block, block // 2])  # shapes only, as a graph with external weights is read
    s.dims.extend([n * D // block])
    model = helper.make_model(helper.make_graph([node], "g", [], [], [b, s]))
    assert own_ops.swap_linear(model) == swapped
    assert [n.op_type for n in model.graph.node] == [own_ops.LINEAR_OP_TYPE if swapped else "MatMulNBits"]


def _experts_and_linear_model(weights, linear):
    """One RoutedExperts node (routing given as scores) and one BlockwiseMatMul reading its output."""
    b, s = linear
    nodes = [_ours(4, 1), helper.make_node(own_ops.LINEAR_OP_TYPE, ["y", "b", "s"], ["z"], domain=own_ops.DOMAIN,
                                           K=D, N=2 * I, bits=4, block_size=32)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D]),
                     helper.make_tensor_value_info("r", TensorProto.FLOAT, ["T", E])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["T", 2 * I])],
        [numpy_helper.from_array(w, n) for w, n in zip((*weights, b, s), ("w1", "s1", "w2", "s2", "b", "s"))])
    return _model(graph, own_ops.DOMAIN)


@pytest.mark.parametrize("where", ["external", "inline"])
def test_half_scales_are_stored_where_exact_and_compute_the_same(libraries, tmp_path, where):
    """The build's float16 scales (``store_half_scales``): every scale tensor of float16 values becomes float16 (in the
    side file where the weights are external, in the graph otherwise), the session computes exactly what it did with
    float32 scales; a RoutedExperts node with one scale that no float16 holds keeps both its tensors float32, and so
    does a scale tensor something else reads too."""
    import onnx

    rng = np.random.default_rng(5)
    weights = _weights(4)
    b = rng.integers(0, 256, size=(2 * I, D // 32, 16), dtype=np.uint8)
    s = _half_values(rng.random(2 * I * D // 32, dtype=np.float32) * 0.02 + 0.005)
    feeds = {"x": rng.standard_normal((3, D), dtype=np.float32), "r": rng.standard_normal((3, E), dtype=np.float32)}

    def prepared(model, name):
        """``model`` saved with its weights external (or not), loaded without them, its scales made float16."""
        path = tmp_path / name / "model.onnx"
        path.parent.mkdir()
        onnx.save_model(model, str(path), save_as_external_data=where == "external", location="model.data",
                        size_threshold=0)
        loaded = onnx.load(str(path), load_external_data=False)
        side = path.parent / "side.scales16"
        return loaded, own_ops.store_half_scales(loaded, path.parent, side), side

    def run(model, folder):
        return _run(model, feeds, libraries["portable"].path, folder)[0]

    model = _experts_and_linear_model(weights, (b, s))
    want = run(model, tmp_path)
    half, stored, side = prepared(model, "exact")
    assert stored == 3 and side.is_file() == (where == "external")
    assert {t.name: t.data_type for t in half.graph.initializer if t.name.startswith("s")} == dict.fromkeys(
        ("s1", "s2", "s"), TensorProto.FLOAT16)
    np.testing.assert_array_equal(run(half, side.parent), want)

    inexact = list(weights)
    inexact[3] = inexact[3].copy()
    inexact[3][0, 0, 0] = np.float32(0.01) + np.float32(1e-9)  # no float16 value
    model = _experts_and_linear_model(tuple(inexact), (b, s))
    model.graph.node.append(helper.make_node("Identity", ["s"], ["s_again"]))  # the linear's scales read elsewhere too
    model.graph.output.append(helper.make_tensor_value_info("s_again", TensorProto.FLOAT, None))
    kept, stored, side = prepared(model, "inexact")
    assert stored == 0 and not side.exists()
    assert {t.data_type for t in kept.graph.initializer if t.name.startswith("s")} == {TensorProto.FLOAT}


def _moe_recipe():
    """The tiny preset, its second layer a MoE of 8 experts (V3 routing), int4 weights in blocks of 32."""
    recipe = tiny_recipe("static", weights="int4", block_size=32)
    return recipe.replace(model=recipe.model.replace(
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=2.5))


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory) -> Path:
    from mla_deploy.exporter import export_recipe

    out = tmp_path_factory.mktemp("moe") / "artifact"
    export_recipe(_moe_recipe(), out)
    return out


def _tokens(*args) -> list[int]:
    record = json.loads(ok(cli("run", *args, "--prompt-ids", "3,14,15,92,65", "--max-new-tokens", "16", "--json")))
    return record["sequences"][0]["tokens"]


def test_engine_holds_the_operator_and_gives_the_source_graphs_tokens(moe_artifact, libraries, tmp_path):
    if libraries["native"].path is None:
        pytest.skip(f"the build keeps QMoE here: {libraries['native'].why_not}")
    import onnx

    art = Path(shutil.copytree(moe_artifact, tmp_path / "art"))
    out = ok(cli("build", art, "--target", "cpu"))
    record = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    linear = record["linear"]  # every quantized product but the shared experts', the lm_head's too
    half = 2 * 2 + 3 * 2 + linear  # every scale tensor: the export's scales are float16 values
    assert record["experts"] == record["shared"]  # each MoE node computes its shared expert too
    # the per-head products this export leaves float would go into LatentAttention, but its latent rank (16) is no
    # multiple of 32: they stay FloatMatMul
    assert record["attention"] == 0
    assert (f"operators: mla_deploy.RoutedExperts x2, mla_deploy.BlockwiseMatMul x{linear}, mla_deploy.FloatMatMul "
            f"x{record['float_linear']} (cpu_ops.so, instruction set {libraries['native'].isa}, 2 with their layer's "
            f"shared experts, {half} scale tensors as "
            f"float16)") in out, out
    assert record["experts"] == 2 and linear >= 2 * 10 and record["library"] == cpu_ops.LIBRARY  # prefill, decode
    assert record["half_scales"] == half
    assert not list(art.glob(".cpu*")) and not list((art / "cpu").glob("*.scales16"))  # the build's side file: gone
    float_weights = []  # the ranks of the FloatMatMul nodes' (transposed) weights
    for graph in ("prefill", "decode"):
        model = onnx.load(str(art / "cpu" / f"{graph}.onnx"), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        ranks = {t.name: len(t.dims) for t in model.graph.initializer}
        float_weights += [ranks[n.input[1]] for n in model.graph.node if n.op_type == own_ops.FLOAT_LINEAR_OP_TYPE]
        assert ops.count(own_ops.OP_TYPE) == 1 and "QMoE" not in ops and "MatMulNBits" not in ops
        assert ops.count(own_ops.LINEAR_OP_TYPE) == linear // 2 and "Sigmoid" not in ops
        experts = next(n for n in model.graph.node if n.op_type == own_ops.OP_TYPE)
        assert [next(p for p in ("gate", "up", "down") if f".shared_experts.{p}_proj." in name)
                for name in experts.input[7:]] == ["gate", "gate", "up", "up", "down", "down"]
        assert [a.i for a in experts.attribute if a.name == "interleaved"] == [1]  # its weights stored so
        types = {t.name: t.data_type for t in model.graph.initializer}
        scales = [n.input[i] for n in model.graph.node for i in ((3, 5, 8, 10, 12) if n.op_type == own_ops.OP_TYPE else
                                                                 (2,) if n.op_type == own_ops.LINEAR_OP_TYPE else ())]
        assert scales and {types.get(name) for name in scales} == {TensorProto.FLOAT16}  # read as they are: no Cast
    # the routers' [E, D], one per MoE node, and every per-head product the export left float (the source graphs'
    # MatMul nodes of a float32 [H, K, N] weight; now [H, N, K])
    per_head = 0
    for graph in ("prefill", "decode"):
        source = onnx.load(str(art / f"{graph}.onnx"), load_external_data=False)
        floats = {t.name for t in source.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) == 3}
        per_head += sum(n.op_type == "MatMul" and n.input[1] in floats for n in source.graph.node)
    assert len(float_weights) == record["float_linear"] and float_weights.count(2) == record["experts"]
    assert float_weights.count(3) + 2 * record["attention"] == per_head > 0  # a LatentAttention takes its layer's two
    assert _tokens(art) == _tokens(art, "--no-engine")
    info = OrtEngine(art, threads=1).info()
    assert info["operators"].startswith("mla_deploy.RoutedExperts x2") and info["scales_half"] is True

    library = art / "cpu" / cpu_ops.LIBRARY
    changed = library.with_name("changed.so")  # a new file put in its place: this process has the old one mapped
    changed.write_bytes(library.read_bytes() + b"\0")
    changed.replace(library)
    with pytest.raises(ArtifactError, match=r"is stale: its operator library .* was modified"):
        OrtEngine(art, threads=1)
    library.unlink()
    result = cli("run", art, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    message = result.stderr
    assert result.returncode != 0 and "is stale: its operator library" in message and "missing" in message and "\n" not in message.strip()
    assert _tokens(art, "--no-engine")  # the source graphs still run


def test_doctor_says_whether_the_engine_gets_the_operators(libraries, tmp_path, monkeypatch):
    """`mla-deploy doctor` says yes exactly where the build compiles them (here: the native build's outcome), and no
    with the reason without a compiler."""
    report = ok(cli("doctor", "--no-providers"))
    line = next(l for l in report.splitlines() if l.startswith("cpu ops"))
    assert line.startswith("cpu ops      yes") == (libraries["native"].path is not None), line
    if libraries["native"].path is not None:  # the instruction set the build compiles for, as the library says it
        assert line.endswith(f"(C compiler; instruction set: {libraries['native'].isa})"), line
        assert f"yes, with mla-deploy's operators ({libraries['native'].isa})" in report, report
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    line = next(l for l in ok(cli("doctor", "--no-providers")).splitlines() if l.startswith("cpu ops"))
    assert line == (f"cpu ops      no: the CPU engine keeps ONNX Runtime's kernels (no C compiler "
                    f"($CC={tmp_path / 'no-such-cc'} not found))"), line


def test_without_a_compiler_the_engine_keeps_qmoe_and_says_why(moe_artifact, tmp_path, monkeypatch):
    art = Path(shutil.copytree(moe_artifact, tmp_path / "art"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    out = ok(cli("build", art, "--target", "cpu"))
    assert "operators: ONNX Runtime's only (no C compiler ($CC=" in out, out
    record = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    assert record["experts"] == record["linear"] == 0 and not (art / "cpu" / cpu_ops.LIBRARY).exists()
    assert _tokens(art) == _tokens(art, "--no-engine")


def _file_pmd_mapped_kib(path: Path) -> int:
    """KiB of ``path``'s mappings in this process mapped by 2 MiB page-table entries (``/proc/self/smaps``)."""
    total, current = 0, ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and ":" not in fields[0]:
            current = fields[5] if len(fields) > 5 else ""
        elif current == str(path) and fields[0] == "FilePmdMapped:":
            total += int(fields[1])
    return total


def _huge_file_pages_here(tmp_path: Path) -> bool:
    """Whether this kernel and filesystem put an uncached file's pages, read through a mapping that asks for huge
    pages, on 2 MiB pages (Linux 6.x on ext4 does; tmpfs and older kernels do not)."""
    import mmap

    from mla_deploy.ort.cpu_build import drop_cached_pages

    probe = tmp_path / "probe.bin"
    probe.write_bytes(np.random.default_rng(0).bytes(16 << 20))
    drop_cached_pages(probe)
    with open(probe, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        m.madvise(mmap.MADV_HUGEPAGE)
        sum(m[i] for i in range(0, len(m), 4096))
        return _file_pmd_mapped_kib(probe) > 0


def test_the_operators_read_the_engine_file_on_huge_pages(libraries, tmp_path):
    """A weight ONNX Runtime maps from a file (as the engine's ``.data``), not cached yet (as the build leaves it:
    ``drop_cached_pages``): the operator advises its range before the first read, so the kernel reads it into 2 MiB
    pages. Without the advice a single read of it stays on 4 KiB pages (measured on Linux 6.18, ext4)."""
    import onnx

    from mla_deploy.ort.cpu_build import drop_cached_pages

    if libraries["native"].path is None:
        pytest.skip(f"no native build: {libraries['native'].why_not}")
    if not _huge_file_pages_here(tmp_path):
        pytest.skip("this kernel or filesystem maps no file pages on 2 MiB pages")
    n, k = 8192, 2048  # 8 MiB of int4
    rng = np.random.default_rng(1)
    b = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    scales = rng.random(n * k // 32, dtype=np.float32) * 0.02
    node = helper.make_node(own_ops.LINEAR_OP_TYPE, ["a", "b", "s"], ["y"], domain=own_ops.DOMAIN, K=k, N=n, bits=4,
                            block_size=32)
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "s")])
    model = _model(graph, own_ops.DOMAIN)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    data = tmp_path / "m.data"
    drop_cached_pages(data)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    cpu_ops.register(options, libraries["native"].path)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"])
    session.run(None, {"a": rng.standard_normal((1, k), dtype=np.float32)})
    assert _file_pmd_mapped_kib(data) >= 2048, _file_pmd_mapped_kib(data)


# ---- HeadwiseMatMul: the absorbed attention's per-head products ------------------------------------------------------
HEADS, HN = 3, 40  # 40 rows: two tiles of 16 and one of 8


def _signed(bits: int, shape, seed: int):
    """Signed integers of ``bits`` in ``shape`` (``[H, N, K]``) and positive block scales ``[H, N, K/32]``."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=shape).astype(np.int8)
    return q, rng.random((*shape[:2], shape[2] // 32), dtype=np.float32) * 0.02 + 0.005


def _per_head_graph(q, scales, bits: int, block: int = 32, axis: int = 2, perm=(0, 2, 1), zero_point: bool = False):
    """``MatMul(a [H, M, K], Transpose(DequantizeLinear(q, scales, axis, block), perm))``: the export's per-head
    product (mla_deploy.quant.formats.HEADWISE)."""
    import ml_dtypes

    h, n, k = q.shape
    ints = numpy_helper.from_array(q.astype(ml_dtypes.int4) if bits == 4 else q, "q")
    inits = [ints, numpy_helper.from_array(scales, "s")]
    if zero_point:
        zeros = np.zeros(scales.shape, np.int8)
        inits.append(numpy_helper.from_array(zeros.astype(ml_dtypes.int4) if bits == 4 else zeros, "z"))
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"] if zero_point else ["q", "s"], ["w"], axis=axis,
                              block_size=block),
             helper.make_node("Transpose", ["w"], ["wt"], perm=list(perm)),
             helper.make_node("MatMul", ["a", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "heads", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [h, "M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [h, "M", n])], inits)
    return _model(graph, opset=21)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("build", ["native", "portable"])
def test_headwise_matmul_equals_matmulnbits_on_each_head(libraries, bits, rows, build):
    """The export's per-head product, swapped for ours, against ONNX Runtime's MatMulNBits run on each head's
    weights (the same integers with its zero point, the same scales): equal to float32 rounding, for one row
    (decode) and six (prefill)."""
    library = libraries[build]
    if library.path is None:
        pytest.skip(f"no native build: {library.why_not}")
    q, scales = _signed(bits, (HEADS, HN, D), seed=bits)
    model = _per_head_graph(q, scales, bits)
    assert own_ops.swap_headwise(model) == 1
    assert [n.op_type for n in model.graph.node] == [own_ops.HEADWISE_OP_TYPE]
    a = np.random.default_rng(rows).standard_normal((HEADS, rows, D), dtype=np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    cpu_ops.register(options, library.path)
    got = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"a": a})[0]
    assert got.shape == (HEADS, rows, HN)
    zero = 1 << (bits - 1)
    for h in range(HEADS):
        stored = (q[h].astype(np.int16) + zero).astype(np.uint8).reshape(HN, D // 32, 32)
        if bits == 4:
            stored = stored[..., 0::2] | (stored[..., 1::2] << 4)
        node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=D, N=HN, bits=bits,
                                block_size=32, accuracy_level=4)
        graph = helper.make_graph([node], "head", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [rows, D])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, HN])],
                                  [numpy_helper.from_array(np.ascontiguousarray(stored), "b"),
                                   numpy_helper.from_array(scales[h].reshape(-1), "s")])
        want = _open(graph, None).run(None, {"a": a[h]})[0]
        scale = np.abs(want).max()
        assert scale > 0 and np.abs(got[h] - want).max() <= 2e-5 * scale, (h, np.abs(got[h] - want).max() / scale)


@pytest.mark.parametrize("change", [{"block": 64}, {"axis": 1}, {"perm": (0, 1, 2)}, {"zero_point": True},
                                    {"k": 48}])
def test_headwise_swap_only_where_the_operator_reads_the_weight(change):
    """Blocks of 64, another axis or transpose, a zero point, or input features that fill no whole block of 32 keep
    the standard nodes (ONNX Runtime folds them into a float weight)."""
    bits, k = 4, change.pop("k", 64)
    q, scales = _signed(bits, (HEADS, 32 if change.get("axis") == 1 else HN, k), seed=0)
    if change.get("block") == 64 or k % 32:
        scales = np.ones((HEADS, HN, -(-k // change.get("block", 32))), np.float32)
    model = _per_head_graph(q, scales, bits, **change)
    assert own_ops.swap_headwise(model) == 0
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Transpose", "MatMul"]


def test_engine_computes_the_per_head_products_with_the_operator(libraries, tmp_path):
    """An int4 export whose per-head weights fill blocks of 32 (a static cache): the CPU engine computes each as
    HeadwiseMatMul does, inside the layer's LatentAttention (its integers read from the artifact's file as they are),
    and decodes the source graphs' tokens."""
    if libraries["native"].path is None:
        pytest.skip(f"the build keeps ONNX Runtime's operators here: {libraries['native'].why_not}")
    import onnx

    from mla_deploy.exporter import export_recipe

    recipe = tiny_recipe("static", weights="int4", block_size=32, prefill_form="A_CC", external_data_threshold=0)
    recipe = recipe.replace(model=recipe.model.replace(kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32))
    art = tmp_path / "art"
    export_recipe(recipe, art)
    out = ok(cli("build", art, "--target", "cpu"))
    record = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    layers = recipe.model.num_hidden_layers
    # each layer's two products, inside its LatentAttention (the attention tests below) or on their own
    assert record["heads"] + 2 * record["attention"] == 2 * layers, record
    ops = [n.op_type for n in onnx.load(str(art / "cpu" / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count(own_ops.HEADWISE_OP_TYPE) == record["heads"] and "DequantizeLinear" not in ops
    assert ops.count(own_ops.ATTENTION_OP_TYPE) == record["attention"] == layers, out
    assert _tokens(art) == _tokens(art, "--no-engine")


def _concat_per_head_recipe(heads: int = 4, cache_mode: str = "concat", weights: str = "int4"):
    """The tiny preset with a concatenated latent cache, int4 weights in blocks of 32, per-head weights that fill
    them (r 64, dn 32, dv 32; an absorbed prefill too, so that they are quantized), YaRN rope. 4 heads with the
    query compressed (V3's q_a_proj/q_b_proj): a panel of 16 query rows spans several tokens; 16 heads with a plain
    q_proj (V2-Lite's): one token's heads fill a panel (the vector path of the softmax). ``weights="float"``: every
    weight float32, the per-head ones too (LatentAttention's float products)."""
    quantized = {"block_size": 32} if weights != "float" else {}
    recipe = tiny_recipe(cache_mode, weights=weights, prefill_form="A_CC", external_data_threshold=0, **quantized)
    return recipe.replace(model=recipe.model.replace(kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32,
                                                     num_attention_heads=heads,
                                                     q_lora_rank=recipe.model.q_lora_rank if heads == 4 else None))


@pytest.fixture(scope="module", params=[(4, "concat"), (16, "concat"), (16, "static"), (4, "concat", "float"),
                                        (16, "static", "float")],
                ids=["4-heads-q-lora", "16-heads-q-proj", "static-cache", "float-4-heads", "float-static"])
def attention_engines(libraries, tmp_path_factory, request) -> tuple[Path, Path]:
    """One export built twice: with each layer's attention core as LatentAttention, and without (its per-head
    products HeadwiseMatMul, the rest ONNX Runtime's nodes: the same int8 compute of the per-head products; float
    weights: FloatMatMul, the same float32 products summed in another order)."""
    if libraries["native"].path is None:
        pytest.skip(f"the build keeps ONNX Runtime's operators here: {libraries['native'].why_not}")
    from mla_deploy.exporter import export_recipe

    root = tmp_path_factory.mktemp("attention")
    export_recipe(_concat_per_head_recipe(*request.param), root / "fused")
    shutil.copytree(root / "fused", root / "unfused")
    ok(cli("build", root / "fused", "--target", "cpu"))
    swap = own_ops.swap_attention
    own_ops.swap_attention = lambda model: 0
    try:
        ok(cli("build", root / "unfused", "--target", "cpu"))
    finally:
        own_ops.swap_attention = swap
    return root / "fused", root / "unfused"


def test_engine_holds_one_attention_node_per_layer(attention_engines):
    """Each layer's attention core (cache write, rope, norm, W_UK, scores, softmax, W_UV) is one LatentAttention
    node; the record and the build's line count them and no longer count their per-head products."""
    import onnx

    fused, unfused = attention_engines
    layers = _concat_per_head_recipe().model.num_hidden_layers
    record = json.loads((fused / "cpu" / "engine.json").read_text())["operators"]
    assert record["attention"] == layers and record["heads"] == 0
    ops = [n.op_type for n in onnx.load(str(fused / "cpu" / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count(own_ops.ATTENTION_OP_TYPE) == layers
    assert "Softmax" not in ops and own_ops.HEADWISE_OP_TYPE not in ops
    before = [n.op_type for n in onnx.load(str(unfused / "cpu" / "model.onnx"), load_external_data=False).graph.node]
    assert own_ops.ATTENTION_OP_TYPE not in before and len(before) - len(ops) >= 20 * layers
    assert f"mla_deploy.LatentAttention x{layers}" in OrtEngine(fused, threads=1).info()["operators"]


def _first_attention_session(engine: Path, library: Path | None = None):
    """A session on ``engine``'s CPU engine graph with layer 0's attention output (``o_proj``'s input) as an output
    too, its operators from ``library`` (default: the engine's own): ``(session, that output's name)``."""
    import onnx

    from mla_deploy.quant.formats import EXTERNAL_FOLDER_ENTRY

    model = onnx.load(str(engine / "cpu" / "model.onnx"), load_external_data=False)
    o_proj = next(n for n in model.graph.node if n.op_type in (own_ops.LINEAR_OP_TYPE, own_ops.FLOAT_LINEAR_OP_TYPE)
                  and "layers.0.self_attn.o_proj" in n.input[1])
    model.graph.output.append(onnx.ValueInfoProto(name=o_proj.input[0]))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry(EXTERNAL_FOLDER_ENTRY, str(engine / "cpu"))
    cpu_ops.register(options, library or engine / "cpu" / cpu_ops.LIBRARY)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, o_proj.input[0]


def test_attention_operator_equals_the_nodes_it_replaces(attention_engines, libraries):
    """Two sequences prefilled over an empty cache (one right-padded where the cache is concatenated), then one
    decode step over what they wrote, through both engines: layer 0's attention output (o_proj's input: the same
    inputs reach both) and its present cache equal to float32 rounding (1e-5 of their scale; the per-head products
    are the same int8 compute in both, or float32 sums in another order). Later layers are compared loosely: there the inputs already differ in the
    last bits, which can move an activation's int8 rounding. The engine's graph run with the operators compiled in
    portable C (the operators' code without vector instructions) equals the unswapped nodes in the same way."""
    import onnx

    fused_path = attention_engines[0]
    static = any(i.name == "write_indices" for i in onnx.load(str(fused_path / "cpu" / "model.onnx"),
                                                               load_external_data=False).graph.input)
    recipe = _concat_per_head_recipe()
    width, layers = recipe.model.kv_lora_rank + recipe.model.qk_rope_head_dim, recipe.model.num_hidden_layers
    sessions = [_first_attention_session(path) for path in attention_engines]
    sessions.append(_first_attention_session(fused_path, libraries["portable"].path))
    rng = np.random.default_rng(5)
    ids = rng.integers(0, recipe.model.vocab_size, size=(2, 5), dtype=np.int64)
    valid = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1 - static, 1 - static]], dtype=np.int64)
    lengths = valid.sum(axis=1)
    feed = {"input_ids": ids, "position_ids": np.arange(5)[None].repeat(2, 0), "logits_index": (lengths - 1)[:, None]}
    if static:
        feed["write_indices"] = np.zeros(2, np.int64)
        feed.update({f"past_latent.{i}": np.zeros((2, 1, 8, width), np.float32) for i in range(layers)})
    else:
        feed["attention_mask"] = valid
        feed.update({f"past_latent.{i}": np.zeros((2, 0, width), np.float32) for i in range(layers)})
    prefill = [session.run(None, feed) for session, _ in sessions]
    step = {"input_ids": np.array([[11], [12]], dtype=np.int64), "position_ids": lengths[:, None],
            "logits_index": np.zeros((2, 1), np.int64), **{f"past_latent.{i}": prefill[1][1 + i] for i in range(layers)}}
    if static:
        step["write_indices"] = lengths
    else:
        step["attention_mask"] = np.concatenate([valid, np.ones((2, 1), np.int64)], axis=1)
    decode = [session.run(None, step) for session, _ in sessions]
    for fused, unfused in [(runs[0], runs[1]) for runs in (prefill, decode)] + [
            (runs[2], runs[1]) for runs in (prefill, decode)]:
        attn, want = fused[-1], unfused[-1]
        rows = valid.astype(bool) if attn.shape[1] == 5 else np.ones(attn.shape[:2], bool)  # padding rows: any
        assert np.abs(attn[rows] - want[rows]).max() <= 1e-5 * np.abs(want[rows]).max()
        assert np.abs(fused[1] - unfused[1]).max() <= 1e-5 * np.abs(unfused[1]).max()  # layer 0's cache
        for i in range(1, layers):
            assert np.abs(fused[1 + i] - unfused[1 + i]).max() <= 0.05 * np.abs(unfused[1 + i]).max()
        assert np.abs(fused[0] - unfused[0]).max() <= 0.05 * np.abs(unfused[0]).max()  # the logits


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_few_tokens_per_head_products_in_panels_equal_the_rows(libraries, tmp_path, weights):
    """LatentAttention computes a step of at most 4 tokens' per-head products over its weights copied into panels of
    16 rows (made by the first such call), more tokens row by row: the same integer sums, so one decode step of two
    sequences (panels) and of the same two among six (rows) give layer 0's attention output equal to float32
    rounding (1e-5 of its scale), for int4 and int8 per-head weights; and a later step still takes the panels."""
    if libraries["native"].path is None:
        pytest.skip(f"the build keeps ONNX Runtime's operators here: {libraries['native'].why_not}")
    from mla_deploy.exporter import export_recipe

    export_recipe(_concat_per_head_recipe(16, "concat", weights), tmp_path / "art")
    ok(cli("build", tmp_path / "art", "--target", "cpu"))
    recipe = _concat_per_head_recipe(16, "concat", weights)
    layers = recipe.model.num_hidden_layers
    session, _ = _first_attention_session(tmp_path / "art")
    rng = np.random.default_rng(9)
    ids = rng.integers(0, recipe.model.vocab_size, size=(2, 5), dtype=np.int64)
    feed = {"input_ids": ids, "position_ids": np.arange(5)[None].repeat(2, 0), "logits_index": np.full((2, 1), 4),
            "attention_mask": np.ones((2, 5), np.int64),
            **{f"past_latent.{i}": np.zeros((2, 0, recipe.model.kv_lora_rank + recipe.model.qk_rope_head_dim),
                                            np.float32) for i in range(layers)}}
    past = session.run(None, feed)[1:1 + layers]

    def step(rows, token):
        pick = np.arange(rows) % 2
        return session.run(None, {"input_ids": np.full((rows, 1), token, np.int64),
                                  "position_ids": np.full((rows, 1), 5, np.int64),
                                  "logits_index": np.zeros((rows, 1), np.int64),
                                  "attention_mask": np.ones((rows, 6), np.int64),
                                  **{f"past_latent.{i}": past[i][pick] for i in range(layers)}})[-1]

    for token in (11, 12):  # the first call makes the panels, the second finds them made
        panels, rows = step(2, token), step(6, token)[:2]
        assert np.abs(panels - rows).max() <= 1e-5 * np.abs(rows).max()


def test_engine_with_the_attention_operator_gives_the_same_tokens(attention_engines):
    """Two prompts of different lengths through `mla-deploy run`: the same greedy tokens with the attention core
    as one operator as with ONNX Runtime's nodes around HeadwiseMatMul (the source graphs compute the per-head
    products in float, so on a random tiny model a near tie may go either way there)."""
    prompts = ("--prompt-ids", "3,14,15,92,65", "--prompt-ids", "7,8")
    fused, unfused = (json.loads(ok(cli("run", path, *prompts, "--max-new-tokens", "12", "--json")))
                      for path in attention_engines)
    assert [s["tokens"] for s in fused["sequences"]] == [s["tokens"] for s in unfused["sequences"]]


def test_float_attention_core_is_kept_where_the_latent_rank_is_not_a_multiple_of_32(libraries, tmp_path):
    """A float export whose latent rank (48) is not a multiple of the operator's 32 channels: its attention cores
    stay ONNX Runtime's nodes around FloatMatMul (no LatentAttention), and the engine decodes the source graphs'
    tokens."""
    if libraries["native"].path is None:
        pytest.skip(f"the build keeps ONNX Runtime's operators here: {libraries['native'].why_not}")
    from mla_deploy.exporter import export_recipe

    recipe = _concat_per_head_recipe(16, "static", "float")
    recipe = recipe.replace(model=recipe.model.replace(kv_lora_rank=48))
    art = tmp_path / "art"
    export_recipe(recipe, art)
    ok(cli("build", art, "--target", "cpu"))
    record = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    assert record["attention"] == 0 and record["float_linear"] > 0, record
    assert _tokens(art) == _tokens(art, "--no-engine")


@pytest.mark.parametrize("shared, external", [(1, False), (2, True)], ids=["1-shared-in-graph", "2-shared-external"])
def test_float_engine_computes_the_experts_with_the_operator(libraries, tmp_path, shared, external):
    """A float export with MoE layers (V3 routing): the CPU engine swaps each float MoE for FloatExperts and each
    MatMul of a float weight for FloatMatMul, gives each FloatExperts its layer's shared experts (1 or 2 of the
    routed experts' width, as V3 and V2-Lite have them; their weights in the graph or in the side file), says so,
    and decodes the source graphs' tokens (float32 throughout: no int8 rounding to move; the prompt's prefill through
    ONNX Runtime's FusedMatMul, the steps through ours)."""
    if libraries["native"].path is None:
        pytest.skip(f"the build keeps ONNX Runtime's operators here: {libraries['native'].why_not}")
    import onnx

    from mla_deploy.exporter import export_recipe

    recipe = _moe_recipe()
    recipe = recipe.replace(export=dataclasses.replace(recipe.export, weights="float",
                                                       **({"external_data_threshold": 0} if external else {})),
                            model=recipe.model.replace(n_shared_experts=shared))
    art = tmp_path / "art"
    export_recipe(recipe, art)
    out = ok(cli("build", art, "--target", "cpu"))
    record = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    assert record["float_experts"] == 2 and "mla_deploy.FloatExperts x2" in out, out  # prefill and decode graphs
    assert record["float_linear"] > 0 and f"mla_deploy.FloatMatMul x{record['float_linear']}" in out, out
    assert record["shared"] == 2 and "2 with their layer's shared experts" in out, out
    assert not list((art / "cpu").glob("*.rewritten"))  # the build's side file: gone
    I = recipe.model.moe_intermediate_size
    for graph in ("prefill", "decode"):
        model = onnx.load(str(art / "cpu" / f"{graph}.onnx"), load_external_data=False).graph
        ops = [n.op_type for n in model.node]
        assert ops.count(own_ops.FLOAT_EXPERTS_OP_TYPE) == 1 and "MoE" not in ops and "Log" not in ops
        experts = next(n for n in model.node if n.op_type == own_ops.FLOAT_EXPERTS_OP_TYPE)
        dims = {t.name: list(t.dims) for t in model.initializer}
        hidden = recipe.model.hidden_size
        assert [dims[name] for name in experts.input[5:]] == [[shared, 2 * I, hidden], [shared, hidden, I]]
        assert not [name for name in dims if "shared_experts" in name]  # their MatMul weights went with the nodes
        weights = {t.name for t in model.initializer if len(t.dims) == 2}
        assert ops.count(own_ops.FLOAT_LINEAR_OP_TYPE) >= 4  # the projections, the MLPs, lm_head
        assert not [n.name for n in model.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert _tokens(art) == _tokens(art, "--no-engine")


# ---- the instruction sets: the AVX2 path beside the AVX-512 VNNI one and portable C ----------------------------


@pytest.fixture(scope="module")
def avx2(tmp_path_factory) -> cpu_ops.Library:
    """The operators compiled for AVX2 (its explicit flags, no AVX-512: what an AVX2-only CPU gets), run here."""
    from mla_deploy.ort.record import host_cpu

    isa = cpu_ops.isa_named("avx2")
    if not all(f in host_cpu("").features for f in isa.needs):
        pytest.skip("this CPU has no AVX2 with FMA and F16C")
    library = cpu_ops.compile_library(tmp_path_factory.mktemp("avx2"), isa)
    assert library.path is not None and library.isa == "avx2", library.why_not
    return library


def _vnni(libraries) -> cpu_ops.Library:
    if libraries["native"].isa != "avx512-vnni":
        pytest.skip(f"no AVX-512 VNNI build here ({libraries['native'].why_not or libraries['native'].isa})")
    return libraries["native"]


def _each_build(model, feeds, libraries, avx2) -> dict[str, list[np.ndarray]]:
    """``model``'s outputs for ``feeds`` with the operators of the AVX-512 VNNI, AVX2 and portable builds."""
    builds = {"avx512-vnni": _vnni(libraries), "avx2": avx2, "portable": libraries["portable"]}
    out = {}
    for name, library in builds.items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        cpu_ops.register(options, library.path)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        out[name] = session.run(None, feeds)
    return out


def _bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32),
                                                                                    b.view(np.uint32))


def _vector_paths_agree(outputs: dict[str, list[np.ndarray]]) -> None:
    """AVX2 equals AVX-512 VNNI bit for bit (the same lanes, the same float operations in the same order); portable C
    equals it to float32 rounding (the same integers, its float sums in another order), as it always has."""
    for vnni, avx2, portable in zip(outputs["avx512-vnni"], outputs["avx2"], outputs["portable"]):
        assert np.abs(vnni).max() > 0
        assert _bit_equal(avx2, vnni), np.abs(avx2 - vnni).max() / np.abs(vnni).max()
        assert np.abs(portable - vnni).max() <= 2e-5 * np.abs(vnni).max()


def test_the_avx2_library_uses_no_avx512(avx2):
    """The AVX2 build says it is one (its exported function and the marker the build reads), and holds no AVX-512
    instruction (no zmm or mask register, no EVEX-only form): it runs on an AVX2-only CPU although compiled on an
    AVX-512 one."""
    import ctypes

    exported = ctypes.CDLL(str(avx2.path)).mla_deploy_cpu_ops_isa
    exported.restype = ctypes.c_char_p
    assert exported() == b"avx2" and cpu_ops.library_isa(avx2.path) == "avx2" and not avx2.vnni
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the library's instructions")
    import re
    import subprocess

    text = subprocess.run([objdump, "-d", str(avx2.path)], capture_output=True, text=True, check=True).stdout
    assert "vpmaddubsw" in text and "vpdpbusd" not in text
    assert not re.search(r"%zmm|%k[0-7]|\{evex\}|%[xy]mm(1[6-9]|2[0-9]|3[01])\b", text)


def _blockwise_model(K: int, N: int, bits: int, weights, scales) -> object:
    """One input ``a [T, K]`` through BlockwiseMatMul four times: the weights as MatMulNBits holds them and
    interleaved, each with float32 and float16 scales."""
    nodes, inits, outputs = [], [], []
    for layout in ("source", "interleaved"):
        b = weights if layout == "source" else own_ops.interleave_rows(weights.reshape(N, -1), bits).reshape(
            weights.shape)
        inits.append(numpy_helper.from_array(b, f"b_{layout}"))
        for stored in ("float", "float16"):
            name = f"{layout}_{stored}"
            inits.append(numpy_helper.from_array(scales.astype(np.float16) if stored == "float16" else scales,
                                                 f"s_{name}"))
            nodes.append(helper.make_node(own_ops.LINEAR_OP_TYPE, ["a", f"b_{layout}", f"s_{name}"], [name],
                                          domain=own_ops.DOMAIN, K=K, N=N, bits=bits, block_size=32,
                                          interleaved=int(layout == "interleaved")))
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["T", N]))
    graph = helper.make_graph(nodes, "blockwise", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["T", K])],
                              outputs, inits)
    return _model(graph, own_ops.DOMAIN)


# K: 3 blocks (int4 all left over; int8 two at a time and one), 4 (int4: 4 rows at a time), 16 (int8: 4 rows at a
# time; interleaved groups), 20 (a group of 16 and 4 over); 43 rows: tiles, and 3 rows left by 4 at a time;
# tokens: 1 (decode), 3, 6 (4 at a time and 2)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [96, 128, 512, 640])
@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_blockwise_matmul_avx2_equals_vnni_bit_for_bit(libraries, avx2, bits, K, tokens):
    """BlockwiseMatMul on random weights, scales (float32 and float16) and activations, both weight layouts: the
    AVX2 build's outputs equal the AVX-512 VNNI build's bit for bit, the portable build's to float32 rounding."""
    N, rng = 43, np.random.default_rng(K + bits + tokens)
    weights = rng.integers(0, 256, size=(N, K // 32, 32 * bits // 8), dtype=np.uint8)
    scales = _half_values(rng.random(N * K // 32, dtype=np.float32) * 0.02 + 0.005)
    a = rng.standard_normal((tokens, K), dtype=np.float32)
    _vector_paths_agree(_each_build(_blockwise_model(K, N, bits, weights, scales), {"a": a}, libraries, avx2))


# ---- multi-token tiles: a product of several tokens equals the row-by-row products of before, bit for bit -------

#: main before the tiles: its operators computed a product of several tokens one weight row at a time (4 tokens
#: against a row); the tiles (rows x tokens) must give its outputs bit for bit
ROW_BY_ROW = "92f770efd8cfeaed45b6159098d7f2ca632312d4"
#: a decode step (1), a few rows of a batch (2, 3), whole tiles and a token over (7 = 4 + 3, 33 = 8 x 4 + 1), 16
TOKEN_COUNTS = (1, 2, 3, 7, 16, 33)


@pytest.fixture(scope="module")
def row_by_row(libraries, avx2, tmp_path_factory) -> dict[str, cpu_ops.Library]:
    """The operators at :data:`ROW_BY_ROW` (their source read from this checkout's git history), compiled for AVX2 and,
    where this CPU has it, AVX-512 VNNI."""
    import subprocess

    git, root = shutil.which("git"), cpu_ops.source_path().parents[3]
    done = subprocess.run([git or "git", "-C", str(root), "show", f"{ROW_BY_ROW}:mla_deploy/ort/csrc/cpu_ops.c"],
                          capture_output=True) if git else None
    if done is None or done.returncode != 0:
        pytest.skip("no git history holding the row-by-row operators here")
    folder = tmp_path_factory.mktemp("row_by_row")
    source = folder / "cpu_ops.c"
    source.write_bytes(done.stdout)
    built = {}
    for name in ("avx512-vnni", "avx2"):
        if name == "avx512-vnni" and libraries["native"].isa != name:
            continue
        (folder / name).mkdir()
        built[name] = cpu_ops.compile_library(folder / name, cpu_ops.isa_named(name), source=source)
        assert built[name].path is not None, built[name].why_not
    return built


@pytest.fixture(scope="module")
def all_tiles(row_by_row, tmp_path_factory) -> dict[str, cpu_ops.Library]:
    """This source with every product of several tokens in tiles (``TILE_MIN_K`` 0: the build takes them only for
    rows over 4096 values), for the instruction sets of :func:`row_by_row`: the tiles' every path on small shapes."""
    source = cpu_ops.source_path().read_text()
    old = "#define TILE_MIN_K 4096"
    assert source.count(old) == 1
    folder = tmp_path_factory.mktemp("all_tiles")
    (folder / "cpu_ops.c").write_text(source.replace(old, "#define TILE_MIN_K 0"))
    built = {}
    for name in row_by_row:
        (folder / name).mkdir()
        built[name] = cpu_ops.compile_library(folder / name, cpu_ops.isa_named(name), source=folder / "cpu_ops.c")
        assert built[name].path is not None, built[name].why_not
    return built


def _tiles_equal_row_by_row(model, feeds: list[dict], libraries, avx2, row_by_row, all_tiles) -> None:
    """``model``'s outputs for each of ``feeds``: this source's (as built, and with every product in tiles) equal the
    row-by-row operators' bit for bit, on each instruction path built here, and AVX2's equal AVX-512 VNNI's."""
    new = {"avx2": avx2}
    if "avx512-vnni" in row_by_row:
        new["avx512-vnni"] = libraries["native"]
    runs = {}
    for name, library in [*((f"new {n}", lib) for n, lib in new.items()),
                          *((f"tiles {n}", lib) for n, lib in all_tiles.items()),
                          *((f"old {n}", lib) for n, lib in row_by_row.items())]:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        cpu_ops.register(options, library.path)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        runs[name] = [session.run(None, f) for f in feeds]
    for name in new:
        for which in ("new", "tiles"):
            for feed, got, want in zip(feeds, runs[f"{which} {name}"], runs[f"old {name}"]):
                for mine, ref in zip(got, want):
                    rows = next(iter(feed.values())).shape
                    assert np.abs(ref).max() > 0, rows
                    assert _bit_equal(mine, ref), (which, name, rows, np.abs(mine - ref).max() / np.abs(ref).max())
    if "avx512-vnni" in new:
        for got, want in zip(runs["new avx2"], runs["new avx512-vnni"]):
            assert all(_bit_equal(mine, ref) for mine, ref in zip(got, want))


# K: 3 blocks (all left over), 4, 16 (one group, or 4 rows of a decode step at a time), 20 (a group and 4), 44 (an
# expert's 1408: 2 groups and 12), 65 (4 groups and one block alone); over 4096 values (the build's tiles): 132 (8
# groups and 4), 145 (9 groups and one); 75 rows: tiles and rows over
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [96, 128, 512, 640, 1408, 2080, 4224, 4640])
def test_blockwise_matmul_tiles_equal_the_row_by_row_products(libraries, avx2, row_by_row, all_tiles, bits, K):
    """BlockwiseMatMul over 1 to 33 tokens, both weight layouts, float32 and float16 scales: the tiles of rows x
    tokens give the row-by-row operators' outputs bit for bit, on AVX-512 VNNI and on AVX2."""
    N, rng = 75, np.random.default_rng(K + bits)
    weights = rng.integers(0, 256, size=(N, K // 32, 32 * bits // 8), dtype=np.uint8)
    scales = _half_values(rng.random(N * K // 32, dtype=np.float32) * 0.02 + 0.005)
    feeds = [{"a": rng.standard_normal((t, K), dtype=np.float32)} for t in TOKEN_COUNTS]
    _tiles_equal_row_by_row(_blockwise_model(K, N, bits, weights, scales), feeds, libraries, avx2, row_by_row,
                            all_tiles)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [96, 640, 2080, 4640])
def test_a_prefill_product_equals_each_token_alone(libraries, avx2, bits, K):
    """33 tokens in one BlockwiseMatMul call (4 tokens a row, or tiles over 4096 values) equal each token's own call
    (a decode step's product) bit for bit, where a decode step sums each row as the row-by-row products did (rows
    over 512 values, or of a block count the 4-row decode path does not take): no git history needed."""
    N, rng = 75, np.random.default_rng(K * bits)
    weights = rng.integers(0, 256, size=(N, K // 32, 32 * bits // 8), dtype=np.uint8)
    scales = _half_values(rng.random(N * K // 32, dtype=np.float32) * 0.02 + 0.005)
    a = rng.standard_normal((33, K), dtype=np.float32)
    model = _blockwise_model(K, N, bits, weights, scales)
    builds = {"native": libraries["native"], "avx2": avx2}
    for name, library in builds.items():
        if library.path is None:
            continue
        session = _open_model(model, library.path)
        together = session.run(None, {"a": a})
        alone = [session.run(None, {"a": a[t:t + 1]}) for t in range(len(a))]
        for i, got in enumerate(together):
            want = np.concatenate([one[i] for one in alone])
            assert _bit_equal(got, want), (name, i, np.abs(got - want).max())


def _open_model(model, library: Path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    cpu_ops.register(options, library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _routed_experts_model(bits: int):
    """RoutedExperts four times (both layouts, float32 and float16 scales) on the QMoE tests' weights (fc1 of 20
    blocks, fc2 of 5), routed by the scores ``r``."""
    nodes, inits, outputs = [], [], []
    for layout in ("source", "interleaved"):
        for stored in ("float", "float16"):
            name = f"{layout}_{stored}"
            weights = _as_half(_weights(bits)) if stored == "float16" else _weights(bits)
            extra = {}
            if layout == "interleaved":
                weights, extra = _interleaved(weights, bits), {"interleaved": 1}
            names = [f"{n}_{name}" for n in ("w1", "s1", "w2", "s2")]
            inits += [numpy_helper.from_array(w, n) for w, n in zip(weights, names)]
            nodes.append(helper.make_node(own_ops.OP_TYPE, ["x", "r", *names], [name], domain=own_ops.DOMAIN, k=K,
                                          expert_weight_bits=bits, block_size=32, normalize_routing_weights=1,
                                          **extra))
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["T", D]))
    graph = helper.make_graph(nodes, "experts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", D]),
                                                 helper.make_tensor_value_info("r", TensorProto.FLOAT, ["T", E])],
                              outputs, inits)
    return _model(graph, own_ops.DOMAIN)


@pytest.mark.parametrize("bits", [4, 8])
def test_routed_experts_grouped_tiles_equal_the_row_by_row_products(libraries, avx2, row_by_row, all_tiles, bits):
    """RoutedExperts over 1 to 33 tokens (each expert's tokens gathered, its products in tiles over them): the
    row-by-row operators' outputs bit for bit, and each token computed alone gives the same (the routing weights
    and the experts' sums per token are the same whatever else the call holds)."""
    rng = np.random.default_rng(bits)
    feeds = [{"x": rng.standard_normal((t, D), dtype=np.float32), "r": rng.standard_normal((t, E), dtype=np.float32)}
             for t in TOKEN_COUNTS]
    model = _routed_experts_model(bits)
    _tiles_equal_row_by_row(model, feeds, libraries, avx2, row_by_row, all_tiles)
    session, last = _open_model(model, avx2.path), feeds[-1]
    together = session.run(None, last)
    alone = [session.run(None, {n: v[t:t + 1] for n, v in last.items()}) for t in range(len(last["x"]))]
    for i, got in enumerate(together):
        assert _bit_equal(got, np.concatenate([one[i] for one in alone]))


@pytest.mark.parametrize("bits", [4, 8])
def test_shared_experts_tiles_equal_the_row_by_row_products(libraries, avx2, row_by_row, all_tiles, bits):
    """The shared experts folded into RoutedExperts (their gate, up and down products in tiles over every token):
    the row-by-row operators' outputs bit for bit for 1 to 33 tokens."""
    model = _shared_experts_model(bits)
    assert own_ops.swap_experts(model) == 1 and own_ops.swap_linear(model) == 3
    assert own_ops.fold_shared_experts(model) == 1
    rng = np.random.default_rng(bits + 1)
    feeds = [{"h": rng.standard_normal((1, t, D), dtype=np.float32), "r": rng.standard_normal((t, E), dtype=np.float32)}
             for t in TOKEN_COUNTS]
    _tiles_equal_row_by_row(model, feeds, libraries, avx2, row_by_row, all_tiles)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [128, 512])
def test_headwise_matmul_tiles_equal_the_row_by_row_products(libraries, avx2, row_by_row, all_tiles, bits, K):
    """HeadwiseMatMul (the absorbed attention's W_UK over 128 values and W_UV over 512, signed weights) over 1 to 33
    rows per head, as a prefill computes them: the row-by-row operators' outputs bit for bit."""
    q, scales = _signed(bits, (HEADS, HN, K), seed=bits + K)
    model = _per_head_graph(q, scales, bits)
    assert own_ops.swap_headwise(model) == 1
    rng = np.random.default_rng(K)
    feeds = [{"a": rng.standard_normal((HEADS, t, K), dtype=np.float32)} for t in TOKEN_COUNTS]
    _tiles_equal_row_by_row(model, feeds, libraries, avx2, row_by_row, all_tiles)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [96, 640])
@pytest.mark.parametrize("tokens", [1, 6])
def test_blockwise_matmul_integer_sums_are_the_same_on_every_path(libraries, avx2, bits, K, tokens):
    """Activations whose int8 quantization is exact (small integers and one 127 per block: block scale 1) and
    power-of-two weight scales make every float operation of the product exact, whatever its order: then all three
    builds give the exact sum of the integer products, computed here in int64, bit for bit (the same integers on
    every path, portable C's included)."""
    N, rng = 43, np.random.default_rng(K * bits + tokens)
    weights = rng.integers(0, 256, size=(N, K // 32, 32 * bits // 8), dtype=np.uint8)
    scales = 2.0 ** -rng.integers(6, 9, size=N * K // 32).astype(np.float32)
    a = rng.integers(-8, 9, size=(tokens, K // 32, 32)).astype(np.float32)
    peak = rng.integers(0, 32, size=(tokens, K // 32))
    np.put_along_axis(a, peak[..., None], rng.choice([-127.0, 127.0], size=(tokens, K // 32, 1)), axis=2)
    zero = 1 << (bits - 1)
    values = weights.astype(np.int64)
    if bits == 4:  # element 2j in byte j's low nibble, 2j + 1 in its high one (MatMulNBits' packing)
        values = np.stack([values & 15, values >> 4], axis=-1).reshape(N, K // 32, 32)
    per_block = np.einsum("nbj,tbj->tnb", values - zero, a.astype(np.int64))  # exact integers
    want = (per_block * scales.reshape(N, K // 32)).sum(axis=2).astype(np.float32)  # exact: well within 2^24 units
    outputs = _each_build(_blockwise_model(K, N, bits, weights, scales), {"a": a.reshape(tokens, K)}, libraries, avx2)
    for name, got in outputs.items():
        for output in got:
            assert _bit_equal(output, want), (name, np.abs(output - want).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 6])
def test_routed_experts_avx2_equals_vnni_bit_for_bit(libraries, avx2, bits, tokens):
    """RoutedExperts (fc1 of 20 blocks, fc2 of 5) on the same weights as QMoE's tests, both layouts, float32 and
    float16 scales, routing by the scores: AVX2 equals AVX-512 VNNI bit for bit, portable C to float32 rounding."""
    rng = np.random.default_rng(tokens + 10 * bits)
    x = rng.standard_normal((tokens, D), dtype=np.float32)
    r = rng.standard_normal((tokens, E), dtype=np.float32)
    _vector_paths_agree(_each_build(_routed_experts_model(bits), {"x": x, "r": r}, libraries, avx2))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 3])
def test_routed_experts_with_shared_experts_avx2_equals_vnni_bit_for_bit(libraries, avx2, bits, tokens):
    """The shared experts folded into RoutedExperts (their gate, up and down products in the same call): AVX2 equals
    AVX-512 VNNI bit for bit, portable C to float32 rounding."""
    model = _shared_experts_model(bits)
    assert own_ops.swap_experts(model) == 1 and own_ops.swap_linear(model) == 3
    assert own_ops.fold_shared_experts(model) == 1
    rng = np.random.default_rng(bits + tokens)
    feeds = {"h": rng.standard_normal((1, tokens, D), dtype=np.float32),
             "r": rng.standard_normal((tokens, E), dtype=np.float32)}
    _vector_paths_agree(_each_build(model, feeds, libraries, avx2))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 6])
def test_headwise_matmul_avx2_equals_vnni_bit_for_bit(libraries, avx2, bits, rows):
    """HeadwiseMatMul (signed per-head weights, flipped to the zero point as they are read): AVX2 equals AVX-512
    VNNI bit for bit, portable C to float32 rounding."""
    q, scales = _signed(bits, (HEADS, HN, D), seed=bits)
    model = _per_head_graph(q, scales, bits)
    assert own_ops.swap_headwise(model) == 1
    a = np.random.default_rng(rows).standard_normal((HEADS, rows, D), dtype=np.float32)
    _vector_paths_agree(_each_build(model, {"a": a}, libraries, avx2))


def test_the_best_fast_path_the_cpu_has_is_chosen():
    """AVX-512 VNNI before AVX-VNNI before AVX2 (with FMA and F16C, which its code needs); AVX-512 without VNNI
    (Skylake-X) takes AVX2; without AVX2, FMA or F16C there is none, and doctor's reason says so."""
    avx2 = ("avx2", "fma", "f16c")
    avx512 = ("avx512f", "avx512bw", "avx512vl")
    assert cpu_ops.fast_path(avx2).name == "avx2"
    assert cpu_ops.fast_path(avx2 + ("avxvnni",)).name == "avx-vnni"
    assert cpu_ops.fast_path(avx2 + avx512 + ("avx512_vnni", "avxvnni")).name == "avx512-vnni"
    assert cpu_ops.fast_path(avx2 + avx512).name == "avx2"
    assert cpu_ops.fast_path(("avx2", "fma")) is None and cpu_ops.fast_path(("avx", "sse4_2")) is None
    assert cpu_ops.why_not_here(avx2) is None and cpu_ops.why_not_here(("avx", "sse4_2")) == cpu_ops.NO_FAST_PATH
    assert [cpu_ops.isa_named(i.name) for i in cpu_ops.FAST_PATHS] == list(cpu_ops.FAST_PATHS)
    with pytest.raises(ValueError, match="no operator instruction set 'sse2'"):
        cpu_ops.isa_named("sse2")


def test_a_library_for_an_instruction_set_the_cpu_lacks_is_compiled_but_not_kept(tmp_path):
    """AVX-VNNI's code is compiled here whatever the CPU (its flags and intrinsics build), and kept only where the CPU
    has AVX-VNNI; likewise an AVX2 library for a CPU said to have no AVX2."""
    from mla_deploy.ort.record import host_cpu

    isa = cpu_ops.isa_named("avx-vnni")
    library = cpu_ops.compile_library(tmp_path, isa)
    if all(f in host_cpu("").features for f in isa.needs):
        assert library.path is not None and library.isa == "avx-vnni", library.why_not
    else:  # compiled (not "could not compile"), then refused before anything runs it
        assert library.path is None and not (tmp_path / cpu_ops.LIBRARY).exists()
        assert library.why_not.startswith("compiled for avx-vnni, which this CPU cannot run (it lacks avxvnni"), \
            library.why_not
    library = cpu_ops.compile_library(tmp_path, cpu_ops.isa_named("avx2"), features=("avx", "fma", "f16c"))
    assert library.path is None and library.why_not == "compiled for avx2, which this CPU cannot run (it lacks avx2)"


def test_a_record_without_the_instruction_set_is_read_as_avx512_vnni():
    """Engines recorded before the record named the instruction set were all AVX-512 VNNI builds."""
    from mla_deploy.ort.record import CpuOperators

    used = CpuOperators(1, 2, cpu_ops.LIBRARY, "a" * 64, "b" * 64, isa="avx2")
    assert CpuOperators.from_dict(used.to_dict()) == used
    old = {k: v for k, v in used.to_dict().items() if k != "isa"}
    assert CpuOperators.from_dict(old).isa == "avx512-vnni"
    kept = {k: v for k, v in CpuOperators(why_not=cpu_ops.NO_FAST_PATH).to_dict().items() if k != "isa"}
    assert CpuOperators.from_dict(kept).isa is None


def test_an_engine_built_for_avx2_records_it_and_gives_the_source_graphs_tokens(moe_artifact, avx2, tmp_path):
    """The build given AVX2 (what an AVX2-only CPU's build takes) compiles its library for it, records the
    instruction set, names it, and the engine decodes the source graphs' tokens."""
    from mla_deploy.ort.cpu_build import build_cpu_engine
    from mla_deploy.ort.record import read_cpu_engine_record

    art = Path(shutil.copytree(moe_artifact, tmp_path / "art"))
    record = build_cpu_engine(art, isa=cpu_ops.isa_named("avx2"))
    assert record.operators.used and record.operators.isa == "avx2" and record.operators.why_not is None
    assert json.loads((art / "cpu" / "engine.json").read_text())["operators"]["isa"] == "avx2"
    assert read_cpu_engine_record(art).operators.isa == "avx2"
    assert cpu_ops.library_isa(art / "cpu" / cpu_ops.LIBRARY) == "avx2"
    assert f"({cpu_ops.LIBRARY}, instruction set avx2, " in record.operators.describe()
    assert "instruction set avx2" in OrtEngine(art, threads=1).info()["operators"]
    assert _tokens(art) == _tokens(art, "--no-engine")


def test_a_cpu_without_a_fast_path_keeps_onnx_runtimes_kernels_and_says_why(moe_artifact, tmp_path):
    """A build on a CPU with none of the fast paths (here: told the features of one with AVX but no AVX2) compiles
    nothing, keeps QMoE and MatMulNBits, and records why; the engine decodes the source graphs' tokens."""
    from mla_deploy.ort.cpu_build import build_cpu_engine

    no_avx2 = ("avx", "sse4_2")
    library = cpu_ops.compile_library(tmp_path, features=no_avx2)
    assert library.path is None and library.why_not == cpu_ops.NO_FAST_PATH
    assert not (tmp_path / cpu_ops.LIBRARY).exists()
    art = Path(shutil.copytree(moe_artifact, tmp_path / "art"))
    record = build_cpu_engine(art, features=no_avx2)
    assert not record.operators.used and record.operators.isa is None
    assert record.operators.why_not == cpu_ops.NO_FAST_PATH
    assert record.operators.describe() == f"ONNX Runtime's only ({cpu_ops.NO_FAST_PATH})"
    saved = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    assert saved["why_not"] == cpu_ops.NO_FAST_PATH and saved["isa"] is None
    assert saved["experts"] == saved["linear"] == 0
    assert not (art / "cpu" / cpu_ops.LIBRARY).exists()
    assert _tokens(art) == _tokens(art, "--no-engine")


def test_a_planted_change_of_the_avx2_sum_order_is_caught(libraries, avx2, tmp_path):
    """The bit-for-bit comparison has teeth: an AVX2 build that sums a row's 16 lanes in another order (the same
    values) still passes its check against MatMulNBits (float32 rounding), but no longer equals the AVX-512 VNNI
    build bit for bit."""
    source = cpu_ops.source_path().read_text()
    old = "const __m256 eight = _mm256_add_ps(vf_high(v), vf_low(v));"
    assert source.count(old) == 1
    planted = tmp_path / "cpu_ops.c"
    planted.write_text(source.replace(old, "const __m256 eight = _mm256_add_ps(_mm256_permute_ps(vf_high(v), 0x1B), "
                                           "vf_low(v));"))
    changed = cpu_ops.compile_library(tmp_path, cpu_ops.isa_named("avx2"), source=planted)
    assert changed.path is not None and changed.isa == "avx2", changed.why_not
    K, N, bits, rng = 640, 43, 4, np.random.default_rng(3)
    weights = rng.integers(0, 256, size=(N, K // 32, 32 * bits // 8), dtype=np.uint8)
    scales = _half_values(rng.random(N * K // 32, dtype=np.float32) * 0.02 + 0.005)
    model = _blockwise_model(K, N, bits, weights, scales)
    a = rng.standard_normal((1, K), dtype=np.float32)
    outputs = _each_build(model, {"a": a}, libraries, changed)
    vnni = outputs["avx512-vnni"][0]  # the source layout: its lanes summed by vf_sum
    assert not _bit_equal(outputs["avx2"][0], vnni)
    assert np.abs(outputs["avx2"][0] - vnni).max() <= 2e-5 * np.abs(vnni).max()


@pytest.fixture(scope="module", params=["int4", "int8"])
def attention_engine(libraries, tmp_path_factory, request) -> tuple[Path, str]:
    """An export with 16 heads and quantized per-head weights (the tiny preset's), built with LatentAttention."""
    if libraries["native"].path is None:
        pytest.skip(f"the build keeps ONNX Runtime's operators here: {libraries['native'].why_not}")
    from mla_deploy.exporter import export_recipe

    art = tmp_path_factory.mktemp("attention") / "art"
    export_recipe(_concat_per_head_recipe(16, "concat", request.param), art)
    ok(cli("build", art, "--target", "cpu"))
    return art, request.param


def test_latent_attention_avx2_equals_vnni_bit_for_bit(attention_engine, libraries, avx2):
    """LatentAttention through the AVX-512 VNNI and AVX2 builds: a prefill of two sequences (per-head products row by
    row) and a decode step (per-head products in panels): the logits, every layer's cache and layer 0's attention
    output equal bit for bit (the scores, the softmax with its own exp and the weighted sum run the same 16 lanes on
    both paths, as the products do). The portable build is compared with the nodes the operator replaces by
    test_attention_operator_equals_the_nodes_it_replaces."""
    art, weights = attention_engine
    recipe = _concat_per_head_recipe(16, "concat", weights)
    layers, width = recipe.model.num_hidden_layers, recipe.model.kv_lora_rank + recipe.model.qk_rope_head_dim
    vnni = _vnni(libraries)
    sessions = {name: _first_attention_session(art, library.path)[0]
                for name, library in (("avx512-vnni", vnni), ("avx2", avx2))}
    rng = np.random.default_rng(4)
    feed = {"input_ids": rng.integers(0, recipe.model.vocab_size, size=(2, 5), dtype=np.int64),
            "position_ids": np.arange(5)[None].repeat(2, 0), "logits_index": np.full((2, 1), 4),
            "attention_mask": np.ones((2, 5), np.int64),
            **{f"past_latent.{i}": np.zeros((2, 0, width), np.float32) for i in range(layers)}}
    prefill = {name: session.run(None, feed) for name, session in sessions.items()}
    step = {"input_ids": np.array([[11], [12]], np.int64), "position_ids": np.full((2, 1), 5, np.int64),
            "logits_index": np.zeros((2, 1), np.int64), "attention_mask": np.ones((2, 6), np.int64),
            **{f"past_latent.{i}": prefill["avx512-vnni"][1 + i] for i in range(layers)}}
    decode = {name: session.run(None, step) for name, session in sessions.items()}
    for runs in (prefill, decode):
        want, got = runs["avx512-vnni"], runs["avx2"]
        assert len(got) == len(want) == 2 + layers  # the logits, each layer's cache, layer 0's attention output
        for mine, ref in zip(got, want):
            assert np.abs(ref).max() > 0 and _bit_equal(mine, ref), np.abs(mine - ref).max() / np.abs(ref).max()
