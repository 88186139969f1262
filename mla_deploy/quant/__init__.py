"""Weight-only quantization: the one place that knows what ``--weights``, ``--block-size`` and ``--quant-format``
mean.

* :mod:`.scheme`: the arithmetic: symmetric int8/int4 with one scale per block of input features
  (:class:`WeightQuantization`, :func:`quantize`, :func:`dequantize`, :func:`fake_quantize`, :func:`pack_int4`);
* :mod:`.formats`: each weight format as an object (:data:`QDQ`, :data:`MATMULNBITS`; and :data:`QMOE`/
  :data:`QMOE_CUDA`, the fused experts' ``QMoE`` layouts, CPU and CUDA, whatever the format): the nodes it
  inserts, the layout and bytes it stores, whether TensorRT builds it, how a session computes it exactly;
* :mod:`.graph`: which weights of a traced graph are quantized (:func:`quantize_graph_weights`), what an
  artifact's graphs hold (:func:`observe_graphs`), and a graph initializer's part (:class:`WeightPart`);
* :mod:`.record`: :class:`Quantization`, what an export does to its weights and the manifest's typed record of it,
  with :data:`FLOAT` (nothing quantized) a first-class value: callers ask it instead of branching on it.

Everything else (the recipe, the exporter, the manifest and its check, the engine, validation, the bench, the
CLI's choices) goes through these names. Importing this package is cheap (torch, onnx and onnx_ir are imported
when a weight is quantized or a graph read), so the CLI takes its choices from here.
"""

from .formats import (COMPUTE, DEFAULT_FORMAT, EXACT_COMPUTE, FAST_COMPUTE, FORMATS, HEADWISE, MATMULNBITS, QDQ,
                      QMOE, QMOE_CUDA, QMOE_LAYOUTS, WeightFormat, accuracy_level, layout_disagreement,
                      matmulnbits_layout)
from .graph import GraphQuantization, QuantizedKeys, WeightPart, WHOLE, observe_graphs, quantize_graph_weights
from .record import (FLOAT, WEIGHTS, Quantization, Quantized, from_manifest, parse_block_size, plan, plans,
                     require_quantized, weights_list)
from .scheme import (BLOCK_SIZES, DEFAULT_BLOCK_SIZE, SCHEMES, WeightQuantization, dequantize, fake_quantize,
                     pack_int4, quantize)

#: the CLI's ``--block-size`` choices (click takes strings)
BLOCK_SIZE_CHOICES = tuple(str(b) for b in BLOCK_SIZES)

__all__ = ["BLOCK_SIZES", "BLOCK_SIZE_CHOICES", "COMPUTE", "DEFAULT_BLOCK_SIZE", "DEFAULT_FORMAT", "EXACT_COMPUTE",
           "FAST_COMPUTE", "FLOAT", "FORMATS", "GraphQuantization", "HEADWISE", "MATMULNBITS", "QDQ", "QMOE",
           "QMOE_CUDA", "QMOE_LAYOUTS", "layout_disagreement",
           "Quantization", "Quantized", "QuantizedKeys",
           "SCHEMES", "WEIGHTS", "WHOLE", "WeightFormat", "WeightPart", "WeightQuantization", "accuracy_level",
           "dequantize", "fake_quantize", "from_manifest", "matmulnbits_layout", "observe_graphs", "pack_int4",
           "parse_block_size", "plan", "plans", "quantize", "quantize_graph_weights", "require_quantized", "weights_list"]
