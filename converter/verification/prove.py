"""Run the tensor proof over a merged folder: choose the referee, read every output file, return the result.

The referee is chosen by asking, in order: are all adapters PEFT folders on a transformers base (PEFT itself;
TIES/DARE/magnitude pruning through PEFT's merge utilities)? a diffusion base with files diffusers' loader reads
right (diffusers)? multi-component PEFT folders (PEFT per component)? Else the published formula, with the
reasons the others declined in its label. A 4-bit output is not proven tensor by tensor (said in the report).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from converter.engine.base_reader import open_base
from converter.engine.bnb4 import dequantize_folder, prequantized
from converter.engine.recipe import Recipe
from converter.errors import ConverterError
from converter.formats.components import component_folders
from converter.io.dtypes import parse_user_dtype
from converter.io.scratch import temp_folder
from converter.verification.combination_referee import CombinationReferee
from converter.verification.diffusers_loader import diffusers_declines
from converter.verification.diffusers_referee import DiffusersReferee, PeftComponentsReferee
from converter.verification.formula import FormulaReferee
from converter.verification.fourbit import four_bit_config
from converter.verification.peft_referee import PeftReferee
from converter.verification.referee import JudgedByBehaviour, Referee, RefereeInfo, RefereeUnavailable, could_not
from converter.verification.tensors import TensorProof, TensorProofResult, locations


def prove_tensors(
    merged: Path, recipe: Recipe, base: Path, adapters: list[Path], log: Callable[[str], None] = print
) -> tuple[TensorProofResult | None, RefereeUnavailable | None, Referee | None]:
    """(the result, None, the referee), or (None, why the proof could not run, None)."""
    with temp_folder("proof", log=log) as scratch:
        try:
            proof, base = open_proof(merged, recipe, base, adapters, Path(scratch))
        except RefereeUnavailable as e:
            return None, e, None
        log(f"tensor proof: every tensor of {merged.name} against the base and the {proof.referee.info.name} referee")
        output = open_base(merged / base.name if base.is_file() else merged)
        try:
            with one_torch_thread():
                for f in output.files:
                    proof.check_file(f.path, f"{f.path.parent.name}/" if output.diffusion == "diffusers" else "")
        except RefereeUnavailable as e:
            return None, e, None
        finally:
            proof.close()
        return proof.result(), None, proof.referee


def open_proof(
    merged: Path, recipe: Recipe, base: Path, adapters: list[Path], scratch: Path
) -> tuple[TensorProof, Path]:
    """A TensorProof of the output `merged` (which may not exist yet: a pipelined push proves its shards as they
    are written) and the base it reads (a 4-bit base dequantized into `scratch`); RefereeUnavailable: none can."""
    base, note = _plain_base(base, scratch, recipe)
    referee = choose_referee(merged, recipe, base, adapters)
    if note:
        referee.info.notes.append(note)
    where = locations(open_base(base, allow_pickle=recipe.allow_pickle))
    return TensorProof(where, referee, parse_user_dtype(recipe.dtype)), base


def _plain_base(base: Path, scratch: Path, recipe: Recipe) -> tuple[Path, str | None]:
    """A bitsandbytes 4-bit base as the merge reads it: each weight dequantized by bitsandbytes (from its stored
    quant state, as transformers' `dequantize()` does), into `scratch`; any other base as it is."""
    if base.is_file() or not (base / "config.json").is_file():
        return base, None
    import json

    if not prequantized(json.loads((base / "config.json").read_text())):
        return base, None

    dequantize_folder(open_base(base), scratch)
    return scratch, "the base is bitsandbytes 4-bit: each weight dequantized by bitsandbytes first, as the merge does"


@contextmanager
def one_torch_thread():
    """torch's own threads for elementwise work: one. The proof is memory-bound row blocks, and a second intra-op
    thread spins beside other work."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def choose_referee(merged: Path, recipe: Recipe, base: Path, adapters: list[Path]) -> Referee:
    """The most independent referee that can judge this merge (RefereeUnavailable: none can)."""
    if (merged / "config.json").is_file() and four_bit_config(merged):
        raise JudgedByBehaviour("a 4-bit output is judged by its behaviour against PEFT's own quantized merge; "
                                 "its packed weights are not compared tensor by tensor")  # fmt: skip
    if not adapters:
        return NoAdapters()
    diffusion = base.is_file() or (base / "model_index.json").is_file()
    reasons = []
    for who, ask in ((("PEFT", _peft), ("PEFT", _peft_components), ("diffusers", _diffusers)) if diffusion
                     else (("PEFT", _peft),)):  # fmt: skip
        try:
            referee = _built(who, lambda ask=ask: ask(recipe, base, adapters, merged))
            if referee is not None:
                return referee
        except RefereeUnavailable as e:
            reasons.append(str(e))

    reason = "; ".join(reasons) or "no other referee reads these adapters"
    try:
        return _built("the published formula", lambda: FormulaReferee(recipe, base, adapters, reason))
    except RefereeUnavailable as e:
        raise RefereeUnavailable(f"{reason}, and the published formula cannot recompute it either ({e})") from None


def _built(who: str, build: Callable[[], Referee | None]) -> Referee | None:
    """A referee with every expectation asked now (it declines here, or never); an error inside the library it
    stands on (a model class it cannot build, a layer it cannot merge) is its refusal, said in one line."""
    try:
        referee = build()
        if referee is not None:
            referee.expectations()
        return referee
    except (RefereeUnavailable, ConverterError):  # a refusal, or input the user must fix: said as it is
        raise
    except Exception as e:  # noqa: BLE001 - whatever the library raised: this referee cannot judge, the next may
        raise RefereeUnavailable(could_not(f"{who} could not be built for this model", e)) from None


class NoAdapters:
    """Nothing merged (a training checkpoint without a LoRA, reassembled): every tensor must be the base's."""

    info = RefereeInfo("none needed", "no adapters: every tensor must be the base's own")

    def expectations(self) -> dict:
        return {}


def is_peft_folder(path: Path) -> bool:
    """A PEFT adapter folder (or its adapter_model.safetensors) with its adapter_config.json."""
    folder = path if path.is_dir() else path.parent
    named = path.is_dir() or path.name.startswith("adapter_model.")
    return named and (folder / "adapter_config.json").is_file()


def _peft(recipe: Recipe, base: Path, adapters: list[Path], merged: Path) -> Referee | None:
    if not adapters or not all(is_peft_folder(a) for a in adapters):
        if adapters and any(is_peft_folder(a) for a in adapters):
            raise RefereeUnavailable("PEFT reads only some of the adapters (the others are not PEFT folders)")
        return None
    if not (base / "config.json").is_file():
        return None

    names = set(open_base(base, allow_pickle=recipe.allow_pickle).names())
    folders = [a if a.is_dir() else a.parent for a in adapters]
    if recipe.method not in (None, "sum"):
        return CombinationReferee(base, folders, recipe, names, _vocab(merged))
    return PeftReferee(base, folders, recipe, names, _vocab(merged))


def _vocab(merged: Path) -> int | None:
    """The output's vocabulary (the adapters may have been trained on a resized one)."""
    import json

    if not (merged / "config.json").is_file():
        return None
    config = json.loads((merged / "config.json").read_text())
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(vocab) if vocab else None  # a vision or audio model has none


def _peft_components(recipe: Recipe, base: Path, adapters: list[Path], merged: Path) -> Referee | None:
    if not adapters or not all(component_folders(a) for a in adapters):
        return None

    return PeftComponentsReferee(recipe, base, adapters)


def _diffusers(recipe: Recipe, base: Path, adapters: list[Path], merged: Path) -> Referee | None:
    why = diffusers_declines(recipe, base, adapters)
    if why:
        raise RefereeUnavailable(why)
    return DiffusersReferee(recipe, base, adapters)
