"""Give a checkpoint without tokenizer files (a random one, or the first layers of a real one) a tokenizer that
covers its whole vocabulary, so that a text server can serve it and every id a model generates decodes to text:

    python benchmarks/bench_tokenizer.py CKPT

It writes the tests' small byte-level BPE (tests/hf_oracle.py: a chat template, BOS/EOS) with added tokens
``[t123]`` up to the config's ``vocab_size`` (text that does not look like a control token to llama.cpp) into CKPT
(tokenizer.json, tokenizer_config.json, chat_template.jinja). `mla-deploy export --hf` carries it into the
artifact and llama.cpp's converter into the GGUF (as user-defined tokens), so `benchmarks/serve_bench.py` gets the same
text, a chunk per token, from both servers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "config.json").is_file():
        sys.exit("usage: python benchmarks/bench_tokenizer.py CKPT (a checkpoint folder with its config.json)")
    from hf_oracle import hf_tokenizer

    folder = Path(argv[0])
    vocab_size = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    tokenizer = hf_tokenizer("post_processor")
    tokenizer.add_tokens([f"[t{i}]" for i in range(len(tokenizer), vocab_size)])
    tokenizer.save_pretrained(folder)
    print(f"wrote a tokenizer of {len(tokenizer)} ids into {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
