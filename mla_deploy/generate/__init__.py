"""Generation: tokenizer, chat template, sampling, the generation loop and text streaming."""
