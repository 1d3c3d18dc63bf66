"""Training recipe of the embedded default model: tokenizer, V4.1 backbone, DSpark drafter (``flashserve train``)."""
