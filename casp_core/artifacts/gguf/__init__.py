"""GGUF, llama.cpp's format, both ways: `source` reads a GGUF file as the model to prune (dequantized once into the
cache); `writer` exports a checkpoint (f32/f16/bf16 by the `gguf` package, the quantized types by llama.cpp's
quantizer); `types` holds the types and the type llama.cpp gives each tensor (light: no torch); `tokenizer` the
vocabulary; `size` a file's bytes before it is written; `engine` each file measured in llama.cpp (perplexity, speed).
"""
