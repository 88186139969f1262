"""benchmarks/compare_llama_cpp.sh: this project's whole-model bench beside llama.cpp's ``llama-bench`` on the same
checkpoint at equal weight precision, in one command, printing one table.

* :mod:`.settings`: what a run compares (checkpoint, precisions, contexts, threads) and where it keeps its files;
* :mod:`.checks`: the one-line refusals (no checkpoint, not a DeepSeek one, no cmake or compiler);
* :mod:`.steps`: the command lines (download the ``llama-cpp-python`` sdist, build its vendored llama.cpp,
  convert, quantize, ``llama-bench``, ``mla-deploy bench model``), cached where a later run can reuse them;
* :mod:`.gguf`: a GGUF file's tensors and the bytes one decode step reads from them;
* :mod:`.table`: llama-bench's JSON and bench.json side by side, with the bandwidth bound and its check;
* :mod:`.convert_entry`: runs llama.cpp's converter (a checkpoint without a tokenizer gets a vocabulary-less
  GGUF, which llama-bench times with random token ids as it does any model).
"""
