"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a checkpoint (this file runs as a script, in the interpreter
that runs the comparison, with the vendored ``gguf-py`` on its path):

    python convert_entry.py LLAMA_CPP_DIR CHECKPOINT [converter options ...]

Three adaptations, all in a subclass of the converter's own class for the checkpoint's architecture, none
touching a weight:

* A checkpoint without tokenizer files (the random ones `samples/03_random_checkpoint` writes) gets a GGUF whose
  tokenizer model is ``none`` with the config's vocabulary size (llama.cpp then holds that many placeholder
  tokens). llama-bench feeds random token ids, so the timings do not depend on the vocabulary.
* A tokenizer whose pre-tokenizer llama.cpp does not recognise (the tests' small byte-level BPE, which
  ``tools/serve_bench.py``'s checkpoint carries) is written with llama.cpp's ``default`` pre-tokenizer: text may
  split into other ids than transformers gives, token ids decode to the same text (the serving bench sends ids).
* A checkpoint without a query compression (``q_lora_rank`` null, as DeepSeek-V2-Lite) gets
  ``attention.q_lora_rank = 0``: llama.cpp takes a model without that key for the "lite" layout only at 26 or 27
  layers, so the first N layers of V2-Lite would not load without it; with 0 it builds the same plain query
  projection it builds for the whole V2-Lite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _adapt(architecture: str, vocabless: bool) -> None:
    """Register, for ``architecture``, the converter's own class with the adaptations of the module docstring."""
    from conversion import ModelBase, get_model_class

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

        def set_gguf_parameters(self) -> None:
            super().set_gguf_parameters()
            if "q_lora_rank" in self.hparams and self.hparams["q_lora_rank"] is None:
                self.gguf_writer.add_q_lora_rank(0)

    ModelBase.register(architecture)(Adapted)


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
