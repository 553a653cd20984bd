"""The engine: a recipe becomes a plan from headers alone, then one streaming pass writes the merged weights.

`recipe` (what to merge), `base_reader` (the one place that picks a base's reader), `checkpoint` (model folders,
diffusers pipelines, single files), `keymap` + `keymap_schema` (the data in keymaps/: how names land on checkpoint
keys), `family` (which diffusion family a community LoRA is for), `model_class` (the transformers class an adapter
was trained for, and the names it loads), `plan` (every output tensor and its patches, every check, before a byte
is written), `merging` (the merge: stream, patch, round once, write, records), `npmerge` / `npmath` / `npkernel`
(the torch-free LoRA math), `taskmerge` + `ties_dare` (TIES / DARE), `bnb4` (bitsandbytes 4-bit in and out),
`writer` (sharded safetensors, headers final before data, one atomic rename), `readers` (the readers of bases it
does not read itself). Training checkpoints read as bases are `converter.training`, above the engine: it registers
its reader with `readers`.
"""
