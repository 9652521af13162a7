"""Chat templates, tokenizers, packing, encoding. In the stage keys."""
