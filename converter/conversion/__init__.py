"""Convert an adapter between formats without merging: kohya ↔ PEFT ↔ diffusers.

Every format is read into `AdapterPatch`es (converter/formats/), turned here into plain LoRA modules
(down, up, alpha on a dotted module path), and written by one small writer per format. Facts about each format:
docs/FORMATS.md (§1 kohya, §4 diffusers, §7 PEFT, §8 known bugs).

- Names: kohya names are flattened ('.' -> '_') and cannot be parsed back, so a kohya file becomes PEFT/diffusers
  only with `--base`: its modules are looked up among the base's real keys (the merge's resolver) and take the base's
  dotted names. kohya output names are made by flattening real dotted names, never by guessing.
- Alphas: each module keeps its own alpha. PEFT and diffusers outputs carry them as `rank_pattern`/`alpha_pattern`
  (nothing folded into the weights, so ΔW is bit-for-bit the same); kohya outputs carry a real `.alpha` per module
  (diffusers' own PEFT→kohya writes alpha = rank, which is wrong for lora_alpha != r, §4).
- Fused ↔ split (BFL qkv / linear1 vs diffusers to_q/to_k/to_v/proj_mlp): a fused module splits exactly by its up
  rows; the down matrix is split too only when the up matrix is block-diagonal (checked exactly: kohya's split_qkv
  layout, §8 mflux#423), else every part shares it. Separate modules fuse into a block-diagonal up and stacked down.
- LoHa / LoKr / full deltas / Tucker LoCon have no exact LoRA form: refused unless `--rank`, then an SVD with the
  reconstruction error reported.
- DoRA: PEFT's magnitude vector and LyCORIS' output-axis `dora_scale` are the same numbers (§3, §7); the old
  input-axis `dora_scale` has no PEFT form and is refused.
- A Hub `--base` is read from its configs and safetensors headers only: names need no weights.

The package: `options` (what convert is asked, as data: no torch, the parser and the Space build it), `core`
(`convert()`), `names` (looking modules up on the base), `modules` (the math: factors, fused
<-> split, SVD), `writers` (kohya, PEFT, diffusers), `pr` (`--push-pr`); `converter convert` is converter.cli.convert.
"""
