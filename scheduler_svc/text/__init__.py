"""Text: tokenizer, chat template, incremental detokenizer with stop strings, structured-output grammars."""
