"""Each verb's options object (extract / resize / combine, convert, push): the command line fills every field
from the option of the same name (nothing listed twice, nothing lost), and each object checks itself when built."""

from __future__ import annotations

from dataclasses import fields

import pytest

from converter.cli.commands import build_parser
from converter.cli.options import options_from
from converter.conversion.options import ConvertOptions
from converter.errors import UsageError
from converter.jobs.options import PushOptions
from converter.methods.options import CombineOptions, ExtractOptions, ResizeOptions

# Each class: command lines that set every one of its fields between them.
COMMAND_LINES = {
    ExtractOptions: [["extract", "--base", "b", "--tuned", "t", "--out", "o", "--rank", "8", "--rank-rule", "sv_fro",
                     "--rank-param", "0.9", "--include", "q_proj", "--exclude", "k_proj", "--no-modules-to-save",
                     "--to", "kohya", "--force", "--allow-pickle"]],
    ResizeOptions: [["resize", "--adapter", "a", "--out", "o", "--rank", "4", "--rank-rule", "sv_ratio",
                    "--rank-param", "2", "--base", "b", "--component", "unet", "--to", "diffusers", "--force",
                    "--allow-pickle"]],
    CombineOptions: [["combine", "--adapter", "a", "--adapter", "b", "--out", "o", "--weight", "0.5", "--weight", "2",
                     "--method", "ties_svd", "--density", "0.3", "--rank", "6", "--seed", "7", "--majority-sign",
                     "frequency", "--svd-clamp", "0.99", "--base", "m", "--component", "unet", "--allow-pickle",
                     "--to", "kohya", "--force"]],
    ConvertOptions: [["convert", "--adapter", "a", "--to", "gguf", "--out", "o", "--base", "b", "--type", "F16",
                     "--rank", "3", "--lora-alpha", "16", "--force", "--allow-pickle", "--no-verify"],
                     # (--component is for the adapter formats, --type for gguf: no one command line has both)
                     ["convert", "--adapter", "a", "--to", "kohya", "--out", "o", "--component", "unet"]],
    PushOptions: [["push", "--repo", "me/m", "--base", "b", "--adapter", "a", "--private", "--create-pr",
                  "--overwrite", "--gguf", "Q8_0", "--mlx", "4bit", "--no-verify"]],
}  # fmt: skip
REQUIRED = {ExtractOptions: {"rank": 1}, ResizeOptions: {"rank": 1}, ConvertOptions: {"to": "peft"}}
# fields whose option says the opposite (--no-verify): what the command line hands over beside the arguments
OTHERS = {ConvertOptions: {"verify": False}, PushOptions: {"verify": None}}


@pytest.mark.parametrize("cls", COMMAND_LINES, ids=lambda c: c.__name__)
def test_every_field_comes_from_the_command_line(cls):
    defaults = cls(**REQUIRED.get(cls, {}))
    unset = {f.name for f in fields(cls)}
    for argv in COMMAND_LINES[cls]:
        options = options_from(cls, build_parser().parse_args(argv), **OTHERS.get(cls, {}))
        unset -= {f.name for f in fields(cls) if getattr(options, f.name) != getattr(defaults, f.name)}
    assert not unset, f"{cls.__name__}: no option on the command line sets {sorted(unset)}"


def test_the_values_arrive_as_given():
    options = options_from(CombineOptions, build_parser().parse_args(COMMAND_LINES[CombineOptions][0]))
    assert options.weights == (0.5, 2.0) and options.sign_method == "frequency" and options.density == 0.3
    assert options.weights_for(["a", "b"]) == [0.5, 2.0]
    assert CombineOptions().weights_for(["a", "b", "c"]) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: ExtractOptions(rank=0), "--rank 0"),
        (lambda: ResizeOptions(rank=4, rule="sv_fro"), "needs --rank-param"),
        (lambda: ExtractOptions(rank=4, to="gguf"), "--to gguf"),
        (lambda: CombineOptions(method="ties"), "needs --density"),
        (lambda: CombineOptions(method="cat", rank=4), "svd methods only"),
        (lambda: CombineOptions(sign_method="mean"), "--majority-sign mean"),
        (lambda: CombineOptions(weights=(1.0,)).weights_for(["a", "b"]), "1 --weight for 2 --adapter"),
        (lambda: ConvertOptions(to="onnx"), "--to onnx"),
        (lambda: ConvertOptions(to="peft", type="F16"), "--type is for --to gguf"),
        (lambda: ConvertOptions(to="gguf", component="unet"), "--component is for diffusion adapters"),
        (lambda: PushOptions(gguf="Q3_X"), "GGUF type 'Q3_X'"),
        (lambda: PushOptions(mlx="3bit"), "--mlx: unknown type '3bit'"),
    ],
)
def test_an_option_that_cannot_work_is_refused_when_built(build, words):
    with pytest.raises(UsageError, match=words.replace("-", r"\-")):
        build()


def test_mlx_on_jobs_is_refused_in_one_line(cli):
    code, _, err = cli("push", "--repo", "me/m", "--base", "org/base", "--adapter", "org/lora", "--on-jobs",
                       "--mlx", "4bit", "--token", "hf_x")  # fmt: skip
    assert code == 2 and "MLX folders are made and proven with mlx on this machine" in err
