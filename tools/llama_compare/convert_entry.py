"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a checkpoint (this file runs as a script, in the interpreter
that runs the comparison, with the vendored ``gguf-py`` on its path):

    python convert_entry.py LLAMA_CPP_DIR CHECKPOINT [converter options ...]

The converter reads the vocabulary from the checkpoint's tokenizer files. A checkpoint without any (the random
ones `samples/03_random_checkpoint` writes) gets a GGUF whose tokenizer model is ``none`` with the config's
vocabulary size (llama.cpp then holds that many placeholder tokens): the converter's class for the
checkpoint's architecture is subclassed with a ``set_vocab`` that writes just that. llama-bench feeds random
token ids, so the timings do not depend on the vocabulary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _vocabless(architecture: str) -> None:
    """Register, for ``architecture``, the converter's own class with a vocabulary-less ``set_vocab``."""
    from conversion import ModelBase, get_model_class

    base = get_model_class(architecture)

    class Vocabless(base):  # type: ignore[misc, valid-type]
        model_arch = base.model_arch  # the converter requires each class to name it

        def set_vocab(self) -> None:
            self.gguf_writer.add_tokenizer_model("none")

    ModelBase.register(architecture)(Vocabless)


def main(argv: list[str]) -> None:
    llama, checkpoint, *options = argv
    sys.path[:0] = [llama, str(Path(llama) / "gguf-py")]
    import convert_hf_to_gguf

    folder = Path(checkpoint)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        for architecture in json.loads((folder / "config.json").read_text()).get("architectures") or []:
            _vocabless(architecture)
    sys.argv = ["convert_hf_to_gguf.py", checkpoint, *options]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
