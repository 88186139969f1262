"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a checkpoint (this file runs as a script, in the interpreter
that runs the comparison, with the vendored ``gguf-py`` on its path):

    python convert_entry.py LLAMA_CPP_DIR CHECKPOINT [converter options ...]

Five adaptations, all in a subclass of the converter's own class for the checkpoint's architecture, none
changing a byte the converter writes for a checkpoint it converts without them:

* A checkpoint without tokenizer files (the random ones `samples/03_random_checkpoint` writes) gets a GGUF whose
  tokenizer model is ``none`` with the config's vocabulary size (llama.cpp then holds that many placeholder
  tokens). llama-bench feeds random token ids, so the timings do not depend on the vocabulary.
* A tokenizer whose pre-tokenizer llama.cpp does not recognise (the tests' small byte-level BPE, which
  ``benchmarks/serve_bench.py``'s checkpoint carries) is written with llama.cpp's ``default`` pre-tokenizer: text may
  split into other ids than transformers gives, token ids decode to the same text (the serving bench sends ids).
* A checkpoint without a query compression (``q_lora_rank`` null, as DeepSeek-V2-Lite) gets
  ``attention.q_lora_rank = 0``: llama.cpp takes a model without that key for the "lite" layout only at 26 or 27
  layers, so the first N layers of V2-Lite would not load without it; with 0 it builds the same plain query
  projection it builds for the whole V2-Lite.
* A config written by transformers 5 (GLM-4.7-Flash's, DeepSeek-V3.2's) gets the keys the converter reads and
  transformers leaves out: ``first_k_dense_replace`` from ``mlp_layer_types``, ``scoring_func`` sigmoid for the
  classes that route by sigmoid (:func:`_transformers_keys`).
* A layer's routed experts are written one expert at a time. The converter stacks a layer's experts into one
  tensor and turns it to float32 before quantizing it: for DeepSeek-V3 (256 experts of 2048 x 7168) that is 15 GB
  for each of the three projections, and the kernel's out-of-memory killer stopped it on a 24 GiB machine. Here each
  projection goes to the writer as the converter's own ``gguf.LazyChunkedTensor`` (its upstream answer to a tensor
  too large to hold: one chunk resident at a time), a chunk an expert, each loaded, turned to float32 and quantized
  as the stack would have been. A quantized block never spans two experts (blocks run along a row), so the file
  holds the same bytes (a test compares the two on a tiny checkpoint).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
#: a routed expert's projection in a DeepSeek checkpoint: (layer, expert, projection)
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
#: the converter's order of a layer's stacked projections
PROJECTIONS = ("down_proj", "gate_proj", "up_proj")


def _adapt(architecture: str, vocabless: bool) -> None:
    """Register, for ``architecture``, the converter's own class with the adaptations of the module docstring."""
    import gguf
    import numpy as np
    import torch
    from conversion import ModelBase, get_model_class
    from conversion.base import LazyTorchTensor

    base = get_model_class(architecture)

    class Adapted(base):  # type: ignore[misc, valid-type]
        model_arch = base.model_arch  # the converter requires each class to name it

        def set_vocab(self) -> None:
            if vocabless:
                self.gguf_writer.add_tokenizer_model("none")
            else:
                super().set_vocab()

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return super().get_vocab_base_pre(tokenizer)
            except NotImplementedError:  # an unrecognised pre-tokenizer: see the module docstring
                return "default"

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._routed: dict[int, set[str]] = {}  # per layer, the names of its routed experts' projections seen

        def modify_tensors(self, data_torch, name: str, bid: int | None):
            expert = EXPERT.fullmatch(name)
            if (expert is None or not getattr(self, "merge_expert", False) or self.fuse_gate_up_exps
                    or int(expert.group(1)) >= int(self.hparams["num_hidden_layers"])):
                yield from super().modify_tensors(data_torch, name, bid)
                return
            layer = int(expert.group(1))
            seen = self._routed.setdefault(layer, set())
            seen.add(name)
            n_experts = int(self.hparams["n_routed_experts"])
            if len(seen) < 3 * n_experts:
                return
            del self._routed[layer]
            for projection in PROJECTIONS:
                names = [f"model.layers.{layer}.mlp.experts.{i}.{projection}.weight" for i in range(n_experts)]
                rows, columns = self.model_tensors[names[0]]().shape
                stacked = gguf.LazyChunkedTensor([self._expert_chunk(n) for n in names], (n_experts, rows, columns),
                                                 np.float32)
                yield self.map_tensor_name(f"model.layers.{layer}.mlp.experts.{projection}.weight"), stacked

        def _expert_chunk(self, name: str):
            """One expert's projection as the stack holds it (float32), loaded when it is written."""
            def load():
                # a fresh lazy tensor each call: to_eager() of a kept one would keep every expert it loaded
                return LazyTorchTensor.to_eager(self.model_tensors[name]()).to(torch.float32).contiguous().numpy()
            return load

        def prepare_tensors(self) -> None:
            super().prepare_tensors()
            left = sorted(n for names in self._routed.values() for n in names)
            if left:
                raise ValueError(f"experts of an incomplete layer, not written: {left[:3]} ...")

        def set_gguf_parameters(self) -> None:
            _transformers_keys(self.hparams, architecture)
            super().set_gguf_parameters()
            if "q_lora_rank" in self.hparams and self.hparams["q_lora_rank"] is None:
                self.gguf_writer.add_q_lora_rank(0)

    ModelBase.register(architecture)(Adapted)


#: architectures whose transformers class always routes by sigmoid scores (DeepSeek-V3's router)
SIGMOID_ROUTED = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV32ForCausalLM")


def _transformers_keys(hparams: dict, architecture: str) -> None:
    """The keys llama.cpp's converter reads that a config written by transformers 5 leaves out, from what it says
    instead: ``first_k_dense_replace`` from ``mlp_layer_types`` (GLM-4.7-Flash, DeepSeek-V3.2; without it the
    converter writes no dense layers and llama.cpp cannot load the file), and ``scoring_func`` sigmoid where the
    class routes by sigmoid (without it llama.cpp falls back to softmax routing). A config that names them is
    left as it is."""
    types = hparams.get("mlp_layer_types")
    if types and hparams.get("first_k_dense_replace") is None:
        lead = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
        if "dense" in types[lead:]:
            raise ValueError(f"mlp_layer_types {types}: llama.cpp takes dense layers only before the MoE ones")
        hparams["first_k_dense_replace"] = lead
    if architecture in SIGMOID_ROUTED and hparams.get("n_routed_experts") and not hparams.get("scoring_func"):
        hparams["scoring_func"] = "sigmoid"


def main(argv: list[str]) -> None:
    llama, checkpoint, *options = argv
    sys.path[:0] = [llama, str(Path(llama) / "gguf-py")]
    import convert_hf_to_gguf

    folder = Path(checkpoint)
    vocabless = not any((folder / name).is_file() for name in TOKENIZER_FILES)
    for architecture in json.loads((folder / "config.json").read_text()).get("architectures") or []:
        _adapt(architecture, vocabless)
    sys.argv = ["convert_hf_to_gguf.py", checkpoint, *options]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
