"""GGUF out: a Hugging Face model folder written as GGUF files for llama.cpp, and proven.

Why a package of its own: GGUF is the format most fine-tuners ship to llama.cpp, Ollama and LM Studio, and the step
where their models break (wrong Q/K row order, a wrong pre-tokenizer, a dropped tensor, a wrong rope base). Here
F32 / F16 / BF16 / Q8_0 are written in Python through llama.cpp's own `gguf` package (its writer, its name maps,
its reference quantizers), tensor by tensor from the safetensors; the K-quants come from llama.cpp's own quantizer
(llama-cpp-python, the `converter[gguf]` extra). Each file is then proven three ways: its tensors read back equal
the source's as cast / quantized by the reference, llama.cpp tokenizes like transformers, and llama.cpp's logits
match transformers' within a threshold per type.

Modules: types (the type names), source (the safetensors, read one tensor at a time), arch (architectures:
metadata and tensor names), vocab (the tokenizer's metadata), write (the streaming, atomic writer), llama
(llama.cpp through llama-cpp-python, silenced), proof (the three proofs), export (all of it, per type),
publish; the command is converter.cli.gguf. A LoRA adapter as a GGUF adapter llama.cpp applies at run time
(`converter convert --to gguf`): adapter (plan and writer), adapter_proof (read back, then llama.cpp against PEFT),
adapter_export (all of it).
"""
