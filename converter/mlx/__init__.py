"""MLX out: a merged model as the folders mlx-lm writes (4-bit, 8-bit, bf16), proven by mlx-lm on the CPU.

`types` (what a user may ask for), `runtime` (mlx and mlx-lm, imported on first use), `layout` (what mlx-lm would
write, from its own model classes and quantizer, no weights), `write` (the folder, one tensor at a time), `proof`
(tensors read back, the config, mlx-lm's logits against the merged model's), `export` (all of it, per type),
`publish` (`<repo>-4bit` ... on the Hub).
"""
